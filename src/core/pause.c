/* Pause and resume: the driver work on claimed allocations, with the table lock released. */
#include "core/core.h"

#include <stdlib.h>
#include <time.h>

#include "backup/fill.h"
#include "backup/transfer.h"
#include "core/core_internal.h"
#include "platform/log.h"

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Forgets the backup a move would install, dropping it if it is new. */
static void discard_copy(struct tms_move *m)
{
    if (m->copy != m->a->host_copy) tms_backup_unref(m->copy);
    m->copy = NULL;
}

/* Queued kernels may still write the memory: copy and unmap only after. */
static int synchronize_devices(const struct tms_driver *drv, const struct tms_move *m, size_t n, struct tms_err *err)
{
    uint64_t done = 0;  /* bit per device; devices >= 64 are synchronized every time */
    for (size_t i = 0; i < n; i++) {
        int device = m[i].a->device;
        if (device < 64 && (done >> device & 1)) continue;
        int rc = drv->synchronize(device);
        if (rc)
            return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "synchronize of device %d before pause failed",
                                   device);
        if (device < 64) done |= 1ull << device;
    }
    return TMS_OK;
}

/* ---- letting allocations go while the others copy ------------------------------
 * A pause whose every backup is a retained one, page-locked and reused whole,
 * unmaps and releases each allocation as soon as its copy is in: the
 * driver's clean-up of freed device memory then runs under the copies left
 * instead of slowing a resume that follows at once (docs/design.md). Such
 * copies fail only where the driver does; an allocation let go before that
 * is mapped again and its whole backup copied back. */
struct early_release {
    const struct tms_driver *drv;
    struct tms_move *m;
    int released;        /* unmapped: it settles paused */
    int rc;              /* the hook's failure: of the release (reported, not undone, as unmap_all
                          * does), or of the unmap (unmap_all tries again; a failed pause reports it) */
    struct tms_err err;
};

static int releases_early(const struct tms_move *m, size_t n, int retain)
{
    if (!retain) return 0;
    size_t backed_up = 0;
    for (size_t i = 0; i < n; i++) {
        const struct tms_alloc *a = m[i].a;
        if (!a->backup) continue;
        const struct tms_backup *held = m[i].copy;
        if (!held || held->ranges || held->size != a->size || held->kind != a->backup_kind ||
            tms_backup_path(held, 1, 0, a->size) != TMS_PATH_DIRECT)
            return 0;
        backed_up++;
    }
    return backed_up > 1;  /* one copy has nothing to run under */
}

static void release_backed_up(void *arg)
{
    struct early_release *e = arg;
    struct tms_alloc *a = e->m->a;
    const char *tag = tms_core_tag_name(a->tag_id);
    if ((e->rc = tms_chunks_unmap(e->drv, a, tag, &e->err)) != TMS_OK) return;
    e->released = 1;
    e->m->state = TMS_PAUSED;
    e->rc = tms_chunks_release(e->drv, a, tag, &e->err);
}

static void unrestore(const struct tms_driver *drv, struct tms_move *m, struct tms_err *err);

/* After a failed pause: each allocation let go is mapped again and its whole
 * backup copied back; one that cannot be stays paused with that backup. */
static void restore_released(const struct tms_driver *drv, struct early_release *early, size_t n, struct tms_err *err)
{
    for (size_t i = 0; i < n; i++) {
        /* What the driver said when it was let go: a leaked handle, or chunks left unusable. */
        if (early[i].rc) tms_err_append(err, "%s", early[i].err.msg);
        if (!early[i].released) continue;
        struct tms_move *m = early[i].m;
        struct tms_alloc *a = m->a;
        const char *tag = tms_core_tag_name(a->tag_id);
        struct tms_err e = {0};
        int rc = m->copy ? tms_backup_open(m->copy, &e) : tms_fail(&e, TMS_E_STATE, 0, "its backup is gone");
        if (rc == TMS_OK) {
            int mapped = (rc = tms_chunks_map(drv, a, tag, &e)) == TMS_OK;
            if (mapped) {
                struct tms_transfer item = {.device = a->device, .dev = a->va, .backup = m->copy, .n = a->size};
                rc = tms_transfer_run(drv, 0, &item, 1, &e);
            }
            (void)tms_backup_close(m->copy, 0, NULL);
            if (mapped && rc) unrestore(drv, m, &e);
        }
        if (rc == TMS_OK) {
            m->state = TMS_ACTIVE;
            continue;
        }
        if (m->state == TMS_ACTIVE) {  /* left mapped by unrestore, which said how */
            tms_err_append(err, "%s", e.msg);
            continue;
        }
        tms_err_append(err, "allocation 0x%llx (tag '%s') was already released and stays paused with its backup: %s",
                       (unsigned long long)a->va, tag, e.msg);
    }
}

