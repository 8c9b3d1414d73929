/* Backup copies at link speed: a pool of worker threads moving blocks through pinned staging. */
#include "backup/transfer.h"

#include "platform/config.h"
#include "platform/fork.h"
#include "platform/log.h"
#include "platform/topology.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/*
 * Why this shape (docs/performance.md has the measurements):
 *  - a DMA into pageable memory is several times slower than into pinned
 *    memory, but pinning fresh memory is slow too; so copies go through a
 *    small pinned staging area reused across cycles, unless the backup is
 *    page-locked already (it says so: its path);
 *  - one thread fills fresh pages far below the link's rate, so the host
 *    side of the copy is spread over worker threads;
 *  - each worker owns two staging slots and two streams: while one slot's
 *    DMA runs, it copies the other slot on the host side;
 *  - device->host blocks are small enough to still be in the CPU cache when
 *    copied out of the staging; host->device blocks trade that against the
 *    number of waits. TMS_BACKUP_BLOCK_BYTES sets one size for both;
 *  - a slot stays larger than either block (unless TMS_BACKUP_BLOCK_BYTES
 *    sets one size for all): a backup's staged blocks may be up to its size.
 * The workers know nothing of how a backup keeps its bytes: the backup's kind
 * (backup.h) says how each block moves and does the host side of it.
 */
#define TO_HOST_BLOCK_BYTES ((size_t)2 << 20)
#define TO_DEVICE_BLOCK_BYTES ((size_t)4 << 20)
#define SLOT_BYTES ((size_t)8 << 20)
_Static_assert(SLOT_BYTES >= TO_HOST_BLOCK_BYTES && SLOT_BYTES >= TO_DEVICE_BLOCK_BYTES, "a block fits a slot");
#define DEFAULT_MAX_WORKERS 16
#define MAX_DEVICES 64

struct block {
    size_t item;
    size_t offset;
    size_t len;
};

struct job {
    const struct tms_driver *drv;
    int to_host;
    struct tms_transfer *items;
    const struct block *blocks;
    size_t n_blocks;
    size_t next_block;   /* atomic: next block to claim */
    int failed;          /* atomic */
    pthread_mutex_t err_lock;
    struct tms_err err;  /* first error, under err_lock */
    size_t *backed_up;   /* items whose backed_up is due, in completion order (pool_lock) */
    size_t n_backed_up;  /* guarded by pool_lock */
    /* Items with a prepare hook become ready one by one: */
    size_t ready;        /* atomic, set under pool_lock: items [0, ready) may be copied */
    size_t limit;        /* guarded by pool_lock: items from here on are never copied */
};

struct worker {
    pthread_t thread;
    unsigned long start_seq;              /* job_seq when created: jobs after it are ours */
    void *slot[2];                        /* pinned staging, slot_bytes each */
    tms_stream stream[MAX_DEVICES][2];    /* created on first use of a device */
};

/* The pool: created once per process (again in a forked child). */
static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;  /* guards all below */
static pthread_cond_t job_posted = PTHREAD_COND_INITIALIZER;
static pthread_cond_t job_finished = PTHREAD_COND_INITIALIZER;
static pthread_cond_t item_ready = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER;   /* one job at a time */
static struct worker *workers;
static int worker_count;
static size_t slot_bytes;  /* fixed while the pool lives */
static int slot_device;    /* the device the staging was pinned in the context of (portable memory) */
/* A warm-up that failed on its own thread: the next copy reports it (once)
 * instead of trying again, as a region's warm-up in the caller's thread used
 * to raise it; later copies try again. A warm-up runs only if no copy has
 * tried to start the pool before it (guarded by pool_lock). */
static int pool_attempted;
static int warm_failed;
static struct tms_err warm_err;
static int warm_cancel;  /* atomic: set at exit, the warm-up pins nothing more */
static unsigned long job_seq;
static struct job *current_job;
static int workers_busy;
/* Progress of the job running now, readable without locks (progress lines
 * for long pauses): bytes done and bytes in the job. */
