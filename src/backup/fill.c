/* A backed-up pause's backups, in one walk: the budget reserved, each backup made or reused, every copy run in batches, the budget settled. */
#include "backup/fill.h"

#include <stdlib.h>

#include "backup/ledger.h"
#include "backup/transfer.h"

/* Forgets the backup a plan would install, dropping it if it is new. */
static void discard_copy(struct tms_backup_plan *p)
{
    if (p->copy != p->held) tms_backup_unref(p->copy);
    p->copy = NULL;
}

static void forget_ranges(struct tms_backup_plan *p, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(p[i].ranges);
        p[i].ranges = NULL;
    }
}

int tms_backup_fill(const struct tms_driver *drv, struct tms_backup_plan *p, size_t n, int spill,
                    struct tms_err *err)
{
    size_t n_items = 0, reserved = 0;
    for (size_t i = 0; i < n; i++) {
        p[i].copy = p[i].held;
        n_items += p[i].ranges ? p[i].n_ranges : 1;
    }
    struct tms_transfer_batch b;
    int rc = n ? tms_budget_reserve(p, n, spill, &reserved, err) : TMS_OK;
    if (!rc && n && (rc = tms_transfer_batch_start(&b, drv, 1, n_items, n, err))) {
        tms_ledger_copied(reserved);
        tms_ledger_release(reserved);
    }
    if (rc || !n) {  /* nothing touched yet: every allocation keeps its backup */
        forget_ranges(p, n);
        return rc;
    }
    for (size_t i = 0; i < n && !rc && !b.rc; i++) {
        /* The core drops the old backup when it settles if this is another one. */
        int kind = p[i].spill ? tms_backup_spill_kind() : p[i].kind;
        rc = tms_backup_for_pause(drv, kind, p[i].device, p[i].size, p[i].va, &p[i].copy, err);
        /* A new backup copied whole and kept is locked by this copy, not later. */
        if (!rc && p[i].retain && !p[i].ranges && p[i].copy != p[i].held) tms_backup_will_be_kept(p[i].copy);
        if (!rc && p[i].backed_up && !p[i].ranges && p[i].copy == p[i].held) {
            p[i].n_items = 1;
            tms_transfer_batch_add_whole(&b, p[i].copy, p[i].device, p[i].va, p[i].size, p[i].backed_up,
                                         p[i].backed_up_arg, &p[i].first_item);
        } else if (!rc) {
            tms_transfer_batch_add(&b, p[i].copy, p[i].device, p[i].va, p[i].size, p[i].ranges, p[i].n_ranges, NULL,
                                   &p[i].first_item, &p[i].n_items);
        }
    }
    if (rc) tms_transfer_batch_close(&b);
    else tms_transfer_batch_run(&b);
    if (!rc && b.rc) {
        rc = b.rc;
        if (err) *err = b.err;
    }
    for (size_t i = 0; i < n && !rc; i++) {
        int complete;
        p[i].copied = tms_transfer_batch_done(&b, p[i].first_item, p[i].n_items, &complete);
        tms_backup_copied(p[i].copy);
        tms_backup_set_ranges(p[i].copy, p[i].ranges, p[i].n_ranges);  /* the backup's from now on */
        p[i].ranges = NULL;
    }
    /* After a failure a whole copy with a hook stays: the hook may have let
     * its allocation go, and then the copy is all that holds its bytes. */
    for (size_t i = 0; i < n && rc; i++)
        if (p[i].backed_up && p[i].copy && p[i].copy == p[i].held && p[i].n_items == 1)
            tms_transfer_batch_done(&b, p[i].first_item, 1, &p[i].whole);
    tms_transfer_batch_end(&b);
    forget_ranges(p, n);
    tms_ledger_copied(reserved);  /* what the backups keep is host memory now: no longer in flight */
    if (rc) {
        tms_ledger_release(reserved);  /* hooks are set only where a copy reuses a backup: nothing new is kept */
        for (size_t i = 0; i < n; i++) {
            if (p[i].whole) tms_backup_copied(p[i].copy);
            else discard_copy(&p[i]);
        }
    } else {
        tms_budget_settle(p, n);
    }
    return rc;
}
