/* Allocate and free through the core, and memory adopted from its owner (expandable segments). */
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/core_internal.h"
#include "platform/config.h"
#include "platform/driver.h"
#include "platform/log.h"

static int check_margin(const struct tms_driver *drv, int device, size_t reserved, size_t size, const char *tag,
                        struct tms_err *err)
{
    size_t margin = tms_core_margin();
    if (!margin) return TMS_OK;
    size_t free_bytes = 0, total = 0;
    int rc = drv->mem_get_info(device, &free_bytes, &total);
    if (rc)
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "mem_get_info on device %d failed", device);
    if (free_bytes < reserved || free_bytes - reserved < margin)
        return tms_fail(err, TMS_E_OOM, 0,
                        "allocation of %zu bytes (tag '%s', device %d) would leave %zu of %zu free bytes, "
                        "below memory_margin_bytes=%zu",
                        size, tag, device, free_bytes > reserved ? free_bytes - reserved : 0, free_bytes, margin);
    return TMS_OK;
}

int tms_core_check_margin(int device, size_t bytes, int tag_id, struct tms_err *err)
{
    if (!tms_core_margin()) return TMS_OK;
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    return rc ? rc : check_margin(drv, device, bytes, bytes, tms_core_tag_name(tag_id), err);
}

/* n rounded up to a multiple of unit (> 0); 0 if that does not fit a size_t. */
static size_t round_up(size_t n, size_t unit)
{
    size_t rem = n % unit;
    if (!rem) return n;
    return n > SIZE_MAX - (unit - rem) ? 0 : n + (unit - rem);
}

int tms_core_alloc(size_t size, int device, const struct tms_region *r, void **ptr, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    if (device < -1) return tms_fail(err, TMS_E_ARG, 0, "device %d does not exist (-1: the current one)", device);
    if (size == 0) return *ptr = NULL, TMS_OK;
    const char *tag = tms_core_tag_name(r->tag_id);
    int restore = r->restore >= 0 ? r->restore : tms_core_restore_mode_default();
    /* Memory a resume could never fill would stay paused for good: refused where it is asked for. */
    if (restore != TMS_RESTORE_NONE && !drv->fill)
        return tms_fail(err, TMS_E_UNSUPPORTED, 0, "allocation in tag '%s' with restore='%s': the %s backend cannot "
                        "fill device memory (use restore='none')", tag, tms_core_restore_mode_name(restore), drv->name);
    int count = 0;
    if (device < 0 && (rc = drv->current_device(&device)))
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "cannot tell the current device");
    if ((rc = drv->device_count(&count)))
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "device count failed");
    if (device >= count)
        return tms_fail(err, TMS_E_ARG, 0, "device %d does not exist (%d devices)", device, count);
    size_t gran = 0;
    if ((rc = drv->granularity(device, &gran)))
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "granularity query on device %d failed", device);
    size_t reserved = gran ? round_up(size, gran) : 0;
    if (!reserved)
        return tms_fail(err, TMS_E_OOM, 0, "allocation of %zu bytes (tag '%s', device %d) is larger than any device", size,
                        tag, device);
    if ((rc = check_margin(drv, device, reserved, size, tag, err))) return rc;

    const struct tms_defaults *defaults = tms_defaults();
    size_t chunk = defaults->chunk_bytes_set ? defaults->chunk_bytes : drv->default_chunk_bytes();
    chunk = chunk ? round_up(chunk, gran) : reserved;
    if (!chunk || chunk > reserved) chunk = reserved;  /* TMS_CHUNK_BYTES is bounded: 0 only if it were not */
    size_t n_chunks = reserved / chunk + (reserved % chunk != 0);
    if (n_chunks > INT_MAX)
        return tms_fail(err, TMS_E_OOM, 0,
                        "allocation of %zu bytes (tag '%s', device %d) is larger than any device (%zu chunks of %zu bytes)",
                        size, tag, device, n_chunks, chunk);
    struct tms_alloc *a = calloc(1, sizeof *a);
    if (!a) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory for an allocation record");
    a->size = size;
    a->reserved = reserved;
    a->chunk = chunk;
    a->n_chunks = (int)n_chunks;
    a->device = device;
    a->tag_id = r->tag_id;
    a->state = TMS_ACTIVE;
    a->backup = r->backup || r->disk_backup;
    a->backup_kind = tms_backup_kind_of_region(r->backup_kind, r->disk_backup);
    a->skip_unchanged = r->skip_unchanged;
    a->restore = restore;
    /* Exportable from the start: a handle cannot be made shareable later. */
    a->handle_types = defaults->shareable && drv->share_types ? drv->share_types(device) : 0;
    a->ext = &a->one_ext;
    a->ext_cap = 1;
    if (tms_extents_reserve(a, a->n_chunks)) {
        free(a);
        return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory for %zu chunk handles", n_chunks);
    }
    rc = drv->reserve(reserved, gran, &a->va);
    if (rc) {
        tms_alloc_destroy(a);
        return tms_driver_fail(err, tms_driver_status(drv, rc), drv, rc,
                               "address reserve of %zu bytes (tag '%s', device %d) failed", reserved, tag, device);
    }
    if ((rc = tms_extents_map(drv, a, tag, err))) {
        int urc = drv->unreserve(a->va, reserved);
        if (urc) tms_driver_fail_append(err, drv, urc, "undoing it, address free failed");
        tms_alloc_destroy(a);
        return rc;
    }
    tms_table_lock();
    rc = tms_table_insert_locked(a);
    tms_table_unlock();
    if (rc) {
        tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory growing the allocation table");
        if (tms_extents_unmap(drv, a, tag, err) == TMS_OK) (void)tms_extents_release(drv, a, tag, err);
        int urc = drv->unreserve(a->va, reserved);
        if (urc) tms_driver_fail_append(err, drv, urc, "undoing it, address free failed");
        tms_alloc_destroy(a);
        return TMS_E_HOST_OOM;
    }
    *ptr = (void *)(uintptr_t)a->va;
    /* The first pause of a process that never entered a Python region
     * (TMS_INIT_ENABLE, the C ABI) finds its copy workers ready too. */
    if (a->backup) tms_backup_warm_later(drv, device);
    TMS_DEBUG("alloc 0x%llx size %zu reserved %zu chunks %d device %d tag '%s' backup %s", (unsigned long long)a->va,
              size, reserved, a->n_chunks, device, tag, a->backup ? tms_backup_kind_name(a->backup_kind) : "none");
    return TMS_OK;
}

