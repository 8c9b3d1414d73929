/* Backup files: each created under an unpredictable name in the checked directory, its header checked on every open, its blocks written and read with O_DIRECT. */
#include "backup/files_dir.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "platform/config.h"
#include "platform/log.h"
#include "platform/os.h"

#define HEADER_MAGIC "TMSDISK1"

static long fault_calls[TMS_FAULT_OPS];  /* atomic; only the disk ops are used here */

static int fault_hit(int op)
{
    long at = tms_defaults()->fault_at[op];
    return at && __atomic_add_fetch(&fault_calls[op], 1, __ATOMIC_RELAXED) == at;
}

static size_t round_up_align(size_t n) { return (n + TMS_DISK_ALIGN - 1) / TMS_DISK_ALIGN * TMS_DISK_ALIGN; }

void tms_disk_path(const struct tms_disk_file *f, char *buf, size_t n)
{
    snprintf(buf, n, "%s/%s", f->dir ? f->dir->path : "?", f->name);
}

struct header {
    char magic[8];
    uint64_t size;
    uint64_t key;
    uint64_t dev;
    uint64_t ino;
};

static void *aligned_block(void)
{
    void *p = NULL;
    return posix_memalign(&p, TMS_DISK_ALIGN, TMS_DISK_HEADER_BYTES) == 0 ? memset(p, 0, TMS_DISK_HEADER_BYTES) : NULL;
}

static struct header header_of(const struct tms_disk_file *f)
{
    struct header h = {.size = f->size, .key = f->key, .dev = (uint64_t)f->dev, .ino = (uint64_t)f->ino};
    memcpy(h.magic, HEADER_MAGIC, sizeof h.magic);
    return h;
}

static int write_header(const struct tms_disk_file *f, struct tms_err *err)
{
    char path[PATH_MAX];
    tms_disk_path(f, path, sizeof path);
    void *block = aligned_block();
    if (!block) return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory writing the header of %s", path);
    struct header h = header_of(f);
    memcpy(block, &h, sizeof h);
    ssize_t w;
    do w = pwrite(f->fd, block, TMS_DISK_HEADER_BYTES, 0);
    while (w < 0 && errno == EINTR);
    int e = w < 0 ? errno : ENOSPC;
    free(block);
    if (w == (ssize_t)TMS_DISK_HEADER_BYTES) return TMS_OK;
    return tms_fail(err, TMS_E_IO, e, "disk backup: writing the header of %s failed: %s (errno %d)", path,
                    strerror(e), e);
}

static int check_header(const struct tms_disk_file *f, struct tms_err *err)
{
    char path[PATH_MAX];
    tms_disk_path(f, path, sizeof path);
    void *block = aligned_block();
    if (!block) return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory reading the header of %s", path);
    ssize_t r;
    do r = pread(f->fd, block, TMS_DISK_HEADER_BYTES, 0);
    while (r < 0 && errno == EINTR);
    int e = errno;
    struct header want = header_of(f), have;
    memcpy(&have, block, sizeof have);
    free(block);
    if (r < 0) return tms_fail(err, TMS_E_IO, e, "disk backup: reading the header of %s failed: %s (errno %d)", path,
                               strerror(e), e);
    if (r != (ssize_t)TMS_DISK_HEADER_BYTES || memcmp(&want, &have, sizeof want) != 0)
        return tms_fail(err, TMS_E_IO, 0,
                        "disk backup: %s does not hold the header written with this backup (replaced or "
                        "truncated): its bytes are not restored", path);
    return TMS_OK;
}

