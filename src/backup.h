/* Backups of paused allocations: host buffers and disk files, reference-counted. */
#ifndef TMS_BACKUP_H
#define TMS_BACKUP_H

#include <stddef.h>
#include <stdint.h>

#include "disk.h"
#include "driver.h"

/* Reference-counted so a zero-copy view handed to Python keeps the bytes
 * alive after the core has dropped them (resume without retain, free). */
struct tms_backup {
    void *host;                      /* NULL for a disk backup */
    size_t size;
    int kind;                        /* enum tms_backup_kind */
    int registered;                  /* pinned by host_register (else host_alloc_pinned) */
    int refs;                        /* atomic */
    const struct tms_driver *drv;
    struct tms_disk_file file;       /* kind TMS_BACKUP_DISK */
};

/* New backup of size bytes for the allocation at va, with one reference.
 * Fills err on failure (TMS_E_HOST_OOM naming size and kind; TMS_E_IO for a
 * file). */
int tms_backup_new(const struct tms_driver *drv, int kind, size_t size, uint64_t va, struct tms_backup **out,
                   struct tms_err *err);
/* A pause of an allocation backed up as kind may write into b again: same
 * kind, and a file only where tms_disk_rewritable says so. */
int tms_backup_reusable(const struct tms_backup *b, int kind);
void tms_backup_ref(struct tms_backup *b);
void tms_backup_unref(struct tms_backup *b);

#endif
