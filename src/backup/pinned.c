/* The page-locked backup kind ("pinned"): fresh pages that its first copy page-locks piece by piece, DMA'd straight into after. */
#include <errno.h>
#include <stdlib.h>

#include "backup/host.h"
#include "platform/log.h"

/* cuMemHostAlloc of a large backup takes seconds, and faulting in and
 * registering the whole backup before copying into it serialises the two:
 * the first copy locks each piece just before its DMA instead, on every copy
 * worker at once (docs/performance.md). */
static int create(struct tms_backup *b, int device, uint64_t va, struct tms_err *err)
{
    (void)va;
    if (!(b->locked = tms_host_piece_map(b->size)))
        return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory for a pinned backup record");
    if ((b->host = tms_host_map_fresh(b->drv, device, b->size))) return TMS_OK;
    int e = errno;
    free(b->locked);
    b->locked = NULL;
    return tms_fail(err, TMS_E_HOST_OOM, e, "cannot map %zu bytes of host memory for a pinned backup: errno %d",
                    b->size, e);
}

static int reusable(const struct tms_backup *b)
{
    (void)b;
    return 1;
}

static int first_copy(const struct tms_backup *b)
{
    return b->locked && __atomic_load_n(&b->pinning, __ATOMIC_ACQUIRE) == TMS_PIN_NONE;
}

/* Are the pieces under [off, off+len) all page-locked? */
static int range_locked(const struct tms_backup *b, size_t off, size_t len)
{
    if (!b->locked || !len) return 0;
    for (size_t k = off / TMS_PIN_PIECE_BYTES; k <= (off + len - 1) / TMS_PIN_PIECE_BYTES; k++)
        if (b->locked[k] != TMS_PIECE_LOCKED) return 0;
    return 1;
}

/* Until every piece is locked (copies of part of it lock only their
 * pieces), a copy to it locks what it still needs and one from it goes
 * direct where its pieces are locked. */
static enum tms_backup_path path(const struct tms_backup *b, int to_host, size_t off, size_t len)
{
    if (tms_host_page_locked(b)) return TMS_PATH_DIRECT;
    if (!first_copy(b)) return TMS_PATH_STAGED;
    if (to_host) return TMS_PATH_PREPARED;
    return range_locked(b, off, len) ? TMS_PATH_DIRECT : TMS_PATH_STAGED;
}

/* Page-locks the piece that is [off, off+len), faulting its fresh pages in
 * first: registering unfaulted memory faults it in on one thread inside the
 * driver, and touching each page beat MADV_POPULATE_WRITE
 * (docs/performance.md). A piece the driver cannot lock stays pageable (0);
 * lacking the memory to lock it fails the copy. */
static int prepare_block(struct tms_backup *b, size_t off, size_t len, struct tms_err *err)
{
    unsigned char *piece = &b->locked[off / TMS_PIN_PIECE_BYTES];
    if (*piece) return *piece == TMS_PIECE_LOCKED;  /* by an earlier copy of part of the backup */
    volatile char *p = (char *)b->host + off;
    for (size_t at = 0; at < len; at += 4096) p[at] = 0;
    int rc = b->drv->host_register(b->device, (char *)b->host + off, len);
    if (rc == 0) {
        *piece = TMS_PIECE_LOCKED;
        return 1;
    }
    if (!b->drv->is_oom(rc)) return *piece = TMS_PIECE_REFUSED, 0;
    tms_driver_fail(err, TMS_E_HOST_OOM, b->drv, rc,
                    "cannot pin %zu bytes of host memory for a pinned backup of %zu bytes (offset %zu)", len, b->size,
                    off);
    return -TMS_E_HOST_OOM;
}

/* A copy succeeded: page-locked from now on once every piece is; pieces a
 * copy of part of it left alone are locked by a later copy that needs them.
 * If the driver refused a piece it stays pageable, the pieces locked so far
 * unlocked (they would only hold memory: copies of it stage). */
static void copied(struct tms_backup *b)
{
    if (!first_copy(b)) return;
    size_t locked = 0, refused = 0, pieces = tms_host_pieces(b->size);
    for (size_t k = 0; k < pieces; k++) {
        locked += b->locked[k] == TMS_PIECE_LOCKED;
        refused += b->locked[k] == TMS_PIECE_REFUSED;
    }
    if (locked == pieces) {
        __atomic_store_n(&b->pinning, TMS_PIN_DONE, __ATOMIC_RELEASE);
        return;
    }
    if (!refused) return;
    tms_host_unlock_pieces(b);
    __atomic_store_n(&b->pinning, TMS_PIN_FAILED, __ATOMIC_RELEASE);
    TMS_DEBUG("pinned backup of %zu bytes stays pageable: the driver locked %zu of its %zu pieces", b->size, locked,
              pieces);
}

static int kept_while_active(const struct tms_backup *b, int retain)
{
    (void)b;
    return retain;
}

const struct tms_backup_ops tms_backup_ops_pinned = {
    .name = "pinned",
    .granule = TMS_PIN_PIECE_BYTES,  /* a first copy locks whole pieces */
    .host_memory = 1,
    .create = create,
    .reusable = reusable,
    .path = path,
    .block_len = tms_host_block_len,
    .direct_at = tms_host_direct_at,
    .prepare_block = prepare_block,
    .write_block = tms_host_write_block,
    .read_block = tms_host_read_block,
    .copied = copied,
    .kept_while_active = kept_while_active,
    .release = tms_host_release,
    .page_locked = tms_host_page_locked,
};
