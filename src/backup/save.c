/* A save, the way down of a backed-up pause, as passes over one plan: reserve, choose, narrow, copy, commit (or undo). */
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

/* A fingerprinted move's copies still to land: the last one records what they
 * carried (skip.c) while the copies of the other moves go on. */
struct landing {
    struct save *s;
    size_t index, left;
};

/* One save as it goes through its passes: plan, reserve (budget.c), choose
 * each backup (backup.c), narrow each copy to what changed (skip.c), copy
 * (transfer_batch.c), then commit or undo. */
struct save {
    const struct tms_driver *drv;
    struct tms_backup_move *const *m;
    size_t n, n_items, reserved;
    struct tms_save_plan *p;
    struct early_hook *early;
    struct landing *landing;  /* per move; NULL: each is recorded at commit */
    struct tms_transfer_batch b;
    struct tms_skip skip;
    struct tms_save_info *info;
};

static void landed(void *arg)
{
    struct landing *l = arg;
    if (--l->left) return;
    tms_skip_confirm(l->s->drv, &l->s->p[l->index], 1, &l->s->skip, l->s->info);
}

/* A plan per move, and the early hooks where every move may go early. */
static int plan(struct save *s, const struct tms_backup_hooks *hooks, struct tms_err *err)
{
    s->p = calloc(s->n, sizeof *s->p);
    s->landing = s->n > 1 ? calloc(s->n, sizeof *s->landing) : NULL;  /* one move has nothing to overlap */
    s->early = hooks && hooks->saved && saves_early(s->m, s->n) ? calloc(s->n, sizeof *s->early) : NULL;
    if (!s->p) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning %zu backups", s->n);
    for (size_t i = 0; i < s->n; i++) {
        struct tms_backup_move *m = s->m[i];
        s->p[i].m = m;
        m->copy = m->held, m->copied = 0, m->unchanged = 0, m->whole = 0;
        s->n_items += m->ranges ? m->n_ranges : 1;
        if (s->early)
            s->p[i].early = 1, s->early[i] = (struct early_hook){.hooks = hooks, .index = i, .drv = s->drv,
                                                                 .plan = &s->p[i], .skip = &s->skip, .info = s->info};
    }
    return TMS_OK;
}

/* Move i's backup: its held one written again, or a new one (of the spill
 * kind where the budget sent it to disk); the core drops the old one when it
 * settles if this is another. */
static int choose(struct save *s, size_t i, struct tms_err *err)
{
    struct tms_backup_move *m = s->m[i];
    int kind = s->p[i].spill ? tms_backup_spill_kind() : m->kind;
    int rc = tms_backup_for_pause(s->drv, kind, m->device, m->size, m->va, &m->copy, err);
    if (rc) return rc;
    /* A new backup copied whole and kept is locked by this copy, not later. */
    if (m->retain && !m->ranges && m->copy != m->held) tms_backup_will_be_kept(m->copy);
    /* What a backup recorded describes bytes this save may overwrite. */
    if (m->copy == m->held && !s->p[i].compare) tms_backup_forget_fingerprints(m->copy);
    return TMS_OK;
}

/* Move i's copy queued: whole, reporting when it lands (early), or its
 * ranges less what skip.c found unchanged. */
static void queue(struct save *s, size_t i)
{
    struct tms_backup_move *m = s->m[i];
    struct tms_save_plan *p = &s->p[i];
    if (p->early && m->copy == m->held) {
        p->n_items = (size_t)tms_transfer_batch_add_whole(&s->b, m->copy, m->device, m->va, m->size, saved_early,
                                                          &s->early[i], &p->first_item);
        return;
    }
    p->early = 0;
    const struct tms_range *copy = p->copy ? p->copy : m->ranges;
    size_t n_copy = p->copy ? p->n_copy : m->n_ranges;
    tms_transfer_batch_add(&s->b, m->copy, m->device, m->va, m->size, copy, n_copy, NULL, &p->first_item,
                           &p->n_items);
    if (s->landing && p->fingerprinted && p->n_items) {
        s->landing[i] = (struct landing){.s = s, .index = i, .left = p->n_items};
        tms_transfer_batch_on_backed_up(&s->b, p->first_item, p->n_items, landed, &s->landing[i]);
    }
}

