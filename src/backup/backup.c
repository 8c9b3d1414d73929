/* Backups of paused allocations: host buffers and disk files, reference-counted. */
#include "backup/backup.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

#include "platform/config.h"
#include "platform/log.h"
#include "platform/topology.h"
#include "backup/transfer.h"

/* Fresh pages for a backup of device's memory, placed (once touched) on the
 * device's NUMA node where the host has several: a DMA across the socket
 * link runs slower and takes the other socket's memory bandwidth. */
static void *map_fresh(const struct tms_driver *drv, int device, size_t size)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    /* Huge pages: fresh-page copies run ~40 vs ~28 GB/s and munmap of
     * 8 GiB takes 17 vs 180 ms (DESIGN, measured on the lent H100). */
    (void)madvise(p, size, MADV_HUGEPAGE);
    int node = drv->numa_node ? drv->numa_node(device) : -1;
    if (node >= 0) {
        int rc = tms_topology_prefer_node(p, size, node);
        if (rc) TMS_DEBUG("backup of %zu bytes not placed on NUMA node %d: errno %d", size, node, rc);
    }
    return p;
}

static size_t piece_count(size_t size) { return (size + TMS_PIN_PIECE_BYTES - 1) / TMS_PIN_PIECE_BYTES; }

static unsigned char *new_piece_map(size_t size) { return calloc(piece_count(size) ? piece_count(size) : 1, 1); }

/* Fresh pages that the first copy into them page-locks piece by piece
 * (tms_transfer lock_pieces): cuMemHostAlloc of 8 GiB takes ~3 s, and
 * faulting in and registering the whole backup before copying into it ran
 * the pause at 14.9-17.9 GB/s, 16 GiB on the lent H100. */
static int map_to_lock(const struct tms_driver *drv, int device, struct tms_backup *b, size_t size,
                       struct tms_err *err)
{
    if (!(b->locked = new_piece_map(size)))
        return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory for a pinned backup record");
    b->host = map_fresh(drv, device, size);
    if (b->host) return TMS_OK;
    int map_errno = errno;
    free(b->locked);
    b->locked = NULL;
    return tms_fail(err, TMS_E_HOST_OOM, map_errno, "cannot map %zu bytes of host memory for a pinned backup: errno %d",
                    size, map_errno);
}

int tms_backup_new(const struct tms_driver *drv, int kind, int device, size_t size, uint64_t va,
                   struct tms_backup **out, struct tms_err *err)
{
    struct tms_backup *b = calloc(1, sizeof *b);
    if (!b) return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory for a backup record");
    int rc = TMS_OK;
    if (kind == TMS_BACKUP_DISK) {
        rc = tms_disk_create(va, size, &b->file, err);
    } else if (kind == TMS_BACKUP_PINNED) {
        rc = map_to_lock(drv, device, b, size, err);
    } else if (!(b->host = map_fresh(drv, device, size))) {
        rc = tms_fail(err, TMS_E_HOST_OOM, errno, "cannot map %zu bytes of mmap host memory for a backup: errno %d",
                      size, errno);
    }
    if (rc) {
        free(b);
        return rc;
    }
    b->size = size;
    b->kind = kind;
    b->refs = 1;
    b->drv = drv;
    *out = b;
    return TMS_OK;
}

int tms_backup_reusable(const struct tms_backup *b, int kind)
{
    return b->kind == kind && (kind != TMS_BACKUP_DISK || tms_disk_rewritable(&b->file));
}

int tms_backup_pinned(const struct tms_backup *b)
{
    return __atomic_load_n(&b->pinning, __ATOMIC_ACQUIRE) == TMS_PIN_DONE;
}

unsigned char *tms_backup_pieces_to_lock(const struct tms_backup *b)
{
    return b->kind == TMS_BACKUP_PINNED && __atomic_load_n(&b->pinning, __ATOMIC_ACQUIRE) == TMS_PIN_NONE ? b->locked
                                                                                                       : NULL;
}

