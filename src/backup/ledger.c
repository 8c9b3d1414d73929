/* The host-wide budget of host backups: one ledger file the processes of a user share, by name. */
#include "backup/ledger.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "platform/config.h"
#include "platform/fork.h"
#include "platform/log.h"
#include "platform/os.h"

/*
 * The ledger is an array of records, one per process that has written to it:
 * the bytes it holds against the budget, the bytes its pauses are still
 * copying, and its pid (for a person reading the file; nothing trusts it).
 * A record is alive while its process holds an open-file-description lock on
 * the record's byte of the lock space: the kernel drops it when the process
 * dies, in whatever PID namespace, before it becomes a zombie. Records are
 * read and written under the guard lock, and whoever reads a dead record
 * clears it. docs/design.md says why these locks, and where the file lives.
 */
struct record {
    uint64_t reserved;   /* host backups held against the budget (0 in a process without one) */
    uint64_t in_flight;  /* reserved by pauses still copying: not yet in MemAvailable */
    int32_t pid;
    uint32_t unused;
};

#define MAX_RECORDS 4096
/* The lock space, apart from where the records lie: the guard, then a byte
 * per record. A lock of the whole file is had only while no other process
 * holds a record or the guard. */
#define GUARD_BYTE 0
#define LIVE_BYTE(slot) ((off_t)(slot) + 1)
#define REOPEN_TRIES 8
#define SHARED_NAMES 8
#define WARN_SAFETY (1u << 16)
#define WARN_WRITE (1u << 17)

static pthread_mutex_t ledger_lock = PTHREAD_MUTEX_INITIALIZER;
static int ledger_fd = -1;                  /* guarded by ledger_lock; -1 until first use */
static char ledger_path[PATH_MAX];          /* guarded by ledger_lock: the file ledger_fd was opened as */
static struct tms_os_id ledger_id;          /* guarded by ledger_lock: its device and inode */
static size_t mine;                         /* guarded by ledger_lock: reserved by this process */
static size_t flying;                       /* guarded by ledger_lock: of mine, reserved by pauses still copying */
static size_t my_slot = SIZE_MAX;           /* guarded by ledger_lock: the record this process holds, first write to exit */
static struct record my_record;             /* guarded by ledger_lock: what that record says */
static struct record scanned[MAX_RECORDS];  /* guarded by ledger_lock: the records as the last scan left them */
static size_t scanned_n;                    /* guarded by ledger_lock */
static unsigned warned;                     /* guarded by ledger_lock: a bit per warning given once */
static int ledger_alone;                    /* guarded by ledger_lock: no place could be had, for good */
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void drop_ledger_locked(void)
{
    if (ledger_fd >= 0) close(ledger_fd);
    ledger_fd = -1;
    my_slot = SIZE_MAX;
    my_record = (struct record){0};
}

/* A child has no reservation of its own. Closing its copy of the descriptor
 * leaves the parent's locks alone: they belong to the open file description,
 * which the parent still holds. */
static void ledger_fork_prepare(void) { pthread_mutex_lock(&ledger_lock); }
static void ledger_fork_parent(void) { pthread_mutex_unlock(&ledger_lock); }
static void ledger_fork_child(void)
{
    drop_ledger_locked();
    mine = flying = 0;
    pthread_mutex_unlock(&ledger_lock);
}
static void fork_setup(void)
{
    static const struct tms_fork_handlers handlers = {ledger_fork_prepare, ledger_fork_parent, ledger_fork_child};
    tms_fork_register(TMS_FORK_LEDGER, &handlers);
}

static int has_budget(const struct tms_defaults *d) { return d->host_limit_bytes || d->host_limit_percent; }

static size_t limit_bytes(size_t mem_total)
{
    const struct tms_defaults *d = tms_defaults();
    /* mem_total < 2^52 (tms_os_meminfo's bound): a percentage of it cannot wrap. */
    return d->host_limit_percent ? mem_total * d->host_limit_percent / 100 : d->host_limit_bytes;
}

static size_t add_saturating(size_t a, uint64_t b) { return b > SIZE_MAX - a ? SIZE_MAX : a + (size_t)b; }

/* ---- where the ledger lives ------------------------------------------------------ */