int tms_disk_create(uint64_t va, size_t size, struct tms_disk_file *f, struct tms_err *err)
{
    struct tms_disk_dir *d = NULL;
    int rc = tms_files_dir_for_new(&d, err), e = 0;
    if (rc) return rc;
    unsigned long long tok = tms_files_token(d);
    struct tms_disk_file made = {.fd = -1, .owner = getpid(), .dir = d, .size = size};
    tms_files_identity(&made.key, &made.generation);

    int flags = O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC;
    int fd = -1;
    /* A name someone else made first is tried again with another random part. */
    for (int attempt = 0; attempt < 8 && fd < 0; attempt++) {
        snprintf(made.name, sizeof made.name, "tms-%d-%016llx-%016llx.bin", (int)getpid(), tok, tms_files_random());
        made.direct = 1;
        fd = fault_hit(TMS_FAULT_DISK_NO_DIRECT) ? (errno = EINVAL, -1) : openat(d->dfd, made.name, flags | O_DIRECT, 0600);
        if (fd < 0 && errno == EINVAL) {  /* the filesystem has no O_DIRECT */
            made.direct = 0;
            fd = openat(d->dfd, made.name, flags, 0600);
        }
        e = errno;
        if (fd < 0 && e != EEXIST) break;
    }
    if (fd < 0) return tms_files_fail_errno(err, e, "creating a file in", d->path, NULL);
    made.fd = fd;
    tms_files_add_file(d);  /* tms_disk_remove counts it out, on every path from here */
    made.drop_cache = !made.direct && !d->memory_fs;
    struct statx st;
    if ((e = tms_os_stat_fd(fd, &st))) {
        rc = tms_files_fail_errno(err, -e, "checking", d->path, made.name);
        tms_disk_remove(&made);
        return rc;
    }
    struct tms_os_id id = tms_os_id_of(&st);
    made.dev = id.dev;
    made.ino = id.ino;
    made.uid = st.stx_uid;  /* who the filesystem says owns it (NFS root_squash: not always this user) */
    /* Reserving the blocks up front makes a full disk fail here, before any
     * copy. Not on tmpfs: there it would zero every page once more. */
    off_t total = (off_t)(TMS_DISK_HEADER_BYTES + round_up_align(size));
    if (!d->memory_fs && fallocate(fd, 0, 0, total) != 0 && errno != EOPNOTSUPP && errno != ENOSYS) {
        e = errno;
        rc = tms_fail(err, TMS_E_IO, e, "disk backup: reserving %zu bytes for allocation 0x%llx in %s/%s failed: %s "
                      "(errno %d)", (size_t)total, (unsigned long long)va, d->path, made.name, strerror(e), e);
        tms_disk_remove(&made);
        return rc;
    }
    if ((rc = write_header(&made, err))) {
        tms_disk_remove(&made);
        return rc;
    }
    *f = made;
    return TMS_OK;
}

static struct tms_os_id id_of(const struct tms_disk_file *f) { return (struct tms_os_id){f->dev, f->ino}; }

int tms_disk_open(struct tms_disk_file *f, struct tms_err *err)
{
    if (f->fd >= 0) return TMS_OK;
    char path[PATH_MAX];
    tms_disk_path(f, path, sizeof path);
    struct tms_err lock_err = {0};
    if (f->owner == getpid() && tms_files_ensure_lock(f->dir, &lock_err))  /* a removed lock would leave its files unowned */
        tms_log_warn("%s", lock_err.msg);
    int fd = openat(f->dir->dfd, f->name, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | (f->direct ? O_DIRECT : 0));
    if (fd < 0) return tms_files_fail_errno(err, errno, "opening", f->dir->path, f->name);
    struct tms_os_id found, want = id_of(f);
    if (tms_os_check_file(fd, f->uid, &found) != 0 || !tms_os_same_id(&found, &want)) {
        close(fd);
        return tms_fail(err, TMS_E_IO, 0,
                        "disk backup: opening %s found another file than the backup written there (replaced "
                        "meanwhile): its bytes are not restored", path);
    }
    f->fd = fd;
    int rc = check_header(f, err);
    if (rc) tms_disk_close(f);
    return rc;
}

void tms_disk_close(struct tms_disk_file *f)
{
    if (f->fd >= 0) close(f->fd);
    f->fd = -1;
}