/* The copies succeeded: each backup holds its move's ranges, with the record
 * of what they carried, and the budget what each backup holds. */
static void commit(struct save *s)
{
    for (size_t i = 0; i < s->n; i++) {
        int complete;
        s->m[i]->copied = tms_transfer_batch_done(&s->b, s->p[i].first_item, s->p[i].n_items, &complete);
        tms_backup_copied(s->m[i]->copy);
    }
    tms_skip_confirm(s->drv, s->p, s->n, &s->skip, s->info);
    tms_skip_record(s->p, s->n, &s->skip);
    for (size_t i = 0; i < s->n; i++) {
        tms_backup_set_ranges(s->m[i]->copy, s->m[i]->ranges, s->m[i]->n_ranges);  /* the backup's from now on */
        s->m[i]->ranges = NULL;
    }
}

/* The save failed: every backup it began to write is dropped, but a whole
 * copy the hook reported, which stays: the caller may have let its
 * allocation go, and then the copy is all that holds its bytes. */
static void undo(struct save *s)
{
    for (size_t i = 0; i < s->n; i++) {
        struct tms_backup_move *m = s->m[i];
        if (s->p[i].early && m->copy && m->copy == m->held && s->p[i].n_items == 1)
            tms_transfer_batch_done(&s->b, s->p[i].first_item, 1, &m->whole);
    }
}

int tms_backup_save(const struct tms_driver *drv, struct tms_backup_move *const *m, size_t n, int spill,
                    const struct tms_backup_hooks *hooks, struct tms_save_info *info, struct tms_err *err)
{
    struct tms_save_info unused;
    if (!info) info = &unused;
    *info = (struct tms_save_info){0};
    if (!n) return TMS_OK;
    struct save s = {.drv = drv, .m = m, .n = n, .info = info};
    int rc = plan(&s, hooks, err);
    if (!rc) rc = tms_budget_reserve(s.p, n, spill, &s.reserved, err);
    if (!rc && (rc = tms_transfer_batch_start(&s.b, drv, 1, s.n_items, n, err))) {
        tms_ledger_copied(s.reserved);
        tms_ledger_release(s.reserved);
    }
    if (rc) {  /* nothing touched yet: every allocation keeps its backup */
        forget_ranges(m, n);
        free(s.early);
        free(s.landing);
        free(s.p);
        return rc;
    }
    /* Fingerprinted first, all at once: a chunk that differs from this after
     * its copy was written while it was copied. */
    tms_skip_fingerprint(drv, s.p, n, &s.skip, info);
    for (size_t i = 0; i < n && !rc && !s.b.rc; i++) {
        rc = choose(&s, i, err);
        if (!rc) rc = tms_skip_ranges(&s.p[i], &s.skip, err);  /* narrow */
        if (!rc) queue(&s, i);
    }
    if (rc || s.b.rc) tms_transfer_batch_close(&s.b);  /* a save that failed copies nothing more */
    else tms_transfer_batch_run(&s.b);
    if (!rc && s.b.rc) {
        rc = s.b.rc;
        if (err) *err = s.b.err;
    }
    if (!rc) commit(&s);
    else undo(&s);
    tms_skip_end(s.p, n, &s.skip);
    tms_transfer_batch_end(&s.b);
    forget_ranges(m, n);
    tms_ledger_copied(s.reserved);  /* what the backups keep is host memory now: no longer in flight */
    if (rc) {
        tms_ledger_release(s.reserved);  /* hooks are set only where a copy reuses a backup: nothing new is kept */
        for (size_t i = 0; i < n; i++) {
            if (m[i]->whole) tms_backup_copied(m[i]->copy);
            else tms_backup_move_discard(m[i]);
        }
    } else {
        tms_budget_settle(s.p, n);
    }
    free(s.early);
    free(s.landing);
    free(s.p);
    return rc;
}
