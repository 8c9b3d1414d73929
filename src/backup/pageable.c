/* The pageable backup kind ("mmap"): fresh anonymous pages, copied through the staging, returned to the OS on resume. */
#include <errno.h>

#include "backup/host.h"

static int create(struct tms_backup *b, int device, uint64_t va, struct tms_err *err)
{
    (void)va;
    if ((b->host = tms_host_map_fresh(b->drv, device, b->size))) return TMS_OK;
    int e = errno;
    return tms_fail(err, TMS_E_HOST_OOM, e, "cannot map %zu bytes of mmap host memory for a backup: errno %d", b->size,
                    e);
}

static int reusable(const struct tms_backup *b)
{
    (void)b;
    return 1;
}

/* Page-locked once a retained backup's background locking is done (retained.c). */
static enum tms_backup_path path(const struct tms_backup *b, int to_host, size_t off, size_t len)
{
    (void)to_host, (void)off, (void)len;
    return tms_host_page_locked(b) ? TMS_PATH_DIRECT : TMS_PATH_STAGED;
}

static int kept_while_active(const struct tms_backup *b, int retain)
{
    (void)b;
    return retain;
}

/* Kept across resume, it is copied every cycle: page-locked in the
 * background, its copies then skip the staging. */
static void kept(struct tms_backup *b, int retain)
{
    if (retain) tms_backup_pin_later(b);
}

const struct tms_backup_ops tms_backup_ops_pageable = {
    .name = "mmap",
    .host_memory = 1,
    .create = create,
    .reusable = reusable,
    .path = path,
    .block_len = tms_host_block_len,
    .direct_at = tms_host_direct_at,
    .write_block = tms_host_write_block,
    .read_block = tms_host_read_block,
    .kept_while_active = kept_while_active,
    .kept = kept,
    .release = tms_host_release,
    .page_locked = tms_host_page_locked,
};
