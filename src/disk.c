/* Backup files: one per allocation backed up to disk, in the process's disk backup directory. */
#include "disk.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/vfs.h>
#include <time.h>
#include <unistd.h>

#include "config.h"
#include "log.h"

/*
 * Who owns a file (issue 11: a process killed with SIGKILL must not leave
 * backups behind for good). Each process holds an flock on a lock file of
 * its own in every directory it writes to, named tms-<pid>-<token>.lock;
 * its backups are tms-<pid>-<token>-<va>-<seq>.bin. The kernel drops the
 * flock when the process dies, however it dies, so whoever next prepares
 * the directory can take it: that owner is dead and its files go. The lock
 * is made under a hidden name, locked, then renamed into place, so a lock
 * file under its real name is always held while its owner lives. The token
 * (random) keeps a recycled pid from adopting a dead process's files.
 */
#define TMPFS_MAGIC_ 0x01021994
#define RAMFS_MAGIC_ 0x858458f6

struct backup_dir {
    char *path;
    int lock_fd;
    int memory_fs;  /* tmpfs or ramfs: backups there take RAM */
};

static pthread_mutex_t disk_lock = PTHREAD_MUTEX_INITIALIZER;  /* guards all below */
static char *chosen_dir;            /* NULL: the default */
static struct backup_dir *dirs;     /* prepared by this process */
static size_t dir_count;
static unsigned long long token;
static pid_t token_pid;             /* the process token belongs to (fork makes another) */
static unsigned long long file_seq;
static unsigned long fork_generation;  /* forks made by this process (its files before one are shared) */

static long fault_calls[TMS_FAULT_OPS];  /* atomic; only the disk ops are used here */

static int fault_hit(int op)
{
    long at = tms_host_env()->fault_at[op];
    return at && __atomic_add_fetch(&fault_calls[op], 1, __ATOMIC_RELAXED) == at;
}

static size_t round_up_align(size_t n) { return (n + TMS_DISK_ALIGN - 1) / TMS_DISK_ALIGN * TMS_DISK_ALIGN; }

static int fail_errno(struct tms_err *err, int e, const char *what, const char *path)
{
    return tms_fail(err, TMS_E_IO, e, "disk backup: %s %s failed: %s (errno %d)", what, path, strerror(e), e);
}

/* ---- owners --------------------------------------------------------------- */

static void ensure_token_locked(void)
{
    if (token_pid == getpid()) return;
    if (getrandom(&token, sizeof token, GRND_NONBLOCK) != (ssize_t)sizeof token) {
        struct timespec ts;
        clock_gettime(CLOCK_MONOTONIC, &ts);
        token = (unsigned long long)ts.tv_nsec * 0x9e3779b97f4a7c15ull ^ (unsigned long long)ts.tv_sec ^
                (unsigned long long)getpid() << 32;
    }
    token_pid = getpid();
}

enum name_kind { NAME_OTHER, NAME_LOCK, NAME_BACKUP, NAME_NEW_LOCK };

static int parse_name(const char *name, int *pid, unsigned long long *tok)
{
    int n = 0;
    int hidden = name[0] == '.';
    if (sscanf(name + hidden, "tms-%d-%llx%n", pid, tok, &n) != 2 || n == 0) return NAME_OTHER;
    const char *rest = name + hidden + n;
    size_t len = strlen(rest);
    if (hidden) return strcmp(rest, ".lock.new") == 0 ? NAME_NEW_LOCK : NAME_OTHER;
    if (strcmp(rest, ".lock") == 0) return NAME_LOCK;
    if (rest[0] == '-' && len > 4 && strcmp(rest + len - 4, ".bin") == 0) return NAME_BACKUP;
    return NAME_OTHER;
}

