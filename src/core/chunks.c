/* The physical memory of one allocation: its chunks' handles (or its extents, with memory a job lent), mapped and unmapped. */
#include <stdlib.h>

#include "core/core_internal.h"
#include "platform/log.h"

size_t tms_chunk_size(const struct tms_alloc *a, int i)
{
    size_t start = (size_t)i * a->chunk;
    return a->reserved - start < a->chunk ? a->reserved - start : a->chunk;
}

static tms_va chunk_va(const struct tms_alloc *a, int i) { return a->va + (tms_va)i * a->chunk; }

static int create_once(const struct tms_driver *drv, struct tms_alloc *a, size_t size, tms_phys *h)
{
    return a->handle_types && drv->create_shareable ? drv->create_shareable(a->device, size, a->handle_types, h)
                                                    : drv->create(a->device, size, h);
}

/* One handle of size bytes for a, exportable as it was made. Where the
 * driver will not make exportable memory (a container without the right, an
 * old driver), ours is made plain and cannot be shared (first: no handle of
 * it exists yet); an adopted allocation keeps what its owner asked for. */
static int create_handle(const struct tms_driver *drv, struct tms_alloc *a, size_t size, int first, tms_phys *h)
{
    int rc = create_once(drv, a, size, h);
    /* Memory kept for a job gives way: released (this process's, then the members'), then tried again. */
    if (rc && drv->is_oom(rc) && tms_pool_make_room(a->device, size)) rc = create_once(drv, a, size, h);
    if (rc && a->handle_types && !a->adopted && first && !drv->is_oom(rc) && drv->create_shareable) {
        TMS_DEBUG("exportable create on device %d failed (%s): allocation 0x%llx is made plain", a->device,
                  drv->code_name(rc), (unsigned long long)a->va);
        a->handle_types = 0;
        rc = drv->create(a->device, size, h);
    }
    return rc;
}

/* Extents that are exactly the plain chunks, all its own, become them again:
 * sharing and the statistics then see the allocation as before any lending. */
static void plain_again(struct tms_alloc *a)
{
    if (a->n_ext != a->n_chunks) return;
    for (int i = 0; i < a->n_ext; i++)
        if (a->ext[i].key || a->ext[i].len != tms_chunk_size(a, i) || a->ext[i].size != a->ext[i].len) return;
    for (int i = 0; i < a->n_ext; i++) a->handles[i] = a->ext[i].handle;
    free(a->ext);
    a->ext = NULL;
    a->n_ext = 0;
}

/* The planned extents mapped in order, then the driver's memory for what
 * they leave (in chunks of a->chunk). On failure nothing stays mapped or
 * created here, and the plan stays in a->ext for the caller to give back. */
