/* The process-wide settings a face may change at run time: memory margin, retained backups, spilling to disk. */
#include <stddef.h>

#include "core/core.h"
#include "core/core_internal.h"
#include "platform/config.h"

static size_t margin_bytes;          /* atomic */
static int retain_override = -1;     /* atomic; -1: TMS_RETAIN_CPU_BACKUP decides */
static int spill_override = -1;      /* atomic; -1: TMS_SPILL_TO_DISK decides */
static int skip_override = -1;       /* atomic; -1: TMS_SKIP_UNCHANGED decides */

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

void tms_core_set_skip_unchanged(int skip) { __atomic_store_n(&skip_override, skip ? 1 : 0, __ATOMIC_RELAXED); }

int tms_core_skip_unchanged(void)
{
    int v = __atomic_load_n(&skip_override, __ATOMIC_RELAXED);
    return v >= 0 ? v : tms_defaults()->skip_unchanged;
}

int tms_alloc_skips_unchanged(const struct tms_alloc *a)
{
    return a->backup && (a->skip_unchanged >= 0 ? a->skip_unchanged : tms_core_skip_unchanged());
}
