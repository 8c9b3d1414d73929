/* The physical memory of one allocation: its extents, whatever they came from, mapped, unmapped and let go along one path each. */
#include <stdlib.h>
#include <string.h>

#include "core/core_internal.h"
#include "platform/log.h"

static const struct tms_provider *provider;  /* atomic: set once by share/ */

void tms_core_set_provider(const struct tms_provider *p) { __atomic_store_n(&provider, p, __ATOMIC_RELEASE); }

const struct tms_provider *tms_extents_provider(void) { return __atomic_load_n(&provider, __ATOMIC_ACQUIRE); }

size_t tms_chunk_size(const struct tms_alloc *a, int i)
{
    size_t start = (size_t)i * a->chunk;
    return a->reserved - start < a->chunk ? a->reserved - start : a->chunk;
}

int tms_extents_exchangeable(const struct tms_driver *drv, const struct tms_alloc *a)
{
    return !a->adopted && a->handle_types && drv->export_fd && drv->import_fd && drv->device_identity;
}

int tms_extents_reserve(struct tms_alloc *a, int n)
{
    if (n <= a->ext_cap) return TMS_OK;
    int inline_one = a->ext == &a->one_ext;
    struct tms_extent *more = realloc(inline_one ? NULL : a->ext, (size_t)n * sizeof *more);
    if (!more) return TMS_E_HOST_OOM;
    if (inline_one && a->n_ext) memcpy(more, &a->one_ext, sizeof *more);  /* it lived in one_ext */
    a->ext = more;
    a->ext_cap = n;
    return TMS_OK;
}

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
    /* Memory a provider keeps gives way: let go (this process's, then others'), then tried again. */
    const struct tms_provider *p = tms_extents_provider();
    if (rc && drv->is_oom(rc) && p && p->provide(NULL, 0, a->device, size)) rc = create_once(drv, a, size, h);
    if (rc && a->handle_types && !a->adopted && first && !drv->is_oom(rc) && drv->create_shareable) {
        TMS_DEBUG("exportable create on device %d failed (%s): allocation 0x%llx is made plain", a->device,
                  drv->code_name(rc), (unsigned long long)a->va);
        a->handle_types = 0;
        rc = drv->create(a->device, size, h);
    }
    return rc;
}

int tms_extents_map(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err)
{
    int planned = a->n_ext;
    size_t off = 0;
    for (int i = 0; i < planned; i++) off += a->ext[i].len;
    size_t rest = a->reserved - off, pieces = rest ? (rest + a->chunk - 1) / a->chunk : 0;
    if (pieces > (size_t)(INT32_MAX - planned) || tms_extents_reserve(a, planned + (int)pieces))
        return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory for %zu chunk handles of allocation 0x%llx",
                        pieces + (size_t)planned, (unsigned long long)a->va);
    /* Every handle first, then every map: a failed create has mapped nothing. */
    int rc = 0, mapped = 0, failed = 0;
    const char *op = "create";
    for (; off < a->reserved; failed++) {
        size_t len = a->reserved - off < a->chunk ? a->reserved - off : a->chunk;
        tms_phys h;
        if ((rc = create_handle(drv, a, len, !planned && !failed, &h))) break;
        a->ext[a->n_ext++] = (struct tms_extent){.handle = h, .len = len, .size = len, .from = {.kind = TMS_MEM_OWN}};
        off += len;
    }
    if (!rc) {
        failed = 0;
        op = "map";
        for (off = 0; mapped < a->n_ext; mapped++) {
            if ((rc = drv->map(a->device, a->va + off, a->ext[mapped].len, a->ext[mapped].handle))) break;
            off += a->ext[mapped].len;
        }
        failed = mapped;
    } else {
        failed += planned;
    }
    if (!rc) return TMS_OK;
    int status = tms_driver_status(drv, rc);
    size_t failed_len = failed < a->n_ext ? a->ext[failed].len : a->reserved - off < a->chunk ? a->reserved - off : a->chunk;
    int total = planned + (int)pieces;
    tms_driver_fail(err, status, drv, rc,
                    "%s of %zu bytes (chunk %d of %d) for allocation 0x%llx of %zu bytes, tag '%s', device %d failed",
                    op, failed_len, failed + 1, total, (unsigned long long)a->va, a->size, tag, a->device);
    off = 0;
    for (int i = 0; i < mapped; off += a->ext[i++].len) {
        int urc = drv->unmap(a->va + off, a->ext[i].len);
        if (urc) tms_driver_fail_append(err, drv, urc, "undoing it, unmap of chunk %d failed", i + 1);
    }
    for (int i = planned; i < a->n_ext; i++) {
        int rrc = drv->release(a->ext[i].handle);
        if (rrc) tms_driver_fail_append(err, drv, rrc, "undoing it, release of chunk %d failed", i + 1);
    }
    a->n_ext = planned;
    return status;
}

int tms_extents_unmap(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err)
{
    size_t off = 0;
    for (int i = 0; i < a->n_ext; off += a->ext[i++].len) {
        int rc = drv->unmap(a->va + off, a->ext[i].len);
        if (rc && drv->is_shutdown(rc)) return TMS_OK;  /* process exit: the driver took it all */
        if (!rc) continue;
        tms_driver_fail(err, TMS_E_DRIVER, drv, rc,
                        "unmap of allocation 0x%llx (%zu bytes, chunk %d of %d), tag '%s', device %d failed",
                        (unsigned long long)a->va, a->size, i + 1, a->n_ext, tag, a->device);
        size_t back = 0;
        for (int j = 0; j < i; back += a->ext[j++].len) {
            int mrc = drv->map(a->device, a->va + back, a->ext[j].len, a->ext[j].handle);
            if (mrc)
                tms_err_append(err, "mapping chunk %d back failed too (%s, %d): bytes 0x%llx..0x%llx are unusable",
                               j + 1, drv->code_name(mrc), mrc, (unsigned long long)(a->va + back),
                               (unsigned long long)(a->va + back + a->ext[j].len));
        }
        return TMS_E_DRIVER;
    }
    return TMS_OK;
}

void tms_extents_give(struct tms_give *items, size_t n)
{
    const struct tms_provider *p = tms_extents_provider();
    if (p && n) p->give(items, n);
}

int tms_extents_release(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err)
{
    int first_rc = 0;
    int lent = 0;
    for (int i = 0; i < a->n_ext && !lent; i++) lent = a->ext[i].from.kind == TMS_MEM_LENT;
    if (lent) {  /* a provider's memory goes back to it */
        struct tms_give g = {.owner = a, .device = a->device, .ext = a->ext, .n_ext = a->n_ext};
        tms_extents_give(&g, 1);
        first_rc = g.rc;
    }
    for (int i = 0; i < a->n_ext; i++) {
        if (a->ext[i].from.kind != TMS_MEM_OWN) continue;
        int rc = drv->release(a->ext[i].handle);
        if (rc && !first_rc && !drv->is_shutdown(rc)) first_rc = rc;
    }
    a->n_ext = 0;
    if (first_rc)
        return tms_driver_fail(err, TMS_E_DRIVER, drv, first_rc,
                               "release of allocation 0x%llx (%zu bytes), tag '%s', device %d failed",
                               (unsigned long long)a->va, a->size, tag, a->device);
    return TMS_OK;
}

void tms_extents_forget(struct tms_alloc *a)
{
    struct tms_give g = {.owner = a, .device = a->device, .gone = 1};
    tms_extents_give(&g, 1);
}