/* An owner is dead when its lock file is gone or can be locked. */
static int owner_dead(int dfd, int pid, unsigned long long tok)
{
    char lock_name[64];
    snprintf(lock_name, sizeof lock_name, "tms-%d-%016llx.lock", pid, tok);
    int fd = openat(dfd, lock_name, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return errno == ENOENT;
    int dead = flock(fd, LOCK_EX | LOCK_NB) == 0;
    close(fd);
    return dead;
}

/* A lock file not yet renamed into place (its owner died in between):
 * unlocked and older than a minute, so one being made now is left alone
 * whatever pid namespace its owner lives in. */
static int stale_new_lock(int dfd, const char *name)
{
    struct statx st;  /* statx, not fstatat: fstatat is a GLIBC_2.33 symbol, the wheel targets 2.28 */
    if (statx(dfd, name, AT_SYMLINK_NOFOLLOW, STATX_MTIME, &st) != 0 || time(NULL) - st.stx_mtime.tv_sec < 60) return 0;
    int fd = openat(dfd, name, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    int dead = flock(fd, LOCK_EX | LOCK_NB) == 0;
    close(fd);
    return dead;
}

/* Removes what dead owners left in the directory (or, mine_only, this
 * process's own files: at exit). */
static void sweep(int dfd, const char *path, int mine_only)
{
    int list_fd = dup(dfd);
    DIR *d = list_fd >= 0 ? fdopendir(list_fd) : NULL;
    if (!d) {
        int e = errno;
        if (list_fd >= 0) close(list_fd);
        tms_log_warn("disk backup: cannot list %s to remove stale backups: %s", path, strerror(e));
        return;
    }
    size_t removed = 0;
    for (struct dirent *e; (e = readdir(d));) {
        int pid;
        unsigned long long tok;
        int kind = parse_name(e->d_name, &pid, &tok);
        if (kind == NAME_OTHER) continue;
        int mine = pid == getpid() && tok == token;
        int remove;
        if (mine_only) remove = mine;
        else if (mine) remove = 0;
        else if (kind == NAME_NEW_LOCK) remove = stale_new_lock(dfd, e->d_name);
        else remove = owner_dead(dfd, pid, tok);
        if (remove && unlinkat(dfd, e->d_name, 0) == 0) removed++;
    }
    closedir(d);
    if (removed && !mine_only) TMS_DEBUG("disk backup: removed %zu files of dead processes from %s", removed, path);
}

static int make_dirs(const char *path)
{
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return errno = ENAMETOOLONG, -1;
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(buf, 0700) != 0 && errno != EEXIST) return -1;
        *p = '/';
    }
    if (mkdir(buf, 0700) != 0 && errno != EEXIST) return -1;
    return 0;
}

static int take_lock(int dfd, const char *path, int *lock_fd, struct tms_err *err)
{
    char hidden[80], final[64];
    snprintf(hidden, sizeof hidden, ".tms-%d-%016llx.lock.new", (int)getpid(), token);
    snprintf(final, sizeof final, "tms-%d-%016llx.lock", (int)getpid(), token);
    int fd = openat(dfd, hidden, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return fail_errno(err, errno, "creating a lock file in", path);
    if (flock(fd, LOCK_EX | LOCK_NB) != 0 || renameat(dfd, hidden, dfd, final) != 0) {
        int e = errno;
        unlinkat(dfd, hidden, 0);
        close(fd);
        return fail_errno(err, e, "taking the lock file in", path);
    }
    *lock_fd = fd;
    return TMS_OK;
}

/* dir is resolved to an absolute path first: a relative one (or $TMPDIR)
 * must not move with the working directory, away from the lock file. */
static int prepare_dir_locked(const char *dir, struct backup_dir **out, struct tms_err *err)
{
    if (make_dirs(dir) != 0) return fail_errno(err, errno, "creating directory", dir);
    char path[PATH_MAX];
    if (!realpath(dir, path)) return fail_errno(err, errno, "resolving directory", dir);
    for (size_t i = 0; i < dir_count; i++)
        if (strcmp(dirs[i].path, path) == 0) return *out = &dirs[i], TMS_OK;
    ensure_token_locked();
    int dfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0) return fail_errno(err, errno, "opening directory", path);
    struct backup_dir d = {.lock_fd = -1};
    struct statfs fs;
    d.memory_fs = fstatfs(dfd, &fs) == 0 && (fs.f_type == TMPFS_MAGIC_ || (unsigned long)fs.f_type == RAMFS_MAGIC_);
    struct backup_dir *grown = realloc(dirs, (dir_count + 1) * sizeof *dirs);
    int rc = grown ? TMS_OK : tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory for a directory record");
    if (grown) dirs = grown;
    if (!rc && !(d.path = strdup(path))) rc = tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory for a path");
    if (!rc) rc = take_lock(dfd, path, &d.lock_fd, err);
    if (!rc) {
        sweep(dfd, path, 0);
        if (d.memory_fs)
            tms_log_warn("disk backup directory %s is on a %s: backups there take RAM, not disk "
                         "(set TMS_DISK_BACKUP_DIR or set_disk_backup_dir to a disk)",
                         path, fs.f_type == TMPFS_MAGIC_ ? "tmpfs" : "ramfs");
        dirs[dir_count] = d;
        *out = &dirs[dir_count++];
    } else {
        free(d.path);
    }
    close(dfd);
    return rc;
}

