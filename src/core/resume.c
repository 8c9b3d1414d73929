/* Resume: map each allocation just before its backup's copy may start, restore, settle; all outside the table lock. */
#include "core/core.h"

#include <stdlib.h>
#include <time.h>

#include "core/core_internal.h"
#include "platform/log.h"

uint64_t tms_core_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* An allocation whose restore failed goes back to paused, its backup kept
 * for a retry. If its memory cannot even be unmapped it stays mapped and
 * active with bytes that are not its own: marked, so that its next pause
 * keeps the backup instead of copying them, and the message says so. */
static void unrestore(const struct tms_driver *drv, struct tms_move *m, struct tms_err *err)
{
    struct tms_alloc *a = m->a;
    const char *tag = tms_core_tag_name(a->tag_id);
    struct tms_err undo_err = {0};
    m->b.copy = m->b.held;
    if (tms_extents_unmap(drv, a, tag, &undo_err) == TMS_OK) {
        m->state = TMS_PAUSED;
        if (tms_extents_release(drv, a, tag, &undo_err))
            tms_log_warn("after a failed restore of 0x%llx: %s", (unsigned long long)a->va, undo_err.msg);
        return;
    }
    m->state = TMS_ACTIVE;
    a->wrong_bytes = 1;
    m->wrong = 1;
    tms_err_append(err, "allocation 0x%llx (tag '%s') stays mapped and active holding bytes that are not its own, "
                   "its backup kept for its next pause and resume: %s", (unsigned long long)a->va, tag, undo_err.msg);
}

/* The message of restored bytes that differ from what their pause backed up. */
static void say_bad(struct tms_err *err, int first, const struct tms_move *m)
{
    const struct tms_alloc *a = m->a;
    const char *what = "resume: allocation 0x%llx of %zu bytes (tag '%s', device %d) came back other than it was "
                       "paused: the %zu bytes at offset 0x%zx differ from what its pause recorded (a backup "
                       "changed while it was paused); it stays paused with its backup (verify_restore = False, or "
                       "TMS_VERIFY_RESTORE=0, restores it unchecked)";
    size_t span = a->size - m->b.bad_offset < TMS_CORE_FP_CHUNK ? a->size - m->b.bad_offset : TMS_CORE_FP_CHUNK;
    if (first) {
        tms_fail(err, TMS_E_IO, 0, what, (unsigned long long)a->va, a->size, tms_core_tag_name(a->tag_id), a->device,
                 span, m->b.bad_offset);
        if (err) err->flags |= TMS_ERR_CORRUPT;
    } else {
        tms_err_append(err, "allocation 0x%llx (tag '%s') came back other than it was paused from offset 0x%zx and "
                       "stays paused with its backup", (unsigned long long)a->va, tms_core_tag_name(a->tag_id),
                       m->b.bad_offset);
    }
}

/* ---- mapping while the copies run ---------------------------------------------
 * The backup layer calls map_before_restore in the thread that runs the
 * copies, just before each allocation's copy may start: the later
 * allocations map under the first ones' copies. The first map that fails
 * stops the mapping, so the rest stay paused with their backups and a retry
 * resumes them. */
struct resume_maps {
    const struct tms_driver *drv;
    struct tms_move *const *m;
    size_t mapped;  /* allocations [0, mapped) are mapped */
    int rc;         /* the map that failed */
    struct tms_err err;
};

static int map_before_restore(void *arg, size_t i)
{
    struct resume_maps *r = arg;
    struct tms_alloc *a = r->m[i]->a;
    if ((r->rc = tms_extents_map(r->drv, a, tms_core_tag_name(a->tag_id), &r->err))) return r->rc;
    r->mapped = i + 1;
    return TMS_OK;
}

int tms_core_restore_moves(const struct tms_driver *drv, struct tms_move *const *m, size_t n, int retain,
                           uint64_t *verify_ns, struct tms_err *err)
{
    struct tms_backup_move **b = calloc(n ? n : 1, sizeof *b);
    if (!b) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning the resume of %zu allocations", n);
    for (size_t i = 0; i < n; i++) {
        const struct tms_alloc *a = m[i]->a;
        struct tms_backup_move *bm = &m[i]->b;
        *bm = (struct tms_backup_move){.kind = a->backup_kind, .device = a->device, .va = a->va, .size = a->size,
                                       .reserved = a->reserved,
                                       .held = bm->held, .copy = bm->held,
                                       .retain = tms_alloc_keeps_backup(a, retain),
                                       .verify = bm->held && tms_core_verify_restore()};
        b[i] = bm;
    }
    struct resume_maps maps = {.drv = drv, .m = m};
    struct tms_backup_hooks hooks = {.arg = &maps, .before_restore = map_before_restore};
    struct tms_err restore_err = {0};
    struct tms_restore_info info = {0};
    int rc = tms_backup_restore(drv, b, n, &hooks, &info, &restore_err);
    free(b);
    if (verify_ns) *verify_ns += info.verify_ns;
    /* The map that stopped the resume came first: a backup that could not be
     * opened is only ever later. */
    if (maps.rc) {
        if (err) *err = maps.err;
        if (rc) tms_err_append(err, "%s", restore_err.msg);
        rc = maps.rc;
    } else if (rc && err) {
        *err = restore_err;
    }
    /* Bytes that came back other than they were paused fail the call, after any failure before. */
    for (size_t i = 0; i < maps.mapped; i++) {
        if (!m[i]->b.bad) continue;
        say_bad(err, !rc, m[i]);
        if (!rc) rc = TMS_E_IO;
    }
    /* An allocation is active only once all its bytes are back, as they were paused. */
    for (size_t i = 0; i < maps.mapped; i++) {
        if (!m[i]->b.whole) {
            unrestore(drv, m[i], err);
            continue;
        }
        m[i]->state = TMS_ACTIVE;
        if (m[i]->b.held) m[i]->skipped = m[i]->a->size - m[i]->b.copied;
    }
    return rc;
}

