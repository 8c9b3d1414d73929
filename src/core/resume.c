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
 * for a retry. If its memory cannot even be unmapped it is left mapped and
 * active with its backup, and the message says its contents are incomplete. */
static void unrestore(const struct tms_driver *drv, struct tms_move *m, struct tms_err *err)
{
    struct tms_alloc *a = m->a;
    const char *tag = tms_core_tag_name(a->tag_id);
    struct tms_err undo_err = {0};
    m->b.copy = m->b.held;
    if (tms_chunks_unmap(drv, a, tag, &undo_err) == TMS_OK) {
        if (tms_chunks_release(drv, a, tag, &undo_err))
            tms_log_warn("after a failed restore of 0x%llx: %s", (unsigned long long)a->va, undo_err.msg);
        return;
    }
    m->state = TMS_ACTIVE;
    tms_err_append(err, "allocation 0x%llx (tag '%s') stays mapped with incomplete contents, its backup kept: %s",
                   (unsigned long long)a->va, tag, undo_err.msg);
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
    if ((r->rc = tms_chunks_map(r->drv, a, tms_core_tag_name(a->tag_id), &r->err))) return r->rc;
    r->mapped = i + 1;
    return TMS_OK;
}

int tms_core_restore_moves(const struct tms_driver *drv, struct tms_move *const *m, size_t n, int retain,
                           struct tms_err *err)
{
    struct tms_backup_move **b = calloc(n ? n : 1, sizeof *b);
    if (!b) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning the resume of %zu allocations", n);
    for (size_t i = 0; i < n; i++) {
        const struct tms_alloc *a = m[i]->a;
        struct tms_backup_move *bm = &m[i]->b;
        *bm = (struct tms_backup_move){.kind = a->backup_kind, .device = a->device, .va = a->va, .size = a->size,
                                       .held = bm->held, .copy = bm->held,
                                       .retain = retain || tms_alloc_skips_unchanged(a)};
        b[i] = bm;
    }
    struct resume_maps maps = {.drv = drv, .m = m};
    struct tms_backup_hooks hooks = {.arg = &maps, .before_restore = map_before_restore};
    struct tms_err restore_err = {0};
    int rc = tms_backup_restore(drv, b, n, &hooks, &restore_err);
    free(b);
    /* The map that stopped the resume came first: a backup that could not be
     * opened is only ever later. */
    if (maps.rc) {
        if (err) *err = maps.err;
        if (rc) tms_err_append(err, "%s", restore_err.msg);
        rc = maps.rc;
    } else if (rc && err) {
        *err = restore_err;
    }
    /* An allocation is active only once all its bytes are back. */
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
    /* In a job: each allocation's memory planned first, from what this process
     * kept and what the other members lend (lend.c); its map uses the plan. */
    if (order) tms_lend_plan(drv, order, n, args);
    rc = order ? tms_core_restore_moves(drv, order, n, retain, err)
               : tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning the resume of %zu allocations", n);
    free(order);
    for (size_t i = 0; i < n; i++)
        if (m[i].state == TMS_PAUSED && m[i].a->ext) tms_lend_unplan(drv, m[i].a);  /* never mapped */
    for (size_t i = 0; i < n; i++)
        if (m[i].b.copy && m[i].b.retain) tms_backup_kept(m[i].b.copy, 1);
    uint64_t ns = tms_core_now_ns() - start;
    tms_report_end(drv, args, m, n, ns);
    tms_table_settle(drv, m, n, 0, ns);
    TMS_DEBUG("resume %s%s: %zu allocations, %.3f ms, status %d", tags ? tags[0] : "<all>", n_tags > 1 ? " (and more)" : "",
              n, (double)ns / 1e6, rc);
    return rc;
}
