/* The copies of a pause or resume in batches that keep at most a kind's open limit of backups open; what the core asks of the copy workers. */
#include "backup/transfer.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Closes the batch's backups; after a pause's copies, a close that finds a
 * write not durable fails the batch. */
static void close_open(struct tms_transfer_batch *b, int copied)
{
    for (size_t i = 0; i < b->n_open; i++) {
        struct tms_err e = {0};
        int rc = tms_backup_close(b->open[i], b->to_host && copied, &e);
        if (rc && !b->rc) b->rc = rc, b->err = e;
    }
    b->start = b->count;
    b->n_open = 0;
}

void tms_transfer_batch_run(struct tms_transfer_batch *b)
{
    struct tms_err e = {0};
    int rc = tms_transfer_run(b->drv, b->to_host, b->items + b->start, b->count - b->start, &e);
    if (rc && !b->rc) b->rc = rc, b->err = e;
    close_open(b, !rc);
}

void tms_transfer_batch_close(struct tms_transfer_batch *b) { close_open(b, 0); }

/* The batch holds backup open now: it runs once it holds the kind's limit. */
static void opened(struct tms_transfer_batch *b, struct tms_backup *backup)
{
    b->open[b->n_open++] = backup;
    int limit = tms_backup_open_limit(backup);
    if (limit && b->n_open == (size_t)limit) tms_transfer_batch_run(b);
}

/* Room for k more items: a save that leaves unchanged chunks out copies more
 * ranges than its allocations have, known only once each backup is chosen. */
static int room(struct tms_transfer_batch *b, size_t k)
{
    if (b->count + k <= b->cap) return 1;
    size_t cap = b->cap * 2 > b->count + k ? b->cap * 2 : b->count + k;
    struct tms_transfer *grown = cap <= SIZE_MAX / sizeof *grown ? realloc(b->items, cap * sizeof *grown) : NULL;
    if (!grown) {
        if (!b->rc) b->rc = tms_fail(&b->err, TMS_E_HOST_OOM, 0, "out of host memory planning %zu copies", b->count + k);
        return 0;
    }
    memset(grown + b->cap, 0, (cap - b->cap) * sizeof *grown);
    b->items = grown, b->cap = cap;
    return 1;
}

void tms_transfer_batch_add(struct tms_transfer_batch *b, struct tms_backup *backup, int device, tms_va va,
                            size_t size, const struct tms_range *ranges, size_t n_ranges,
                            const struct tms_restore_opts *restore, size_t *first, size_t *n)
{
    *first = b->count;
    *n = ranges ? n_ranges : 1;
    if (!room(b, *n)) {
        *n = 0;
        opened(b, backup);  /* closed with the batch all the same */
        return;
    }
    for (size_t r = 0; r < *n; r++)
        b->items[b->count++] = (struct tms_transfer){
            .device = device, .dev = va, .backup = backup,
            .offset = ranges ? ranges[r].off : 0, .n = ranges ? ranges[r].len : size};
    for (size_t k = *first; restore && restore->restored && k < *first + *n; k++)
        b->items[k].restored = restore->restored, b->items[k].restored_arg = restore->restored_arg;
    if (restore && *n) b->items[*first].prepare = restore->prepare, b->items[*first].prepare_arg = restore->prepare_arg;
    opened(b, backup);
}

void tms_transfer_batch_on_backed_up(struct tms_transfer_batch *b, size_t first, size_t n, void (*backed_up)(void *arg),
                                     void *arg)
{
    for (size_t k = first; k < first + n && k < b->count; k++)
        b->items[k].backed_up = backed_up, b->items[k].backed_up_arg = arg;
}

int tms_transfer_batch_add_whole(struct tms_transfer_batch *b, struct tms_backup *backup, int device, tms_va va,
                                  size_t size, void (*backed_up)(void *arg), void *arg, size_t *first)
{
    *first = b->count;
    if (!room(b, 1)) {
        opened(b, backup);
        return 0;
    }
    b->items[b->count++] = (struct tms_transfer){.device = device, .dev = va, .backup = backup, .n = size,
                                                 .backed_up = backed_up, .backed_up_arg = arg};
    opened(b, backup);
    return 1;
}

int tms_transfer_batch_start(struct tms_transfer_batch *b, const struct tms_driver *drv, int to_host, size_t items,
                             size_t backups, struct tms_err *err)
{
    *b = (struct tms_transfer_batch){.drv = drv, .to_host = to_host};
    b->cap = items ? items : 1;
    b->items = calloc(b->cap, sizeof *b->items);
    b->open = calloc(backups ? backups : 1, sizeof *b->open);
    if (b->items && b->open) return TMS_OK;
    free(b->items);
    free(b->open);
    return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning the copies of %zu backups", backups);
}

size_t tms_transfer_batch_done(const struct tms_transfer_batch *b, size_t first, size_t n, int *complete)
{
    size_t done = 0;
    *complete = 1;
    for (size_t k = first; k < first + n; k++) {
        done += b->items[k].done;
        if (b->items[k].done != b->items[k].n) *complete = 0;
    }
    return done;
}

void tms_transfer_batch_end(struct tms_transfer_batch *b)
{
    free(b->items);
    free(b->open);
}

/* The core's two questions of the copy workers (backup.h). */
void tms_backup_warm_later(const struct tms_driver *drv, int device) { tms_transfer_warm_later(drv, device); }

void tms_backup_copy_progress(size_t *done, size_t *total) { tms_transfer_progress(done, total); }
