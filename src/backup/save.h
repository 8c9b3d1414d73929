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
    /* Fingerprints (skip.c): its chunks in the call's fingerprints, whether
     * its held backup's own can be compared (skip unchanged memory), the
     * ranges to copy, and whether what the copy carried was fingerprinted
     * again already (a move let go early). */
    int fingerprinted;
    int compare;
    int tail_listed;            /* its last chunk, partly past its end, is listed (the rest of it zeroed) */
    size_t fp_first, fp_n;
    struct tms_range *copy;
    size_t n_copy;
    int confirmed;
};

/* The fingerprints of one save (skip.c): before the copies (pre), and of the
 * chunks they carried once they are done (post): a chunk whose two differ
 * was written while it was copied, and its backup's record of it is not trusted. */
struct tms_skip {
    tms_va *chunks;             /* device address of each chunk listed */
    size_t *index;              /* its index in its allocation (offset / TMS_FP_CHUNK) */
    struct tms_fp *fp;          /* pre */
    struct tms_fp *post;
    unsigned char *copied;      /* the copy carried it: post is taken, and the record compares it with pre */
    unsigned char *posted;      /* post was taken */
    size_t n;
    uint64_t generation;        /* of the key they were taken under */
};

/* Fingerprints every chunk of the moves that skip unchanged memory (one call
 * per device) and says which of them can be compared with what their held
 * backup recorded. Where that cannot be done (no kernel, a failed run, no
 * memory) the moves are copied whole, their backups forget what they
 * recorded, and info->why_not says why. */
void tms_skip_fingerprint(const struct tms_driver *drv, struct tms_save_plan *p, size_t n, struct tms_skip *s,
                          struct tms_save_info *info);
/* The ranges of plan p to copy (p->copy), once its backup for this save is
 * known: all of its ranges, less the granules whose every chunk matches what
 * the backup it reuses recorded; m->unchanged counts what was left out.
 * TMS_E_HOST_OOM. */
int tms_skip_ranges(struct tms_save_plan *p, const struct tms_skip *s, struct tms_err *err);
/* After the copies (or, for a move let go early, in its saved hook before
 * the memory goes): the chunks the copies carried, fingerprinted again. A
 * run that fails leaves them unrecorded and info says why. */
void tms_skip_confirm(const struct tms_driver *drv, struct tms_save_plan *p, size_t n, struct tms_skip *s,
                      struct tms_save_info *info);
/* After the copies succeeded: the backup records the fingerprints of the
 * chunks it now holds as they were, but of those written while they were
 * copied (their two fingerprints differ), which it does not trust. */
void tms_skip_record(struct tms_save_plan *p, size_t n, const struct tms_skip *s);
void tms_skip_end(struct tms_save_plan *p, size_t n, struct tms_skip *s);

/* Reserves from the budget what the plans' host backups need beyond what
 * those they reuse hold (*reserved); where the budget has no room and spill
 * is on, the largest go to disk instead (their spill set) until the rest fits;
 * else the error names the budget, and nothing has changed. */
int tms_budget_reserve(struct tms_save_plan *plans, size_t n, int spill, size_t *reserved, struct tms_err *err);
/* After the copies: each host backup holds what it needs (reserved covered
 * the growth); what a reused one held beyond goes back. */
void tms_budget_settle(struct tms_save_plan *plans, size_t n);

#endif
