/* The disk backup directory: checked before it is trusted, held open, one owner lock per process, files of dead owners swept. */
#include "backup/files_dir.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "platform/config.h"
#include "platform/fork.h"
#include "platform/log.h"
#include "platform/os.h"

/*
 * The directory may be shared with other users, so nothing in it is trusted
 * by name. It is used only when it is safe: owned by this user and writable
 * by no one else, or sticky (like /tmp) and owned by root or this user, with
 * every directory above it likewise out of other users' reach
 * (TMS_DISK_BACKUP_TRUST_DIR=1 vouches for one that is not). Its descriptor
 * is held, and every file is opened relative to it without following links
 * and without blocking; files are created exclusively under names with a
 * random part, and a reopen checks that it found the very file it created,
 * whose header carries this process's secret key.
 *
 * Who owns a file: each process holds an flock on a lock file of its own in
 * every directory it writes to, tms-<pid>-<token>.lock; its backups are
 * tms-<pid>-<token>-<random>.bin. The kernel drops the flock when the
 * process dies, however it dies, so the next process that prepares the
 * directory can take it: that owner is dead and its files go. A lock that is
 * missing proves nothing (a cleaner may have removed a live one): those
 * files stay. The lock is made under a hidden name, locked, then renamed
 * into place, so a lock file under its real name is always held while its
 * owner lives; a live owner whose lock was removed makes a new one.
 */

/* disk_lock guards the records below; it is taken by fork's prepare handler,
 * so nothing is opened or read while it is held. */
static pthread_mutex_t disk_lock = PTHREAD_MUTEX_INITIALIZER;
static struct tms_disk_dir **dirs;  /* never freed: files point at them */
static size_t dir_count;
static struct tms_disk_dir *chosen;  /* set_dir's; NULL: the default */
static char *default_path;           /* the default, resolved once */
static unsigned long long key;
static pid_t key_pid;                /* the process key belongs to (fork makes another) */
static int default_errno;            /* the default directory could not be made absolute */
static unsigned long fork_generation;  /* forks made by this process (its files before one are shared) */
/* Serialises the making of lock files (file I/O: not under disk_lock). */
static pthread_mutex_t lock_file_mutex = PTHREAD_MUTEX_INITIALIZER;

int tms_files_fail_errno(struct tms_err *err, int e, const char *what, const char *dir, const char *name)
{
    return tms_fail(err, TMS_E_IO, e, "disk backup: %s %s%s%s failed: %s (errno %d)", what, dir, name ? "/" : "",
                    name ? name : "", strerror(e), e);
}

unsigned long long tms_files_random(void)
{
    unsigned long long v;
    if (getrandom(&v, sizeof v, GRND_NONBLOCK) == (ssize_t)sizeof v) return v;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    static unsigned long long counter;  /* only where getrandom fails: mixed, not relied on */
    v = __atomic_add_fetch(&counter, 1, __ATOMIC_RELAXED);
    return (v * 0x9e3779b97f4a7c15ull) ^ (unsigned long long)ts.tv_nsec ^ ((unsigned long long)getpid() << 32) ^
           (unsigned long long)(uintptr_t)&v;
}

static void ensure_key_locked(void)
{
    if (key_pid == getpid()) return;
    key = tms_files_random();
    key_pid = getpid();
}

static unsigned long long current_token(const struct tms_disk_dir *d) { return d->tokens[d->n_tokens - 1]; }

/* ---- names ------------------------------------------------------------------ */

enum name_kind { NAME_OTHER, NAME_LOCK, NAME_BACKUP, NAME_NEW_LOCK };

/* n lowercase hex digits at s: 1 and *v, else 0. */
static int hex_exact(const char *s, int n, unsigned long long *v)
{
    *v = 0;
    for (int i = 0; i < n; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
        if (d < 0) return 0;
        *v = *v << 4 | (unsigned)d;
    }
    return 1;
}

/* The names the library makes, exactly: tms-<pid>-<token>.lock,
 * tms-<pid>-<token>-<random>.bin and .tms-<pid>-<token>.lock.new, pid in
 * decimal without leading zeros, token and random 16 lowercase hex digits. */
