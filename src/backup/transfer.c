/* Backup copies at link speed: a pool of worker threads moving blocks through pinned staging. */
#include "backup/transfer.h"

#include "platform/config.h"
#include "platform/topology.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

/*
 * Why this shape (issue 4, figures from DESIGN on the lent H100):
 *  - a DMA into pageable memory runs 8-15 GB/s, into pinned memory ~55 GB/s,
 *    but pinning fresh memory costs ~3 s per 8 GiB; so copies go through a
 *    small pinned staging area reused across cycles;
 *  - one thread fills fresh pages at ~2 GB/s, 8-16 threads at ~40 GB/s, so
 *    the host side of the copy is spread over worker threads;
 *  - each worker owns two staging slots and two streams: while one slot's
 *    DMA runs, it copies the other slot on the host side;
 *  - block size was measured on the lent H100 (8 GiB, 16 workers): device->
 *    host ran 36-38 GB/s with 2 MiB blocks against 28-32 with 4-16 MiB
 *    (small blocks are still in the CPU cache when copied out of staging);
 *    host->device, 16 GiB: 47-49 GB/s with 4 MiB, 43-47 with 8, 44 with 2
 *    (a resume's workers spend 81-93% of their time copying into the
 *    staging; benchmarks/results/20261125-023015_*-resume-block.md).
 *    TMS_BACKUP_BLOCK_BYTES sets one size for both.
 *  - a slot stays 8 MiB (unless TMS_BACKUP_BLOCK_BYTES sets one size for
 *    all): a disk backup's file I/O goes through it, in blocks up to its size.
 *  - a pinned backup is locked as it is copied, a whole piece per block: the
 *    piece is registered as one range, so that it can be unregistered as one.
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
static pthread_mutex_t run_lock = PTHREAD_MUTEX_INITIALIZER;   /* one job at a time */
static struct worker *workers;
static int worker_count;
static size_t slot_bytes;  /* fixed while the pool lives */
static unsigned long job_seq;
static struct job *current_job;
static int workers_busy;
/* Progress of the job running now, readable without locks (progress lines
 * for long pauses, issue 7): bytes done and bytes in the job. */
static size_t progress_done;   /* atomic */
static size_t progress_total;  /* atomic */

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
    tms_fail(&e, j->drv->is_oom(rc) ? TMS_E_OOM : TMS_E_DRIVER, rc,
             "%s of %zu bytes %s device %d at 0x%llx (allocation offset %zu of %zu) failed: %s (%d)", what, b->len,
             j->to_host ? "from" : "to", it->device, (unsigned long long)(it->dev + b->offset), b->offset, it->n,
             j->drv->code_name(rc), rc);
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

/* Does the DMA of it go straight to its host memory, without staging? */
static int direct(int to_host, const struct tms_transfer *it)
{
    return it->host_pinned || (to_host && it->lock_pieces);
}

static ssize_t claim(struct job *j)
{
    if (__atomic_load_n(&j->failed, __ATOMIC_ACQUIRE)) return -1;
    size_t b = __atomic_fetch_add(&j->next_block, 1, __ATOMIC_RELAXED);
    return b < j->n_blocks ? (ssize_t)b : -1;
}

/* Moves a block out of the staging into a backup's fresh pages with
 * streaming stores: a plain store reads each destination line before
 * writing it, and the kernel has just zeroed these lines out of the cache,
 * so that read is one more pass over memory per byte backed up. */
static void copy_out_of_staging(void *dst, const void *src, size_t n)
{
#if defined(__x86_64__)
    char *d = dst;
    const char *s = src;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + 48));
        _mm_stream_si128((__m128i *)(void *)d, a);
        _mm_stream_si128((__m128i *)(void *)(d + 16), b);
        _mm_stream_si128((__m128i *)(void *)(d + 32), c);
        _mm_stream_si128((__m128i *)(void *)(d + 48), e);
    }
    memcpy(d, s, n);
    _mm_sfence();  /* streaming stores are weakly ordered: visible before the block counts as done */
#else
    memcpy(dst, src, n);
#endif
}

/* Counts len more bytes of it as copied. */
static void credit(struct job *j, struct tms_transfer *it, size_t len)
{
    /* acq_rel: the worker completing the item comes after every other block's DMA. */
    size_t done = __atomic_add_fetch(&it->done, len, __ATOMIC_ACQ_REL);
    __atomic_add_fetch(&progress_done, len, __ATOMIC_RELAXED);
    if (!j->to_host && done == it->n && it->restored) it->restored(it->restored_arg);
}

