/* The job's memory: own physical handles a pause did not release, idle until a member borrows them or the bound passes, lent until they come back; and the records of memory members lent. */
#include "share/job_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "platform/config.h"
#include "platform/driver.h"
#include "platform/fork.h"
#include "platform/log.h"
#include "platform/os.h"

enum { IDLE, LENT };

struct kept {
    tms_phys handle;
    size_t size;
    int device;
    int state;
    uint64_t key;                   /* this process's name for it, never 0 */
    uint64_t batch;                 /* LENT: the lend it went out with */
    int borrower;                   /* LENT: the borrower's pid */
    const void *owner;              /* the paused allocation it backed; NULL once that took other memory or was freed */
    int order;                      /* its place in the owner's memory */
    uint64_t idle_until_ns;         /* IDLE: released to the driver then */
    int spent;                      /* IDLE: returned spent (tms_job_returned): released, never lent again */
};

/* A piece members lent, mapped here (or planned): what its extent's id names. */
struct lent_piece {
    uint64_t id;
    int device;
    struct tms_job_piece p;
};

/* A leaf lock: nothing else is taken under it, and no driver call runs
 * under it (handles are exported and released after it is dropped). */
static pthread_mutex_t kept_lock = PTHREAD_MUTEX_INITIALIZER;
static struct kept *pool;           /* guarded by kept_lock */
static size_t n_pool, cap_pool;     /* guarded by kept_lock */
static struct lent_piece *lent_here;  /* guarded by kept_lock */
static size_t n_lent_here, cap_lent_here;  /* guarded by kept_lock */
static uint64_t last_key, last_batch, last_id;  /* guarded by kept_lock */
static size_t pool_entries;         /* atomic: n_pool + n_lent_here, read without the lock */
static size_t borrowed[TMS_STATS_DEVICES];  /* atomic: bytes mapped here from memory members lent */
static size_t kept_fds;                     /* atomic: descriptors borrowed pieces keep (tms_job_keep_fd) */
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void fork_prepare(void) { pthread_mutex_lock(&kept_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&kept_lock); }
/* The child is in no job: what its parent kept or lent is the parent's. A
 * lender's memory is not the child's either: its copy of each descriptor a
 * borrowed piece keeps would hold that memory alive, so it is closed (the
 * record stays: the child's allocations still name it). */
static void fork_child(void)
{
    n_pool = 0;
    for (size_t i = 0; i < n_lent_here; i++)
        if (lent_here[i].p.fd >= 0) close(lent_here[i].p.fd), lent_here[i].p.fd = -1;
    __atomic_store_n(&kept_fds, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&pool_entries, n_lent_here, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&kept_lock);
}
static void register_fork(void)
{
    static const struct tms_fork_handlers handlers = {fork_prepare, fork_parent, fork_child};
    tms_fork_register(TMS_FORK_POOL, &handlers);
}

/* Handles taken out of the pool, back to the driver (outside the lock). drop is not
 * const: GCC takes a const pointer into a partly filled array for a read of all of it. */
static void release_kept(const struct tms_driver *drv, tms_phys *drop, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int rc = drv->release(drop[i]);
        if (rc && !drv->is_shutdown(rc))
            tms_log_warn("releasing memory kept for the job failed: %s (%d)", drv->code_name(rc), rc);
    }
}

static void lock(void)
{
    pthread_once(&fork_once, register_fork);
    pthread_mutex_lock(&kept_lock);
}
static void unlock(void) { pthread_mutex_unlock(&kept_lock); }

int tms_job_pool_any(void) { return __atomic_load_n(&pool_entries, __ATOMIC_RELAXED) != 0; }

static void count_entries_locked(void) { __atomic_store_n(&pool_entries, n_pool + n_lent_here, __ATOMIC_RELAXED); }

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static int slot(int device) { return device < TMS_STATS_DEVICES ? device : TMS_STATS_DEVICES - 1; }

static uint64_t hold_ns(void) { return (uint64_t)tms_defaults()->job_hold_ms * 1000000u; }

static void remove_at_locked(size_t i)
{
    pool[i] = pool[--n_pool];
    count_entries_locked();
}