/* Unlocks every piece that is locked, whoever locked it and in whatever order. */
static void unlock_pieces(struct tms_backup *b)
{
    if (!b->locked) return;
    for (size_t k = 0; k < piece_count(b->size); k++)
        if (b->locked[k]) {
            (void)b->drv->host_unregister((char *)b->host + k * TMS_PIN_PIECE_BYTES);
            b->locked[k] = 0;
        }
}

void tms_backup_copied(struct tms_backup *b)
{
    if (!tms_backup_pieces_to_lock(b)) return;
    size_t locked = 0;
    for (size_t k = 0; k < piece_count(b->size); k++) locked += b->locked[k];
    if (locked == piece_count(b->size)) {
        __atomic_store_n(&b->pinning, TMS_PIN_DONE, __ATOMIC_RELEASE);
        return;
    }
    /* Locked pieces in a pageable backup would only hold memory: copies of it stage. */
    unlock_pieces(b);
    __atomic_store_n(&b->pinning, TMS_PIN_FAILED, __ATOMIC_RELEASE);
    TMS_DEBUG("pinned backup of %zu bytes stays pageable: the driver locked %zu of its %zu pieces", b->size, locked,
              piece_count(b->size));
}

/*
 * One thread page-locks the queued backups, one piece at a time, and only
 * while no copy runs: cuMemHostRegister competing with a resume's DMA slowed
 * it to 23 GB/s (24 GiB in 48 backups, one thread each, on the lent H100),
 * and a whole 512 MiB backup registered as the first resume began slowed that
 * resume to 10 GB/s. At exit the queue is dropped and the exit waits for the
 * piece being locked, so no thread is inside the driver while it is torn down.
 */
_Static_assert(TMS_PIN_PIECE_BYTES % TMS_DIRECT_BLOCK_BYTES == 0,
               "default direct copy blocks tile the registered pieces");
static pthread_mutex_t pin_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pin_queued = PTHREAD_COND_INITIALIZER;
static struct tms_backup *pin_head, *pin_tail;  /* guarded by pin_lock; each holds a reference */
static int pin_thread_started;             /* guarded by pin_lock */
static int pin_stopping;                   /* written under pin_lock; read atomically while waiting for copies */
static pthread_t pin_thread;
static pthread_once_t pin_once = PTHREAD_ONCE_INIT;

static void drop_queue_locked(void)
{
    while (pin_head) {
        struct tms_backup *b = pin_head;
        pin_head = b->pin_next;
        __atomic_store_n(&b->pinning, TMS_PIN_FAILED, __ATOMIC_RELEASE);
        tms_backup_unref(b);
    }
    pin_tail = NULL;
}

/* The thread is joined, not left blocked: its stack and TLS go with it
 * (valgrind counts a thread alive at exit as possibly lost memory). */
static void stop_pinning_at_exit(void)
{
    pthread_mutex_lock(&pin_lock);
    __atomic_store_n(&pin_stopping, 1, __ATOMIC_RELEASE);
    drop_queue_locked();
    int started = pin_thread_started;
    pin_thread_started = 0;
    pthread_cond_broadcast(&pin_queued);
    pthread_mutex_unlock(&pin_lock);
    if (started) pthread_join(pin_thread, NULL);
}

static void pin_fork_prepare(void) { pthread_mutex_lock(&pin_lock); }
static void pin_fork_parent(void) { pthread_mutex_unlock(&pin_lock); }
static void pin_fork_child(void)
{
    pin_head = pin_tail = NULL;  /* the parent's: left alone */
    pin_thread_started = 0;
    pthread_cond_init(&pin_queued, NULL);
    pthread_mutex_unlock(&pin_lock);
}

static void pin_setup(void)
{
    (void)atexit(stop_pinning_at_exit);
    (void)pthread_atfork(pin_fork_prepare, pin_fork_parent, pin_fork_child);
}

static int stopping_now(void) { return __atomic_load_n(&pin_stopping, __ATOMIC_ACQUIRE); }

/* Registers b a piece at a time, each after the copies running now; -1 if
 * the process is exiting (the pieces locked so far go with the backup). */