void tms_alloc_destroy(struct tms_alloc *a)
{
    tms_extents_forget(a);  /* memory a provider kept for it, if paused */
    if (a->ext != &a->one_ext) free(a->ext);
    tms_backup_unref(a->host_copy);
    free(a);
}

int tms_core_owns(const void *ptr)
{
    if (!ptr || tms_table_count() == 0) return 0;
    tms_table_lock();
    const struct tms_alloc *a = tms_table_find_locked((tms_va)(uintptr_t)ptr);
    int owned = a && !a->adopted;  /* adopted memory is its owner's to give back (tms_core_disown) */
    tms_table_unlock();
    return owned;
}

int tms_core_holds(const void *ptr)
{
    if (!ptr || tms_table_count() == 0) return 0;
    tms_table_lock();
    int held = tms_table_owner_locked((tms_va)(uintptr_t)ptr) != NULL;
    tms_table_unlock();
    return held;
}

/* The driver side of a free, for an allocation already out of the table.
 * If its memory cannot be unmapped it goes back into the table (a live
 * mapping must not be lost) and the free fails. */
int tms_alloc_release_detached(const struct tms_driver *drv, struct tms_alloc *a, struct tms_err *err)
{
    const char *tag = tms_core_tag_name(a->tag_id);
    tms_va va = a->va;
    int rc;
    if (a->state == TMS_ACTIVE) {
        /* cuMemUnmap does not wait for queued kernels, unlike cudaFree. */
        rc = drv->synchronize(a->device);
        if (rc && drv->is_shutdown(rc)) {
            tms_alloc_destroy(a);  /* process exit: the driver already took the memory */
            return TMS_OK;
        }
        if (rc)
            tms_driver_fail(err, TMS_E_DRIVER, drv, rc,
                            "synchronize of device %d before freeing 0x%llx (%zu bytes) failed", a->device,
                            (unsigned long long)va, a->size);
        else
            rc = tms_extents_unmap(drv, a, tag, err);
        if (rc) {
            a->free_requested = 0;
            tms_table_lock();
            int irc = tms_table_insert_locked(a);
            tms_table_unlock();
            if (irc) tms_err_append(err, "its record could not be kept either (out of host memory): it leaks");
            return rc;
        }
        struct tms_err release_err = {0};
        if (tms_extents_release(drv, a, tag, &release_err))  /* a leaked handle must not fail the free */
            tms_log_warn("free of 0x%llx: %s", (unsigned long long)va, release_err.msg);
    }
    TMS_DEBUG("free 0x%llx size %zu device %d tag '%s' (%s)", (unsigned long long)va, a->size, a->device, tag,
              a->state == TMS_ACTIVE ? "active" : "paused");
    rc = drv->unreserve(a->va, a->reserved);
    int shutdown = rc && drv->is_shutdown(rc);
    size_t size = a->size;
    tms_alloc_destroy(a);
    if (rc && !shutdown)
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "address free of 0x%llx (%zu bytes), tag '%s' failed",
                               (unsigned long long)va, size, tag);
    return TMS_OK;
}

