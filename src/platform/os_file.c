/* Files as the OS shows them: statx of a descriptor or a name, a file's identity, owner and seal checks, the filesystem's kind. */
#include "platform/os.h"

#include <errno.h>
#include <fcntl.h>
#include <sys/vfs.h>
#include <unistd.h>

/* Not in every libc's headers: the magic numbers statfs gives these filesystems. */
#define TMPFS_MAGIC_ 0x01021994
#define RAMFS_MAGIC_ 0x858458f6

/* errno negated, never 0: a call that failed without saying why is still a failure. */
static int fail(void) { return errno > 0 ? -errno : -EIO; }

int tms_os_stat_fd(int fd, struct statx *st)
{
    return statx(fd, "", AT_EMPTY_PATH, STATX_BASIC_STATS, st) == 0 ? 0 : fail();
}

int tms_os_stat_at(int at, const char *path, int flags, struct statx *st)
{
    return statx(at, path, flags, STATX_BASIC_STATS, st) == 0 ? 0 : fail();
}

static int owned_file(const struct statx *st, uint32_t uid)
{
    if (!S_ISREG(st->stx_mode)) return TMS_OS_NOT_FILE;
    return st->stx_uid == uid ? 0 : TMS_OS_NOT_OWNER;
}

int tms_os_check_file(int fd, uint32_t uid, struct tms_os_id *id)
{
    struct statx st;
    int rc = tms_os_stat_fd(fd, &st);
    if (rc || (rc = owned_file(&st, uid))) return rc;
    *id = tms_os_id_of(&st);
    return 0;
}

int tms_os_check_file_at(int at, const char *name, uint32_t uid)
{
    struct statx st;
    int rc = tms_os_stat_at(at, name, AT_SYMLINK_NOFOLLOW, &st);
    return rc ? rc : owned_file(&st, uid);
}

int tms_os_open_file(int at, const char *name, int flags, uint32_t uid, int *fd)
{
    int opened = openat(at, name, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
    if (opened < 0) return fail();
    struct tms_os_id id;
    int rc = tms_os_check_file(opened, uid, &id);
    if (rc) {
        close(opened);
        return rc;
    }
    *fd = opened;
    return 0;
}

int tms_os_names(int at, const char *path, const struct tms_os_id *id)
{
    struct statx st;
    int rc = tms_os_stat_at(at, path, AT_SYMLINK_NOFOLLOW, &st);
    if (rc) return rc;
    struct tms_os_id found = tms_os_id_of(&st);
    return tms_os_same_id(&found, id) ? 0 : TMS_OS_OTHER_FILE;
}

int tms_os_check_sealed(int fd, uint64_t size, struct tms_os_id *id)
{
    struct statx st;
    int rc = tms_os_stat_fd(fd, &st);
    if (rc) return rc;
    if (!S_ISREG(st.stx_mode)) return TMS_OS_NOT_FILE;
    int seals = fcntl(fd, F_GET_SEALS);
    if (seals < 0 && errno != EINVAL) return fail();
    if (seals < 0 || !(seals & F_SEAL_SHRINK)) return TMS_OS_UNSEALED;  /* EINVAL: a file that takes no seals */
    if (st.stx_size < size) return TMS_OS_SHORT;
    *id = tms_os_id_of(&st);
    return 0;
}

int tms_os_memory_fs(int fd, const char **kind)
{
    struct statfs fs;
    if (fstatfs(fd, &fs) != 0) return fail();
    *kind = fs.f_type == TMPFS_MAGIC_ ? "tmpfs" : (unsigned long)fs.f_type == RAMFS_MAGIC_ ? "ramfs" : NULL;
    return 0;
}
