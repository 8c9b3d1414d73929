/* Backups of paused allocations: host buffers and disk files, reference-counted. */
#include "backup.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/mman.h>

#include "config.h"
#include "log.h"
#include "transfer.h"

static void *map_fresh(size_t size)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    /* Huge pages: fresh-page copies run ~40 vs ~28 GB/s and munmap of
     * 8 GiB takes 17 vs 180 ms (DESIGN, measured on the lent H100). */
    (void)madvise(p, size, MADV_HUGEPAGE);
    return p;
}

/* Page-locked memory made from fresh pages populated by the copy workers and
 * then registered: cuMemHostAlloc of 8 GiB takes ~3 s, populating it in
 * parallel and registering ~0.3 s (DESIGN). Falls back to host_alloc_pinned
 * where registering is not supported. */
static int pin_fresh(const struct tms_driver *drv, struct tms_backup *b, size_t size, struct tms_err *err)
{
    void *p = map_fresh(size);
    if (!p)
        return tms_fail(err, TMS_E_HOST_OOM, errno, "cannot map %zu bytes of host memory for a pinned backup: errno %d",
                        size, errno);
    int rc = tms_transfer_populate(drv, p, size, err);
    if (rc) {
        munmap(p, size);
        return rc;
    }
    int drc = drv->host_register(p, size);
    if (!drc) {
        b->host = p;
        b->registered = 1;
        return TMS_OK;
    }
    munmap(p, size);
    if (drv->is_oom(drc))
        return tms_fail(err, TMS_E_HOST_OOM, drc, "cannot pin %zu bytes of host memory for a pinned backup: %s (%d)",
                        size, drv->code_name(drc), drc);
    drc = drv->host_alloc_pinned(size, &b->host);
    if (drc)
        return tms_fail(err, TMS_E_HOST_OOM, drc, "cannot allocate %zu bytes of pinned host memory for a backup: %s (%d)",
                        size, drv->code_name(drc), drc);
    return TMS_OK;
}

int tms_backup_new(const struct tms_driver *drv, int kind, size_t size, uint64_t va, struct tms_backup **out,
                   struct tms_err *err)
{
    struct tms_backup *b = calloc(1, sizeof *b);
    if (!b) return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory for a backup record");
    int rc = TMS_OK;
    if (kind == TMS_BACKUP_DISK) {
        rc = tms_disk_create(va, size, &b->file, err);
    } else if (kind == TMS_BACKUP_PINNED) {
        rc = pin_fresh(drv, b, size, err);
    } else if (!(b->host = map_fresh(size))) {
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
    return b->kind == TMS_BACKUP_PINNED || __atomic_load_n(&b->pinning, __ATOMIC_ACQUIRE) == TMS_PIN_DONE;
}

/* Pinning threads still running: the process waits for them at exit, so
 * none is inside the driver while it is torn down. */
static pthread_mutex_t pinning_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pinning_done = PTHREAD_COND_INITIALIZER;
static int pinning_threads;  /* guarded by pinning_lock */
static pthread_once_t pinning_once = PTHREAD_ONCE_INIT;

static void wait_for_pinning(void)
{
    pthread_mutex_lock(&pinning_lock);
    while (pinning_threads > 0) pthread_cond_wait(&pinning_done, &pinning_lock);
    pthread_mutex_unlock(&pinning_lock);
}

static void pinning_fork_prepare(void) { pthread_mutex_lock(&pinning_lock); }
static void pinning_fork_parent(void) { pthread_mutex_unlock(&pinning_lock); }
static void pinning_fork_child(void)
{
    pinning_threads = 0;  /* they did not come along */
    pthread_cond_init(&pinning_done, NULL);
    pthread_mutex_unlock(&pinning_lock);
}

static void pinning_setup(void)
{
    (void)atexit(wait_for_pinning);
    (void)pthread_atfork(pinning_fork_prepare, pinning_fork_parent, pinning_fork_child);
}

static void *pin_in_background(void *arg)
{
    struct tms_backup *b = arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);  /* signals belong to the application's threads */
    int rc = b->drv->host_register(b->host, b->size);
    if (rc) TMS_DEBUG("retained backup of %zu bytes stays pageable: %s (%d)", b->size, b->drv->code_name(rc), rc);
    __atomic_store_n(&b->pinning, rc ? TMS_PIN_FAILED : TMS_PIN_DONE, __ATOMIC_RELEASE);
    tms_backup_unref(b);  /* the last reference unregisters it */
    pthread_mutex_lock(&pinning_lock);
    if (--pinning_threads == 0) pthread_cond_broadcast(&pinning_done);
    pthread_mutex_unlock(&pinning_lock);
    return NULL;
}

void tms_backup_pin_later(struct tms_backup *b)
{
    int none = TMS_PIN_NONE;
    if (!b || b->kind != TMS_BACKUP_MMAP ||
        !__atomic_compare_exchange_n(&b->pinning, &none, TMS_PIN_RUNNING, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return;
    pthread_once(&pinning_once, pinning_setup);
    tms_backup_ref(b);
    pthread_mutex_lock(&pinning_lock);
    pinning_threads++;
    pthread_mutex_unlock(&pinning_lock);
    pthread_attr_t attr;
    pthread_t thread;
    int rc = pthread_attr_init(&attr);
    if (!rc) {
        (void)pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        rc = pthread_create(&thread, &attr, pin_in_background, b);
        pthread_attr_destroy(&attr);
    }
    if (rc) {
        __atomic_store_n(&b->pinning, TMS_PIN_FAILED, __ATOMIC_RELEASE);
        tms_backup_unref(b);
        pthread_mutex_lock(&pinning_lock);
        pinning_threads--;
        pthread_mutex_unlock(&pinning_lock);
    }
}

void tms_backup_ref(struct tms_backup *b)
{
    __atomic_add_fetch(&b->refs, 1, __ATOMIC_RELAXED);
}

void tms_backup_unref(struct tms_backup *b)
{
    if (!b || __atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
    /* Driver calls here fail only at driver teardown, when the process ends. */
    if (b->kind == TMS_BACKUP_DISK) {
        tms_disk_remove(&b->file);
    } else if (b->kind == TMS_BACKUP_PINNED && !b->registered) {
        (void)b->drv->host_free_pinned(b->host, b->size);
    } else {
        if (b->registered || __atomic_load_n(&b->pinning, __ATOMIC_ACQUIRE) == TMS_PIN_DONE)
            (void)b->drv->host_unregister(b->host);
        munmap(b->host, b->size);
    }
    free(b);
}
