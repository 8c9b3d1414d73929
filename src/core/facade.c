/* The faces' way to the services below the core (settings, budget, disk directory, backends, copy workers): each a forward, no policy. */
#include <stdio.h>
#include <string.h>

#include "backup/backup.h"
#include "backup/ledger.h"
#include "core/core.h"
#include "platform/config.h"
#include "platform/driver.h"

void tms_core_defaults(struct tms_core_defaults *out)
{
    const struct tms_defaults *d = tms_defaults();
    *out = (struct tms_core_defaults){
        .init_enable = d->init_enable, .init_backup = d->init_backup, .init_backup_kind = tms_backup_default_kind(),
        .init_disk_backup = d->init_disk_backup, .retain_backup = d->retain_backup, .chunk_bytes = d->chunk_bytes,
        .disk_block_bytes = d->disk_block_bytes, .progress = d->progress, .backup_live_only = d->backup_live_only,
        .spill_to_disk = d->spill_to_disk, .reloc_hooks = d->reloc_hooks,
    };
    snprintf(out->job, sizeof out->job, "%s", d->job);
}

int tms_core_env_check(struct tms_err *err) { return tms_env_check(err); }

int tms_core_host_budget(struct tms_host_budget *out, struct tms_err *err)
{
    struct tms_ledger_info info;
    int rc = tms_ledger_info(&info, err);
    *out = (struct tms_host_budget){.limit = info.limit, .reserved = info.reserved, .mine = info.mine,
                                    .mem_total = info.mem_total, .mem_available = info.mem_available,
                                    .safety = info.safety, .alone = info.alone};
    snprintf(out->name, sizeof out->name, "%s", info.name);
    snprintf(out->ledger, sizeof out->ledger, "%s", info.ledger);
    return rc;
}

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