static int parse_name(const char *name, int *pid, unsigned long long *tok)
{
    int hidden = name[0] == '.';
    const char *s = name + hidden;
    if (strncmp(s, "tms-", 4) != 0) return NAME_OTHER;
    s += 4;
    long long p = 0;
    int digits = 0;
    while (s[digits] >= '0' && s[digits] <= '9' && digits < 10) p = p * 10 + (s[digits++] - '0');
    if (digits == 0 || (s[0] == '0') || p > INT_MAX || s[digits] != '-') return NAME_OTHER;
    s += digits + 1;
    if (!hex_exact(s, 16, tok)) return NAME_OTHER;
    s += 16;
    *pid = (int)p;
    if (hidden) return strcmp(s, ".lock.new") == 0 ? NAME_NEW_LOCK : NAME_OTHER;
    if (strcmp(s, ".lock") == 0) return NAME_LOCK;
    unsigned long long r;
    if (s[0] == '-' && hex_exact(s + 1, 16, &r) && strcmp(s + 17, ".bin") == 0) return NAME_BACKUP;
    return NAME_OTHER;
}

/* ---- the directory ---------------------------------------------------------- */

static int unsafe(struct tms_err *err, const char *dir, const struct tms_os_stop *stop)
{
    return tms_fail(err, TMS_E_ARG, 0,
                    "disk backup directory %s is not safe: %s is owned by uid %u with mode %04o, so another user "
                    "could replace its files (use a directory that only uid %u can write, or set "
                    "TMS_DISK_BACKUP_TRUST_DIR=1 to vouch for it)",
                    dir, stop->at, (unsigned)stop->uid, (unsigned)(stop->mode & 07777), (unsigned)geteuid());
}

/* Opens the resolved absolute path component by component, never following
 * a link, each directory on the way checked (os.h says how) unless vouched for. */
static int open_checked(const char *path, int *out, struct tms_err *err)
{
    struct tms_os_stop stop;
    int rc = tms_os_open_trusted(path, !tms_defaults()->disk_trust_dir, out, &stop);
    if (rc == TMS_OS_UNSAFE) return unsafe(err, path, &stop);
    if (!rc) return TMS_OK;
    int root = strcmp(stop.at, "/") == 0;
    return tms_files_fail_errno(err, -rc, stop.opening ? root ? "opening" : "opening directory" : "checking",
                                root ? "/" : path, NULL);
}

/* The resolved form of an absolute path that exists, made where missing. A
 * link on the way to it is followed only where another user could not have
 * made or replaced it (os.h), checked before anything is made (mkdir follows
 * links). */
static int resolve(const char *abs, char *resolved, struct tms_err *err)
{
    if (!tms_defaults()->disk_trust_dir) {
        struct tms_os_stop stop;
        int rc = tms_os_check_links(abs, &stop);
        if (rc == TMS_OS_UNSAFE) return unsafe(err, abs, &stop);
        if (rc) return tms_files_fail_errno(err, -rc, "resolving", abs, NULL);
    }
    int rc = tms_os_make_dirs(abs);
    if (rc) return tms_files_fail_errno(err, -rc, "creating directory", abs, NULL);
    if ((rc = tms_os_resolve(abs, resolved))) return tms_files_fail_errno(err, -rc, "resolving directory", abs, NULL);
    return TMS_OK;
}

/* ---- lock files ------------------------------------------------------------- */

/* d's lock for this process: made now if it has none (first use, a fork, or
 * its file was removed while it lived). A name someone else took (they saw
 * the token) makes a new token. */
