/* A restore, the way back of a resume: each backup opened, its allocation prepared by the caller just before its copy may start, every copy run in batches, what came back checked. */
#include "backup/kind.h"

#include <stdlib.h>

#include "backup/transfer.h"

/* One move of a restore. Its items count down as they land; the worker that
 * lands the last one checks what came back, then lets the storage go where
 * the backup is not kept, unless the check failed: that backup is all that
 * holds the allocation's bytes. */
struct restoring {
    const struct tms_driver *drv;
    struct tms_backup_move *m;
    int parts_left;       /* atomic */
    int release;          /* its storage goes once its bytes are back and checked */
    int tail_zeroed;      /* its last chunk's bytes past the allocation were zeroed, as at its pause */
    int finished;         /* checked (and released where it goes) */
    uint64_t *verify_ns;  /* atomic: the call's */
};

static void finish(struct restoring *r)
{
    struct tms_backup_move *m = r->m;
    if (m->verify) {
        uint64_t ns = 0;
        tms_verify_restored(r->drv, m->held, m, r->tail_zeroed, &ns);
        __atomic_add_fetch(r->verify_ns, ns, __ATOMIC_RELAXED);
    }
    if (r->release && !m->bad) tms_backup_release_restored(m->held);
    r->finished = 1;
}

static void part_restored(void *arg)
{
    struct restoring *r = arg;
    if (__atomic_sub_fetch(&r->parts_left, 1, __ATOMIC_ACQ_REL) == 0) finish(r);
}

struct restore {
    const struct tms_backup_hooks *hooks;
    struct restoring *moves;
    size_t next;  /* moves [0, next) are prepared: their hook said go */
    size_t n;
    int stopped;  /* a hook said stop */
};

/* The hooks of every move up to and including last, in order; a move to
 * check has the tail of its last chunk zeroed once it is mapped. */
static int prepare_upto(struct restore *r, size_t last)
{
    while (!r->stopped && r->next <= last && r->next < r->n) {
        if (r->hooks && r->hooks->before_restore && r->hooks->before_restore(r->hooks->arg, r->next)) {
            r->stopped = 1;
            break;
        }
        struct restoring *one = &r->moves[r->next];
        const struct tms_backup_move *m = one->m;
        if (m->verify && m->held) one->tail_zeroed = tms_fp_zero_tail(one->drv, m);
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
                       const struct tms_backup_hooks *hooks, struct tms_restore_info *info, struct tms_err *err)
{
    struct tms_restore_info unused;
    if (!info) info = &unused;
    *info = (struct tms_restore_info){0};
    size_t n_items = 0, n_backups = 0;
    for (size_t i = 0; i < n; i++) {
        m[i]->copy = m[i]->held, m[i]->copied = 0, m[i]->whole = 0;
        m[i]->verified = 0, m[i]->bad = 0, m[i]->bad_offset = 0, m[i]->unverified = NULL;
        if (m[i]->held) n_items += items_of(m[i]->held), n_backups++;
    }
    struct restoring *moves = calloc(n ? n : 1, sizeof *moves);
    struct restore r = {.hooks = hooks, .moves = moves, .n = n};
    struct tms_transfer_batch b;
    struct first_item *first = calloc(n ? n : 1, sizeof *first);
    size_t *item0 = calloc(n ? n : 1, sizeof *item0), *items = calloc(n ? n : 1, sizeof *items);
    int rc = moves && first && item0 && items ? TMS_OK
             : tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning the resume of %zu allocations", n);
    for (size_t i = 0; !rc && i < n; i++)
        moves[i] = (struct restoring){.drv = drv, .m = m[i], .verify_ns = &info->verify_ns,
                                      .release = m[i]->held && !tms_backup_kept_while_active(m[i]->held, m[i]->retain),
                                      .parts_left = m[i]->held ? (int)items_of(m[i]->held) : 0};
    int planned = !rc && !(rc = tms_transfer_batch_start(&b, drv, 0, n_items, n_backups, err));
    /* A backup that cannot be opened stops the restore as a hook does: the
     * moves from it on are neither prepared nor copied. */
    for (size_t i = 0; planned && !rc && !b.rc && i < n; i++) {
        struct tms_backup *held = m[i]->held;
        if (!held) continue;  /* prepared with the next copy, or at the end */
        if ((rc = tms_backup_open(held, err))) break;
        first[i] = (struct first_item){.r = &r, .move = i};
        struct tms_restore_opts opts = {.restored = part_restored, .restored_arg = &moves[i],
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
    /* A move is whole once all its bytes are back (and it was prepared), and
     * they are what its pause backed up where that was checked. */
    for (size_t i = 0; i < r.next; i++) {
        int complete = 1;
        if (m[i]->held) m[i]->copied = tms_transfer_batch_done(&b, item0[i], items[i], &complete);
        if (!complete) continue;
        if (m[i]->held && !moves[i].finished) finish(&moves[i]);  /* it had nothing to copy */
        if (m[i]->bad) continue;
        m[i]->whole = 1;
        if (moves[i].release) m[i]->copy = NULL;  /* its storage went */
    }
    if (planned) tms_transfer_batch_end(&b);
    free(moves);
    free(first);
    free(item0);
    free(items);
    return rc;
}
