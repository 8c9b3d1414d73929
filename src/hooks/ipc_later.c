/* The walk of every loaded object's relocations takes long enough in a process with
 * PyTorch's CUDA libraries loaded to matter to a first region, and nothing needs
 * the hooks until memory is shared: so it runs beside the caller, and a share,
 * or an open, that comes first waits for it. */
#include "hooks/ipc_later.h"

#include <pthread.h>
#include <signal.h>
#include <stdlib.h>

#include "platform/fork.h"
#include "platform/log.h"

static pthread_mutex_t later_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_t later_thread;
static int later_started;     /* guarded by later_lock: a thread to join */
static int later_asked;       /* guarded by later_lock: once per process */
static int later_exit_hooked; /* guarded by later_lock */
static int (*later_install)(struct tms_err *err);  /* set before the thread starts */

static void *later_main(void *arg)
{
    (void)arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    struct tms_err err = {0};
    if (later_install(&err)) TMS_DEBUG("IPC hooks not installed beside the caller: %s", err.msg);
    return NULL;
}

static void join_locked(void)
{
    if (!later_started) return;
    pthread_join(later_thread, NULL);
    later_started = 0;
}

/* No thread of the library may patch an object while the process tears down. */
static void join_at_exit(void)
{
    pthread_mutex_lock(&later_lock);
    join_locked();
    pthread_mutex_unlock(&later_lock);
}

static void later_prepare(void) { pthread_mutex_lock(&later_lock); }
static void later_parent(void) { pthread_mutex_unlock(&later_lock); }
static void later_child(void)
{
    pthread_mutex_init(&later_lock, NULL);
    later_started = 0;  /* the parent's thread is not the child's to join */
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;
static void register_fork(void)
{
    static const struct tms_fork_handlers handlers = {later_prepare, later_parent, later_child};
    tms_fork_register(TMS_FORK_IPC_LATER, &handlers);
}

void tms_ipc_hooks_install_later(int (*install)(struct tms_err *err))
{
    pthread_once(&fork_once, register_fork);
    pthread_mutex_lock(&later_lock);
    if (!later_asked) {
        later_asked = 1;
        later_install = install;
        if (!later_exit_hooked) later_exit_hooked = atexit(join_at_exit) == 0;
        /* Without a thread the first share installs them. */
        later_started = later_exit_hooked && pthread_create(&later_thread, NULL, later_main, NULL) == 0;
    }
    pthread_mutex_unlock(&later_lock);
}

int tms_ipc_hooks_install(int (*install)(struct tms_err *err), struct tms_err *err)
{
    pthread_once(&fork_once, register_fork);
    pthread_mutex_lock(&later_lock);
    join_locked();
    pthread_mutex_unlock(&later_lock);
    return install(err);
}
