/* A save, the way down of a backed-up pause: the budget reserved, each backup made or reused, every copy run in batches, the budget settled. */
#include "backup/save.h"

#include <stdlib.h>

#include "backup/ledger.h"
#include "backup/transfer.h"

void tms_backup_move_discard(struct tms_backup_move *m)
{
    if (m->copy != m->held) tms_backup_unref(m->copy);
    m->copy = NULL;
}

static void forget_ranges(struct tms_backup_move *const *m, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(m[i]->ranges);
        m[i]->ranges = NULL;
    }
}

/* Whole copies into reused retained backups that take a DMA at once: the
 * caller may then let each allocation go as soon as its copy is in (the
 * driver's clean-up of freed memory runs under the copies left). One copy
 * has nothing to run under; a live-only copy leaves part of the backup as it
 * was, so it never goes early. */
static int saves_early(struct tms_backup_move *const *m, size_t n)
{
    if (n < 2) return 0;
    for (size_t i = 0; i < n; i++) {
        const struct tms_backup *held = m[i]->held;
        if (!m[i]->retain || m[i]->skip_unchanged || m[i]->ranges || !held || held->ranges ||
            held->size != m[i]->size || held->kind != m[i]->kind ||
            tms_backup_path(held, 1, 0, m[i]->size) != TMS_PATH_DIRECT)
            return 0;
    }
    return 1;
}

struct early_hook {
    const struct tms_backup_hooks *hooks;
    size_t index;
    const struct tms_driver *drv;
    struct tms_save_plan *plan;
    struct tms_skip *skip;
    struct tms_save_info *info;
};

/* What the copy carried is fingerprinted again before the memory goes. */
static void saved_early(void *arg)
{
    const struct early_hook *e = arg;
    tms_skip_confirm(e->drv, e->plan, 1, e->skip, e->info);
    e->hooks->saved(e->hooks->arg, e->index);
}

int tms_backup_save(const struct tms_driver *drv, struct tms_backup_move *const *m, size_t n, int spill,
                    const struct tms_backup_hooks *hooks, struct tms_save_info *info, struct tms_err *err)
{
    struct tms_save_info unused;
    if (!info) info = &unused;
    *info = (struct tms_save_info){0};
    if (!n) return TMS_OK;
    struct tms_save_plan *p = calloc(n, sizeof *p);
    struct early_hook *early = hooks && hooks->saved && saves_early(m, n) ? calloc(n, sizeof *early) : NULL;
    size_t n_items = 0, reserved = 0;
    for (size_t i = 0; p && i < n; i++) {
        p[i].m = m[i];
        m[i]->copy = m[i]->held, m[i]->copied = 0, m[i]->unchanged = 0, m[i]->whole = 0;
        n_items += m[i]->ranges ? m[i]->n_ranges : 1;
        if (early) p[i].early = 1, early[i] = (struct early_hook){.hooks = hooks, .index = i};
    }
    struct tms_transfer_batch b;
    struct tms_skip skip;
    for (size_t i = 0; early && i < n; i++)
        early[i].drv = drv, early[i].plan = &p[i], early[i].skip = &skip, early[i].info = info;
    int rc = p ? tms_budget_reserve(p, n, spill, &reserved, err)
               : tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning %zu backups", n);
    if (!rc && (rc = tms_transfer_batch_start(&b, drv, 1, n_items, n, err))) {
        tms_ledger_copied(reserved);
        tms_ledger_release(reserved);
    }
    if (rc) {  /* nothing touched yet: every allocation keeps its backup */
        forget_ranges(m, n);
        free(early);
        free(p);
        return rc;
    }
    /* Fingerprinted first, all at once: a chunk that differs from this after
     * its copy was written while it was copied. */
    tms_skip_fingerprint(drv, p, n, &skip, info);
    for (size_t i = 0; i < n && !rc && !b.rc; i++) {
        /* The core drops the old backup when it settles if this is another one. */
        int kind = p[i].spill ? tms_backup_spill_kind() : m[i]->kind;
        rc = tms_backup_for_pause(drv, kind, m[i]->device, m[i]->size, m[i]->va, &m[i]->copy, err);
        /* A new backup copied whole and kept is locked by this copy, not later. */
        if (!rc && m[i]->retain && !m[i]->ranges && m[i]->copy != m[i]->held) tms_backup_will_be_kept(m[i]->copy);
        /* What a backup recorded describes bytes this save may overwrite. */
        if (!rc && m[i]->copy == m[i]->held && !p[i].compare) tms_backup_forget_fingerprints(m[i]->copy);
        if (!rc) rc = tms_skip_ranges(&p[i], &skip, err);
        if (!rc && p[i].early && m[i]->copy == m[i]->held) {
            p[i].n_items = (size_t)tms_transfer_batch_add_whole(&b, m[i]->copy, m[i]->device, m[i]->va, m[i]->size,
                                                                saved_early, &early[i], &p[i].first_item);
        } else if (!rc) {
            p[i].early = 0;
            const struct tms_range *copy = p[i].copy ? p[i].copy : m[i]->ranges;
            size_t n_copy = p[i].copy ? p[i].n_copy : m[i]->n_ranges;
            tms_transfer_batch_add(&b, m[i]->copy, m[i]->device, m[i]->va, m[i]->size, copy, n_copy, NULL,
                                   &p[i].first_item, &p[i].n_items);
        }
    }
    if (rc || b.rc) tms_transfer_batch_close(&b);  /* a save that failed copies nothing more */
    else tms_transfer_batch_run(&b);
    if (!rc && b.rc) {
        rc = b.rc;
        if (err) *err = b.err;
    }
    for (size_t i = 0; i < n && !rc; i++) {
        int complete;
        m[i]->copied = tms_transfer_batch_done(&b, p[i].first_item, p[i].n_items, &complete);
        tms_backup_copied(m[i]->copy);
    }
    if (!rc) tms_skip_confirm(drv, p, n, &skip, info);
    if (!rc) tms_skip_record(p, n, &skip);
    for (size_t i = 0; i < n && !rc; i++) {
        tms_backup_set_ranges(m[i]->copy, m[i]->ranges, m[i]->n_ranges);  /* the backup's from now on */
        m[i]->ranges = NULL;
    }
    tms_skip_end(p, n, &skip);
    /* After a failure a whole copy the hook reported stays: the caller may
     * have let its allocation go, and then the copy is all that holds its bytes. */
    for (size_t i = 0; i < n && rc; i++)
        if (p[i].early && m[i]->copy && m[i]->copy == m[i]->held && p[i].n_items == 1)
            tms_transfer_batch_done(&b, p[i].first_item, 1, &m[i]->whole);
    tms_transfer_batch_end(&b);
    forget_ranges(m, n);
    tms_ledger_copied(reserved);  /* what the backups keep is host memory now: no longer in flight */
    if (rc) {
        tms_ledger_release(reserved);  /* hooks are set only where a copy reuses a backup: nothing new is kept */
        for (size_t i = 0; i < n; i++) {
            if (m[i]->whole) tms_backup_copied(m[i]->copy);
            else tms_backup_move_discard(m[i]);
        }
    } else {
        tms_budget_settle(p, n);
    }
    free(early);
    free(p);
    return rc;
}