/* ---- what memory paused without backup holds ------------------------------------
 * Zeros or 0xFF in every byte where its region asked (restore="zero" or
 * "poison"), written once it is mapped, every range of a device queued before
 * one wait. Where that cannot be done, those allocations go back to paused
 * and the call fails naming them: none is active holding bytes it did not ask for. */
static int wants_fill(const struct tms_move *m, int mode)
{
    return m->state == TMS_ACTIVE && m->a->state == TMS_PAUSED && !m->b.held && m->a->restore == mode;
}

static int fill_device(const struct tms_driver *drv, struct tms_move *m, size_t n, int mode, int device,
                       tms_va *va, size_t *len, struct tms_err *err)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (wants_fill(&m[i], mode) && m[i].a->device == device) va[k] = m[i].a->va, len[k++] = m[i].a->size;
    unsigned char byte = mode == TMS_RESTORE_ZERO ? 0 : 0xff;
    int rc = drv->fill ? drv->fill(device, va, len, k, byte) : -1;
    if (!rc) return TMS_OK;
    struct tms_err why = {0};
    if (drv->fill)
        tms_driver_fail(&why, TMS_E_DRIVER, drv, rc, "resume: filling %zu allocations on device %d with 0x%02x "
                        "(restore='%s') failed", k, device, byte, tms_core_restore_mode_name(mode));
    else
        tms_fail(&why, TMS_E_UNSUPPORTED, 0, "resume: the %s backend cannot fill device memory (restore='%s')",
                 drv->name, tms_core_restore_mode_name(mode));
    for (size_t i = 0; i < n; i++) {
        if (!wants_fill(&m[i], mode) || m[i].a->device != device) continue;
        tms_err_append(&why, "allocation 0x%llx (tag '%s') stays paused", (unsigned long long)m[i].a->va,
                       tms_core_tag_name(m[i].a->tag_id));
        unrestore(drv, &m[i], &why);
    }
    if (err && !err->status) *err = why;
    else if (err) tms_err_append(err, "%s", why.msg);
    return why.status;
}

static int fill_discarded(const struct tms_driver *drv, struct tms_move *m, size_t n, struct tms_err *err)
{
    int any = 0, rc = TMS_OK;
    for (size_t i = 0; i < n; i++) any |= wants_fill(&m[i], TMS_RESTORE_ZERO) || wants_fill(&m[i], TMS_RESTORE_POISON);
    if (!any) return TMS_OK;
    tms_va *va = malloc(n * sizeof *va);
    size_t *len = malloc(n * sizeof *len);
    for (int mode = TMS_RESTORE_ZERO; mode <= TMS_RESTORE_POISON; mode++) {
        for (size_t i = 0; i < n; i++) {
            if (!wants_fill(&m[i], mode)) continue;
            int device = m[i].a->device, first = 1;
            for (size_t j = 0; j < i && first; j++) first = !(wants_fill(&m[j], mode) && m[j].a->device == device);
            if (!first) continue;
            int one = va && len ? fill_device(drv, m, n, mode, device, va, len, err) : TMS_E_HOST_OOM;
            if (one && !rc) rc = one;
            if (va && len) continue;
            /* No room even to list them: none of them stays active holding bytes it did not ask for. */
            struct tms_err why = {0};
            tms_fail(&why, TMS_E_HOST_OOM, 0, "resume: out of host memory listing memory to fill (restore='%s')",
                     tms_core_restore_mode_name(mode));
            for (size_t j = 0; j < n; j++)
                if (wants_fill(&m[j], mode)) unrestore(drv, &m[j], &why);
            if (err && !err->status) *err = why;
            else if (err) tms_err_append(err, "%s", why.msg);
            break;
        }
    }
    free(va);
    free(len);
    return rc;
}

int tms_core_resume_moves(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    uint64_t start = tms_core_now_ns();
    struct tms_move *m;
    size_t n;
    if ((rc = tms_table_claim(tags, n_tags, TMS_PAUSED, &m, &n, err)) || n == 0) return rc;
    tms_report_begin(drv, args, m, n);
    int retain = tms_core_retain();
    struct tms_move **order = calloc(n, sizeof *order);
    for (size_t i = 0; order && i < n; i++) order[i] = &m[i];
    /* Each allocation's memory planned first, from what the provider keeps or
     * gets from other processes (provide.c); its map uses the plan. */
    if (order) tms_extents_plan(drv, order, n, args);
    uint64_t verify_ns = 0;
    rc = order ? tms_core_restore_moves(drv, order, n, retain, &verify_ns, err)
               : tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning the resume of %zu allocations", n);
    free(order);
    int filled = fill_discarded(drv, m, n, err);
    if (!rc) rc = filled;
    if (args->report) args->report->verify_ns = verify_ns;
    for (size_t i = 0; i < n; i++)
        if (m[i].state == TMS_PAUSED && m[i].a->n_ext) tms_extents_unplan(drv, m[i].a);  /* never mapped */
    for (size_t i = 0; i < n; i++)
        if (m[i].b.copy && m[i].b.retain) tms_backup_kept(m[i].b.copy, 1);
    uint64_t ns = tms_core_now_ns() - start;
    tms_report_end(drv, args, m, n, ns);
    tms_table_settle(drv, m, n, 0, ns);
    TMS_DEBUG("resume %s%s: %zu allocations, %.3f ms, status %d", tags ? tags[0] : "<all>", n_tags > 1 ? " (and more)" : "",
              n, (double)ns / 1e6, rc);
    return rc;
}