/* Backs up every backed-up allocation in one call below (backup/fill.h):
 * the core plans the ranges each copies, the backups do the rest. On failure
 * nothing has been unmapped but what early let go (restore_released), and a
 * backup the call began to overwrite is dropped (the move's copy NULL) unless
 * it was written whole for an allocation early let go. */
static int backup_all(const struct tms_driver *drv, struct tms_move *m, size_t n, const struct tms_op_args *args,
                      int retain, struct early_release *early, struct tms_err *err)
{
    size_t n_plans = 0, k = 0;
    for (size_t i = 0; i < n; i++) n_plans += m[i].a->backup != 0;
    if (!n_plans) return TMS_OK;
    struct tms_backup_plan *p = calloc(n_plans, sizeof *p);
    if (!p) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning %zu backups", n_plans);
    int rc = TMS_OK;
    for (size_t i = 0; i < n && !rc; i++) {
        const struct tms_alloc *a = m[i].a;
        if (!a->backup) continue;
        p[k] = (struct tms_backup_plan){.kind = a->backup_kind, .device = a->device, .va = a->va, .size = a->size,
                                        .held = m[i].copy, .retain = retain};
        if (args->n_skip)
            rc = tms_live_plan(a->backup_kind, a->va, a->size, args->skip, args->n_skip, &p[k].ranges,
                               &p[k].n_ranges, err);
        k++;
    }
    if (rc) {
        for (size_t j = 0; j < k; j++) free(p[j].ranges);
        free(p);
        return rc;
    }
    /* Only whole copies go early: a live-only one leaves part of the backup as it was. */
    for (size_t j = 0; j < n_plans && early; j++)
        if (p[j].ranges) early = NULL;
    for (size_t i = 0, j = 0; i < n && early; i++) {
        if (!m[i].a->backup) continue;
        early[i] = (struct early_release){.drv = drv, .m = &m[i]};
        p[j].backed_up = release_backed_up, p[j].backed_up_arg = &early[i];
        j++;
    }
    rc = tms_backup_fill(drv, p, n_plans, tms_core_spill(), err);
    for (size_t i = 0, j = 0; i < n; i++) {
        if (!m[i].a->backup) continue;
        m[i].copy = p[j].copy;
        if (!rc) m[i].copied = p[j].copied, m[i].skipped = m[i].a->size - p[j].copied;
        j++;
    }
    free(p);
    return rc;
}

/* Unmaps and releases each allocation; one whose unmap fails stays active
 * and whole (and keeps its new copy only as a retained one). */
static int unmap_all(const struct tms_driver *drv, struct tms_move *m, size_t n, int retain,
                     const struct early_release *early, struct tms_err *err)
{
    int rc = TMS_OK;
    for (size_t i = 0; i < n; i++) {
        if (early && early[i].released) {
            if (early[i].rc && !rc) {
                rc = early[i].rc;
                if (err) *err = early[i].err;
            }
            continue;
        }
        struct tms_alloc *a = m[i].a;
        const char *tag = tms_core_tag_name(a->tag_id);
        struct tms_err one_err = {0};
        int one = tms_chunks_unmap(drv, a, tag, &one_err);
        if (one == TMS_OK) {
            m[i].state = TMS_PAUSED;
            one = tms_chunks_release(drv, a, tag, &one_err);  /* paused all the same: reported, not undone */
        } else if (m[i].copy && !tms_backup_kept_while_active(m[i].copy, retain)) {
            discard_copy(&m[i]);  /* still active: the device holds the bytes */
        }
        if (one && !rc) {
            rc = one;
            if (err) *err = one_err;
        }
    }
    return rc;
}

/* Backups kept across the call are told so (a retained one is page-locked
 * in the background: it is copied every cycle). */