/* Waits for the copy of block b in slot to land, then (device->host) moves
 * it out of staging and credits its bytes. */
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
    if (j->to_host && it->file) {
        struct tms_err e;
        if (tms_disk_write(it->file, w->slot[slot], blk->len, blk->offset, &e)) {
            job_fail(j, &e);
            return;
        }
    } else if (j->to_host && !direct(1, it)) {
        copy_out_of_staging((char *)it->host + blk->offset, w->slot[slot], blk->len);
    }
    credit(j, it, blk->len);
}

/* Copies block blk, a piece of a pinned backup the driver would not lock,
 * through the staging slot, a slot's size at a time: a DMA into pageable
 * memory runs 8-15 GB/s. The slot must be free. */
static void copy_unlocked_piece(struct worker *w, struct job *j, const struct block *blk, int slot, tms_stream s)
{
    struct tms_transfer *it = &j->items[blk->item];
    for (size_t off = 0; off < blk->len; off += slot_bytes) {
        size_t n = blk->len - off < slot_bytes ? blk->len - off : slot_bytes;
        int rc = j->drv->copy_async(it->device, 1, w->slot[slot], it->dev + blk->offset + off, n, s);
        if (!rc) rc = j->drv->stream_wait(it->device, s);
        if (rc) {
            fail_driver(j, "backup copy", blk, rc);
            return;
        }
        copy_out_of_staging((char *)it->host + blk->offset + off, w->slot[slot], n);
    }
    credit(j, it, blk->len);
}

/* Page-locks the piece that is block blk of a pinned backup, faulting its
 * fresh pages in first: registering unfaulted memory faults it in on one
 * thread inside the driver (5 GB/s, 16 workers, lent H100), and touching
 * each page beat MADV_POPULATE_WRITE (29.7-30.6 vs 25.5-27.5 GB/s for the
 * whole pause). 1 if locked; 0 if the driver cannot lock host memory (the
 * piece stays pageable); -1, the job failed, for lack of memory. */
static int lock_piece(struct job *j, const struct block *blk)
{
    struct tms_transfer *it = &j->items[blk->item];
    volatile char *p = (char *)it->host + blk->offset;
    for (size_t off = 0; off < blk->len; off += 4096) p[off] = 0;
    int rc = j->drv->host_register((char *)it->host + blk->offset, blk->len);
    if (rc == 0) {
        it->lock_pieces[blk->offset / TMS_PIN_PIECE_BYTES] = 1;
        return 1;
    }
    if (j->drv->is_oom(rc)) {
        struct tms_err e;
        tms_fail(&e, TMS_E_HOST_OOM, rc,
                 "cannot pin %zu bytes of host memory for a pinned backup of %zu bytes (device %d at 0x%llx, offset %zu): "
                 "%s (%d)", blk->len, it->n, it->device, (unsigned long long)(it->dev + blk->offset), blk->offset,
                 j->drv->code_name(rc), rc);
        job_fail(j, &e);
        return -1;
    }
    return 0;
}