static size_t progress_done;   /* atomic */
static size_t progress_total;  /* atomic */

/* Copies in progress, for the page-locking of retained backups, which
 * waits for none to run (retained.c). */
static pthread_mutex_t idle_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t idle_cond = PTHREAD_COND_INITIALIZER;
static int runs_in_progress;  /* guarded by idle_lock */

static void job_fail(struct job *j, struct tms_err *e)
{
    pthread_mutex_lock(&j->err_lock);
    if (!j->failed) j->err = *e;
    __atomic_store_n(&j->failed, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&j->err_lock);
}

static int fail_driver(struct job *j, const char *what, const struct block *b, int rc)
{
    const struct tms_transfer *it = &j->items[b->item];
    struct tms_err e;
    tms_driver_fail(&e, tms_driver_status(j->drv, rc), j->drv, rc,
                    "%s of %zu bytes %s device %d at 0x%llx (allocation offset %zu, %s backup of %zu bytes) failed", what,
                    b->len, j->to_host ? "from" : "to", it->device,
                    (unsigned long long)(it->dev + it->offset + b->offset), it->offset + b->offset,
                    tms_backup_kind_name(it->backup->kind), it->backup->size);
    job_fail(j, &e);
    return rc;
}

static tms_stream *stream_for(struct worker *w, struct job *j, const struct block *b, int slot)
{
    int device = j->items[b->item].device;
    if (device < 0 || device >= MAX_DEVICES) {
        struct tms_err e;
        tms_fail(&e, TMS_E_ARG, 0, "device %d is beyond the %d devices backups support", device, MAX_DEVICES);
        job_fail(j, &e);
        return NULL;
    }
    tms_stream *s = &w->stream[device][slot];
    if (!*s) {
        int rc = j->drv->stream_create(device, s);
        if (rc) {
            *s = NULL;
            fail_driver(j, "stream create for copy", b, rc);
            return NULL;
        }
    }
    return s;
}

/* Does the DMA of it go straight to its backup's memory, without staging? */
static int direct(const struct tms_transfer *it) { return it->path != TMS_PATH_STAGED; }

/* Waits until item may be copied (1) or never will be (0). */
static int wait_ready(struct job *j, size_t item)
{
    if (item < __atomic_load_n(&j->ready, __ATOMIC_ACQUIRE)) return 1;
    pthread_mutex_lock(&pool_lock);
    while (item >= j->ready && item < j->limit) pthread_cond_wait(&item_ready, &pool_lock);
    int ready = item < j->ready;
    pthread_mutex_unlock(&pool_lock);
    return ready;
}

/* The next block to copy; blocks of items that will never be ready are passed over. */
static ssize_t claim(struct job *j)
{
    for (;;) {
        if (__atomic_load_n(&j->failed, __ATOMIC_ACQUIRE)) return -1;
        size_t b = __atomic_fetch_add(&j->next_block, 1, __ATOMIC_RELAXED);
        if (b >= j->n_blocks) return -1;
        if (wait_ready(j, j->blocks[b].item)) return (ssize_t)b;
    }
}

/* Counts len more bytes of it as copied. */
static void credit(struct job *j, struct tms_transfer *it, size_t len)
{
    /* acq_rel: the worker completing the item comes after every other block's DMA. */
    size_t done = __atomic_add_fetch(&it->done, len, __ATOMIC_ACQ_REL);
    __atomic_add_fetch(&progress_done, len, __ATOMIC_RELAXED);
    if (!j->to_host && done == it->n && it->restored) it->restored(it->restored_arg);
    if (j->to_host && done == it->n && it->backed_up) {
        pthread_mutex_lock(&pool_lock);  /* the thread running the job calls it */
        j->backed_up[j->n_backed_up++] = (size_t)(it - j->items);
        pthread_cond_broadcast(&job_finished);
        pthread_mutex_unlock(&pool_lock);
    }
}

/* Waits for the copy of block b in slot to land, then (device->host) moves
 * it out of staging into the backup and credits its bytes. */
