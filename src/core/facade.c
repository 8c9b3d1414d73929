/* The faces' way to the services below the core (budget, disk directory, backends, copy workers): each a forward, no policy. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backup/backup.h"
#include "backup/ledger.h"
#include "core/core.h"
#include "platform/driver.h"
#include "platform/fingerprint.h"

int tms_core_host_budget(struct tms_ledger_info *info, struct tms_err *err) { return tms_ledger_info(info, err); }

int tms_core_set_disk_dir(const char *dir, struct tms_err *err) { return tms_backup_set_disk_dir(dir, err); }

void tms_core_disk_dir(char *buf, size_t n) { tms_backup_disk_dir(buf, n); }

int tms_core_use_backend(const char *name, struct tms_err *err) { return tms_driver_select(name, err); }

int tms_core_backend(const char **name, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (!rc) *name = drv->name;
    return rc;
}

const char *tms_core_loaded_backend(void) { return tms_driver_loaded_name(); }

void tms_core_set_platform_hint(const char *platform) { tms_driver_set_platform_hint(platform); }

int tms_core_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err), count = 0;
    if (rc) return rc;
    if (device < 0) return tms_fail(err, TMS_E_ARG, 0, "device must be >= 0, got %d", device);
    if ((rc = drv->device_count(&count)))
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "device count failed");
    if (device >= count) return tms_fail(err, TMS_E_ARG, 0, "device %d does not exist (%d devices)", device, count);
    if ((rc = drv->mem_get_info(device, free_bytes, total_bytes)))
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "mem_get_info on device %d failed", device);
    return TMS_OK;
}

/* The caller's device: the one its regions' allocations will land on. */
int tms_core_warm_backups(struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err), device = 0;
    if (rc) return rc;
    if ((rc = drv->current_device(&device)))
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "current device query failed");
    tms_backup_warm_later(drv, device);
    return TMS_OK;
}

int tms_core_current_device(int *device, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    if ((rc = drv->current_device(device)))
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "current device query failed");
    return TMS_OK;
}

int tms_core_device_active(int device, int *active, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err), count = 0;
    if (rc) return rc;
    if ((rc = drv->device_count(&count)))
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "device count failed");
    if (device < 0 || device >= count)
        return tms_fail(err, TMS_E_ARG, 0, "device %d does not exist (%d devices)", device, count);
    if ((rc = drv->device_active(device, active)))
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "primary context state of device %d failed", device);
    return TMS_OK;
}

void tms_core_copy_progress(size_t *done, size_t *total) { tms_backup_copy_progress(done, total); }

void *tms_core_backup_bytes(const struct tms_backup *b) { return tms_backup_host(b); }

void tms_core_backup_release(struct tms_backup *b) { tms_backup_unref(b); }

/* Per thread, so a failure is read back by the thread that caused it. */
static _Thread_local char last_error[sizeof ((struct tms_err *)0)->msg];

void tms_core_keep_error(const struct tms_err *err) { snprintf(last_error, sizeof last_error, "%s", err->msg); }

const char *tms_core_last_error(void) { return last_error; }

int tms_core_fingerprint(int device, uint64_t va, size_t n, uint64_t (*out)[4], struct tms_err *err)
{
    _Static_assert(TMS_CORE_FP_CHUNK == TMS_FP_CHUNK && TMS_FP_LANES == 4, "core.h's fingerprint shape");
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err), count = 0;
    if (rc) return rc;
    if ((rc = drv->device_count(&count)))
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "device count failed");
    if (device < 0 || device >= count) return tms_fail(err, TMS_E_ARG, 0, "device %d does not exist (%d devices)", device, count);
    if (!drv->fingerprint) return tms_fail(err, TMS_E_UNSUPPORTED, 0, "the %s backend has no fingerprint kernel", drv->name);
    tms_va *chunks = malloc((n ? n : 1) * sizeof *chunks);
    if (!chunks) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory listing %zu chunks", n);
    for (size_t i = 0; i < n; i++) chunks[i] = va + i * TMS_FP_CHUNK;
    rc = drv->fingerprint(device, chunks, n, (struct tms_fp *)out);
    free(chunks);
    if (rc)
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "fingerprint of %zu chunks at 0x%llx on device %d failed", n,
                               (unsigned long long)va, device);
    return TMS_OK;
}

int tms_core_fingerprint_bytes(const void *data, size_t len, size_t chunk, const void *key, uint64_t (*out)[4],
                               struct tms_err *err)
{
    size_t block = (size_t)16 * 64 * TMS_FP_THREADS;
    if (!chunk || chunk % block || len % chunk)
        return tms_fail(err, TMS_E_ARG, 0, "fingerprint of %zu bytes in chunks of %zu: chunks must be whole %zu-byte "
                        "blocks and divide the bytes", len, chunk, block);
    const struct tms_fp_key *k = key;
    uint64_t generation;
    int rc = key ? TMS_OK : tms_fp_key(&k, &generation, err);
    for (size_t i = 0; !rc && i < len / chunk; i++)
        tms_fp_compute((const char *)data + i * chunk, chunk, k, (struct tms_fp *)out[i]);
    return rc;
}