int tms_files_ensure_lock(struct tms_disk_dir *d, struct tms_err *err)
{
    pthread_mutex_lock(&lock_file_mutex);
    struct statx st;
    int rc = TMS_OK;
    if (d->lock_fd >= 0 && d->lock_pid == getpid() && tms_os_stat_fd(d->lock_fd, &st) == 0 && st.stx_nlink > 0) goto out;
    if (d->lock_fd >= 0 && d->lock_pid == getpid()) close(d->lock_fd);  /* removed under us: a new one */
    d->lock_fd = -1;
    if (d->lock_pid != getpid()) d->n_tokens = 0, d->lock_pid = getpid(), d->files = 0;  /* a new process after a fork */
    if (!d->n_tokens) d->tokens[d->n_tokens++] = tms_files_random();
    for (;;) {
        char hidden[80], final[64];
        snprintf(hidden, sizeof hidden, ".tms-%d-%016llx.lock.new", (int)getpid(), current_token(d));
        snprintf(final, sizeof final, "tms-%d-%016llx.lock", (int)getpid(), current_token(d));
        int fd = openat(d->dfd, hidden, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
        int e = errno;
        if (fd >= 0 && flock(fd, LOCK_EX | LOCK_NB) == 0 && renameat(d->dfd, hidden, d->dfd, final) == 0) {
            d->lock_fd = fd;
            d->file_uid = tms_os_stat_fd(fd, &st) == 0 ? st.stx_uid : geteuid();
            break;
        }
        if (fd >= 0) {
            e = errno;
            unlinkat(d->dfd, hidden, 0);
            close(fd);
        }
        if (e != EEXIST || d->n_tokens == TOKENS_PER_DIR) {
            rc = tms_files_fail_errno(err, e, "taking a lock file in", d->path, NULL);
            break;
        }
        d->tokens[d->n_tokens++] = tms_files_random();
    }
out:
    pthread_mutex_unlock(&lock_file_mutex);
    return rc;
}

/* A regular file of this user's, opened without following a link or
 * blocking (os.h); -1 if not. */
static int open_own(int dfd, const char *name, int flags)
{
    int fd = -1;
    return tms_os_open_file(dfd, name, flags, geteuid(), &fd) == 0 ? fd : -1;
}

static int own_regular_file(int dfd, const char *name) { return tms_os_check_file_at(dfd, name, geteuid()) == 0; }

/* One of this process's files: a regular file owned as the filesystem makes
 * this process's files (not always this user: NFS root_squash). */
static int my_regular_file(const struct tms_disk_dir *d, const char *name)
{
    return tms_os_check_file_at(d->dfd, name, d->file_uid) == 0;
}

struct owner {
    int pid;
    unsigned long long token;
};

/* Removes what dead owners left in d (or, mine_only, this process's own
 * files: at exit). An owner is dead when its lock file, a regular file of
 * this user's, can be locked; its backups go first, then the lock, while
 * this holds it. Runs without disk_lock. */
static int my_token(const struct tms_disk_dir *d, int pid, unsigned long long tok)
{
    if (pid != getpid() || d->lock_pid != getpid()) return 0;
    for (int i = 0; i < d->n_tokens; i++)
        if (d->tokens[i] == tok) return 1;
    return 0;
}

static void sweep(struct tms_disk_dir *d, int mine_only)
{
    int list_fd = openat(d->dfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    DIR *dir = list_fd >= 0 ? fdopendir(list_fd) : NULL;
    if (!dir) {
        int e = errno;
        if (list_fd >= 0) close(list_fd);
        tms_log_warn("disk backup: cannot list %s to remove stale backups: %s", d->path, strerror(e));
        return;
    }
    struct owner *owners = NULL;
    size_t n_owners = 0, removed = 0;
    for (struct dirent *e; (e = readdir(dir));) {
        int pid;
        unsigned long long tok;
        int kind = parse_name(e->d_name, &pid, &tok);
        if (kind == NAME_OTHER) continue;
        int mine = my_token(d, pid, tok);
        if (mine_only) {
            if (mine && my_regular_file(d, e->d_name) && unlinkat(d->dfd, e->d_name, 0) == 0) removed++;
            continue;
        }
        if (mine || kind != NAME_LOCK || !own_regular_file(d->dfd, e->d_name)) {
            if (!mine && kind == NAME_NEW_LOCK && own_regular_file(d->dfd, e->d_name)) {
                /* Not yet renamed into place (its owner died in between): unlocked
                 * and older than a minute, so one being made now is left alone. */
                struct statx st;
                int fd = open_own(d->dfd, e->d_name, O_RDONLY);
                if (fd >= 0 && tms_os_stat_fd(fd, &st) == 0 && time(NULL) - st.stx_mtime.tv_sec >= 60 &&
                    flock(fd, LOCK_EX | LOCK_NB) == 0 && unlinkat(d->dfd, e->d_name, 0) == 0)
                    removed++;
                if (fd >= 0) close(fd);
            }
            continue;
        }
        struct owner *grown = realloc(owners, (n_owners + 1) * sizeof *owners);
        if (!grown) break;
        owners = grown;
        owners[n_owners++] = (struct owner){pid, tok};
    }
    for (size_t i = 0; i < n_owners; i++) {
        char lock_name[64];
        snprintf(lock_name, sizeof lock_name, "tms-%d-%016llx.lock", owners[i].pid, owners[i].token);
        int fd = open_own(d->dfd, lock_name, O_RDONLY);
        if (fd < 0) continue;
        if (flock(fd, LOCK_EX | LOCK_NB) != 0) {  /* held: its owner lives */
            close(fd);
            continue;
        }
        rewinddir(dir);
        for (struct dirent *e; (e = readdir(dir));) {
            int pid;
            unsigned long long tok;
            if (parse_name(e->d_name, &pid, &tok) == NAME_BACKUP && pid == owners[i].pid && tok == owners[i].token &&
                own_regular_file(d->dfd, e->d_name) && unlinkat(d->dfd, e->d_name, 0) == 0)
                removed++;
        }
        if (unlinkat(d->dfd, lock_name, 0) == 0) removed++;
        close(fd);
    }
    free(owners);
    closedir(dir);
    if (removed && !mine_only) TMS_DEBUG("disk backup: removed %zu files of dead processes from %s", removed, d->path);
}

/* The live record of the directory at resolved whose identity is (dev, ino), if any. */
static struct tms_disk_dir *find_dir_locked(const char *resolved, uint64_t dev, uint64_t ino)
{
    for (size_t i = 0; i < dir_count; i++)
        if (!dirs[i]->retired && dirs[i]->dev == dev && dirs[i]->ino == ino && strcmp(dirs[i]->path, resolved) == 0)
            return dirs[i];
    return NULL;
}

/* The record of the directory at abs (absolute), prepared on first use: made,
 * checked, opened and swept. A directory removed and made again under the
 * same path is another directory: a new record. Files and opens happen
 * without disk_lock. */
static int get_dir(const char *abs, struct tms_disk_dir **out, struct tms_err *err)
{
    char resolved[PATH_MAX];
    int rc = resolve(abs, resolved, err);
    if (rc) return rc;
    struct statx st;
    if ((rc = tms_os_stat_at(AT_FDCWD, resolved, 0, &st)))
        return tms_files_fail_errno(err, -rc, "checking directory", resolved, NULL);
    struct tms_os_id id = tms_os_id_of(&st);
    pthread_mutex_lock(&disk_lock);
    *out = find_dir_locked(resolved, id.dev, id.ino);
    pthread_mutex_unlock(&disk_lock);
    if (*out) return TMS_OK;

    int dfd = -1;
    if ((rc = open_checked(resolved, &dfd, err))) return rc;
    struct tms_disk_dir *d = calloc(1, sizeof *d);
    char *path = strdup(resolved);
    if (!d || !path) {
        free(d);
        free(path);
        close(dfd);
        return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory for a directory record");
    }
    const char *memory_fs = NULL;
    *d = (struct tms_disk_dir){.path = path, .dfd = dfd, .lock_fd = -1, .lock_pid = getpid()};
    if (tms_os_stat_fd(dfd, &st) == 0) id = tms_os_id_of(&st), d->dev = id.dev, d->ino = id.ino;
    d->memory_fs = tms_os_memory_fs(dfd, &memory_fs) == 0 && memory_fs;
    if ((rc = tms_files_ensure_lock(d, err))) {
        close(dfd);
        free(path);
        free(d);
        return rc;
    }
    pthread_mutex_lock(&disk_lock);
    struct tms_disk_dir *existing = find_dir_locked(resolved, d->dev, d->ino);
    struct tms_disk_dir **grown = existing ? NULL : realloc(dirs, (dir_count + 1) * sizeof *dirs);
    if (grown) {
        dirs = grown;
        dirs[dir_count++] = d;
    }
    pthread_mutex_unlock(&disk_lock);
    if (!grown) {  /* another thread prepared it meanwhile (or no memory): drop ours */
        char final[64];
        snprintf(final, sizeof final, "tms-%d-%016llx.lock", (int)getpid(), current_token(d));
        (void)unlinkat(dfd, final, 0);
        close(d->lock_fd);
        close(dfd);
        free(path);
        free(d);
        if (!existing) return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory for a directory record");
        *out = existing;
        return TMS_OK;
    }
    sweep(d, 0);
    if (d->memory_fs)
        tms_log_warn("disk backup directory %s is on a %s: backups there take RAM, not disk "
                     "(set TMS_DISK_BACKUP_DIR or set_disk_backup_dir to a disk)",
                     path, memory_fs);
    *out = d;
    return TMS_OK;
}

/* A directory that is neither chosen nor holds a file of this process's any
 * more gives back its descriptors and lock; its record stays (retired), so
 * a file record pointing at it never dangles. Runs without disk_lock. */
static void retire(struct tms_disk_dir *d)
{
    sweep(d, 1);  /* our lock (and nothing else: no files) */
    if (d->lock_fd >= 0) close(d->lock_fd);
    close(d->dfd);
    d->lock_fd = d->dfd = -1;
}

/* The default directory's absolute path, resolved once: a relative
 * TMS_DISK_BACKUP_DIR must not move with later changes of directory. */
static const char *default_locked(void)
{
    if (default_path || default_errno) return default_path;
    const char *env = *tms_defaults()->disk_dir ? tms_defaults()->disk_dir : tms_defaults()->tmpdir;
    int rc = tms_os_absolute(*env ? env : "/tmp", &default_path);
    if (rc) default_errno = -rc;
    return default_path;
}

/* ---- exit and fork -------------------------------------------------------- */

/* trylock: a thread stuck in a slow directory must not hold up the exit;
 * what is left then, the next process's sweep removes. */
static void remove_mine_at_exit(void)
{
    if (pthread_mutex_trylock(&disk_lock) != 0) return;
    size_t n = dir_count;
    struct tms_disk_dir **list = n ? malloc(n * sizeof *list) : NULL;
    if (list) memcpy(list, dirs, n * sizeof *list);
    pthread_mutex_unlock(&disk_lock);
    for (size_t i = 0; list && i < n; i++)
        if (!list[i]->retired && list[i]->lock_pid == getpid()) sweep(list[i], 1);  /* the lock too: nothing is left */
    free(list);
}

static void fork_prepare(void) { pthread_mutex_lock(&disk_lock); }
static void fork_parent(void)
{
    fork_generation++;
    pthread_mutex_unlock(&disk_lock);
}

/* The child is a new owner: it makes its own token, key and locks on first
 * use, and the parent's files (still in the child's table, read through the
 * inherited directory descriptors) are never removed by it. */
static void fork_child(void)
{
    pthread_mutex_init(&lock_file_mutex, NULL);
    for (size_t i = 0; i < dir_count; i++) {
        if (dirs[i]->lock_fd >= 0) close(dirs[i]->lock_fd);  /* the parent's flock stays with the parent's descriptor */
        dirs[i]->lock_fd = -1;
    }
    pthread_mutex_unlock(&disk_lock);
}

static pthread_once_t handlers_once = PTHREAD_ONCE_INIT;
static void install_handlers(void)
{
    static const struct tms_fork_handlers handlers = {fork_prepare, fork_parent, fork_child};
    (void)atexit(remove_mine_at_exit);
    tms_fork_register(TMS_FORK_FILES, &handlers);
}

/* ---- API ------------------------------------------------------------------ */

/* rc, with err marked as being about the directory where the directory was
 * what failed (not the host memory for its record). */
static int dir_failed(int rc, struct tms_err *err)
{
    if (err && (rc == TMS_E_ARG || rc == TMS_E_IO)) err->flags |= TMS_ERR_DISK_DIR;
    return rc;
}

int tms_disk_set_dir(const char *dir, struct tms_err *err)
{
    if (!dir || !*dir)
        return dir_failed(tms_fail(err, TMS_E_ARG, 0, "the disk backup directory must be a non-empty path"), err);
    pthread_once(&handlers_once, install_handlers);
    char *abs = NULL;
    int rc = tms_os_absolute(dir, &abs);
    if (rc) return dir_failed(tms_files_fail_errno(err, -rc, "resolving directory", dir, NULL), err);
    struct tms_disk_dir *d = NULL;
    rc = get_dir(abs, &d, err);
    free(abs);
    if (rc) return dir_failed(rc, err);
    pthread_mutex_lock(&disk_lock);
    struct tms_disk_dir *previous = chosen;
    chosen = d;
    d->replaced = 0;
    int drop = previous && previous != d && !previous->retired && previous->lock_pid == getpid();
    if (drop && previous->files) previous->replaced = 1, drop = 0;
    if (drop) previous->retired = 1;
    pthread_mutex_unlock(&disk_lock);
    if (drop) retire(previous);
    return TMS_OK;
}

void tms_disk_get_dir(char *buf, size_t n)
{
    pthread_once(&handlers_once, install_handlers);
    pthread_mutex_lock(&disk_lock);
    const char *dflt = chosen ? NULL : default_locked();
    snprintf(buf, n, "%s", chosen ? chosen->path : dflt ? dflt : "?");
    pthread_mutex_unlock(&disk_lock);
}

/* ---- for the files' I/O (files.c) ------------------------------------------- */

int tms_files_dir_for_new(struct tms_disk_dir **out, struct tms_err *err)
{
    pthread_once(&handlers_once, install_handlers);
    pthread_mutex_lock(&disk_lock);
    struct tms_disk_dir *d = chosen;
    const char *dflt = d ? NULL : default_locked();
    char *abs = dflt ? strdup(dflt) : NULL;
    int e = default_errno;
    pthread_mutex_unlock(&disk_lock);
    int rc = TMS_OK;
    if (!d && !dflt)
        return dir_failed(tms_fail(err, TMS_E_IO, e, "disk backup: the default directory cannot be made absolute "
                                   "(the working directory is unknown): %s (errno %d)", strerror(e), e), err);
    if (!d && !abs) return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory for a path");
    if (!d) rc = get_dir(abs, &d, err);
    free(abs);
    if (!rc) rc = tms_files_ensure_lock(d, err);
    if (!rc) *out = d;
    return dir_failed(rc, err);
}

unsigned long long tms_files_token(struct tms_disk_dir *d)
{
    pthread_mutex_lock(&lock_file_mutex);
    unsigned long long tok = current_token(d);
    pthread_mutex_unlock(&lock_file_mutex);
    return tok;
}

void tms_files_identity(uint64_t *out_key, unsigned long *generation)
{
    pthread_mutex_lock(&disk_lock);
    ensure_key_locked();
    *out_key = key;
    *generation = fork_generation;
    pthread_mutex_unlock(&disk_lock);
}

unsigned long tms_files_generation(void)
{
    pthread_mutex_lock(&disk_lock);
    unsigned long generation = fork_generation;
    pthread_mutex_unlock(&disk_lock);
    return generation;
}

void tms_files_add_file(struct tms_disk_dir *d)
{
    pthread_mutex_lock(&disk_lock);
    d->files++;
    pthread_mutex_unlock(&disk_lock);
}

void tms_files_remove_file(struct tms_disk_dir *d)
{
    pthread_mutex_lock(&disk_lock);
    int drop = d->files && !--d->files && d->replaced && !d->retired;
    if (drop) d->retired = 1;
    pthread_mutex_unlock(&disk_lock);
    if (drop) retire(d);
}