static void finish(struct worker *w, struct job *j, ssize_t b, int slot)
{
    if (b < 0) return;
    const struct block *blk = &j->blocks[b];
    struct tms_transfer *it = &j->items[blk->item];
    int rc = j->drv->stream_wait(it->device, w->stream[it->device][slot]);
    if (rc) {
        fail_driver(j, j->to_host ? "backup copy" : "restore copy", blk, rc);
        return;
    }
    if (j->to_host && !direct(it)) {
        struct tms_err e;
        if (tms_backup_write_block(it->backup, w->slot[slot], blk->len, it->offset + blk->offset, &e)) {
            job_fail(j, &e);
            return;
        }
    }
    credit(j, it, blk->len);
}

/* Copies block blk device->host through the staging slot, a slot's size at
 * a time: a prepared block (a whole piece) the backup could not take
 * directly. The slot must be free. */
static void copy_staged_now(struct worker *w, struct job *j, const struct block *blk, int slot, tms_stream s)
{
    struct tms_transfer *it = &j->items[blk->item];
    for (size_t off = 0; off < blk->len; off += slot_bytes) {
        size_t n = blk->len - off < slot_bytes ? blk->len - off : slot_bytes;
        int rc = j->drv->copy_async(it->device, 1, w->slot[slot], it->dev + it->offset + blk->offset + off, n, s);
        if (!rc) rc = j->drv->stream_wait(it->device, s);
        if (rc) {
            fail_driver(j, "backup copy", blk, rc);
            return;
        }
        struct tms_err e;
        if (tms_backup_write_block(it->backup, w->slot[slot], n, it->offset + blk->offset + off, &e)) {
            job_fail(j, &e);
            return;
        }
    }
    credit(j, it, blk->len);
}

static void worker_run(struct worker *w, struct job *j)
{
    ssize_t in_slot[2] = {-1, -1};  /* block whose copy occupies each slot */
    int cur = 0;
    for (ssize_t b; (b = claim(j)) >= 0; cur ^= 1) {
        const struct block *blk = &j->blocks[b];
        struct tms_transfer *it = &j->items[blk->item];
        struct tms_backup *bk = it->backup;
        size_t at = it->offset + blk->offset;
        /* Host->device reuses the slot only once its previous DMA is done. */
        if (!j->to_host) finish(w, j, in_slot[cur], cur), in_slot[cur] = -1;
        tms_stream *s = stream_for(w, j, blk, cur);
        if (!s) break;
        if (it->path == TMS_PATH_PREPARED) {
            struct tms_err e;
            int ready = tms_backup_prepare_block(bk, at, blk->len, &e);
            if (ready < 0) {
                job_fail(j, &e);
                break;
            }
            if (!ready) {
                /* Device->host leaves slot cur free here; it stays free for
                 * the next block, which the loop's toggle undone gives it. */
                copy_staged_now(w, j, blk, cur, *s);
                cur ^= 1;
                continue;
            }
        }
        void *host = direct(it) ? tms_backup_direct_at(bk, at) : w->slot[cur];
        if (!j->to_host && !direct(it)) {
            struct tms_err e;
            if (tms_backup_read_block(bk, host, blk->len, at, &e)) {
                job_fail(j, &e);
                break;
            }
        }
        int rc = j->drv->copy_async(it->device, j->to_host, host, it->dev + at, blk->len, *s);
        if (rc) {
            fail_driver(j, j->to_host ? "backup copy" : "restore copy", blk, rc);
            break;
        }
        in_slot[cur] = b;
        /* Device->host: drain the other slot while this DMA runs. */
        if (j->to_host) finish(w, j, in_slot[cur ^ 1], cur ^ 1), in_slot[cur ^ 1] = -1;
    }
    /* Nothing may stay in flight: the caller frees or unmaps after return. */
    finish(w, j, in_slot[0], 0);
    finish(w, j, in_slot[1], 1);
}

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);  /* signals belong to the application's threads */
    pthread_mutex_lock(&pool_lock);
    unsigned long seen = w->start_seq;
    for (;;) {
        while (job_seq == seen) pthread_cond_wait(&job_posted, &pool_lock);
        seen = job_seq;
        struct job *j = current_job;
        pthread_mutex_unlock(&pool_lock);
        worker_run(w, j);
        pthread_mutex_lock(&pool_lock);
        if (--workers_busy == 0) pthread_cond_broadcast(&job_finished);
    }
    return NULL;
}

