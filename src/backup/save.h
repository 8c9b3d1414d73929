/* Inside a save (save.c): one plan per move, and what the host backup budget (budget.c) does with them. */
#ifndef TMS_BACKUP_SAVE_H
#define TMS_BACKUP_SAVE_H

#include <stddef.h>

#include "backup/kind.h"

/* A move as a save works it through: the record (backup.h) and what the
 * save keeps beside it. */
struct tms_save_plan {
    struct tms_backup_move *m;
    size_t need;                /* host backup bytes it holds from the budget after the save */
    int spill;                  /* backed up to disk: the budget had no room for it */
    int early;                  /* saved whole into its reused backup: the saved hook tells the caller */
    size_t first_item, n_items; /* its copy's items */
};

/* Reserves from the budget what the plans' host backups need beyond what
 * those they reuse hold (*reserved); where the budget has no room and spill
 * is on, the largest go to disk instead (their spill set) until the rest fits;
 * else the error names the budget, and nothing has changed. */
int tms_budget_reserve(struct tms_save_plan *plans, size_t n, int spill, size_t *reserved, struct tms_err *err);
/* After the copies: each host backup holds what it needs (reserved covered
 * the growth); what a reused one held beyond goes back. */
void tms_budget_settle(struct tms_save_plan *plans, size_t n);

#endif
