/* The pageable backup kind ("mmap"): fresh anonymous pages, copied through the staging, returned to the OS on resume unless retained. */
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

static int kept_while_active(const struct tms_backup *b, int retain)
{
    (void)b;
    return retain;
}

/* Kept across resume, it is copied every cycle, so it is page-locked once:
 * by its first copy if that copy makes it whole (a pause right after a
 * resume then runs at the link's speed), else in the background once copies
 * rest (retained.c); its copies then skip the staging. */
static void kept(struct tms_backup *b, int retain)
{
    if (retain) tms_backup_pin_later(b);
}

const struct tms_backup_ops tms_backup_ops_pageable = {
    .name = "mmap",
    .host_memory = 1,
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
    .will_be_kept = tms_host_lock_on_first_copy,
    .kept = kept,
    .release = tms_host_release,
    .page_locked = tms_host_page_locked,
};
