/* Pause: synchronize, save the backed-up allocations, unmap and release; all outside the table lock. */
#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>

#include "core/core_internal.h"
#include "platform/log.h"

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
 * Where the save allows it (every backup a retained, page-locked one reused
 * whole), each allocation is unmapped and released as soon as its copy is in:
 * the driver's clean-up of freed device memory then runs under the copies
 * left instead of slowing a resume that follows at once (docs/design.md). Such
 * copies fail only where the driver does; an allocation let go before that is
 * mapped again and its whole backup copied back. */
struct pause_run {
    const struct tms_driver *drv;
    struct tms_move **saved;   /* the backed-up moves, in the save's order */
    struct early {
        int released;          /* unmapped: it settles paused */
        int rc;                /* the driver's failure letting it go: of the release (reported, not undone, as
                                * unmap_all does), or of the unmap (unmap_all tries again) */
        struct tms_err err;
    } *early;
};

static void release_saved(void *arg, size_t i)
{
    struct pause_run *p = arg;
    struct tms_move *m = p->saved[i];
    struct early *e = &p->early[i];
    const char *tag = tms_core_tag_name(m->a->tag_id);
    if ((e->rc = tms_extents_unmap(p->drv, m->a, tag, &e->err)) != TMS_OK) return;
    e->released = 1;
    m->state = TMS_PAUSED;
    e->rc = tms_extents_release(p->drv, m->a, tag, &e->err);
}

/* After a failed save: each allocation let go is mapped again and its whole
 * backup copied back (the save kept it), one at a time, so one that cannot
 * be stays paused with that backup and the others still come back. */
static void restore_released(struct pause_run *p, size_t n, struct tms_err *err)
{
    for (size_t i = 0; i < n; i++) {
        /* What the driver said when it was let go: a leaked handle, or chunks left unusable. */
        if (p->early[i].rc) tms_err_append(err, "%s", p->early[i].err.msg);
        if (!p->early[i].released) continue;
        struct tms_move *m = p->saved[i];
        m->b.held = m->b.copy;  /* the whole copy this pause wrote */
        struct tms_err e = {0};
        if (tms_core_restore_moves(p->drv, &m, 1, 1, NULL, &e) == TMS_OK) continue;
        if (m->state == TMS_ACTIVE) {  /* left mapped by its restore, which said how */
            tms_err_append(err, "%s", e.msg);
            continue;
        }
        tms_err_append(err, "allocation 0x%llx (tag '%s') was already released and stays paused with its backup: %s",
                       (unsigned long long)m->a->va, tms_core_tag_name(m->a->tag_id), e.msg);
    }
}

/* Does a pause copy a's bytes? Not where a failed restore left bytes that
 * are not its own: its backup holds the truth and is kept as it is. */
static int saves(const struct tms_alloc *a) { return a->backup && !a->wrong_bytes; }

/* Backs up every backed-up allocation in one call below: the core plans
 * the ranges each copies, the backup layer does the rest. On failure
 * nothing has been unmapped but what early let go (restore_released), and a
 * backup the call began to overwrite is dropped (the move's copy NULL)
 * unless it was written whole for an allocation let go early. */
static int backup_all(struct pause_run *p, struct tms_move *m, size_t n, const struct tms_op_args *args, int retain,
                      struct tms_save_info *info, struct tms_err *err)
{
    size_t n_saved = 0;
    for (size_t i = 0; i < n; i++) n_saved += saves(m[i].a);
    if (!n_saved) return TMS_OK;
    struct tms_backup_move **saved = calloc(n_saved, sizeof *saved);
    if (!saved) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning %zu backups", n_saved);
    int rc = TMS_OK;
    size_t k = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        const struct tms_alloc *a = m[i].a;
        if (!saves(a)) continue;
        struct tms_backup_move *b = &m[i].b;
        int skip = tms_alloc_skips_unchanged(a);
        *b = (struct tms_backup_move){.kind = a->backup_kind, .device = a->device, .va = a->va, .size = a->size,
                                      .reserved = a->reserved,
                                      .held = b->held, .copy = b->held, .retain = tms_alloc_keeps_backup(a, retain),
                                      .skip_unchanged = skip, .verify = tms_core_verify_restore()};
        if (args->n_skip)
            rc = tms_live_plan(a->backup_kind, a->va, a->size, args->skip, args->n_skip, &b->ranges, &b->n_ranges,
                               err);
        saved[k++] = b;
    }
    /* Without memory for the records, nothing goes early. */
    p->saved = rc ? NULL : calloc(n_saved, sizeof *p->saved);
    p->early = p->saved ? calloc(n_saved, sizeof *p->early) : NULL;
    for (size_t i = 0, j = 0; p->saved && i < n; i++)
        if (saves(m[i].a)) p->saved[j++] = &m[i];
    struct tms_backup_hooks hooks = {.arg = p, .saved = release_saved};
    if (!rc) rc = tms_backup_save(p->drv, saved, n_saved, tms_core_spill(), p->early ? &hooks : NULL, info, err);
    for (size_t j = 0; j < k; j++) {
        free(saved[j]->ranges);  /* the save took them; left only if planning failed */
        saved[j]->ranges = NULL;
    }
    if (rc && p->early) restore_released(p, n_saved, err);
    for (size_t i = 0; i < n && !rc; i++)
        if (saves(m[i].a)) m[i].skipped = m[i].a->size - m[i].b.copied - m[i].b.unchanged;
    free(saved);
    return rc;
}

