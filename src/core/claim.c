/* The claim and settle of a pause or resume: which allocations it moves, decided at once, and how they settle. */
#include <stdio.h>
#include <stdlib.h>

#include "core/core.h"
#include "core/core_internal.h"
#include "platform/log.h"

static uint64_t call_seq;  /* guarded by the table lock: numbers pause/resume calls */

/* Moves run in address order: the driver's unmap and map cost per
 * allocation grows with a scattered order (docs/performance.md). */
static int by_device_and_address(const void *x, const void *y)
{
    const struct tms_alloc *a = ((const struct tms_move *)x)->a, *b = ((const struct tms_move *)y)->a;
    if (a->device != b->device) return a->device < b->device ? -1 : 1;
    return (a->va > b->va) - (a->va < b->va);
}

static int state_error(struct tms_err *err, int from, const char *tag, size_t n_tags, size_t other)
{
    const char *op = from == TMS_ACTIVE ? "pause" : "resume";
    const char *why = from == TMS_ACTIVE ? "already paused" : "not paused";
    const char *which = from == TMS_ACTIVE ? "none active" : "all active";
    if (!tag) return tms_fail(err, TMS_E_STATE, 0, "%s of all tags: %s (%zu allocations, %s)", op, why, other, which);
    if (n_tags == 1)
        return tms_fail(err, TMS_E_STATE, 0, "%s of tag '%s': %s (%zu allocations, %s)", op, tag, why, other, which);
    return tms_fail(err, TMS_E_STATE, 0, "%s of tag '%s' (one of %zu tags): %s (%zu allocations, %s); no tag of the "
                    "list was %s", op, tag, n_tags, why, other, which, from == TMS_ACTIVE ? "paused" : "resumed");
}

/* Mapped by a receiver of share() or CUDA IPC, or exported by its owner. */
static int held_elsewhere(const struct tms_alloc *a) { return a->share_holders || a->exported_by_owner; }

/* A pause of memory another process maps would free nothing there and
 * leave it reading memory this process no longer owns: refused whole. */
static int held_error(struct tms_err *err, const struct tms_alloc *a)
{
    if (!a->share_holders)
        return tms_fail(err, TMS_E_STATE, 0,
                        "pause of tag '%s': allocation 0x%llx (%zu bytes) was exported to another process by its "
                        "owner (cuMemExportToShareableHandle: PyTorch's expandable-segment sharing) and stays held "
                        "until freed; nothing was paused",
                        tms_core_tag_name(a->tag_id), (unsigned long long)a->va, a->size);
    char pids[64] = "";
    size_t used = 0;
    int shown = a->share_holders < TMS_SHARE_PIDS_KEPT ? a->share_holders : TMS_SHARE_PIDS_KEPT;
    for (int i = 0; i < shown && used < sizeof pids; i++) {
        int n = snprintf(pids + used, sizeof pids - used, "%s%d", i ? ", " : "", a->share_pids[i]);
        if (n < 0) break;
        used += (size_t)n;
    }
    return tms_fail(err, TMS_E_STATE, 0,
                    "pause of tag '%s': allocation 0x%llx (%zu bytes) is mapped by %d other process%s (pid %s%s) "
                    "through share() or CUDA IPC; nothing was paused: they must close it first",
                    tms_core_tag_name(a->tag_id), (unsigned long long)a->va, a->size, a->share_holders,
                    a->share_holders == 1 ? "" : "es", pids, a->share_holders > shown ? " and more" : "");
}

int tms_table_claim(const char *const *tags, size_t n_tags, int from, struct tms_move **moves, size_t *n,
                    struct tms_err *err)
{
    *moves = NULL;
    *n = 0;
    int rc = TMS_OK;
    size_t lists = tags ? n_tags : 1, want = 0;
    int *ids = calloc(lists, sizeof *ids);
    if (!ids) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory listing %zu tags", lists);
    tms_table_lock();
    /* Every tag's allocations settled first, then one decision for all of them. */
    for (int settled = 0; !settled;) {
        settled = 1;
        want = 0;
        for (size_t t = 0; t < lists && !rc; t++) {
            ids[t] = tags ? tms_tags_find_locked(tags[t]) : -1;
            if (tags && ids[t] < 0) continue;  /* never used: nothing to do, as upstream */
            size_t count[2] = {0, 0}, moving = 0;
            const struct tms_alloc *held = NULL;
            TMS_FOR_EACH_OF_TAG(a, ids[t]) {
                if (a->moving) moving++;
                else count[a->state]++;
                if (from == TMS_ACTIVE && !a->moving && a->state == TMS_ACTIVE && held_elsewhere(a) && !held) held = a;
            }
            if (moving) {
                settled = 0;
                break;
            }
            if (held) rc = held_error(err, held);
            size_t other = count[from == TMS_ACTIVE ? TMS_PAUSED : TMS_ACTIVE];
            if (!count[from] && other) rc = state_error(err, from, tags ? tags[t] : NULL, n_tags, other);
            want += count[from];
        }
        if (!settled) tms_table_wait_settled();
    }
    struct tms_move *m = !rc && want ? calloc(want, sizeof *m) : NULL;
    if (!rc && want && !m) rc = tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory listing %zu allocations", want);
    size_t i = 0;
    for (size_t t = 0; m && t < lists; t++) {
        if (tags && ids[t] < 0) continue;
        TMS_FOR_EACH_OF_TAG(a, ids[t]) {
            if (a->state != from) continue;
            a->moving = 1;
            m[i++] = (struct tms_move){.a = a, .state = from, .b = {.held = a->host_copy, .copy = a->host_copy}};
        }
    }
    *moves = m;
    *n = i;
    tms_table_unlock();
    free(ids);
    if (*moves) qsort(*moves, *n, sizeof **moves, by_device_and_address);  /* ours alone now */
    return rc;
}

void tms_table_settle(const struct tms_driver *drv, struct tms_move *m, size_t n, int is_pause, uint64_t ns)
{
    tms_table_lock();
    call_seq++;
    for (size_t i = 0; i < n; i++) {
        struct tms_alloc *a = m[i].a;
        int changed = a->state != m[i].state;
        tms_stats_account_locked(a, -1);
        m[i].drop = NULL;
        if (m[i].b.copy != a->host_copy) {
            m[i].drop = a->host_copy;
            a->host_copy = m[i].b.copy;
        }
        a->state = m[i].state;
        tms_stats_account_locked(a, +1);
        a->moving = 0;
        if (changed) tms_stats_count_change_locked(a, &m[i], is_pause, ns, call_seq);
        if (a->free_requested) tms_table_unlink_locked(tms_table_link_locked(a->va));
        else m[i].a = NULL;  /* what is left in m[].a: frees to finish */
    }
    tms_table_settled_locked();
    tms_table_unlock();
    for (size_t i = 0; i < n; i++) {
        tms_backup_unref(m[i].drop);
        if (!m[i].a) continue;
        tms_va va = m[i].a->va;
        struct tms_err e = {0};
        if (tms_alloc_release_detached(drv, m[i].a, &e))
            tms_log_warn("free of 0x%llx, finished after its %s: %s", (unsigned long long)va,
                         is_pause ? "pause" : "resume", e.msg);
    }
    free(m);
}

