/* The library's one fork registration: each subsystem's handlers run by rank (platform/fork.h), whatever order they registered in. */
#include "platform/fork.h"

#include <pthread.h>

static const struct tms_fork_handlers *registered[TMS_FORK_RANKS];  /* atomic; each set once */
static pthread_once_t install_once = PTHREAD_ONCE_INIT;

static const struct tms_fork_handlers *at(int rank) { return __atomic_load_n(&registered[rank], __ATOMIC_ACQUIRE); }

static void run_prepare(void)
{
    const struct tms_fork_handlers *h;
    for (int r = 0; r < TMS_FORK_RANKS; r++)
        if ((h = at(r)) && h->prepare) h->prepare();
}

static void run_parent(void)
{
    const struct tms_fork_handlers *h;
    for (int r = TMS_FORK_RANKS - 1; r >= 0; r--)
        if ((h = at(r)) && h->parent) h->parent();
}

static void run_child(void)
{
    const struct tms_fork_handlers *h;
    for (int r = TMS_FORK_RANKS - 1; r >= 0; r--)
        if ((h = at(r)) && h->child) h->child();
}

static void install(void) { (void)pthread_atfork(run_prepare, run_parent, run_child); }

void tms_fork_register(enum tms_fork_rank rank, const struct tms_fork_handlers *handlers)
{
    if ((int)rank < 0 || rank >= TMS_FORK_RANKS || !handlers) return;
    pthread_once(&install_once, install);
    const struct tms_fork_handlers *none = NULL;
    (void)__atomic_compare_exchange_n(&registered[rank], &none, handlers, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}