static int map_extents(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err)
{
    int planned = a->n_ext;
    size_t off = 0;
    for (int i = 0; i < planned; i++) off += a->ext[i].len;
    size_t rest = a->reserved - off, pieces = rest ? (rest + a->chunk - 1) / a->chunk : 0;
    if (pieces) {
        struct tms_extent *more = realloc(a->ext, ((size_t)planned + pieces) * sizeof *more);
        if (!more)
            return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning the memory of allocation 0x%llx",
                            (unsigned long long)a->va);
        a->ext = more;
    }
    int mapped = 0, rc = 0;
    const char *op = "map";
    size_t failed_len = 0;
    off = 0;
    for (; mapped < planned; mapped++) {
        failed_len = a->ext[mapped].len;
        if ((rc = drv->map(a->device, a->va + off, failed_len, a->ext[mapped].handle))) break;
        off += failed_len;
    }
    while (!rc && off < a->reserved) {
        size_t len = a->reserved - off < a->chunk ? a->reserved - off : a->chunk;
        tms_phys h;
        failed_len = len;
        op = "create";
        if ((rc = create_handle(drv, a, len, 0, &h))) break;
        a->ext[a->n_ext++] = (struct tms_extent){.handle = h, .len = len, .size = len, .fd = -1};
        op = "map";
        if ((rc = drv->map(a->device, a->va + off, len, h))) break;
        mapped++;
        off += len;
    }
    if (!rc) {
        size_t lent = 0;
        for (int i = 0; i < a->n_ext; i++) lent += a->ext[i].key ? a->ext[i].len : 0;
        if (lent) tms_pool_count_borrowed(a->device, lent);
        plain_again(a);
        return TMS_OK;
    }
    int status = tms_driver_status(drv, rc);
    tms_driver_fail(err, status, drv, rc,
                    "%s of %zu bytes at offset %zu (memory planned from the job's and the driver's) for allocation "
                    "0x%llx of %zu bytes, tag '%s', device %d failed",
                    op, failed_len, off, (unsigned long long)a->va, a->size, tag, a->device);
    off = 0;
    for (int i = 0; i < mapped; i++) {
        int urc = drv->unmap(a->va + off, a->ext[i].len);
        if (urc) tms_driver_fail_append(err, drv, urc, "undoing it, unmap at offset %zu failed", off);
        off += a->ext[i].len;
    }
    for (int i = planned; i < a->n_ext; i++) {
        int rrc = drv->release(a->ext[i].handle);
        if (rrc) tms_driver_fail_append(err, drv, rrc, "undoing it, release of a created handle failed");
    }
    a->n_ext = planned;
    return status;
}

int tms_chunks_map(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err)
{
    if (a->ext) return map_extents(drv, a, tag, err);
    int created = 0, mapped = 0, rc = 0;
    const char *op = "create";
    for (; created < a->n_chunks; created++)
        if ((rc = create_handle(drv, a, tms_chunk_size(a, created), !created, &a->handles[created]))) break;
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

static int unmap_extents(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err)
{
    size_t off = 0;
    for (int i = 0; i < a->n_ext; off += a->ext[i++].len) {
        int rc = drv->unmap(a->va + off, a->ext[i].len);
        if (rc && drv->is_shutdown(rc)) return TMS_OK;
        if (!rc) continue;
        tms_driver_fail(err, TMS_E_DRIVER, drv, rc,
                        "unmap of allocation 0x%llx (%zu bytes, %zu at offset %zu), tag '%s', device %d failed",
                        (unsigned long long)a->va, a->size, a->ext[i].len, off, tag, a->device);
        size_t back = 0;
        for (int j = 0; j < i; back += a->ext[j++].len) {
            int mrc = drv->map(a->device, a->va + back, a->ext[j].len, a->ext[j].handle);
            if (mrc)
                tms_err_append(err, "mapping it back failed too (%s, %d): bytes 0x%llx..0x%llx are unusable",
                               drv->code_name(mrc), mrc, (unsigned long long)(a->va + back),
                               (unsigned long long)(a->va + back + a->ext[j].len));
        }
        return TMS_E_DRIVER;
    }
    return TMS_OK;
}

int tms_chunks_unmap(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err)
{
    if (a->ext) return unmap_extents(drv, a, tag, err);
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
    if (a->ext) {
        /* Borrowed memory goes back to its lenders once released here. */
        first_rc = tms_pool_return_borrowed(drv, a->device, a->ext, a->n_ext, NULL);
        for (int i = 0; i < a->n_ext; i++) {
            if (a->ext[i].key) continue;
            int rc = drv->release(a->ext[i].handle);
            if (rc && !first_rc && !drv->is_shutdown(rc)) first_rc = rc;
        }
        free(a->ext);
        a->ext = NULL;
        a->n_ext = 0;
    } else {
        for (int i = 0; i < a->n_chunks; i++) {
            int rc = drv->release(a->handles[i]);
            if (rc && !first_rc && !drv->is_shutdown(rc)) first_rc = rc;
        }
    }
    if (first_rc)
        return tms_driver_fail(err, TMS_E_DRIVER, drv, first_rc,
                               "release of allocation 0x%llx (%zu bytes), tag '%s', device %d failed",
                               (unsigned long long)a->va, a->size, tag, a->device);
    return TMS_OK;
}