int tms_transfer_allowed_cpus(void)
{
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    return cpus > 0 ? (int)cpus : 1;
}

/* One per core the process may run on: a launcher that pins each rank to
 * its share of the host's cores (one process per GPU) gets that many, not
 * one per core of the host competing with the other ranks'. A process free
 * to run anywhere on a host of several GPUs takes the share of the GPUs it
 * uses: every rank usually sees every GPU, and eight ranks each taking the
 * cores of all eight would ask for eight times the host's cores at once. */
int tms_transfer_default_workers(int allowed_cpus, int online_cpus, int host_gpus, int used_gpus)
{
    int cpus = allowed_cpus;
    if (used_gpus < 1) used_gpus = 1;
    if (allowed_cpus >= online_cpus && host_gpus > used_gpus)
        cpus = (int)((long long)online_cpus * used_gpus / host_gpus);
    return cpus < 2 ? 2 : cpus > DEFAULT_MAX_WORKERS ? DEFAULT_MAX_WORKERS : cpus;
}

/* Devices with a context of this process now (the pool starts at the first
 * backup or warm-up, when the device the process works on has one). */
static int used_devices(const struct tms_driver *drv)
{
    int count = 0, used = 0;
    if (drv->device_count(&count) != 0) return 1;
    for (int d = 0; d < count; d++) {
        int active = 0;
        if (drv->device_active(d, &active) == 0 && active) used++;
    }
    return used;
}

static int wanted_workers(const struct tms_driver *drv)
{
    int n = tms_defaults()->backup_threads;
    if (n > 0) return n;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    return tms_transfer_default_workers(tms_transfer_allowed_cpus(), online > 0 ? (int)online : 1,
                                        tms_topology_host_gpus(TMS_SYSFS), used_devices(drv));
}

static void pool_discard_locked(const struct tms_driver *drv)
{
    for (int i = 0; i < worker_count; i++)
        for (int s = 0; s < 2; s++)
            if (workers[i].slot[s]) (void)drv->host_free_pinned(slot_device, workers[i].slot[s], slot_bytes);
    free(workers);
    workers = NULL;
    worker_count = 0;
}

/* In a forked child the workers are gone and the locks may be held or
 * waited on by threads that no longer exist: start from nothing (the
 * parent's staging stays mapped in the child, unused). */
static void warm_forget_in_child(void);

static void pool_forget_in_child(void)
{
    warm_forget_in_child();
    pool_attempted = 0;
    warm_failed = 0;
    pthread_mutex_init(&idle_lock, NULL);
    pthread_cond_init(&idle_cond, NULL);
    runs_in_progress = 0;
    pthread_mutex_init(&pool_lock, NULL);
    pthread_mutex_init(&run_lock, NULL);
    pthread_cond_init(&job_posted, NULL);
    pthread_cond_init(&job_finished, NULL);
    pthread_cond_init(&item_ready, NULL);
    workers = NULL;
    worker_count = 0;
    current_job = NULL;
    workers_busy = 0;
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void)
{
    static const struct tms_fork_handlers handlers = {.child = pool_forget_in_child};
    tms_fork_register(TMS_FORK_TRANSFER, &handlers);
}

/* device: one the process uses (the first copy's, or the caller's at warm-up);
 * the staging is pinned in its context and serves every device. */
