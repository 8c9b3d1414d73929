/* The physical memory of one allocation: its chunks' handles, mapped and unmapped. */
#include "core/core_internal.h"
#include "platform/log.h"

size_t tms_chunk_size(const struct tms_alloc *a, int i)
{
    size_t start = (size_t)i * a->chunk;
    return a->reserved - start < a->chunk ? a->reserved - start : a->chunk;
}

static tms_va chunk_va(const struct tms_alloc *a, int i) { return a->va + (tms_va)i * a->chunk; }

int tms_chunks_map(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err)
{
    int created = 0, mapped = 0, rc = 0;
    const char *op = "create";
    for (; created < a->n_chunks; created++) {
        size_t size = tms_chunk_size(a, created);
        rc = a->handle_types && drv->create_shareable
                 ? drv->create_shareable(a->device, size, a->handle_types, &a->handles[created])
                 : drv->create(a->device, size, &a->handles[created]);
        /* Where the driver will not make exportable memory (a container
         * without the right, an old driver), ours is made plain and cannot
         * be shared; an adopted allocation keeps what its owner asked for. */
        if (rc && a->handle_types && !a->adopted && !created && !drv->is_oom(rc) && drv->create_shareable) {
            TMS_DEBUG("exportable create on device %d failed (%s): allocation 0x%llx is made plain", a->device,
                      drv->code_name(rc), (unsigned long long)a->va);
            a->handle_types = 0;
            rc = drv->create(a->device, size, &a->handles[created]);
        }
        if (rc) break;
    }
    if (!rc) {
        op = "map";
        for (; mapped < a->n_chunks; mapped++) {
            rc = drv->map(a->device, chunk_va(a, mapped), tms_chunk_size(a, mapped), a->handles[mapped]);
            if (rc) break;
        }
    }
    if (!rc) return TMS_OK;
    int failed = op[0] == 'c' ? created : mapped;
    int status = tms_driver_status(drv, rc);
    tms_driver_fail(err, status, drv, rc,
                    "%s of %zu bytes (chunk %d of %d) for allocation 0x%llx of %zu bytes, tag '%s', device %d failed",
                    op, tms_chunk_size(a, failed), failed + 1, a->n_chunks, (unsigned long long)a->va, a->size, tag,
                    a->device);
    for (int i = 0; i < mapped; i++) {
        int urc = drv->unmap(chunk_va(a, i), tms_chunk_size(a, i));
        if (urc) tms_driver_fail_append(err, drv, urc, "undoing it, unmap of chunk %d failed", i + 1);
    }
    for (int i = 0; i < created; i++) {
        int rrc = drv->release(a->handles[i]);
        if (rrc) tms_driver_fail_append(err, drv, rrc, "undoing it, release of chunk %d failed", i + 1);
    }
    return status;
}

int tms_chunks_unmap(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err)
{
    for (int i = 0; i < a->n_chunks; i++) {
        int rc = drv->unmap(chunk_va(a, i), tms_chunk_size(a, i));
        if (rc && drv->is_shutdown(rc)) return TMS_OK;  /* process exit: the driver took it all */
        if (!rc) continue;
        tms_driver_fail(err, TMS_E_DRIVER, drv, rc,
                        "unmap of allocation 0x%llx (%zu bytes, chunk %d of %d), tag '%s', device %d failed",
                        (unsigned long long)a->va, a->size, i + 1, a->n_chunks, tag, a->device);
        for (int j = 0; j < i; j++) {
            int mrc = drv->map(a->device, chunk_va(a, j), tms_chunk_size(a, j), a->handles[j]);
            if (mrc)
                tms_err_append(err, "mapping chunk %d back failed too (%s, %d): bytes 0x%llx..0x%llx are unusable",
                               j + 1, drv->code_name(mrc), mrc, (unsigned long long)chunk_va(a, j),
                               (unsigned long long)(chunk_va(a, j) + tms_chunk_size(a, j)));
        }
        return TMS_E_DRIVER;
    }
    return TMS_OK;
}

int tms_chunks_release(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err)
{
    int first_rc = 0;
    for (int i = 0; i < a->n_chunks; i++) {
        int rc = drv->release(a->handles[i]);
        if (rc && !first_rc && !drv->is_shutdown(rc)) first_rc = rc;
    }
    if (first_rc)
        return tms_driver_fail(err, TMS_E_DRIVER, drv, first_rc,
                               "release of allocation 0x%llx (%zu bytes), tag '%s', device %d failed",
                               (unsigned long long)a->va, a->size, tag, a->device);
    return TMS_OK;
}