int tms_job_pool_keep(int device, uint64_t handle, size_t size, const void *owner, int order)
{
    uint64_t until = now_ns() + hold_ns();
    lock();
    if (n_pool == cap_pool) {
        size_t grown = cap_pool ? cap_pool * 2 : 64;
        struct kept *more = realloc(pool, grown * sizeof *more);
        if (!more) {
            unlock();
            return TMS_E_HOST_OOM;  /* the caller releases it instead */
        }
        pool = more;
        cap_pool = grown;
    }
    pool[n_pool++] = (struct kept){.handle = handle, .size = size, .device = device, .state = IDLE,
                                   .key = ++last_key, .owner = owner, .order = order, .idle_until_ns = until};
    count_entries_locked();
    unlock();
    return TMS_OK;
}

static int by_order(const void *x, const void *y)
{
    const struct kept *a = x, *b = y;
    return (a->order > b->order) - (a->order < b->order);
}

size_t tms_job_pool_take(const void *owner, struct tms_extent **ext, int *n_ext)
{
    *ext = NULL;
    *n_ext = 0;
    if (!tms_job_pool_any()) return 0;
    lock();
    size_t mine = 0;
    for (size_t i = 0; i < n_pool; i++) mine += pool[i].owner == owner && pool[i].state == IDLE;
    struct kept *taken = mine ? calloc(mine, sizeof *taken) : NULL;
    struct tms_extent *out = taken ? calloc(mine, sizeof *out) : NULL;
    size_t k = 0, bytes = 0;
    for (size_t i = 0; i < n_pool;) {
        if (pool[i].owner != owner) {
            i++;
            continue;
        }
        if (pool[i].state == LENT || !out) {
            /* Mapped by another member now (or no memory to take it back):
             * no longer this allocation's; it stays for the job. */
            pool[i++].owner = NULL;
            continue;
        }
        taken[k++] = pool[i];
        remove_at_locked(i);
    }
    unlock();
    if (!out) {
        free(taken);
        return 0;
    }
    qsort(taken, k, sizeof *taken, by_order);
    for (size_t i = 0; i < k; i++) {
        out[i] = (struct tms_extent){.handle = taken[i].handle, .len = taken[i].size, .size = taken[i].size,
                                     .from = {.kind = TMS_MEM_OWN}};
        bytes += taken[i].size;
    }
    free(taken);
    *ext = out;
    *n_ext = (int)k;
    return bytes;
}

void tms_job_pool_forget(const void *owner)
{
    const struct tms_driver *drv;
    if (!tms_job_pool_any() || tms_driver_get(&drv, NULL)) return;
    tms_phys *drop = NULL;
    size_t n_drop = 0;
    lock();
    size_t idle = 0;
    for (size_t i = 0; i < n_pool; i++) idle += pool[i].owner == owner && pool[i].state == IDLE;
    drop = idle ? calloc(idle, sizeof *drop) : NULL;
    for (size_t i = 0; i < n_pool;) {
        if (pool[i].owner != owner) {
            i++;
            continue;
        }
        pool[i].owner = NULL;
        /* Freed: its idle memory goes back to the driver at once (without a
         * list for it, at the bound); what is lent comes back first. */
        if (pool[i].state == IDLE && drop) {
            drop[n_drop++] = pool[i].handle;
            remove_at_locked(i);
            continue;
        }
        i++;
    }
    unlock();
    release_kept(drv, drop, n_drop);
    free(drop);
}

/* ---- memory members lent, as this process maps it --------------------------------------- */

uint64_t tms_job_borrowed_add(int device, const struct tms_job_piece *p)
{
    uint64_t id = 0;
    lock();
    if (n_lent_here == cap_lent_here) {
        size_t grown = cap_lent_here ? cap_lent_here * 2 : 64;
        struct lent_piece *more = realloc(lent_here, grown * sizeof *more);
        if (more) lent_here = more, cap_lent_here = grown;
    }
    if (n_lent_here < cap_lent_here) {
        id = ++last_id;
        lent_here[n_lent_here++] = (struct lent_piece){.id = id, .device = device, .p = *p};
        count_entries_locked();
        __atomic_add_fetch(&borrowed[slot(device)], p->len, __ATOMIC_RELAXED);
    }
    unlock();
    return id;
}