static int pool_start(const struct tms_driver *drv, int device, int warming, struct tms_err *err)
{
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&pool_lock);
    if (workers) {
        pthread_mutex_unlock(&pool_lock);
        return TMS_OK;
    }
    if (warming && pool_attempted) {  /* a copy came first: it started the pool or reported why not */
        pthread_mutex_unlock(&pool_lock);
        return TMS_OK;
    }
    pool_attempted = 1;
    if (warm_failed && !warming) {
        warm_failed = 0;
        if (err) *err = warm_err;
        pthread_mutex_unlock(&pool_lock);
        return warm_err.status;
    }
    int n = wanted_workers(drv), rc = TMS_OK, cancelled = 0;
    size_t fixed = tms_defaults()->backup_block_bytes;
    slot_bytes = fixed ? fixed : SLOT_BYTES;
    slot_device = device;
    workers = calloc((size_t)n, sizeof *workers);
    if (!workers) rc = tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory for %d copy workers", n);
    for (int i = 0; !rc && i < n; i++) {
        if (warming && __atomic_load_n(&warm_cancel, __ATOMIC_ACQUIRE)) {
            cancelled = 1;
            rc = tms_fail(err, TMS_E_ARG, 0, "copy workers' warm-up cut short: the process is exiting");
            break;
        }
        for (int s = 0; !rc && s < 2; s++) {
            int drc = drv->host_alloc_pinned(device, slot_bytes, &workers[i].slot[s]);
            if (drc) {
                workers[i].slot[s] = NULL;
                rc = tms_driver_fail(err, TMS_E_HOST_OOM, drv, drc, "cannot pin %zu bytes of staging for copy worker %d",
                                     slot_bytes, i);
            }
        }
        worker_count = i + 1;
    }
    int started = 0;
    for (int i = 0; !rc && i < n; i++) {
        workers[i].start_seq = job_seq;
        int prc = pthread_create(&workers[i].thread, NULL, worker_main, &workers[i]);
        if (prc) rc = tms_fail(err, TMS_E_HOST_OOM, prc, "cannot start copy worker %d: error %d", i, prc);
        else started++;
    }
    if (rc && started == 0) {
        pool_discard_locked(drv);
    } else if (rc) {  /* run with the workers that did start; give back the others' staging */
        for (int i = started; i < worker_count; i++)
            for (int s = 0; s < 2; s++)
                if (workers[i].slot[s]) (void)drv->host_free_pinned(device, workers[i].slot[s], slot_bytes);
        worker_count = started;
    }
    if (worker_count > 0) rc = TMS_OK;
    if (rc && warming && !cancelled) {
        warm_failed = 1;
        tms_fail(&warm_err, err->status, err->driver_code, "copy workers' warm-up on device %d failed: %s", device,
                 err->msg);
    }
    pthread_mutex_unlock(&pool_lock);
    return rc;
}

/* ---- the warm-up, on a thread of its own ---------------------------------------- */

/* Pinning the staging takes long enough to matter to the caller's first
 * region, so it runs beside the caller; a copy that comes first takes the
 * pool's lock and starts the pool itself, or waits for the warm-up to end. */
static pthread_mutex_t warm_lock = PTHREAD_MUTEX_INITIALIZER;
static int warm_requested;       /* atomic; set under warm_lock */
static int warm_thread_started;  /* guarded by warm_lock */
static int warm_exit_hooked;     /* guarded by warm_lock */
static pthread_t warm_thread;
static const struct tms_driver *warm_drv;  /* set before the thread starts */
static int warm_device;

static void *warm_main(void *arg)
{
    (void)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    struct tms_err err = {0};
    if (pool_start(warm_drv, warm_device, 1, &err)) TMS_DEBUG("copy workers not warmed up: %s", err.msg);
    return NULL;
}

/* No thread of the library may be inside the driver while it is torn down. */
static void join_warm_at_exit(void)
{
    __atomic_store_n(&warm_cancel, 1, __ATOMIC_RELEASE);  /* waits only for the driver call in flight */
    pthread_mutex_lock(&warm_lock);
    int started = warm_thread_started;
    warm_thread_started = 0;
    pthread_mutex_unlock(&warm_lock);
    if (started) pthread_join(warm_thread, NULL);
}

