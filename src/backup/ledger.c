/* The host-wide budget of host backups: one ledger file the processes of a user share, by name. */
#include "backup/ledger.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "platform/config.h"

/*
 * The ledger is an array of records, one per process that reserved: its pid,
 * its start time (so a reused pid is not taken for it) and its bytes. A
 * process changes its own record under an exclusive flock of the file and
 * counts the others' records whose process still runs: a process killed with
 * SIGKILL gives its reservation back the next time anyone reads the ledger.
 * The directory is the user's own (mode 0700 in /dev/shm): a ledger other
 * users could write would let them forge reservations.
 */
struct record {
    int32_t pid;
    uint32_t unused;
    uint64_t start;  /* the process's start time in clock ticks since boot (/proc/PID/stat) */
    uint64_t bytes;
};

#define MAX_RECORDS 4096

static pthread_mutex_t ledger_lock = PTHREAD_MUTEX_INITIALIZER;
static int ledger_fd = -1;        /* guarded by ledger_lock; -1 until first use with a budget */
static size_t mine;               /* guarded by ledger_lock */
static size_t my_slot = SIZE_MAX; /* guarded by ledger_lock: where this process's record is while it holds bytes */
static uint64_t my_start;         /* guarded by ledger_lock: this process's start time, 0 until read */
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

/* A child has no reservation of its own, and its own open file description:
 * flock excludes descriptions, not processes. */
static void ledger_fork_prepare(void) { pthread_mutex_lock(&ledger_lock); }
static void ledger_fork_parent(void) { pthread_mutex_unlock(&ledger_lock); }
static void ledger_fork_child(void)
{
    if (ledger_fd >= 0) close(ledger_fd);
    ledger_fd = -1;
    mine = 0;
    my_slot = SIZE_MAX;
    my_start = 0;
    pthread_mutex_unlock(&ledger_lock);
}
static void fork_setup(void) { (void)pthread_atfork(ledger_fork_prepare, ledger_fork_parent, ledger_fork_child); }

static uint64_t process_start(pid_t pid)
{
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    const char *p = strrchr(buf, ')');  /* the name may hold spaces and parentheses */
    if (!p) return 0;
    /* Field 22 (starttime) is the 20th after the name. */
    for (int field = 0; field < 20 && p; field++) p = strchr(p + 1, ' ');
    return p ? strtoull(p + 1, NULL, 10) : 0;
}

static void meminfo(size_t *total, size_t *available)
{
    *total = *available = 0;
    const char *path = getenv("TMS_HOST_MEMINFO");  /* tests: a meminfo of their own */
    FILE *f = fopen(path && *path ? path : "/proc/meminfo", "re");
    if (!f) return;
    char line[256];
    unsigned long long kib;
    while (fgets(line, sizeof line, f)) {
        if (sscanf(line, "MemTotal: %llu kB", &kib) == 1) *total = (size_t)kib << 10;
        else if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) *available = (size_t)kib << 10;
    }
    fclose(f);
}

static size_t limit_bytes(size_t mem_total)
{
    const struct tms_defaults *d = tms_defaults();
    return d->host_limit_percent ? mem_total * d->host_limit_percent / 100 : d->host_limit_bytes;  /* < 2^57 bytes: no overflow */
}

/* statx, not stat/fstat: those are GLIBC_2.33 symbols, the wheel targets 2.28. */
static int stat_path(const char *path, struct statx *st) { return statx(AT_FDCWD, path, 0, STATX_BASIC_STATS, st); }
static int stat_fd(int fd, struct statx *st) { return statx(fd, "", AT_EMPTY_PATH, STATX_BASIC_STATS, st); }