static void worker_run(struct worker *w, struct job *j)
{
    ssize_t in_slot[2] = {-1, -1};  /* block whose copy occupies each slot */
    int cur = 0;
    for (ssize_t b; (b = claim(j)) >= 0; cur ^= 1) {
        const struct block *blk = &j->blocks[b];
        struct tms_transfer *it = &j->items[blk->item];
        /* Host->device reuses the slot only once its previous DMA is done. */
        if (!j->to_host) finish(w, j, in_slot[cur], cur), in_slot[cur] = -1;
        tms_stream *s = stream_for(w, j, blk, cur);
        if (!s) break;
        if (j->to_host && it->lock_pieces) {
            int locked = lock_piece(j, blk);
            if (locked < 0) break;
            if (!locked) {
                /* Device->host leaves slot cur free here; it stays free for
                 * the next block, which the loop's toggle undone gives it. */
                copy_unlocked_piece(w, j, blk, cur, *s);
                cur ^= 1;
                continue;
            }
        }
        void *staging = direct(j->to_host, it) ? (char *)it->host + blk->offset : w->slot[cur];
        if (!j->to_host && it->file) {
            struct tms_err e;
            if (tms_disk_read(it->file, staging, blk->len, blk->offset, &e)) {
                job_fail(j, &e);
                break;
            }
        } else if (!j->to_host && !direct(0, it)) {
            memcpy(staging, (char *)it->host + blk->offset, blk->len);
        }
        int rc = j->drv->copy_async(it->device, j->to_host, staging, it->dev + blk->offset, blk->len, *s);
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
 * one per core of the host competing with the other ranks' (issue 16). A
 * process free to run anywhere on a host of several GPUs takes the share of
 * the GPUs it sees. */
int tms_transfer_default_workers(int allowed_cpus, int online_cpus, int host_gpus, int visible_gpus)
{
    int cpus = allowed_cpus;
    if (visible_gpus < 1) visible_gpus = 1;
    if (allowed_cpus >= online_cpus && host_gpus > visible_gpus)
        cpus = (int)((long long)online_cpus * visible_gpus / host_gpus);
    return cpus < 2 ? 2 : cpus > DEFAULT_MAX_WORKERS ? DEFAULT_MAX_WORKERS : cpus;
}

static int wanted_workers(const struct tms_driver *drv)
{
    int n = tms_defaults()->backup_threads;
    if (n > 0) return n;
    long online = sysconf(_SC_NPROCESSORS_ONLN);
    int visible = 1;
    if (drv->device_count(&visible) != 0) visible = 1;
    return tms_transfer_default_workers(tms_transfer_allowed_cpus(), online > 0 ? (int)online : 1,
                                        tms_topology_host_gpus(TMS_SYSFS), visible);
}

static void pool_discard_locked(const struct tms_driver *drv)
{
    for (int i = 0; i < worker_count; i++)
        for (int s = 0; s < 2; s++)
            if (workers[i].slot[s]) (void)drv->host_free_pinned(workers[i].slot[s], slot_bytes);
    free(workers);
    workers = NULL;
    worker_count = 0;
}

/* In a forked child the workers are gone and the locks may be held or
 * waited on by threads that no longer exist: start from nothing (the
 * parent's staging stays mapped in the child, unused). */
static void pool_forget_in_child(void)
{
    pthread_mutex_init(&pool_lock, NULL);
    pthread_mutex_init(&run_lock, NULL);
    pthread_cond_init(&job_posted, NULL);
    pthread_cond_init(&job_finished, NULL);
    workers = NULL;
    worker_count = 0;
    current_job = NULL;
    workers_busy = 0;
}

static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void) { (void)pthread_atfork(NULL, NULL, pool_forget_in_child); }

static int pool_start(const struct tms_driver *drv, struct tms_err *err)
{
    pthread_once(&atfork_once, register_atfork);
    pthread_mutex_lock(&pool_lock);
    if (workers) {
        pthread_mutex_unlock(&pool_lock);
        return TMS_OK;
    }
    int n = wanted_workers(drv), rc = TMS_OK;
    size_t fixed = tms_defaults()->backup_block_bytes;
    slot_bytes = fixed ? fixed : SLOT_BYTES;
    workers = calloc((size_t)n, sizeof *workers);
    if (!workers) rc = tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory for %d copy workers", n);
    for (int i = 0; !rc && i < n; i++) {
        for (int s = 0; !rc && s < 2; s++) {
            int drc = drv->host_alloc_pinned(slot_bytes, &workers[i].slot[s]);
            if (drc) {
                workers[i].slot[s] = NULL;
                rc = tms_fail(err, TMS_E_HOST_OOM, drc, "cannot pin %zu bytes of staging for copy worker %d: %s (%d)",
                              slot_bytes, i, drv->code_name(drc), drc);
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
                if (workers[i].slot[s]) (void)drv->host_free_pinned(workers[i].slot[s], slot_bytes);
        worker_count = started;
    }
    if (worker_count > 0) rc = TMS_OK;
    pthread_mutex_unlock(&pool_lock);
    return rc;
}

int tms_transfer_warm(const struct tms_driver *drv, struct tms_err *err) { return pool_start(drv, err); }

/* Block sizes of one job: staged, straight to page-locked memory, and of a file. */
struct block_sizes {
    size_t staged, direct, file;
};

/* The block of it at off: its size, to the item's end, or for memory copied
 * straight (which is registered in pieces) to the end of its piece,
 * whichever is shortest: a DMA range within one registration. A backup
 * locked as it is copied takes a whole piece per block. */
static size_t block_len(int to_host, const struct tms_transfer *it, size_t off, const struct block_sizes *bs)
{
    size_t size = !direct(to_host, it) ? bs->staged : it->host_pinned ? bs->direct : TMS_PIN_PIECE_BYTES;
    size_t len = it->n - off < size ? it->n - off : size;
    size_t to_piece_end = TMS_PIN_PIECE_BYTES - off % TMS_PIN_PIECE_BYTES;
    return direct(to_host, it) && len > to_piece_end ? to_piece_end : len;
}

static int run_job(const struct tms_driver *drv, int to_host, struct tms_transfer *items, size_t count,
                   struct tms_err *err)
{
    size_t total = 0, n_blocks = 0;
    for (size_t i = 0; i < count; i++) {
        items[i].done = 0;
        total += items[i].n;
    }
    if (total == 0) return TMS_OK;
    int rc = pool_start(drv, err);  /* sets slot_bytes */
    if (rc) return rc;
    size_t fixed = tms_defaults()->backup_block_bytes;  /* a set size is the slots' size too */
    struct block_sizes bs = {
        .staged = fixed ? fixed : to_host ? TO_HOST_BLOCK_BYTES : TO_DEVICE_BLOCK_BYTES,
        .direct = fixed ? fixed : TMS_DIRECT_BLOCK_BYTES,
        .file = tms_defaults()->disk_block_bytes < slot_bytes ? tms_defaults()->disk_block_bytes : slot_bytes,
    };
    for (size_t i = 0; i < count; i++) {
        if (items[i].file) {
            n_blocks += (items[i].n + bs.file - 1) / bs.file;
            continue;
        }
        for (size_t off = 0; off < items[i].n; off += block_len(to_host, &items[i], off, &bs)) n_blocks++;
    }
    struct block *blocks = malloc(n_blocks * sizeof *blocks);
    size_t *files = malloc((count ? count : 1) * sizeof *files);
    if (!blocks || !files) {
        free(blocks);
        free(files);
        return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning %zu copy blocks", n_blocks);
    }
    size_t k = 0, n_files = 0;
    for (size_t i = 0; i < count; i++) {
        if (items[i].file) {
            files[n_files++] = i;
            continue;
        }
        for (size_t off = 0, len; off < items[i].n; off += len)
            blocks[k++] = (struct block){i, off, len = block_len(to_host, &items[i], off, &bs)};
    }
    /* Files take turns, so the workers keep I/O in flight on several files
     * (and their extents) at once rather than all on the first one. */
    for (size_t off = 0; n_files > 0; off += bs.file) {
        size_t left = 0;
        for (size_t f = 0; f < n_files; f++) {
            size_t i = files[f];
            if (off >= items[i].n) continue;
            blocks[k++] = (struct block){i, off, items[i].n - off < bs.file ? items[i].n - off : bs.file};
            files[left++] = i;
        }
        n_files = left;
    }
    free(files);

    __atomic_store_n(&progress_done, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&progress_total, total, __ATOMIC_RELAXED);
    struct job j = {.drv = drv, .to_host = to_host, .items = items, .blocks = blocks, .n_blocks = n_blocks};
    pthread_mutex_init(&j.err_lock, NULL);
    pthread_mutex_lock(&run_lock);
    pthread_mutex_lock(&pool_lock);
    current_job = &j;
    workers_busy = worker_count;
    job_seq++;
    pthread_cond_broadcast(&job_posted);
    while (workers_busy > 0) pthread_cond_wait(&job_finished, &pool_lock);
    current_job = NULL;
    pthread_mutex_unlock(&pool_lock);
    pthread_mutex_unlock(&run_lock);
    pthread_mutex_destroy(&j.err_lock);
    free(blocks);
    if (j.failed) {
        if (err) *err = j.err;
        return j.err.status;
    }
    return TMS_OK;
}

static int runs_in_progress;  /* atomic */

int tms_transfer_run(const struct tms_driver *drv, int to_host, struct tms_transfer *items, size_t count,
                     struct tms_err *err)
{
    __atomic_add_fetch(&runs_in_progress, 1, __ATOMIC_RELAXED);
    int rc = run_job(drv, to_host, items, count, err);
    __atomic_sub_fetch(&runs_in_progress, 1, __ATOMIC_RELAXED);
    return rc;
}

int tms_transfer_idle(void) { return __atomic_load_n(&runs_in_progress, __ATOMIC_RELAXED) == 0; }

void tms_transfer_progress(size_t *done, size_t *total)
{
    *done = __atomic_load_n(&progress_done, __ATOMIC_RELAXED);
    *total = __atomic_load_n(&progress_total, __ATOMIC_RELAXED);
}
