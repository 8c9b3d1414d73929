/* Retained backups: pageable backups kept across resume, page-locked once by a background thread while no copy runs. */
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>

#include "backup/host.h"
#include "backup/transfer.h"
#include "platform/fork.h"
#include "platform/log.h"

/*
 * A retained backup is copied again every cycle; once page-locked, its copies
 * go straight to it at link speed instead of through the staging. One thread
 * locks the queued backups a piece at a time, and only while no copy runs:
 * registering host memory beside a resume's DMA slows the resume
 * (docs/performance.md). A copy that starts meanwhile waits for one piece at
 * most. At exit the queue is dropped and the exit waits for the piece being
 * locked, so no thread is inside the driver while it is torn down.
 */
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
    tms_transfer_wake_idle_waiters();
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
    static const struct tms_fork_handlers handlers = {pin_fork_prepare, pin_fork_parent, pin_fork_child};
    (void)atexit(stop_pinning_at_exit);
    tms_fork_register(TMS_FORK_RETAINED, &handlers);
}

/* Registers b a piece at a time, each after the copies running now (pieces
 * a first copy locked are skipped); -1 if the process is exiting (the pieces
 * locked so far go with the backup). */
static int register_in_pieces(struct tms_backup *b)
{
    for (size_t k = 0; k < tms_host_pieces(b->size); k++) {
        if (b->locked[k] == TMS_PIECE_LOCKED) continue;
        if (tms_transfer_wait_idle(&pin_stopping)) return -1;
        size_t off = k * TMS_PIN_PIECE_BYTES;
        size_t piece = b->size - off < TMS_PIN_PIECE_BYTES ? b->size - off : TMS_PIN_PIECE_BYTES;
        int rc = b->drv->host_register(b->device, (char *)b->host + off, piece);
        if (rc) return rc;
        b->locked[k] = TMS_PIECE_LOCKED;
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
            tms_host_unlock_pieces(b);  /* copies stage through; locked pieces would only hold memory */
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
    if (!b || !b->host ||
        !__atomic_compare_exchange_n(&b->pinning, &none, TMS_PIN_RUNNING, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE))
        return;
    if (!b->locked && !(b->locked = tms_host_piece_map(b->size))) {
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