static int register_in_pieces(struct tms_backup *b)
{
    for (size_t k = 0; k < piece_count(b->size); k++) {
        while (!tms_transfer_idle() && !stopping_now()) usleep(1000);
        if (stopping_now()) return -1;
        size_t off = k * TMS_PIN_PIECE_BYTES;
        size_t piece = b->size - off < TMS_PIN_PIECE_BYTES ? b->size - off : TMS_PIN_PIECE_BYTES;
        int rc = b->drv->host_register((char *)b->host + off, piece);
        if (rc) return rc;
        b->locked[k] = 1;
    }
    return 0;
}

static void *pin_thread_main(void *arg)
{
    (void)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);  /* signals belong to the application's threads */
    pthread_mutex_lock(&pin_lock);
    for (;;) {
        while (!pin_head && !pin_stopping) pthread_cond_wait(&pin_queued, &pin_lock);
        if (pin_stopping) break;
        struct tms_backup *b = pin_head;
        pin_head = b->pin_next;
        if (!pin_head) pin_tail = NULL;
        pthread_mutex_unlock(&pin_lock);
        int rc = register_in_pieces(b);
        if (rc > 0) {
            unlock_pieces(b);  /* copies stage through; locked pieces would only hold memory */
            TMS_DEBUG("retained backup of %zu bytes stays pageable: %s (%d)", b->size, b->drv->code_name(rc), rc);
        }
        __atomic_store_n(&b->pinning, rc ? TMS_PIN_FAILED : TMS_PIN_DONE, __ATOMIC_RELEASE);
        tms_backup_unref(b);  /* the last reference unregisters it */
        pthread_mutex_lock(&pin_lock);
    }
    pthread_mutex_unlock(&pin_lock);
    return NULL;
}

void tms_backup_pin_later(struct tms_backup *b)
{
    int none = TMS_PIN_NONE;
    if (!b || b->kind != TMS_BACKUP_MMAP ||
        !__atomic_compare_exchange_n(&b->pinning, &none, TMS_PIN_RUNNING, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return;
    if (!(b->locked = new_piece_map(b->size))) {
        __atomic_store_n(&b->pinning, TMS_PIN_FAILED, __ATOMIC_RELEASE);
        return;
    }
    pthread_once(&pin_once, pin_setup);
    tms_backup_ref(b);
    pthread_mutex_lock(&pin_lock);
    int rc = pin_stopping ? -1 : 0;
    if (!rc && !pin_thread_started) {
        rc = pthread_create(&pin_thread, NULL, pin_thread_main, NULL);
        pin_thread_started = rc == 0;
    }
    if (!rc) {
        b->pin_next = NULL;
        if (pin_tail) pin_tail->pin_next = b;
        else pin_head = b;
        pin_tail = b;
        pthread_cond_signal(&pin_queued);
    }
    pthread_mutex_unlock(&pin_lock);
    if (rc) {
        __atomic_store_n(&b->pinning, TMS_PIN_FAILED, __ATOMIC_RELEASE);
        tms_backup_unref(b);
    }
}

void tms_backup_ref(struct tms_backup *b)
{
    __atomic_add_fetch(&b->refs, 1, __ATOMIC_RELAXED);
}

/* Driver calls here fail only at driver teardown, when the process ends. */
static void release_host_memory(struct tms_backup *b)
{
    if (!b->host) return;
    unlock_pieces(b);  /* those of a failed pause or of a locking cut short by the exit too */
    free(b->locked);
    b->locked = NULL;
    munmap(b->host, b->size);
    b->host = NULL;
}

void tms_backup_unref(struct tms_backup *b)
{
    if (!b || __atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
    if (b->kind == TMS_BACKUP_DISK) tms_disk_remove(&b->file);
    else release_host_memory(b);
    free(b);
}

void tms_backup_release_restored(void *backup)
{
    struct tms_backup *b = backup;
    /* Another reference is a zero-copy view (or the page-locking thread):
     * the bytes stay until the last one goes. None can be taken meanwhile:
     * tms_core_backup_of waits while the allocation moves. */
    if (b->kind == TMS_BACKUP_DISK || __atomic_load_n(&b->refs, __ATOMIC_ACQUIRE) != 1) return;
    release_host_memory(b);
    TMS_DEBUG("backup of %zu bytes restored and released by its copy worker", b->size);
}