/* The ledger's places, in the order every process of the user tries them:
 * the user's runtime directory, its home's cache, then names under /dev/shm
 * (or /tmp) made by the first process that needs them. A place is used only
 * if it is the user's alone; none: this process counts alone. */
enum { PLACE_RUNTIME, PLACE_HOME, PLACE_SHARED, PLACES = PLACE_SHARED + SHARED_NAMES };

/* Opens path (relative to at) as a directory of this user's alone (os.h).
 * make: made (mode 0700) if missing. Its descriptor, else -1 with why, and
 * *refused 1 if something stood there that is not the user's alone (another
 * user's, a link, a file, a mode others can use), 0 if nothing did. */
static int open_private_at(int at, const char *path, int make, int *refused, char *why, size_t why_size)
{
    *refused = 0;
    int rc = make ? tms_os_make_dir(at, path) : 0;
    if (rc) {
        snprintf(why, why_size, "cannot make it: %s", strerror(-rc));
        return -1;
    }
    int fd = -1;
    struct tms_os_owner found;
    rc = tms_os_open_private_dir(at, path, &fd, &found);
    if (!rc) return fd;
    *refused = rc > 0;
    if (rc == TMS_OS_LINK)
        snprintf(why, why_size, "it is a symbolic link");
    else if (rc == TMS_OS_NOT_DIR)
        snprintf(why, why_size, "it is not a directory");
    else if (rc > 0)
        snprintf(why, why_size, "it is not this user's alone (owner uid %u, mode %04o)", (unsigned)found.uid,
                 (unsigned)(found.mode & 07777));
    else
        snprintf(why, why_size, "%s", strerror(-rc));
    return -1;
}

/* The runtime directory ($XDG_RUNTIME_DIR, else /run/user/<uid>: os.h): it
 * must exist and be the user's alone; the ledger takes a directory inside it. */
static int open_runtime(char *path, size_t size, int *refused, char *why, size_t why_size)
{
    *refused = 0;
    if (tms_os_runtime_dir(tms_defaults()->xdg_runtime_dir, path, size - 32) != 0) {  /* room for the name below */
        snprintf(why, why_size, "its path is too long");
        return -1;
    }
    int top = open_private_at(AT_FDCWD, path, 0, refused, why, why_size);
    if (top < 0) return -1;
    size_t n = strlen(path);
    snprintf(path + n, size - n, "/torch_memory_saver");
    int fd = open_private_at(top, "torch_memory_saver", 1, refused, why, why_size);
    close(top);
    return fd;
}

/* <home>/.cache/torch_memory_saver/ledger-<boot id>, the home from the user
 * database (no other user can make names in it, whatever the environment
 * says); the boot id keeps apart the hosts that share a network home. */
static int open_home(char *path, size_t size, int *refused, char *why, size_t why_size)
{
    char boot[37];
    *refused = 0;
    int rc = tms_os_cache_dir(path, size - 64);  /* room for the names below */
    if (rc == -ENAMETOOLONG) {
        snprintf(why, why_size, "the home directory's path is too long");
        return -1;
    }
    if (rc) {
        snprintf(path, size, "~/.cache/torch_memory_saver");
        snprintf(why, why_size, "uid %u has no home directory in the user database", (unsigned)geteuid());
        return -1;
    }
    if (tms_os_boot_id(boot) != 0) {
        snprintf(why, why_size, "cannot read /proc/sys/kernel/random/boot_id");
        return -1;
    }
    /* The parents follow links (a ~/.cache elsewhere is the user's choice);
     * a failure shows as the last directory's. */
    size_t n = strlen(path);
    (void)tms_os_make_dir(AT_FDCWD, path);
    snprintf(path + n, size - n, "/torch_memory_saver");
    (void)tms_os_make_dir(AT_FDCWD, path);
    snprintf(path + n, size - n, "/torch_memory_saver/ledger-%s", boot);
    return open_private_at(AT_FDCWD, path, 1, refused, why, why_size);
}

/* A name under /dev/shm (or /tmp), the first of them made by the first process
 * of the user that needs it. Anyone can make names there, and another user's
 * name stays (the directory is sticky): each name taken sends the user's
 * processes to the next, in the same order for all of them. mkdir is
 * exclusive, and a name already there is used only if it is the user's alone. */
