/* Backups of paused allocations: host buffers and disk files, reference-counted. */
#ifndef TMS_BACKUP_H
#define TMS_BACKUP_H

#include <stddef.h>
#include <stdint.h>

#include "backup/disk.h"
#include "platform/driver.h"

/* Reference-counted so a zero-copy view handed to Python keeps the bytes
 * alive after the core has dropped them (resume without retain, free). */
struct tms_backup {
    void *host;                      /* NULL for a disk backup, and once released */
    size_t size;
    int kind;                        /* enum tms_backup_kind */
    int pinning;                     /* atomic, enum tms_pinning: TMS_PIN_DONE once page-locked */
    /* Per TMS_PIN_PIECE_BYTES piece of host, 1 while it is registered: by a
     * pinned backup's first copy (any order) or by the page-locking thread
     * (in order). NULL until either may lock it. */
    unsigned char *locked;
    struct tms_backup *pin_next;     /* in the queue of backups to page-lock (backup.c) */
    int refs;                        /* atomic */
    const struct tms_driver *drv;
    struct tms_disk_file file;       /* kind TMS_BACKUP_DISK */
};

enum tms_pinning { TMS_PIN_NONE, TMS_PIN_RUNNING, TMS_PIN_DONE, TMS_PIN_FAILED };

/* New backup of size bytes for the allocation at va on device, with one
 * reference; host memory is placed on the device's NUMA node where the
 * driver knows it. Fills err on failure (TMS_E_HOST_OOM naming size and
 * kind; TMS_E_IO for a file). */
int tms_backup_new(const struct tms_driver *drv, int kind, int device, size_t size, uint64_t va,
                   struct tms_backup **out, struct tms_err *err);
/* A pause of an allocation backed up as kind may write into b again: same
 * kind, and a file only where tms_disk_rewritable says so. */
int tms_backup_reusable(const struct tms_backup *b, int kind);
/* Is b page-locked now (a DMA can go straight to it)? A pinned backup is
 * from its first copy on (tms_backup_copied), where the driver can lock it. */
int tms_backup_pinned(const struct tms_backup *b);
/* The piece map a copy into b locks as it goes (tms_transfer lock_pieces):
 * a new pinned backup's before its first copy; else NULL. */
unsigned char *tms_backup_pieces_to_lock(const struct tms_backup *b);
/* The first copy into b succeeded: a new pinned backup whose pieces that copy
 * all locked is page-locked from now on; one it could not lock whole stays
 * pageable (its locked pieces unlocked). Nothing for other backups. */
void tms_backup_copied(struct tms_backup *b);
/* Queues an mmap backup to be page-locked, once, by a background thread
 * while no copy runs: a retained backup is copied again every cycle, and a
 * page-locked one takes the DMA directly at link speed instead of through
 * the staging (issue 16). Until it is done (~0.3-0.5 s per 8 GiB) copies go
 * through the staging as before. It is registered in pieces of
 * TMS_PIN_PIECE_BYTES (transfer.h), each only while no copy runs, so a copy
 * that starts meanwhile waits for one piece at most. */
void tms_backup_pin_later(struct tms_backup *b);
void tms_backup_ref(struct tms_backup *b);
void tms_backup_unref(struct tms_backup *b);
/* A resume restored every byte of backup (a struct tms_backup *) and drops
 * it: its host memory goes now, on the copy worker, while other allocations'
 * copies still run (freeing 16 GiB of page-locked memory took 0.35-0.5 s, the
 * length of the copies themselves, on the lent H100), unless a zero-copy
 * view still holds it. The record stays until the last reference. */
void tms_backup_release_restored(void *backup);

#endif