int tms_job_borrowed_drop(uint64_t id, struct tms_job_piece *out)
{
    int found = 0;
    lock();
    for (size_t i = 0; i < n_lent_here && !found; i++) {
        if (lent_here[i].id != id) continue;
        found = 1;
        *out = lent_here[i].p;
        __atomic_sub_fetch(&borrowed[slot(lent_here[i].device)], out->len, __ATOMIC_RELAXED);
        if (out->fd >= 0) __atomic_sub_fetch(&kept_fds, 1, __ATOMIC_RELAXED);
        lent_here[i] = lent_here[--n_lent_here];
        count_entries_locked();
    }
    unlock();
    return found;
}

int tms_job_lent_fd(uint64_t id, int pid, int *fd, struct tms_err *err)
{
    int kept = -2;
    lock();
    for (size_t i = 0; i < n_lent_here; i++) {
        struct tms_job_piece *p = &lent_here[i].p;
        if (lent_here[i].id != id) continue;
        /* Its lender must never use it again once another process may map it. */
        if (!fd && pid != p->lender) p->shared_on = 1;
        /* A copy under the lock: a return closes the piece's descriptor under it too. */
        if (fd) kept = p->fd >= 0 ? fcntl(p->fd, F_DUPFD_CLOEXEC, 0) : -1;
        if (fd && kept < 0 && p->fd >= 0) kept = -3 - errno;
        break;
    }
    unlock();
    if (!fd) return TMS_OK;
    if (kept >= 0) {
        *fd = kept;
        return TMS_OK;
    }
    if (kept <= -3)
        return tms_fail(err, TMS_E_IO, -3 - kept, "memory a job lent: dup of its descriptor failed (errno %d)",
                        -3 - kept);
    return tms_fail(err, TMS_E_UNSUPPORTED, 0, "it is memory a job lent, whose descriptor this process did not keep "
                    "(it keeps at most %zu, a quarter of its descriptor limit: raise `ulimit -n`)",
                    tms_os_fd_budget(TMS_OS_FDS_BORROWED));
}

/* A descriptor per borrowed piece adds up (4,096 for 8 GiB of 2 MiB handles):
 * its share of the descriptor budget leaves the process's own files room. */