static int open_shared_name(int k, char *path, size_t size, int *refused, char *why, size_t why_size)
{
    struct statx st;
    const char *base = tms_os_stat_at(AT_FDCWD, "/dev/shm", 0, &st) == 0 && S_ISDIR(st.stx_mode) ? "/dev/shm" : "/tmp";
    if (k) snprintf(path, size, "%s/tms-ledger-%u-%d", base, (unsigned)geteuid(), k);
    else snprintf(path, size, "%s/tms-ledger-%u", base, (unsigned)geteuid());
    return open_private_at(AT_FDCWD, path, 1, refused, why, why_size);
}

/* The ledger's directory: the first place that is the user's alone. Another
 * user's name in a place the user shares is skipped with one warning (the
 * first of the names under /dev/shm only); where no place can be had,
 * *alone is set and why says why for each kind of place. */
static int open_place_locked(char *dir, size_t dir_size, int *alone, char *why_all, size_t why_size)
{
    char why[200];
    size_t used = 0;
    *alone = 0;
    why_all[0] = 0;
    for (int i = 0; i < PLACES; i++) {
        int refused = 0, fd, bit = i < PLACE_SHARED ? i : PLACE_SHARED;
        why[0] = 0;
        if (i == PLACE_RUNTIME) fd = open_runtime(dir, dir_size, &refused, why, sizeof why);
        else if (i == PLACE_HOME) fd = open_home(dir, dir_size, &refused, why, sizeof why);
        else fd = open_shared_name(i - PLACE_SHARED, dir, dir_size, &refused, why, sizeof why);
        if (fd >= 0) return fd;
        if (refused && !(warned & (1u << bit))) {
            warned |= 1u << bit;
            tms_log_warn("the host backup ledger skips %s: %s", dir, why);
        }
        if (i > PLACE_SHARED) continue;  /* the first name under /dev/shm stands for all of them */
        int n = snprintf(why_all + used, why_size - used, "%s%s%s: %s", used ? "; " : "", dir,
                         i == PLACE_SHARED ? " and the next names" : "", why);
        if (n > 0) used = (size_t)n < why_size - used ? used + (size_t)n : why_size - 1;
    }
    *alone = 1;
    return -1;
}