static const char *dir_in_use_locked(void)
{
    if (chosen_dir) return chosen_dir;
    const char *env = getenv("TMS_DISK_BACKUP_DIR");
    if (!env || !*env) env = getenv("TMPDIR");
    return env && *env ? env : "/tmp";
}

/* ---- exit and fork -------------------------------------------------------- */

/* trylock: a thread stuck in a slow directory must not hold up the exit;
 * what is left then, the next process's sweep removes. */
static void remove_mine_at_exit(void)
{
    if (pthread_mutex_trylock(&disk_lock) != 0) return;
    if (token_pid == getpid()) {
        for (size_t i = 0; i < dir_count; i++) {
            int dfd = open(dirs[i].path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
            if (dfd < 0) continue;
            sweep(dfd, dirs[i].path, 1);  /* the lock too: nothing is left */
            close(dfd);
        }
    }
    pthread_mutex_unlock(&disk_lock);
}

static void fork_prepare(void) { pthread_mutex_lock(&disk_lock); }
static void fork_parent(void)
{
    fork_generation++;
    pthread_mutex_unlock(&disk_lock);
}

/* The child is a new owner: it makes its own token and locks on first use,
 * and the parent's files (still in the child's table) are never removed by it. */
static void fork_child(void)
{
    for (size_t i = 0; i < dir_count; i++) {
        close(dirs[i].lock_fd);
        free(dirs[i].path);
    }
    free(dirs);
    dirs = NULL;
    dir_count = 0;
    pthread_mutex_unlock(&disk_lock);
}

static pthread_once_t handlers_once = PTHREAD_ONCE_INIT;
static void install_handlers(void)
{
    (void)atexit(remove_mine_at_exit);
    (void)pthread_atfork(fork_prepare, fork_parent, fork_child);
}

/* ---- API ------------------------------------------------------------------ */

int tms_disk_set_dir(const char *dir, struct tms_err *err)
{
    if (!dir || !*dir) return tms_fail(err, TMS_E_ARG, 0, "the disk backup directory must be a non-empty path");
    pthread_once(&handlers_once, install_handlers);
    char *copy = strdup(dir);
    if (!copy) return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory for a path");
    pthread_mutex_lock(&disk_lock);
    struct backup_dir *d;
    int rc = prepare_dir_locked(copy, &d, err);
    free(copy);
    char *resolved = rc ? NULL : strdup(d->path);
    if (!rc && !resolved) rc = tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory for a path");
    if (!rc) {
        free(chosen_dir);
        chosen_dir = resolved;
    }
    pthread_mutex_unlock(&disk_lock);
    return rc;
}

void tms_disk_get_dir(char *buf, size_t n)
{
    pthread_once(&handlers_once, install_handlers);
    pthread_mutex_lock(&disk_lock);
    snprintf(buf, n, "%s", dir_in_use_locked());
    pthread_mutex_unlock(&disk_lock);
}

int tms_disk_create(uint64_t va, size_t size, struct tms_disk_file *f, struct tms_err *err)
{
    pthread_once(&handlers_once, install_handlers);
    pthread_mutex_lock(&disk_lock);
    struct backup_dir *d;
    int rc = prepare_dir_locked(dir_in_use_locked(), &d, err);
    int memory_fs = rc ? 0 : d->memory_fs;
    unsigned long generation = fork_generation;
    char *path = NULL;
    if (!rc && asprintf(&path, "%s/tms-%d-%016llx-%llx-%llu.bin", d->path, (int)getpid(), token,
                        (unsigned long long)va, ++file_seq) < 0) {
        path = NULL;
        rc = tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory for a path");
    }
    pthread_mutex_unlock(&disk_lock);
    if (rc) return rc;

    int flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
    int direct = 1;
    int fd = open(path, flags | O_DIRECT, 0600);
    if (fd < 0 && errno == EINVAL) {  /* the filesystem has no O_DIRECT */
        direct = 0;
        fd = open(path, flags, 0600);
    }
    if (fd < 0) {
        rc = fail_errno(err, errno, "creating", path);
        free(path);
        return rc;
    }
    struct tms_disk_file made = {.fd = fd, .direct = direct, .drop_cache = !direct && !memory_fs, .owner = getpid(),
                                 .generation = generation, .path = path};
    /* Reserving the blocks up front makes a full disk fail here, before any
     * copy. Not on tmpfs: there it would zero every page once more. */
    if (!memory_fs && fallocate(fd, 0, 0, (off_t)round_up_align(size)) != 0 && errno != EOPNOTSUPP &&
        errno != ENOSYS) {
        int e = errno;
        rc = tms_fail(err, TMS_E_IO, e, "disk backup: reserving %zu bytes for allocation 0x%llx in %s failed: %s "
                      "(errno %d)", round_up_align(size), (unsigned long long)va, path, strerror(e), e);
        tms_disk_remove(&made);
        return rc;
    }
    *f = made;
    return TMS_OK;
}

int tms_disk_open(struct tms_disk_file *f, struct tms_err *err)
{
    if (f->fd >= 0) return TMS_OK;
    f->fd = open(f->path, O_RDWR | O_CLOEXEC | (f->direct ? O_DIRECT : 0));
    return f->fd < 0 ? fail_errno(err, errno, "opening", f->path) : TMS_OK;
}

void tms_disk_close(struct tms_disk_file *f)
{
    if (f->fd >= 0) close(f->fd);
    f->fd = -1;
}

int tms_disk_rewritable(const struct tms_disk_file *f)
{
    pthread_mutex_lock(&disk_lock);
    int same = f->owner == getpid() && f->generation == fork_generation;
    pthread_mutex_unlock(&disk_lock);
    return same;
}

void tms_disk_remove(struct tms_disk_file *f)
{
    if (!f->path) return;
    tms_disk_close(f);
    if (f->owner == getpid() && unlink(f->path) != 0 && errno != ENOENT) {
        int e = errno;
        tms_log_warn("disk backup: cannot remove %s: %s", f->path, strerror(e));
    }
    free(f->path);
    f->path = NULL;
}

static int io_failed(const struct tms_disk_file *f, struct tms_err *err, const char *what, size_t len, size_t offset,
                     int e)
{
    return tms_fail(err, TMS_E_IO, e, "disk backup: %s of %zu bytes at offset %zu of %s failed: %s (errno %d)", what,
                    len, offset, f->path, strerror(e), e);
}

int tms_disk_write(const struct tms_disk_file *f, const void *buf, size_t len, size_t offset, struct tms_err *err)
{
    size_t want = round_up_align(len), done = 0;
    while (done < want) {
        size_t n = want - done;
        ssize_t w;
        if (fault_hit(TMS_FAULT_DISK_WRITE)) {
            w = -1, errno = EIO;
        } else {
            if (n >= 2 * TMS_DISK_ALIGN && fault_hit(TMS_FAULT_DISK_SHORT_WRITE)) n = n / 2 / TMS_DISK_ALIGN * TMS_DISK_ALIGN;
            w = pwrite(f->fd, (const char *)buf + done, n, (off_t)(offset + done));
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0) return io_failed(f, err, "write", want, offset, errno);
        if (w == 0) return io_failed(f, err, "write", want, offset, ENOSPC);
        done += (size_t)w;
    }
    /* Without O_DIRECT the pages would stay cached: the backup's size in RAM. */
    if (f->drop_cache) {
        (void)sync_file_range(f->fd, (off_t)offset, (off_t)want,
                              SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER);
        (void)posix_fadvise(f->fd, (off_t)offset, (off_t)want, POSIX_FADV_DONTNEED);
    }
    return TMS_OK;
}

int tms_disk_read(const struct tms_disk_file *f, void *buf, size_t len, size_t offset, struct tms_err *err)
{
    size_t want = round_up_align(len), done = 0;
    while (done < want) {
        ssize_t r;
        if (fault_hit(TMS_FAULT_DISK_READ)) r = -1, errno = EIO;
        else r = pread(f->fd, (char *)buf + done, want - done, (off_t)(offset + done));
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) return io_failed(f, err, "read", want, offset, errno);
        if (r == 0)
            return tms_fail(err, TMS_E_IO, 0, "disk backup: %s ends at offset %zu, before the %zu bytes to restore at %zu",
                            f->path, offset + done, want, offset);
        done += (size_t)r;
    }
    if (f->drop_cache) (void)posix_fadvise(f->fd, (off_t)offset, (off_t)want, POSIX_FADV_DONTNEED);
    return TMS_OK;
}