static void keep_copies(const struct tms_move *m, size_t n, int retain)
{
    for (size_t i = 0; i < n; i++)
        if (m[i].copy) tms_backup_kept(m[i].copy, retain);
}

/* ---- pause and resume -------------------------------------------------------- */

static int pause_tags(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    uint64_t start = now_ns();
    struct tms_move *m;
    size_t n;
    tms_core_share_reap();
    if ((rc = tms_table_claim(tags, n_tags, TMS_ACTIVE, &m, &n, err)) || n == 0) return rc;
    tms_report_begin(drv, args->report, m, n);
    int retain = tms_core_retain();  /* once: the backups are planned and kept by the same answer */
    rc = synchronize_devices(drv, m, n, err);
    /* All backups first: if one fails, nothing has been unmapped yet, or
     * what was let go early is restored. Without memory for the records,
     * nothing goes early. */
    struct early_release *early = !rc && releases_early(m, n, retain) ? calloc(n, sizeof *early) : NULL;
    if (!rc) rc = backup_all(drv, m, n, args, retain, early, err);
    if (rc && early) restore_released(drv, early, n, err);
    if (!rc) rc = unmap_all(drv, m, n, retain, early, err);
    free(early);
    if (retain) keep_copies(m, n, 1);
    uint64_t ns = now_ns() - start;
    tms_report_end(drv, args->report, m, n, ns);
    tms_table_settle(drv, m, n, 1, ns);
    TMS_DEBUG("pause %s%s: %zu allocations, %.3f ms, status %d", tags ? tags[0] : "<all>", n_tags > 1 ? " (and more)" : "",
              n, (double)ns / 1e6, rc);
    return rc;
}

/* An allocation whose restore failed goes back to paused, its backup kept
 * for a retry. If its memory cannot even be unmapped it is left mapped and
 * active with its backup, and the message says its contents are incomplete. */
static void unrestore(const struct tms_driver *drv, struct tms_move *m, struct tms_err *err)
{
    struct tms_alloc *a = m->a;
    const char *tag = tms_core_tag_name(a->tag_id);
    struct tms_err undo_err = {0};
    if (tms_chunks_unmap(drv, a, tag, &undo_err) == TMS_OK) {
        if (tms_chunks_release(drv, a, tag, &undo_err))
            tms_log_warn("after a failed restore of 0x%llx: %s", (unsigned long long)a->va, undo_err.msg);
        return;
    }
    m->state = TMS_ACTIVE;
    tms_err_append(err, "allocation 0x%llx (tag '%s') stays mapped with incomplete contents, its backup kept: %s",
                   (unsigned long long)a->va, tag, undo_err.msg);
}

static size_t items_of(const struct tms_backup *copy) { return copy->ranges ? copy->n_ranges : 1; }

/* ---- mapping while the copies run ---------------------------------------------
 * A resume maps each allocation in the thread that runs the copies, just
 * before its copy may start: the later allocations map under the first
 * ones' copies. The first map that fails stops the mapping, so the rest stay
 * paused with their backups and a retry resumes them. */
struct resume_maps {
    const struct tms_driver *drv;
    struct tms_move *m;
    size_t mapped;  /* allocations [0, mapped) are mapped */
    int rc;         /* the map that failed */
    struct tms_err err;
};

struct map_through {
    struct resume_maps *maps;
    size_t last;  /* maps every allocation up to and including this one */
};

static int map_upto(struct resume_maps *r, size_t last)
{
    for (; !r->rc && r->mapped <= last; r->mapped++) {
        struct tms_alloc *a = r->m[r->mapped].a;
        r->rc = tms_chunks_map(r->drv, a, tms_core_tag_name(a->tag_id), &r->err);
        if (r->rc) return r->rc;
    }
    return r->rc;
}

static int map_for_copy(void *arg)
{
    struct map_through *t = arg;
    return map_upto(t->maps, t->last);
}

