/* A restore, the way back of a resume: each backup opened, its allocation prepared by the caller just before its copy may start, every copy run in batches. */
#include "backup/kind.h"

#include <stdlib.h>

#include "backup/transfer.h"

struct restore {
    const struct tms_backup_hooks *hooks;
    size_t next;  /* moves [0, next) are prepared: their hook said go */
    size_t n;
    int stopped;  /* a hook said stop */
};

/* The hooks of every move up to and including last, in order. */
static int prepare_upto(struct restore *r, size_t last)
{
    while (!r->stopped && r->next <= last && r->next < r->n) {
        if (r->hooks && r->hooks->before_restore && r->hooks->before_restore(r->hooks->arg, r->next)) {
            r->stopped = 1;
            break;
        }
        r->next++;
    }
    return r->stopped;
}

struct first_item {
    struct restore *r;
    size_t move;
};

static int prepare_move(void *arg)
{
    struct first_item *f = arg;
    return prepare_upto(f->r, f->move);
}

static size_t items_of(const struct tms_backup *b) { return b->ranges ? b->n_ranges : 1; }

int tms_backup_restore(const struct tms_driver *drv, struct tms_backup_move *const *m, size_t n,
                       const struct tms_backup_hooks *hooks, struct tms_err *err)
{
    size_t n_items = 0, n_backups = 0;
    for (size_t i = 0; i < n; i++) {
        m[i]->copy = m[i]->held, m[i]->copied = 0, m[i]->whole = 0;
        if (m[i]->held) n_items += items_of(m[i]->held), n_backups++;
    }
    struct restore r = {.hooks = hooks, .n = n};
    struct tms_transfer_batch b;
    struct first_item *first = calloc(n ? n : 1, sizeof *first);
    size_t *item0 = calloc(n ? n : 1, sizeof *item0), *items = calloc(n ? n : 1, sizeof *items);
    int rc = first && item0 && items ? TMS_OK
             : tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning the resume of %zu allocations", n);
    int planned = !rc && !(rc = tms_transfer_batch_start(&b, drv, 0, n_items, n_backups, err));
    /* A backup that cannot be opened stops the restore as a hook does: the
     * moves from it on are neither prepared nor copied. */
    for (size_t i = 0; planned && !rc && !b.rc && i < n; i++) {
        struct tms_backup *held = m[i]->held;
        if (!held) continue;  /* prepared with the next copy, or at the end */
        if ((rc = tms_backup_open(held, err))) break;
        first[i] = (struct first_item){.r = &r, .move = i};
        /* A backup not kept goes once its last item is restored. */
        struct tms_restore_opts opts = {.release_when_restored = !tms_backup_kept_while_active(held, m[i]->retain),
                                        .prepare = prepare_move, .prepare_arg = &first[i]};
        tms_transfer_batch_add(&b, held, m[i]->device, m[i]->va, m[i]->size, held->ranges, held->n_ranges, &opts,
                               &item0[i], &items[i]);
    }
    if (planned) tms_transfer_batch_run(&b);
    if (!rc && planned && !b.rc && n) prepare_upto(&r, n - 1);  /* the moves after the last copy */
    if (planned && b.rc && !rc) {
        rc = b.rc;
        if (err) *err = b.err;
    }
    /* A move is whole once all its bytes are back (and it was prepared). */
    for (size_t i = 0; i < r.next; i++) {
        int complete = 1;
        if (m[i]->held) m[i]->copied = tms_transfer_batch_done(&b, item0[i], items[i], &complete);
        if (!complete) continue;
        m[i]->whole = 1;
        if (m[i]->held && !tms_backup_kept_while_active(m[i]->held, m[i]->retain)) m[i]->copy = NULL;  /* its storage went */
    }
    if (planned) tms_transfer_batch_end(&b);
    free(first);
    free(item0);
    free(items);
    return rc;
}