/* Unmaps each allocation not let go yet, then lets their memory go: the
 * provider, if any, takes what is its and keeps what the others will ask
 * for (provide.c), the rest is released. One whose unmap fails stays active and
 * whole (and keeps its new copy only as a retained one). */
static int unmap_all(const struct pause_run *p, struct tms_move *m, size_t n, const struct tms_op_args *args,
                     struct tms_err *err)
{
    int rc = TMS_OK;
    unsigned char *unmapped = calloc(n ? n : 1, 1);  /* without the list, each is released as it is unmapped */
    for (size_t i = 0, j = 0; i < n; i++) {
        const struct early *e = p->early && saves(m[i].a) ? &p->early[j++] : NULL;
        if (e && e->released) {
            if (e->rc && !rc) {
                rc = e->rc;
                if (err) *err = e->err;
            }
            continue;
        }
        struct tms_alloc *a = m[i].a;
        const char *tag = tms_core_tag_name(a->tag_id);
        struct tms_err one_err = {0};
        int one = tms_extents_unmap(p->drv, a, tag, &one_err);
        if (one == TMS_OK) {
            m[i].state = TMS_PAUSED;
            if (a->wrong_bytes) {  /* what it held is gone; its backup, kept, is what comes back */
                m[i].wrong = 1;
                tms_log_warn("pause: allocation 0x%llx (tag '%s') held bytes not its own since a failed resume: its "
                             "backup was kept, not overwritten, and comes back at the next resume",
                             (unsigned long long)a->va, tag);
            }
            a->wrong_bytes = 0;
            if (unmapped) unmapped[i] = 1;
            else one = tms_extents_release(p->drv, a, tag, &one_err);  /* paused all the same: reported, not undone */
        } else if (saves(a) && m[i].b.copy && !tms_backup_kept_while_active(m[i].b.copy, m[i].b.retain)) {
            tms_backup_move_discard(&m[i].b);  /* still active: the device holds the bytes */
        }
        if (one && !rc) {
            rc = one;
            if (err) *err = one_err;
        }
    }
    if (unmapped) tms_provide_let_go(p->drv, m, n, unmapped, args, &rc, err);
    free(unmapped);
    return rc;
}

int tms_core_pause_moves(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    uint64_t start = tms_core_now_ns();
    struct tms_move *m;
    size_t n;
    tms_core_share_reap();
    if ((rc = tms_table_claim(tags, n_tags, TMS_ACTIVE, &m, &n, err)) || n == 0) return rc;
    tms_report_begin(drv, args, m, n);
    int retain = tms_core_retain();  /* once: the backups are planned and kept by the same answer */
    struct pause_run p = {.drv = drv};
    struct tms_save_info info = {0};
    rc = synchronize_devices(drv, m, n, err);
    /* All backups first: if one fails, nothing has been unmapped yet, or
     * what was let go early is restored. */
    if (!rc) rc = backup_all(&p, m, n, args, retain, &info, err);
    if (!rc) rc = unmap_all(&p, m, n, args, err);
    free(p.saved);
    free(p.early);
    for (size_t i = 0; i < n; i++)
        if (m[i].b.copy && m[i].b.retain) tms_backup_kept(m[i].b.copy, 1);  /* page-locked in the background */
    if (args->report) {
        args->report->fingerprint_ns = info.fingerprint_ns;
        snprintf(args->report->why_not_skipped, sizeof args->report->why_not_skipped, "%s", info.why_not);
        snprintf(args->report->why_not_verified, sizeof args->report->why_not_verified, "%s",
                 info.why_not_recorded);
    }
    uint64_t ns = tms_core_now_ns() - start;
    tms_report_end(drv, args, m, n, ns);
    tms_table_settle(drv, m, n, 1, ns);
    TMS_DEBUG("pause %s%s: %zu allocations, %.3f ms, status %d", tags ? tags[0] : "<all>", n_tags > 1 ? " (and more)" : "",
              n, (double)ns / 1e6, rc);
    return rc;
}
