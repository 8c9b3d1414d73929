/* A backed-up pause's backups: reserved from the host backup budget, made or reused, filled in batches; all kept or none. */
#ifndef TMS_BACKUP_FILL_H
#define TMS_BACKUP_FILL_H

#include <stddef.h>
#include <stdint.h>

#include "backup/backup.h"
#include "platform/driver.h"
#include "platform/error.h"

/* One allocation a pause backs up. The caller fills the first part. */
struct tms_backup_plan {
    int kind;                   /* the allocation's backup kind */
    int device;
    tms_va va;
    size_t size;
    struct tms_backup *held;    /* its backup now (a pause may write into it again), or NULL */
    struct tms_range *ranges;   /* the bytes to copy (NULL: every one); the call takes them */
    size_t n_ranges;
    int retain;                 /* its backup is kept across resume (retain on) */
    /* Optional, for a plan without ranges: called in the caller's thread once
     * the whole allocation is in its backup, while the others still copy.
     * If the fill then fails, a plan whose copy was whole keeps it. */
    void (*backed_up)(void *arg);
    void *backed_up_arg;
    /* Out: */
    struct tms_backup *copy;    /* its backup after the pause: held or a new one; NULL on failure */
    size_t copied;              /* bytes copied into it */
    int whole;                  /* a failed fill: its copy has a hook, is whole and is kept */
    /* The budget's (budget.c): */
    size_t need;                /* host backup bytes it holds from the budget after the pause */
    int spill;                  /* backed up to disk: the budget had no room for it */
    size_t first_item, n_items; /* its copy's items */
};

/* Reserves what the host backups of the plans need beyond what those reused
 * hold (spilling the largest to disk where spill is on and the budget has no
 * room), makes or reuses each backup, and copies the device's bytes into
 * them. On failure the budget is as it was, and if copying had begun every
 * backup the call touched is dropped (a file is removed: the device still
 * holds the truth, and a half-written copy must not be served as a backup):
 * each plan's copy is NULL (but a whole one with a backed_up hook, kept:
 * the hook may have let its memory go); else each keeps held. pre: the
 * devices are synchronized; the memory stays mapped unless a hook unmaps it. */
int tms_backup_fill(const struct tms_driver *drv, struct tms_backup_plan *plans, size_t n, int spill,
                    struct tms_err *err);

/* ---- the host backup budget of a fill (budget.c) -------------------------- */
/* Reserves from the budget what the plans' host backups need beyond what
 * those they reuse hold (*reserved); where the budget has no room and spill
 * is on, the largest go to disk instead (their spill set) until the rest fits;
 * else the error names the budget, and nothing has changed. */
int tms_budget_reserve(struct tms_backup_plan *plans, size_t n, int spill, size_t *reserved, struct tms_err *err);
/* After the copies: each host backup holds what it needs (reserved covered
 * the growth); what a reused one held beyond goes back. */
void tms_budget_settle(struct tms_backup_plan *plans, size_t n);

#endif
