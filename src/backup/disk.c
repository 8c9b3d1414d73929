/* The disk backup kind: one file per allocation (files.c), written and read a block at a time through the staging. */
#include <errno.h>
#include <stdlib.h>

#include "backup/kind.h"
#include "backup/files.h"
#include "platform/config.h"

static struct tms_disk_file *file_of(const struct tms_backup *b) { return b->kind_state; }

static int create(struct tms_backup *b, int device, uint64_t va, struct tms_err *err)
{
    (void)device;
    struct tms_disk_file *f = calloc(1, sizeof *f);
    if (!f) return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory for a backup file record");
    int rc = tms_disk_create(va, b->size, f, err);  /* open: the pause writes it next */
    if (rc) {
        free(f);
        return rc;
    }
    b->kind_state = f;
    return TMS_OK;
}

/* Rewritten in place only by the process that made it, before any fork (a
 * child may still read it to resume its copy of the allocation). */
static int reusable(const struct tms_backup *b) { return tms_disk_rewritable(file_of(b)); }

static int open_file(struct tms_backup *b, struct tms_err *err) { return tms_disk_open(file_of(b), err); }

static int close_file(struct tms_backup *b, int wrote, struct tms_err *err)
{
    int rc = wrote ? tms_disk_flush(file_of(b), err) : TMS_OK;
    tms_disk_close(file_of(b));
    return rc;
}

static enum tms_backup_path path(const struct tms_backup *b, int to_host, size_t off, size_t len)
{
    (void)b, (void)to_host, (void)off, (void)len;
    return TMS_PATH_STAGED;
}

/* Up to TMS_DISK_BACKUP_CHUNK_MB per I/O, and what a staging slot holds. */
static size_t block_len(const struct tms_backup *b, enum tms_backup_path p, size_t off, size_t left,
                        const struct tms_block_sizes *s)
{
    (void)b, (void)p, (void)off;
    size_t io = tms_defaults()->disk_block_bytes;
    size_t len = io < s->slot ? io : s->slot;
    return left < len ? left : len;
}

static int write_block(struct tms_backup *b, const void *staging, size_t len, size_t off, struct tms_err *err)
{
    return tms_disk_write(file_of(b), staging, len, off, err);
}

static int read_block(struct tms_backup *b, void *staging, size_t len, size_t off, struct tms_err *err)
{
    return tms_disk_read(file_of(b), staging, len, off, err);
}

/* Kept while active, whatever retain says: the next pause rewrites it in place. */
static int kept_while_active(const struct tms_backup *b, int retain)
{
    (void)b, (void)retain;
    return 1;
}

static void release(struct tms_backup *b)
{
    if (!b->kind_state) return;
    tms_disk_remove(file_of(b));
    free(b->kind_state);
    b->kind_state = NULL;
}

int tms_backup_set_disk_dir(const char *dir, struct tms_err *err) { return tms_disk_set_dir(dir, err); }

void tms_backup_disk_dir(char *buf, size_t n) { tms_disk_get_dir(buf, n); }

const struct tms_backup_ops tms_backup_ops_disk = {
    .name = "disk",
    .open_limit = TMS_DISK_FILES_OPEN_AT_ONCE,
    .interleave = 1,
    .create = create,
    .reusable = reusable,
    .open = open_file,
    .close = close_file,
    .path = path,
    .block_len = block_len,
    .write_block = write_block,
    .read_block = read_block,
    .kept_while_active = kept_while_active,
    .release = release,
};
