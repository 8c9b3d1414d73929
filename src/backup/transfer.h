/* Backup copies at link speed: a pool of worker threads moving blocks through pinned staging. */
#ifndef TMS_TRANSFER_H
#define TMS_TRANSFER_H

#include <stddef.h>

#include "backup/disk.h"
#include "platform/driver.h"

/* Page-locked host memory needs no staging: copies to and from it move in
 * blocks this large, fewer waits per byte (issue 16: a retained backup's
 * copies at link speed). Each block starts at a multiple of it. */
#define TMS_DIRECT_BLOCK_BYTES ((size_t)32 << 20)

/* Page-locked host memory may be registered in pieces of this many bytes
 * (backup.c); a direct copy block never crosses a piece's end. */
#define TMS_PIN_PIECE_BYTES ((size_t)64 << 20)

/* One contiguous copy between a device range and host memory or a file. */
struct tms_transfer {
    int device;
    tms_va dev;
    void *host;
    struct tms_disk_file *file;  /* instead of host (open): the bytes go to or come from its offset 0 */
    size_t n;
    int host_pinned;   /* host is page-locked: the DMA goes straight to it */
    /* Device->host only, else NULL: host is fresh pageable memory that this
     * copy page-locks, piece by TMS_PIN_PIECE_BYTES piece, each just before
     * the DMA straight into it (a pinned backup; faulting in, locking and
     * copying pieces on all workers at once paused 16 GiB at 22.9-32.7 GB/s
     * against 14.9-17.9 locking it whole first, lent H100). lock_pieces[k]
     * becomes 1 once piece k is locked; a piece the driver cannot lock (not
     * for lack of memory) is copied pageable. */
    unsigned char *lock_pieces;
    size_t done;       /* out (atomic): bytes known complete, == n on success */
    /* Host->device only, optional: called once, on the worker that completes
     * the item (done == n), while the other items' copies may still run;
     * never for an item of 0 bytes. */
    void (*restored)(void *arg);
    void *restored_arg;
};

/* Copies every item (device->host if to_host, else host->device) and returns
 * when no copy is in flight any more, also on failure. On failure fills err
 * with the first error; items with done == n completed. pre: the device
 * ranges are mapped and no other work writes them. */
int tms_transfer_run(const struct tms_driver *drv, int to_host, struct tms_transfer *items, size_t count,
                     struct tms_err *err);

/* CPUs the calling thread may run on (its affinity), else the online ones. */
int tms_transfer_allowed_cpus(void);

/* The copy workers' count unless TMS_BACKUP_THREADS sets it: one per allowed
 * CPU, or, where the process may run on every online CPU, the share of them
 * of the GPUs it sees among the host's; at least 2 and at most 16. */
int tms_transfer_default_workers(int allowed_cpus, int online_cpus, int host_gpus, int visible_gpus);

/* 1 when no tms_transfer_run is in progress (a hint: one may start next). */
int tms_transfer_idle(void);

/* Bytes copied so far by the current (or last) copy job, and its size. */
void tms_transfer_progress(size_t *done, size_t *total);

/* Starts the workers and their staging buffers ahead of the first pause
 * (pinning costs ~0.4 s per GiB, DESIGN), so that pause runs at link speed. */
int tms_transfer_warm(const struct tms_driver *drv, struct tms_err *err);

#endif
