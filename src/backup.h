/* Host copies of paused allocations: buffers and the device<->host transfers. */
#ifndef TMS_BACKUP_H
#define TMS_BACKUP_H

#include <stddef.h>

#include "driver.h"

/* Reference-counted so a zero-copy view handed to Python keeps the bytes
 * alive after the core has dropped them (resume without retain, free). */
struct tms_backup {
    void *host;
    size_t size;
    int kind;                        /* enum tms_backup_kind */
    int registered;                  /* pinned by host_register (else host_alloc_pinned) */
    int refs;                        /* atomic */
    const struct tms_driver *drv;
};

/* New buffer of size bytes with one reference. Fills err on failure
 * (TMS_E_HOST_OOM), naming size and kind. */
int tms_backup_new(const struct tms_driver *drv, int kind, size_t size, struct tms_backup **out,
                   struct tms_err *err);
void tms_backup_ref(struct tms_backup *b);
void tms_backup_unref(struct tms_backup *b);

#endif