int tms_job_keep_fd(void)
{
    size_t limit = tms_os_fd_budget(TMS_OS_FDS_BORROWED), n = __atomic_load_n(&kept_fds, __ATOMIC_RELAXED);
    do {
        if (n >= limit) return 0;
    } while (!__atomic_compare_exchange_n(&kept_fds, &n, n + 1, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
    return 1;
}

/* ---- the member side: what the job's thread asks ------------------------------------ */

void tms_job_status(int device, size_t *demand, size_t *idle)
{
    size_t paused = tms_core_paused_demand(device), kept = 0;
    lock();
    for (size_t i = 0; i < n_pool; i++)
        kept += pool[i].device == device && pool[i].state == IDLE && !pool[i].spent ? pool[i].size : 0;
    unlock();
    *demand = paused;
    *idle = kept;
}

/* Whether a handle of size bytes serves a need of want bytes: the driver
 * maps a handle whole, never a part of one, so it must not be larger. */
int tms_job_pool_fits(size_t size, size_t want) { return want && size <= want; }

/* The idle handle on device for a need of want bytes: the largest that fits; SIZE_MAX if none. */
static size_t pick_locked(int device, size_t want)
{
    size_t best = SIZE_MAX;
    for (size_t i = 0; i < n_pool; i++) {
        const struct kept *k = &pool[i];
        if (k->device != device || k->state != IDLE || k->spent || !tms_job_pool_fits(k->size, want)) continue;
        if (best == SIZE_MAX || k->size > pool[best].size) best = i;
    }
    return best;
}

int tms_job_lend(int device, const uint64_t *needs, size_t n, int pid, struct tms_job_lent *out, int *fds,
                      size_t *n_out, uint64_t *batch, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    *n_out = 0;
    if (rc) return rc;
    if (!drv->export_fd) return tms_fail(err, TMS_E_UNSUPPORTED, 0, "lend: the %s backend cannot export memory", drv->name);
    tms_phys handles[TMS_JOB_MAX_PIECES];
    uint64_t keys[TMS_JOB_MAX_PIECES];
    size_t k = 0;
    lock();
    uint64_t b = ++last_batch;
    for (size_t i = 0; i < n && k < TMS_JOB_MAX_PIECES; i++) {
        size_t want = needs[i];
        while (want && k < TMS_JOB_MAX_PIECES) {
            size_t at = pick_locked(device, want);
            if (at == SIZE_MAX) break;
            struct kept *e = &pool[at];
            size_t len = e->size < want ? e->size : want;
            e->state = LENT;
            e->batch = b;
            e->borrower = pid;
            out[k] = (struct tms_job_lent){.need = i, .size = e->size, .len = len, .key = e->key};
            handles[k] = e->handle;
            keys[k++] = e->key;
            want -= len;
        }
    }
    unlock();
    size_t sent = 0;
    for (size_t i = 0; i < k; i++) {
        int drc = drv->export_fd(handles[i], &fds[sent]);
        if (drc) {
            TMS_DEBUG("lend: export of a kept handle failed: %s (%d)", drv->code_name(drc), drc);
            (void)tms_job_returned(b, &keys[i], 1, 0);
            continue;
        }
        out[sent++] = out[i];
    }
    *n_out = sent;
    *batch = b;
    return TMS_OK;
}

size_t tms_job_returned(uint64_t batch, const uint64_t *keys, size_t n, int spent)
{
    uint64_t until = now_ns() + hold_ns();
    size_t left = 0;
    lock();
    for (size_t i = 0; i < n_pool; i++) {
        struct kept *e = &pool[i];
        if (e->state != LENT || e->batch != batch) continue;
        int named = !n;
        for (size_t j = 0; j < n && !named; j++) named = keys[j] == e->key;
        if (!named) {
            left++;
            continue;
        }
        e->state = IDLE;
        e->borrower = 0;
        e->idle_until_ns = spent ? 0 : until;
        if (spent) e->spent = 1, e->owner = NULL;
    }
    unlock();
    return left;
}

size_t tms_job_pool_release(int device, size_t bytes)
{
    const struct tms_driver *drv;
    if (!tms_job_pool_any() || tms_driver_get(&drv, NULL)) return 0;
    tms_phys drop[64];
    size_t n_drop = 0, freed = 0;
    lock();
    for (size_t i = 0; i < n_pool && freed < bytes && n_drop < sizeof drop / sizeof *drop;) {
        if (pool[i].device != device || pool[i].state != IDLE) {
            i++;
            continue;
        }
        freed += pool[i].size;
        drop[n_drop++] = pool[i].handle;
        remove_at_locked(i);
    }
    unlock();
    release_kept(drv, drop, n_drop);
    if (freed) TMS_DEBUG("released %zu bytes kept for the job on device %d: memory ran out", freed, device);
    return freed;
}

int tms_job_expire(void)
{
    if (!tms_job_pool_any()) return -1;
    const struct tms_driver *drv;
    if (tms_driver_get(&drv, NULL)) return -1;
    uint64_t now = now_ns(), next = UINT64_MAX;
    tms_phys drop[64];
    size_t n_drop = 0;
    lock();
    for (size_t i = 0; i < n_pool;) {
        struct kept *e = &pool[i];
        if (e->state == IDLE && e->idle_until_ns <= now && n_drop < sizeof drop / sizeof *drop) {
            drop[n_drop++] = e->handle;
            remove_at_locked(i);
            continue;
        }
        if (e->state == IDLE && e->idle_until_ns < next) next = e->idle_until_ns;
        i++;
    }
    unlock();
    release_kept(drv, drop, n_drop);
    if (n_drop == sizeof drop / sizeof *drop) return 0;  /* more are due: at once */
    if (next == UINT64_MAX) return -1;
    uint64_t ms = next > now ? (next - now + 999999) / 1000000 : 0;
    return ms > 60000 ? 60000 : (int)ms;
}

void tms_job_memory(int device, size_t *kept, size_t *lent, size_t *borrowed_out)
{
    size_t idle = 0, out = 0;
    lock();
    for (size_t i = 0; i < n_pool; i++) {
        if (pool[i].device != device) continue;
        if (pool[i].state == IDLE) idle += pool[i].size;
        else out += pool[i].size;
    }
    unlock();
    *kept = idle;
    *lent = out;
    *borrowed_out = __atomic_load_n(&borrowed[slot(device)], __ATOMIC_RELAXED);
}
