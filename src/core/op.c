/* The pause and resume calls: what they name and may skip is checked here, then pause.c or resume.c moves the memory. */
#include "core/core.h"

#include "core/core_internal.h"

static const struct tms_op_args no_args;

int tms_core_pause(const char *tag, struct tms_err *err)
{
    int rc = tag ? tms_core_check_tag(tag, err) : TMS_OK;
    return rc ? rc : tms_core_pause_moves(tag ? &tag : NULL, tag ? 1 : 0, &no_args, err);
}

int tms_core_resume(const char *tag, struct tms_err *err)
{
    int rc = tag ? tms_core_check_tag(tag, err) : TMS_OK;
    return rc ? rc : tms_core_resume_moves(tag ? &tag : NULL, tag ? 1 : 0, &no_args, err);
}

/* Checks what a call names and what it may skip. */
static int check_op(const char *op, const char *const *tags, size_t n_tags, const struct tms_op_args *args,
                    struct tms_err *err)
{
    int rc = tags ? tms_core_check_tags(op, tags, n_tags, err) : TMS_OK;
    if (rc) return rc;
    if (args->n_skip && !args->skip) return tms_fail(err, TMS_E_ARG, 0, "%s: %zu skip ranges and no array", op, args->n_skip);
    for (size_t i = 0; i < args->n_skip; i++) {
        const struct tms_free_span *s = &args->skip[i];
        if (s->start + s->len < s->start)
            return tms_fail(err, TMS_E_ARG, 0, "%s: skip range %zu (0x%llx, %llu bytes) wraps around", op, i,
                            (unsigned long long)s->start, (unsigned long long)s->len);
        if (i && s->start < args->skip[i - 1].start + args->skip[i - 1].len)
            return tms_fail(err, TMS_E_ARG, 0, "%s: skip range %zu (0x%llx) overlaps or precedes the one before", op, i,
                            (unsigned long long)s->start);
    }
    if (args->report) *args->report = (struct tms_op_report){0};
    return TMS_OK;
}

int tms_core_pause_ex(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err)
{
    if (!args) args = &no_args;
    int rc = check_op("pause", tags, n_tags, args, err);
    return rc ? rc : tms_core_pause_moves(tags, tags ? n_tags : 0, args, err);
}

int tms_core_resume_ex(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err)
{
    if (!args) args = &no_args;
    if (args->n_skip) return tms_fail(err, TMS_E_ARG, 0, "resume: skip ranges are a pause's");
    int rc = check_op("resume", tags, n_tags, args, err);
    return rc ? rc : tms_core_resume_moves(tags, tags ? n_tags : 0, args, err);
}