int tms_core_free(void *ptr, struct tms_err *err)
{
    tms_va va = (tms_va)(uintptr_t)ptr;
    const struct tms_driver *drv = NULL;
    /* The core owns nothing before its driver is loaded; once it is, this
     * cannot fail, so no record is taken out and then lost. */
    int loaded = tms_driver_loaded_name() && tms_driver_get(&drv, NULL) == TMS_OK;
    struct tms_alloc *a = NULL;
    int deferred = 0;
    if (loaded) {
        tms_table_lock();
        struct tms_alloc **link = tms_table_link_locked(va);
        a = link ? *link : NULL;
        if (a && (a->free_requested || a->adopted)) {
            a = NULL;
        } else if (a && a->moving) {
            a->free_requested = 1;
            deferred = 1;
        } else if (a) {
            tms_table_unlink_locked(link);
        }
        tms_table_unlock();
    }
    if (!a) return tms_fail(err, TMS_E_NOT_FOUND, 0, "free of 0x%llx: not an allocation of torch_memory_saver",
                            (unsigned long long)va);
    if (deferred) {
        TMS_DEBUG("free 0x%llx: being paused or resumed, its mover frees it", (unsigned long long)va);
        return TMS_OK;
    }
    return tms_alloc_release_detached(drv, a, err);
}

/* ---- adopted memory ------------------------------------------------------- */

int tms_core_adopt(uint64_t va, size_t size, int device, tms_phys handle, uint64_t owner_handle, int handle_types,
                   const struct tms_region *r, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    struct tms_alloc *a = calloc(1, sizeof *a);
    if (!a) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory for an allocation record");
    *a = (struct tms_alloc){
        .va = va, .size = size, .reserved = size, .chunk = size, .n_chunks = 1, .device = device,
        .tag_id = r->tag_id, .state = TMS_ACTIVE, .backup = r->backup || r->disk_backup,
        .backup_kind = tms_backup_kind_of_region(r->backup_kind, r->disk_backup), .adopted = 1,
        .skip_unchanged = r->skip_unchanged, .restore = r->restore >= 0 ? r->restore : tms_core_restore_mode_default(),
        .owner_handle = owner_handle, .handle_types = handle_types, .n_ext = 1, .ext_cap = 1,
        .one_ext = {.handle = handle, .len = size, .size = size, .from = {.kind = TMS_MEM_OWN}},
    };
    a->ext = &a->one_ext;
    tms_table_lock();
    if (tms_table_find_locked(va)) {
        rc = tms_fail(err, TMS_E_STATE, 0, "adopting 0x%llx (%zu bytes): the table already holds an allocation there",
                      (unsigned long long)va, size);
    } else if (tms_table_insert_locked(a)) {
        rc = tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory growing the allocation table");
    }
    tms_table_unlock();
    if (rc) {
        free(a);
        return rc;
    }
    TMS_DEBUG("adopt 0x%llx size %zu device %d tag '%s' backup %s", (unsigned long long)va, size, device,
              tms_core_tag_name(r->tag_id), a->backup ? tms_backup_kind_name(a->backup_kind) : "none");
    return TMS_OK;
}

int tms_core_disown(uint64_t va, size_t max_size, tms_phys *handle, uint64_t *owner_handle, size_t *size,
                    struct tms_err *err)
{
    struct tms_alloc *a;
    size_t found_size = 0;
    tms_table_lock();
    for (;;) {
        struct tms_alloc **link = tms_table_link_locked(va);
        a = link ? *link : NULL;
        if (a && !a->adopted) a = NULL;
        if (!a || !a->moving) {
            if (a && a->size > max_size) found_size = a->size, a = NULL;
            else if (a) tms_table_unlink_locked(link);
            break;
        }
        /* Its mover holds no lock of ours and never waits: it settles. */
        tms_table_wait_settled();
    }
    tms_table_unlock();
    if (found_size)
        return tms_fail(err, TMS_E_ARG, 0, "0x%llx: unmap of %zu bytes covers part of an adopted allocation of %zu",
                        (unsigned long long)va, max_size, found_size);
    if (!a) return tms_fail(err, TMS_E_NOT_FOUND, 0, "0x%llx: no adopted allocation starts there", (unsigned long long)va);
    *handle = a->state == TMS_ACTIVE ? a->ext[0].handle : 0;
    *owner_handle = a->owner_handle;
    *size = a->size;
    TMS_DEBUG("disown 0x%llx size %zu tag '%s' (%s)", (unsigned long long)va, a->size, tms_core_tag_name(a->tag_id),
              a->state == TMS_ACTIVE ? "active" : "paused: nothing mapped, backup dropped");
    tms_alloc_destroy(a);
    return TMS_OK;
}

int tms_alloc_skips_unchanged(const struct tms_alloc *a)
{
    return a->backup && (a->skip_unchanged >= 0 ? a->skip_unchanged : tms_core_skip_unchanged());
}

int tms_alloc_keeps_backup(const struct tms_alloc *a, int retain) { return retain || tms_alloc_skips_unchanged(a); }