static int open_ledger_locked(struct tms_err *err)
{
    if (ledger_fd >= 0) return TMS_OK;
    if (ledger_alone)
        return tms_fail(err, TMS_E_IO, EACCES, "no private place for the host backup ledger: this process counts alone");
    char dir[PATH_MAX - 80], why[1024], name[80];
    int alone = 0, dfd = open_place_locked(dir, sizeof dir, &alone, why, sizeof why);
    if (dfd < 0) {
        ledger_alone = 1;
        tms_log_warn("no private place for the host backup ledger: the budget and the 5 %% kept free count this "
                     "process's backups alone (%s)", why);
        return tms_fail(err, TMS_E_IO, EACCES, "no private place for the host backup ledger: this process counts alone");
    }
    snprintf(name, sizeof name, "%s.ledger", tms_defaults()->host_limit_name);
    int fd = openat(dfd, name, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    int e = errno;
    close(dfd);
    if (fd < 0)
        return tms_fail(err, TMS_E_IO, e, "cannot open the host backup ledger %s/%s: %s", dir, name, strerror(e));
    struct tms_os_id id;
    if (tms_os_check_file(fd, geteuid(), &id) != 0) {
        close(fd);
        return tms_fail(err, TMS_E_IO, EPERM, "the host backup ledger %s/%s is not a file of this user", dir, name);
    }
    snprintf(ledger_path, sizeof ledger_path, "%s/%s", dir, name);
    ledger_id = id;
    ledger_fd = fd;
    return TMS_OK;
}

/* ---- locks and records --------------------------------------------------------- */

/* A lock of len bytes at start (len 0: to the end of the file and beyond),
 * owned by the open file description: 0, or the errno. */
static int set_lock(short type, off_t start, off_t len, int wait)
{
    struct flock fl = {.l_type = type, .l_whence = SEEK_SET, .l_start = start, .l_len = len};
    int rc;
    while ((rc = fcntl(ledger_fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &fl)) != 0 && errno == EINTR) {}
    return rc ? errno : 0;
}

/* Whether another open file description holds the record's byte; when the
 * kernel cannot say, alive: a reservation is never cleared on a doubt. */
static int record_alive(size_t slot)
{
    struct flock fl = {.l_type = F_WRLCK, .l_whence = SEEK_SET, .l_start = LIVE_BYTE(slot), .l_len = 1};
    return fcntl(ledger_fd, F_OFD_GETLK, &fl) != 0 || fl.l_type != F_UNLCK;
}

/* Whether ledger_path still names the open file: the last process to leave removes it. */
static int still_named(void) { return tms_os_names(AT_FDCWD, ledger_path, &ledger_id) == 0; }

/* Opens the ledger if needed and takes its guard. Without a record of its
 * own, the file this process holds may have been removed by the last one to
 * leave it since: it then opens the one the path names now. */
static int guard_locked(struct tms_err *err)
{
    for (int tries = 0;; tries++) {
        int rc = open_ledger_locked(err);
        if (rc) return rc;
        if ((rc = set_lock(F_WRLCK, GUARD_BYTE, 1, 1)) != 0)
            return tms_fail(err, TMS_E_IO, rc, "cannot lock the host backup ledger %s: %s", ledger_path, strerror(rc));
        if (my_slot != SIZE_MAX || still_named()) return TMS_OK;
        drop_ledger_locked();
        if (tries == REOPEN_TRIES)
            return tms_fail(err, TMS_E_IO, ESTALE, "the host backup ledger %s keeps being removed", ledger_path);
    }
}

static void unguard_locked(void) { (void)set_lock(F_UNLCK, GUARD_BYTE, 1, 0); }

static int write_record_locked(size_t slot, const struct record *r, struct tms_err *err)
{
    ssize_t put;
    while ((put = pwrite(ledger_fd, r, sizeof *r, (off_t)(slot * sizeof *r))) < 0 && errno == EINTR) {}
    if (put == (ssize_t)sizeof *r) return TMS_OK;
    int e = put < 0 ? errno : EIO;
    return tms_fail(err, TMS_E_IO, e, "cannot write the host backup ledger %s: %s", ledger_path, strerror(e));
}

struct sums {
    size_t reserved, in_flight;
};

/* Under the guard: what the other live processes hold. Clears the records
 * of processes that are gone. */
static int scan_locked(struct sums *others, struct tms_err *err)
{
    static const struct record none;
    ssize_t got;
    while ((got = pread(ledger_fd, scanned, sizeof scanned, 0)) < 0 && errno == EINTR) {}
    if (got < 0)
        return tms_fail(err, TMS_E_IO, errno, "cannot read the host backup ledger %s: %s", ledger_path, strerror(errno));
    scanned_n = (size_t)got / sizeof *scanned;
    *others = (struct sums){0};
    for (size_t i = 0; i < scanned_n; i++) {
        struct record *r = &scanned[i];
        if (i == my_slot || (!r->reserved && !r->in_flight)) continue;
        if (record_alive(i)) {
            others->reserved = add_saturating(others->reserved, r->reserved);  /* a corrupt record must not wrap the sum */
            others->in_flight = add_saturating(others->in_flight, r->in_flight);
            continue;
        }
        int rc = write_record_locked(i, &none, err);  /* its process is gone, and its reservation with it */
        if (rc) return rc;
        *r = none;
    }
    return TMS_OK;
}

/* Under the guard, after a scan: an empty record nobody holds becomes this process's. */
static int take_slot_locked(struct tms_err *err)
{
    for (size_t i = 0; i < MAX_RECORDS; i++) {
        if (i < scanned_n && (scanned[i].reserved || scanned[i].in_flight)) continue;
        int rc = set_lock(F_WRLCK, LIVE_BYTE(i), 1, 0);
        if (rc == 0) {
            my_slot = i;
            return TMS_OK;
        }
        if (rc != EAGAIN && rc != EACCES)
            return tms_fail(err, TMS_E_IO, rc, "cannot lock a record of the host backup ledger %s: %s", ledger_path,
                            strerror(rc));
    }
    return tms_fail(err, TMS_E_IO, ENOSPC, "the host backup ledger %s is full (%d processes)", ledger_path, MAX_RECORDS);
}

/* What this process's record should say (its pid is added when written). */
static struct record wanted_record(void)
{
    return (struct record){.reserved = has_budget(tms_defaults()) ? mine : 0, .in_flight = flying};
}

/* Under the guard: this process's record says what it holds now. A process
 * takes a record at its first write and keeps it, empty or not, until exit. */
static int publish_locked(struct tms_err *err)
{
    struct record r = wanted_record();
    if (my_slot == SIZE_MAX) {
        if (!r.reserved && !r.in_flight) return TMS_OK;
        int rc = take_slot_locked(err);
        if (rc) return rc;
    }
    r.pid = getpid();
    int rc = write_record_locked(my_slot, &r, err);
    if (!rc) my_record = r;
    return rc;
}

/* After a change of mine or flying outside a reservation: the record
 * follows, with no scan (a resume releases each backup on the copy workers). */
static void republish_locked(void)
{
    if (ledger_fd < 0 || my_slot == SIZE_MAX) return;
    struct record r = wanted_record();
    if (r.reserved == my_record.reserved && r.in_flight == my_record.in_flight) return;
    struct tms_err err = {0};
    int rc = set_lock(F_WRLCK, GUARD_BYTE, 1, 1);
    if (rc) tms_fail(&err, TMS_E_IO, rc, "cannot lock the host backup ledger %s: %s", ledger_path, strerror(rc));
    else {
        (void)publish_locked(&err);
        unguard_locked();
    }
    if (err.status && !(warned & WARN_WRITE)) {
        warned |= WARN_WRITE;
        tms_log_warn("%s", err.msg);
    }
}

/* At exit the process's record goes, and the last process to leave the
 * ledger removes the file. */
__attribute__((destructor)) static void ledger_leave(void)
{
    if (pthread_mutex_trylock(&ledger_lock) != 0) return;  /* a thread is in it: the kernel drops the locks anyway */
    if (ledger_fd >= 0) {
        static const struct record none;
        struct tms_err err = {0};
        if (my_slot != SIZE_MAX && set_lock(F_WRLCK, GUARD_BYTE, 1, 1) == 0)
            (void)write_record_locked(my_slot, &none, &err);
        if (set_lock(F_WRLCK, 0, 0, 0) == 0 && still_named()) (void)unlink(ledger_path);
        drop_ledger_locked();
    }
    pthread_mutex_unlock(&ledger_lock);
}

/* ---- the interface --------------------------------------------------------------- */

static double gib(size_t n) { return (double)n / (double)(1u << 30); }

int tms_ledger_reserve(size_t bytes, size_t *free_bytes, struct tms_err *err)
{
    if (!bytes) return TMS_OK;
    pthread_once(&fork_once, fork_setup);
    const struct tms_defaults *d = tms_defaults();
    size_t total, available;
    (void)tms_os_meminfo(&total, &available);  /* 0 where unknown */
    size_t limit = limit_bytes(total);
    int budget = has_budget(d);
    if (budget && !limit)
        return tms_fail(err, TMS_E_IO, 0,
                        "host backup budget '%s' is %u %% of the host's memory (TMS_HOST_BACKUP_LIMIT), and no MemTotal "
                        "could be read from %s", d->host_limit_name, d->host_limit_percent, tms_os_meminfo_path());
    pthread_mutex_lock(&ledger_lock);
    struct sums others = {0};
    struct tms_err why = {0};
    int rc = TMS_OK, guarded = 0;
    if (budget || (d->host_memory_safety && total)) {
        if ((rc = guard_locked(&why)) == TMS_OK) {
            guarded = 1;
            rc = scan_locked(&others, &why);
        } else if (ledger_alone) {
            rc = TMS_OK;  /* no place could be had (said once): this process alone */
        }
        if (rc && budget) {
            if (guarded) unguard_locked();
            pthread_mutex_unlock(&ledger_lock);
            if (err) *err = why;
            return rc;
        }
        if (rc) {  /* the safety is best effort: without the ledger, this process's pauses alone */
            if (guarded) unguard_locked();
            guarded = 0;
            others = (struct sums){0};
            rc = TMS_OK;
            if (!(warned & WARN_SAFETY)) {
                warned |= WARN_SAFETY;
                tms_log_warn("%s: the 5 %% kept free counts this process's pauses in flight only", why.msg);
            }
        }
    }
    size_t room;
    if (budget) {
        size_t used = add_saturating(others.reserved, mine);
        room = limit > used ? limit - used : 0;
        if (bytes > room)
            rc = tms_fail(err, TMS_E_HOST_OOM, ENOMEM,
                          "host backup budget '%s' of %zu bytes (%.2f GiB, TMS_HOST_BACKUP_LIMIT): this pause needs %zu "
                          "bytes (%.2f GiB), %zu (%.2f GiB) are free; %zu reserved by the processes sharing it, %zu of "
                          "them by this one", d->host_limit_name, limit, gib(limit), bytes, gib(bytes), room, gib(room),
                          used, mine);
    } else {
        /* MemAvailable counts backups already copied; pauses in flight, of any process, are not in it yet. */
        size_t keep = total / 20, in_flight = add_saturating(others.in_flight, flying);
        size_t busy = add_saturating(keep, in_flight);
        room = available > busy ? available - busy : 0;
        if (d->host_memory_safety && total && bytes > room)
            rc = tms_fail(err, TMS_E_HOST_OOM, ENOMEM,
                          "host memory: this pause needs %zu bytes (%.2f GiB) of host backups, and %zu (%.2f GiB) "
                          "are available above the 5 %% of the host's %.2f GiB it keeps free and the %zu bytes "
                          "(%.2f GiB) pauses still copying have reserved (set TMS_HOST_BACKUP_LIMIT for a budget, or "
                          "TMS_HOST_MEMORY_SAFETY=0 to turn this check off)",
                          bytes, gib(bytes), room, gib(room), gib(total), in_flight, gib(in_flight));
    }
    if (free_bytes) *free_bytes = room;
    if (!rc) {
        mine += bytes;
        flying += bytes;
        if (guarded && (rc = publish_locked(&why)) != TMS_OK) {
            if (budget) {
                mine -= bytes;
                flying -= bytes;
                if (err) *err = why;
            } else {
                rc = TMS_OK;
                if (!(warned & WARN_WRITE)) {
                    warned |= WARN_WRITE;
                    tms_log_warn("%s", why.msg);
                }
            }
        }
    }
    if (guarded) unguard_locked();
    pthread_mutex_unlock(&ledger_lock);
    return rc;
}

void tms_ledger_copied(size_t bytes)
{
    if (!bytes) return;
    pthread_mutex_lock(&ledger_lock);
    flying = bytes < flying ? flying - bytes : 0;
    republish_locked();
    pthread_mutex_unlock(&ledger_lock);
}

void tms_ledger_release(size_t bytes)
{
    if (!bytes) return;
    pthread_mutex_lock(&ledger_lock);
    mine = bytes < mine ? mine - bytes : 0;
    if (flying > mine) flying = mine;
    republish_locked();
    pthread_mutex_unlock(&ledger_lock);
}

int tms_ledger_info(struct tms_ledger_info *info, struct tms_err *err)
{
    pthread_once(&fork_once, fork_setup);
    const struct tms_defaults *d = tms_defaults();
    *info = (struct tms_ledger_info){.safety = d->host_memory_safety};
    (void)tms_os_meminfo(&info->mem_total, &info->mem_available);
    info->limit = limit_bytes(info->mem_total);
    snprintf(info->name, sizeof info->name, "%s", d->host_limit_name);
    pthread_mutex_lock(&ledger_lock);
    info->mine = mine;
    int rc = TMS_OK;
    struct sums others = {0};
    struct tms_err why = {0};
    if (info->limit && (rc = guard_locked(&why)) == TMS_OK) {
        rc = scan_locked(&others, &why);
        unguard_locked();
    } else if (!info->limit) {
        (void)open_ledger_locked(&why);  /* only to say where it is */
    }
    if (rc && ledger_alone) rc = TMS_OK;
    if (rc && err) *err = why;
    info->alone = ledger_alone;
    if (ledger_fd >= 0) snprintf(info->ledger, sizeof info->ledger, "%s", ledger_path);
    info->reserved = add_saturating(others.reserved, mine);
    pthread_mutex_unlock(&ledger_lock);
    return rc;
}