static void warm_forget_in_child(void)
{
    pthread_mutex_init(&warm_lock, NULL);
    warm_requested = 0;
    warm_cancel = 0;
    warm_thread_started = 0;  /* the parent's thread is not the child's to join */
}

void tms_transfer_warm_later(const struct tms_driver *drv, int device)
{
    if (__atomic_load_n(&warm_requested, __ATOMIC_ACQUIRE)) return;
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&warm_lock);
    if (!warm_requested) {
        if (!warm_exit_hooked) warm_exit_hooked = atexit(join_warm_at_exit) == 0;
        warm_drv = drv;
        warm_device = device;
        warm_thread_started = pthread_create(&warm_thread, NULL, warm_main, NULL) == 0;
        __atomic_store_n(&warm_requested, 1, __ATOMIC_RELEASE);  /* without a thread the first copy starts the pool */
    }
    pthread_mutex_unlock(&warm_lock);
}

/* The block of item it at off (from the item's start), as its backup's kind cuts it. */
static size_t block_len(const struct tms_transfer *it, size_t off, const struct tms_block_sizes *sizes)
{
    return tms_backup_block_len(it->backup, it->path, it->offset + off, it->n - off, sizes);
}

/* Runs the items' prepare hooks in order in the caller's thread, each
 * run of items up to the next hook made ready at once, until one fails or a
 * copy does: the items from there on are never copied. */
static void prepare_items(struct job *j, size_t count)
{
    for (size_t i = 0; i < count;) {
        struct tms_transfer *it = &j->items[i];
        int stop = __atomic_load_n(&j->failed, __ATOMIC_ACQUIRE) || (it->prepare && it->prepare(it->prepare_arg));
        size_t next = i + 1;
        while (!stop && next < count && !j->items[next].prepare) next++;
        pthread_mutex_lock(&pool_lock);
        if (stop) j->limit = i;
        else __atomic_store_n(&j->ready, next, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&item_ready);
        pthread_mutex_unlock(&pool_lock);
        if (stop) return;
        i = next;
    }
}

static int run_job(const struct tms_driver *drv, int to_host, struct tms_transfer *items, size_t count,
                   struct tms_err *err)
{
    size_t total = 0, n_blocks = 0;
    int prepares = 0;
    for (size_t i = 0; i < count; i++) {
        items[i].done = 0;
        items[i].path = tms_backup_path(items[i].backup, to_host, items[i].offset, items[i].n);
        total += items[i].n;
        prepares |= items[i].prepare != NULL;
    }
    if (total == 0) {  /* nothing to copy: the hooks still run, in order */
        for (size_t i = 0; i < count; i++)
            if (items[i].prepare && items[i].prepare(items[i].prepare_arg)) break;
        return TMS_OK;
    }
    int rc = pool_start(drv, items[0].device, 0, err);  /* sets slot_bytes */
    if (rc) return rc;
    size_t fixed = tms_defaults()->backup_block_bytes;  /* a set size is the slots' size too */
    struct tms_block_sizes sizes = {
        .staged = fixed ? fixed : to_host ? TO_HOST_BLOCK_BYTES : TO_DEVICE_BLOCK_BYTES,
        .direct = fixed ? fixed : TMS_DIRECT_BLOCK_BYTES,
        .slot = slot_bytes,
    };
    for (size_t i = 0; i < count; i++)
        for (size_t off = 0; off < items[i].n; off += block_len(&items[i], off, &sizes)) n_blocks++;
    struct block *blocks = malloc(n_blocks * sizeof *blocks);
    size_t *turns = malloc((count ? count : 1) * sizeof *turns), *next = calloc(count ? count : 1, sizeof *next);
    if (!blocks || !turns || !next) {
        free(blocks);
        free(turns);
        free(next);
        return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning %zu copy blocks", n_blocks);
    }
    size_t k = 0, n_turns = 0;
    for (size_t i = 0; i < count; i++) {
        if (tms_backup_interleaves(items[i].backup)) {
            turns[n_turns++] = i;
            continue;
        }
        for (size_t off = 0, len; off < items[i].n; off += len)
            blocks[k++] = (struct block){i, off, len = block_len(&items[i], off, &sizes)};
    }
    /* Backups whose blocks are I/O take turns, a block each, so the workers
     * keep I/O in flight on several of them (files and their extents) at
     * once rather than all on the first one. */
    while (n_turns > 0) {
        size_t left = 0;
        for (size_t t = 0; t < n_turns; t++) {
            size_t i = turns[t], len = block_len(&items[i], next[i], &sizes);
            blocks[k++] = (struct block){i, next[i], len};
            if ((next[i] += len) < items[i].n) turns[left++] = i;
        }
        n_turns = left;
    }
    free(turns);
    free(next);

