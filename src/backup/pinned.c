/* The page-locked backup kind ("pinned"): fresh pages that its first copy page-locks piece by piece, DMA'd straight into after. */
#include <errno.h>
#include <stdlib.h>

#include "backup/host.h"

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

static int kept_while_active(const struct tms_backup *b, int retain)
{
    (void)b;
    return retain;
}

const struct tms_backup_ops tms_backup_ops_pinned = {
    .name = "pinned",
    .granule = TMS_PIN_PIECE_BYTES,  /* a first copy locks whole pieces */
    .host_memory = 1,
    .must_lock = 1,
    .create = create,
    .reusable = reusable,
    .path = tms_host_path,
    .block_len = tms_host_block_len,
    .direct_at = tms_host_direct_at,
    .prepare_block = tms_host_prepare_block,
    .write_block = tms_host_write_block,
    .read_block = tms_host_read_block,
    .copied = tms_host_copied,
    .kept_while_active = kept_while_active,
    .release = tms_host_release,
    .page_locked = tms_host_page_locked,
};