static int open_ledger_locked(struct tms_err *err)
{
    if (ledger_fd >= 0) return TMS_OK;
    char dir[128], name[96];
    struct statx st;
    const char *base = stat_path("/dev/shm", &st) == 0 && S_ISDIR(st.stx_mode) ? "/dev/shm" : "/tmp";
    snprintf(dir, sizeof dir, "%s/tms-ledger-%u", base, (unsigned)geteuid());
    if (mkdir(dir, 0700) != 0 && errno != EEXIST)
        return tms_fail(err, TMS_E_IO, errno, "cannot make the host backup ledger directory %s: %s", dir, strerror(errno));
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0) return tms_fail(err, TMS_E_IO, errno, "cannot open the ledger directory %s: %s", dir, strerror(errno));
    if (stat_fd(dfd, &st) != 0 || st.stx_uid != geteuid() || (st.stx_mode & 077)) {
        close(dfd);
        return tms_fail(err, TMS_E_IO, EPERM, "the ledger directory %s is not this user's alone (owner %u, mode %o)",
                        dir, (unsigned)st.stx_uid, (unsigned)(st.stx_mode & 07777));
    }
    snprintf(name, sizeof name, "%s.ledger", tms_defaults()->host_limit_name);
    int fd = openat(dfd, name, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    int e = errno;
    close(dfd);
    if (fd < 0) return tms_fail(err, TMS_E_IO, e, "cannot open the ledger %s/%s: %s", dir, name, strerror(e));
    if (stat_fd(fd, &st) != 0 || !S_ISREG(st.stx_mode) || st.stx_uid != geteuid()) {
        close(fd);
        return tms_fail(err, TMS_E_IO, EPERM, "the ledger %s/%s is not a file of this user", dir, name);
    }
    ledger_fd = fd;
    return TMS_OK;
}

/* Under the file lock: the live reservations of the other processes, and the
 * slot of this process's record (a free one if it has none). Clears the
 * records of processes that are gone. */
static uint64_t my_start_locked(void)
{
    if (!my_start) my_start = process_start(getpid());
    return my_start;
}

static size_t add_saturating(size_t a, size_t b) { return a > SIZE_MAX - b ? SIZE_MAX : a + b; }

static int scan_locked(size_t *others, size_t *slot, struct tms_err *err)
{
    static struct record recs[MAX_RECORDS];  /* guarded by ledger_lock */
    ssize_t got = pread(ledger_fd, recs, sizeof recs, 0);
    if (got < 0) return tms_fail(err, TMS_E_IO, errno, "cannot read the host backup ledger: %s", strerror(errno));
    size_t n = (size_t)got / sizeof *recs, free_slot = SIZE_MAX, own = SIZE_MAX;
    pid_t me = getpid();
    uint64_t start = my_start_locked();
    *others = 0;
    for (size_t i = 0; i < n; i++) {
        struct record *r = &recs[i];
        if (r->pid == me && r->start == start) {
            own = i;
            continue;
        }
        if (r->pid > 0 && r->bytes && process_start(r->pid) == r->start) {
            *others = add_saturating(*others, (size_t)r->bytes);  /* a corrupt record must not wrap the sum */
            continue;
        }
        if (r->pid || r->bytes) {  /* its process is gone: its reservation with it */
            static const struct record none;
            if (pwrite(ledger_fd, &none, sizeof none, (off_t)(i * sizeof none)) != (ssize_t)sizeof none)
                return tms_fail(err, TMS_E_IO, errno, "cannot write the host backup ledger: %s", strerror(errno));
        }
        if (free_slot == SIZE_MAX) free_slot = i;
    }
    *slot = own != SIZE_MAX ? own : free_slot != SIZE_MAX ? free_slot : n;
    if (*slot >= MAX_RECORDS) return tms_fail(err, TMS_E_IO, ENOSPC, "the host backup ledger is full (%d processes)", MAX_RECORDS);
    return TMS_OK;
}

/* A record of 0 bytes frees the slot: another process may take it next. */
static int write_mine_locked(size_t slot, size_t bytes, struct tms_err *err)
{
    struct record r = {.pid = getpid(), .start = my_start_locked(), .bytes = bytes};
    if (!bytes) r = (struct record){0};
    if (pwrite(ledger_fd, &r, sizeof r, (off_t)(slot * sizeof r)) != (ssize_t)sizeof r)
        return tms_fail(err, TMS_E_IO, errno, "cannot write the host backup ledger: %s", strerror(errno));
    my_slot = bytes ? slot : SIZE_MAX;
    return TMS_OK;
}

static double gib(size_t n) { return (double)n / (double)(1u << 30); }