    __atomic_store_n(&progress_done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&progress_total, total, __ATOMIC_RELAXED);
    struct job j = {.drv = drv, .to_host = to_host, .items = items, .blocks = blocks, .n_blocks = n_blocks,
                    .ready = prepares ? 0 : count, .limit = count};
    int hooks = 0;
    for (size_t i = 0; i < count && to_host; i++) hooks |= items[i].backed_up != NULL;
    if (hooks && !(j.backed_up = malloc(count * sizeof *j.backed_up))) {
        free(blocks);
        return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning %zu copies", count);
    }
    pthread_mutex_init(&j.err_lock, NULL);
    pthread_mutex_lock(&run_lock);
    pthread_mutex_lock(&pool_lock);
    current_job = &j;
    workers_busy = worker_count;
    job_seq++;
    pthread_cond_broadcast(&job_posted);
    if (prepares) {
        pthread_mutex_unlock(&pool_lock);
        prepare_items(&j, count);
        pthread_mutex_lock(&pool_lock);
    }
    /* Items backed up are handed to their hook here, in the caller's thread,
     * while the workers go on with the rest. */
    for (size_t handed = 0; workers_busy > 0 || handed < j.n_backed_up;) {
        if (handed == j.n_backed_up) {
            pthread_cond_wait(&job_finished, &pool_lock);
            continue;
        }
        struct tms_transfer *it = &items[j.backed_up[handed++]];
        pthread_mutex_unlock(&pool_lock);
        it->backed_up(it->backed_up_arg);
        pthread_mutex_lock(&pool_lock);
    }
    current_job = NULL;
    pthread_mutex_unlock(&pool_lock);
    pthread_mutex_unlock(&run_lock);
    pthread_mutex_destroy(&j.err_lock);
    free(j.backed_up);
    free(blocks);
    if (j.failed) {
        if (err) *err = j.err;
        return j.err.status;
    }
    return TMS_OK;
}

int tms_transfer_run(const struct tms_driver *drv, int to_host, struct tms_transfer *items, size_t count,
                     struct tms_err *err)
{
    pthread_mutex_lock(&idle_lock);
    runs_in_progress++;
    pthread_mutex_unlock(&idle_lock);
    int rc = run_job(drv, to_host, items, count, err);
    pthread_mutex_lock(&idle_lock);
    if (--runs_in_progress == 0) pthread_cond_broadcast(&idle_cond);
    pthread_mutex_unlock(&idle_lock);
    return rc;
}

int tms_transfer_wait_idle(const int *stop)
{
    pthread_mutex_lock(&idle_lock);
    while (runs_in_progress && !__atomic_load_n(stop, __ATOMIC_ACQUIRE)) pthread_cond_wait(&idle_cond, &idle_lock);
    pthread_mutex_unlock(&idle_lock);
    return __atomic_load_n(stop, __ATOMIC_ACQUIRE);
}

void tms_transfer_wake_idle_waiters(void)
{
    pthread_mutex_lock(&idle_lock);
    pthread_cond_broadcast(&idle_cond);
    pthread_mutex_unlock(&idle_lock);
}

void tms_transfer_progress(size_t *done, size_t *total)
{
    *done = __atomic_load_n(&progress_done, __ATOMIC_RELAXED);
    *total = __atomic_load_n(&progress_total, __ATOMIC_RELAXED);
}