static int resume_tags(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    uint64_t start = now_ns();
    struct tms_move *m;
    size_t n, n_items = 0, n_backups = 0;
    if ((rc = tms_table_claim(tags, n_tags, TMS_PAUSED, &m, &n, err)) || n == 0) return rc;
    tms_report_begin(drv, args->report, m, n);
    for (size_t i = 0; i < n; i++)
        if (m[i].copy) n_items += items_of(m[i].copy), n_backups++;
    struct tms_transfer_batch b = {0};
    struct resume_maps maps = {.drv = drv, .m = m};
    struct map_through *through = calloc(n, sizeof *through);
    int retain = tms_core_retain(), planned = 0;
    if (!through) rc = tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning the resume of %zu allocations", n);
    else planned = !(rc = tms_transfer_batch_start(&b, drv, 0, n_items, n_backups, err));
    /* Each backup is opened here and its allocation mapped by its first
     * item's hook; a backup file that cannot be opened stops the resume as a
     * failed map does. */
    size_t open_failed = n;  /* the allocation whose backup could not be opened */
    struct tms_err open_err = {0};
    for (size_t i = 0; !rc && !maps.rc && !b.rc && i < n; i++) {
        struct tms_alloc *a = m[i].a;
        struct tms_backup *copy = m[i].copy;
        if (!copy) continue;  /* mapped with the next copy, or at the end */
        if ((rc = tms_backup_open(copy, &open_err))) {
            open_failed = i;
            break;
        }
        through[i] = (struct map_through){.maps = &maps, .last = i};
        /* A backup not kept goes once its last item is restored. */
        struct tms_restore_opts opts = {.release_when_restored = !tms_backup_kept_while_active(copy, retain),
                                        .prepare = map_for_copy, .prepare_arg = &through[i]};
        tms_transfer_batch_add(&b, copy, a->device, a->va, a->size, copy->ranges, copy->n_ranges, &opts,
                               &m[i].first_item, &m[i].n_items);
    }
    if (planned) tms_transfer_batch_run(&b);
    if (!rc && planned && !b.rc && n) map_upto(&maps, n - 1);  /* the allocations after the last copy */
    /* The first failure in allocation order is the one that stopped the resume. */
    if (maps.rc && maps.mapped < open_failed) {
        rc = maps.rc;
        if (err) *err = maps.err;
        if (open_failed < n) tms_err_append(err, "%s", open_err.msg);
    } else if (open_failed < n && err) {
        *err = open_err;
    }
    if (planned && b.rc && !rc) {
        rc = b.rc;
        if (err) *err = b.err;
    }
    /* An allocation is active only once all its bytes are back. */
    for (size_t i = 0; i < maps.mapped; i++) {
        int restored = 1;
        if (m[i].copy) m[i].copied = tms_transfer_batch_done(&b, m[i].first_item, m[i].n_items, &restored);
        if (!restored) {
            unrestore(drv, &m[i], err);
            continue;
        }
        m[i].state = TMS_ACTIVE;
        if (m[i].copy) m[i].skipped = m[i].a->size - m[i].copied;
        if (m[i].copy && !tms_backup_kept_while_active(m[i].copy, retain)) m[i].copy = NULL;  /* settle drops it */
    }
    if (retain) keep_copies(m, n, 1);
    if (planned) tms_transfer_batch_end(&b);
    free(through);
    uint64_t ns = now_ns() - start;
    tms_report_end(drv, args->report, m, n, ns);
    tms_table_settle(drv, m, n, 0, ns);
    TMS_DEBUG("resume %s%s: %zu allocations, %.3f ms, status %d", tags ? tags[0] : "<all>", n_tags > 1 ? " (and more)" : "",
              n, (double)ns / 1e6, rc);
    return rc;
}

static const struct tms_op_args no_args;

int tms_core_pause(const char *tag, struct tms_err *err)
{
    int rc = tag ? tms_core_check_tag(tag, err) : TMS_OK;
    return rc ? rc : pause_tags(tag ? &tag : NULL, tag ? 1 : 0, &no_args, err);
}

int tms_core_resume(const char *tag, struct tms_err *err)
{
    int rc = tag ? tms_core_check_tag(tag, err) : TMS_OK;
    return rc ? rc : resume_tags(tag ? &tag : NULL, tag ? 1 : 0, &no_args, err);
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
    return rc ? rc : pause_tags(tags, tags ? n_tags : 0, args, err);
}

int tms_core_resume_ex(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err)
{
    if (!args) args = &no_args;
    if (args->n_skip) return tms_fail(err, TMS_E_ARG, 0, "resume: skip ranges are a pause's");
    int rc = check_op("resume", tags, n_tags, args, err);
    return rc ? rc : resume_tags(tags, tags ? n_tags : 0, args, err);
}
