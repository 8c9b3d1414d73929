/* The process-wide settings a face may change at run time: memory margin, retained backups, spilling to disk. */
#include <stddef.h>

#include "core/core.h"
#include "platform/config.h"

static size_t margin_bytes;          /* atomic */
static int retain_override = -1;     /* atomic; -1: TMS_RETAIN_CPU_BACKUP decides */
static int spill_override = -1;      /* atomic; -1: TMS_SPILL_TO_DISK decides */

void tms_core_set_margin(size_t bytes) { __atomic_store_n(&margin_bytes, bytes, __ATOMIC_RELAXED); }
size_t tms_core_margin(void) { return __atomic_load_n(&margin_bytes, __ATOMIC_RELAXED); }

void tms_core_set_spill(int spill) { __atomic_store_n(&spill_override, spill ? 1 : 0, __ATOMIC_RELAXED); }

int tms_core_spill(void)
{
    int v = __atomic_load_n(&spill_override, __ATOMIC_RELAXED);
    return v >= 0 ? v : tms_defaults()->spill_to_disk;
}

void tms_core_set_retain(int retain) { __atomic_store_n(&retain_override, retain ? 1 : 0, __ATOMIC_RELAXED); }

int tms_core_retain(void)
{
    int v = __atomic_load_n(&retain_override, __ATOMIC_RELAXED);
    return v >= 0 ? v : tms_defaults()->retain_backup;
}
