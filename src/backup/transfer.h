/* Backup copies at link speed: a pool of worker threads moving blocks through pinned staging. */
#ifndef TMS_TRANSFER_H
#define TMS_TRANSFER_H

#include <stddef.h>

#include "backup/kind.h"
#include "platform/driver.h"

/* Page-locked host memory needs no staging: copies to and from it move in
 * blocks this large, fewer waits per byte. */
#define TMS_DIRECT_BLOCK_BYTES ((size_t)32 << 20)

/* A copy between a device range and the same bytes of a backup: n bytes
 * from dev + offset to backup offset, or back. */
struct tms_transfer {
    int device;
    tms_va dev;
    struct tms_backup *backup;
    size_t offset;
    size_t n;
    size_t done;       /* out (atomic): bytes known complete, == n on success */
    /* Host->device only, optional: called once, on the worker that completes
     * the item (done == n), while the other items' copies may still run;
     * never for an item of 0 bytes. */
    void (*restored)(void *arg);
    void *restored_arg;
    /* Device->host only, optional: called once, in the thread that runs the
     * copies, when every byte of the item is in its backup, while the other
     * items' copies may still run, and also if another item's copy fails. */
    void (*backed_up)(void *arg);
    void *backed_up_arg;
    /* Host->device only, optional: called in the thread that runs the copies,
     * in item order, before any block of this item or a later one is copied,
     * while the earlier items' copies run (a resume maps its allocations
     * so). Nonzero leaves this item and every later one uncopied (done 0)
     * without failing the run; not called once a copy has failed or if the
     * run fails before its copies start, and then the items not yet prepared
     * stay uncopied too. */
    int (*prepare)(void *arg);
    void *prepare_arg;
    enum tms_backup_path path;  /* private: how its blocks move, chosen when the copy is planned */
};

/* Copies every item (device->host if to_host, else host->device) and returns
 * when no copy is in flight any more, also on failure. On failure fills err
 * with the first error; items with done == n completed. pre: the device
 * ranges are mapped and no other work writes them; the backups are open. */
int tms_transfer_run(const struct tms_driver *drv, int to_host, struct tms_transfer *items, size_t count,
                     struct tms_err *err);

/* ---- batches (transfer_batch.c) -------------------------------------------------
 * The copies of a pause or resume, in batches that hold at most a kind's open
 * limit of open backups (files: descriptors): a batch runs when it is full or
 * at the end, and its backups are closed once it has run. */
struct tms_transfer_batch {
    const struct tms_driver *drv;
    int to_host;
    struct tms_transfer *items;   /* every item of the call */
    size_t start, count, cap;     /* the batch: items[start, count) of cap */
    struct tms_backup **open;     /* the batch's backups, each once */
    size_t n_open;
    int rc;                       /* the first failure */
    struct tms_err err;
};

/* How a resume's copy of one backup goes (tms_transfer_batch_add). */
struct tms_restore_opts {
    void (*restored)(void *arg);  /* set on each of its items (struct tms_transfer): the caller counts them */
    void *restored_arg;
    int (*prepare)(void *arg);    /* set on its first item (struct tms_transfer), if it has one */
    void *prepare_arg;
};

/* Room for items items (it grows as items are added) of backups backups; TMS_E_HOST_OOM. */
int tms_transfer_batch_start(struct tms_transfer_batch *b, const struct tms_driver *drv, int to_host, size_t items,
                             size_t backups, struct tms_err *err);
/* Adds the copy of an open backup between the allocation of size bytes at va
 * on device and the same bytes of the backup: one item per range (ranges
 * NULL: the whole allocation). *first and *n: its items. restore: a
 * resume's options, NULL for a pause. Runs the batch if it is full. */
void tms_transfer_batch_add(struct tms_transfer_batch *b, struct tms_backup *backup, int device, tms_va va,
                            size_t size, const struct tms_range *ranges, size_t n_ranges,
                            const struct tms_restore_opts *restore, size_t *first, size_t *n);
/* A pause's items [first, first + n) call backed_up(arg) each, in the caller's
 * thread, once that item is all in its backup (struct tms_transfer). */
void tms_transfer_batch_on_backed_up(struct tms_transfer_batch *b, size_t first, size_t n, void (*backed_up)(void *arg),
                                     void *arg);
/* A pause's copy of a whole allocation (one item) that calls backed_up(arg)
 * once all of it is in the backup (struct tms_transfer); 0 where it found no
 * room for the item (b->rc says why). */
int tms_transfer_batch_add_whole(struct tms_transfer_batch *b, struct tms_backup *backup, int device, tms_va va,
                                  size_t size, void (*backed_up)(void *arg), void *arg, size_t *first);
/* Runs what is queued and closes its backups; a close after a pause's copies
 * that finds a write not durable fails the batch (b->rc, b->err). */
void tms_transfer_batch_run(struct tms_transfer_batch *b);
/* Closes the queued backups without copying (a pause that stops early). */
void tms_transfer_batch_close(struct tms_transfer_batch *b);
/* Bytes the items [first, first + n) copied; *complete: all of them. */
size_t tms_transfer_batch_done(const struct tms_transfer_batch *b, size_t first, size_t n, int *complete);
void tms_transfer_batch_end(struct tms_transfer_batch *b);

/* CPUs the calling thread may run on (its affinity), else the online ones. */
int tms_transfer_allowed_cpus(void);

/* The copy workers' count unless TMS_BACKUP_THREADS sets it: one per allowed
 * CPU, or, where the process may run on every online CPU, the share of them
 * of the GPUs it uses among the host's; at least 2 and at most 16. */
int tms_transfer_default_workers(int allowed_cpus, int online_cpus, int host_gpus, int used_gpus);

/* Waits until no tms_transfer_run is in progress (one may start next) or
 * *stop is set; returns *stop. */
int tms_transfer_wait_idle(const int *stop);
/* Wakes the waiters of tms_transfer_wait_idle to look at their stop flag. */
void tms_transfer_wake_idle_waiters(void);

/* Bytes copied so far by the current (or last) copy job, and its size. */
void tms_transfer_progress(size_t *done, size_t *total);

/* Starts the workers and their staging buffers ahead of the first pause
 * (pinning the staging takes long), on a thread of its own, once per
 * process (their streams come with the first copy: a stream holds device
 * memory, which a warm-up beside the caller must not move); the staging is pinned in the context of device, one the process
 * uses. If that fails, the next copy fails with its error (once). */
void tms_transfer_warm_later(const struct tms_driver *drv, int device);

#endif