/* sync_file_range where the filesystem has it, else fdatasync. */
static int write_back(int fd, off_t offset, off_t len)
{
    if (fault_hit(TMS_FAULT_DISK_SYNC)) return errno = EIO, -1;
    int rc = (int)sync_file_range(fd, offset, len,
                                  SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
    if (rc != 0 && (errno == EINVAL || errno == ENOSYS || errno == EOPNOTSUPP || errno == ESPIPE)) rc = fdatasync(fd);
    return rc;
}

int tms_disk_flush(struct tms_disk_file *f, struct tms_err *err)
{
    if (f->fd < 0 || !f->drop_cache) return TMS_OK;
    if (fdatasync(f->fd) == 0) return TMS_OK;
    return tms_files_fail_errno(err, errno, "writing back", f->dir->path, f->name);
}

int tms_disk_rewritable(const struct tms_disk_file *f)
{
    return f->owner == getpid() && f->generation == tms_files_generation();
}

void tms_disk_remove(struct tms_disk_file *f)
{
    if (!f->dir || !f->name[0]) return;
    tms_disk_close(f);
    struct tms_os_id id = id_of(f);
    /* Only the file this process made: never what replaced it. */
    if (f->owner == getpid() && tms_os_names(f->dir->dfd, f->name, &id) == 0 &&
        unlinkat(f->dir->dfd, f->name, 0) != 0 && errno != ENOENT) {
        int e = errno;
        tms_log_warn("disk backup: cannot remove %s/%s: %s", f->dir->path, f->name, strerror(e));
    }
    f->name[0] = '\0';
    if (f->owner == getpid()) tms_files_remove_file(f->dir);
}

static int io_failed(const struct tms_disk_file *f, struct tms_err *err, const char *what, size_t len, size_t offset,
                     int e)
{
    return tms_fail(err, TMS_E_IO, e, "disk backup: %s of %zu bytes at offset %zu of %s/%s failed: %s (errno %d)",
                    what, len, offset, f->dir->path, f->name, strerror(e), e);
}

int tms_disk_write(const struct tms_disk_file *f, const void *buf, size_t len, size_t offset, struct tms_err *err)
{
    size_t want = round_up_align(len), done = 0;
    off_t at = (off_t)(TMS_DISK_HEADER_BYTES + offset);
    while (done < want) {
        size_t n = want - done;
        ssize_t w;
        if (fault_hit(TMS_FAULT_DISK_WRITE)) {
            w = -1, errno = EIO;
        } else {
            if (n >= 2 * TMS_DISK_ALIGN && fault_hit(TMS_FAULT_DISK_SHORT_WRITE)) n = n / 2 / TMS_DISK_ALIGN * TMS_DISK_ALIGN;
            w = pwrite(f->fd, (const char *)buf + done, n, at + (off_t)done);
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return io_failed(f, err, "write", want, offset, errno);
        if (w == 0) return io_failed(f, err, "write", want, offset, ENOSPC);
        done += (size_t)w;
    }
    /* Without O_DIRECT the pages would stay cached: the backup's size in RAM.
     * Written back first, and a failed write-back fails the pause. */
    if (f->drop_cache) {
        if (write_back(f->fd, at, (off_t)want) != 0) return io_failed(f, err, "write-back", want, offset, errno);
        (void)posix_fadvise(f->fd, at, (off_t)want, POSIX_FADV_DONTNEED);
    }
    return TMS_OK;
}

int tms_disk_read(const struct tms_disk_file *f, void *buf, size_t len, size_t offset, struct tms_err *err)
{
    size_t want = round_up_align(len), done = 0;
    off_t at = (off_t)(TMS_DISK_HEADER_BYTES + offset);
    while (done < want) {
        ssize_t r;
        if (fault_hit(TMS_FAULT_DISK_READ)) r = -1, errno = EIO;
        else r = pread(f->fd, (char *)buf + done, want - done, at + (off_t)done);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return io_failed(f, err, "read", want, offset, errno);
        if (r == 0)
            return tms_fail(err, TMS_E_IO, 0,
                            "disk backup: %s/%s ends at data offset %zu, before the %zu bytes to restore at %zu",
                            f->dir->path, f->name, offset + done, want, offset);
        done += (size_t)r;
    }
    if (f->drop_cache) (void)posix_fadvise(f->fd, at, (off_t)want, POSIX_FADV_DONTNEED);
    return TMS_OK;
}