/* Runs with ledger_lock and the file lock held: others = the other processes' bytes. */
static int with_ledger(size_t *others, size_t *slot, struct tms_err *err)
{
    int rc = open_ledger_locked(err);
    if (rc) return rc;
    if (flock(ledger_fd, LOCK_EX) != 0)
        return tms_fail(err, TMS_E_IO, errno, "cannot lock the host backup ledger: %s", strerror(errno));
    rc = scan_locked(others, slot, err);
    if (rc) (void)flock(ledger_fd, LOCK_UN);
    return rc;
}

int tms_ledger_reserve(size_t bytes, size_t *free_bytes, struct tms_err *err)
{
    if (!bytes) return TMS_OK;
    pthread_once(&fork_once, fork_setup);
    size_t total, available;
    meminfo(&total, &available);
    size_t limit = limit_bytes(total);
    const struct tms_defaults *d = tms_defaults();
    pthread_mutex_lock(&ledger_lock);
    int rc = TMS_OK;
    if (!limit) {
        /* No budget: the host keeps 5 % of its memory available. */
        size_t keep = total / 20, room = available > keep ? available - keep : 0;
        if (free_bytes) *free_bytes = room;
        if (d->host_memory_safety && total && bytes > room)
            rc = tms_fail(err, TMS_E_HOST_OOM, ENOMEM,
                          "host memory: this pause needs %zu bytes (%.2f GiB) of host backups, and %zu (%.2f GiB) "
                          "are available above the 5 %% of the host's %.2f GiB it keeps free (set "
                          "TMS_HOST_BACKUP_LIMIT for a budget, or TMS_HOST_MEMORY_SAFETY=0 to turn this check off)",
                          bytes, gib(bytes), room, gib(room), gib(total));
        else mine += bytes;
        pthread_mutex_unlock(&ledger_lock);
        return rc;
    }
    size_t others, slot;
    if ((rc = with_ledger(&others, &slot, err))) {
        pthread_mutex_unlock(&ledger_lock);
        return rc;
    }
    size_t used = add_saturating(others, mine), room = limit > used ? limit - used : 0;
    if (free_bytes) *free_bytes = room;
    if (bytes > room)
        rc = tms_fail(err, TMS_E_HOST_OOM, ENOMEM,
                      "host backup budget '%s' of %zu bytes (%.2f GiB, TMS_HOST_BACKUP_LIMIT): this pause needs %zu "
                      "bytes (%.2f GiB), %zu (%.2f GiB) are free; %zu reserved by the processes sharing it, %zu of "
                      "them by this one", d->host_limit_name, limit, gib(limit), bytes, gib(bytes), room, gib(room),
                      used, mine);
    else if (!(rc = write_mine_locked(slot, mine + bytes, err)))
        mine += bytes;
    (void)flock(ledger_fd, LOCK_UN);
    pthread_mutex_unlock(&ledger_lock);
    return rc;
}

void tms_ledger_release(size_t bytes)
{
    if (!bytes) return;
    pthread_mutex_lock(&ledger_lock);
    mine = bytes < mine ? mine - bytes : 0;
    /* Only this process's own record changes: no scan of the others (a resume
     * releases each allocation's backup on the copy workers). */
    if (ledger_fd >= 0 && my_slot != SIZE_MAX && flock(ledger_fd, LOCK_EX) == 0) {
        struct tms_err err = {0};
        (void)write_mine_locked(my_slot, mine, &err);
        (void)flock(ledger_fd, LOCK_UN);
    }
    pthread_mutex_unlock(&ledger_lock);
}

int tms_ledger_info(struct tms_ledger_info *info, struct tms_err *err)
{
    const struct tms_defaults *d = tms_defaults();
    *info = (struct tms_ledger_info){.safety = d->host_memory_safety};
    meminfo(&info->mem_total, &info->mem_available);
    info->limit = limit_bytes(info->mem_total);
    snprintf(info->name, sizeof info->name, "%s", d->host_limit_name);
    pthread_mutex_lock(&ledger_lock);
    info->mine = mine;
    int rc = TMS_OK;
    size_t others = 0, slot;
    if (info->limit && (rc = with_ledger(&others, &slot, err)) == TMS_OK) (void)flock(ledger_fd, LOCK_UN);
    info->reserved = add_saturating(others, mine);
    pthread_mutex_unlock(&ledger_lock);
    return rc;
}
