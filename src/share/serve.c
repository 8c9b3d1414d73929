/* The sender's thread: one poll over its listening sockets and connections, accepted within caps and refusal windows, each answered by its protocol. */
#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/core_share.h"
#include "platform/fork.h"
#include "platform/log.h"
#include "platform/os.h"
#include "share/job_internal.h"
#include "share/place.h"
#include "share/serve.h"
#include "share/wire.h"

/* The thread of this process. A forked child has the parent's descriptors
 * but not its thread: it starts its own on its first share (or lend). */
static pthread_mutex_t serve_lock = PTHREAD_MUTEX_INITIALIZER;
static pid_t thread_pid;        /* guarded by serve_lock: the process whose thread runs */
static int wake_fd = -1;        /* guarded by serve_lock: an eventfd the thread polls, kept for the process */
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

/* A connection that has not asked by then is closed: an honest receiver asks
 * as soon as it is connected. */
#define ASK_WITHIN_MS 2000
/* Connections that have not asked, per listener in all and per peer process:
 * what a process of this user can make this one keep open without a handle. */
#define ASKING_MAX 16
#define ASKING_PER_PEER 4
/* Descriptors the thread keeps (receivers' sockets, pidfds): its share of the
 * descriptor budget (os.h), of which one peer process holds at most half, so
 * that one process's connections and hang-ups never shut out the others. */
#define HELD_PEER_SHARE 2
/* Connections refused (over a cap, malformed, asked nothing in time): at most
 * this many per window and listener, then that listener is not polled until
 * the window ends. A flood costs this process a bounded share of a core and
 * no more than the backlog waits ahead of an honest receiver, and a flood of
 * one socket leaves the others answering. */
#define REFUSALS_PER_WINDOW 64
#define REFUSAL_WINDOW_MS 100
#define ACCEPTS_PER_WAKE 16
#define LISTEN_REST_MS 100  /* out of descriptors or memory */
#define LISTENERS_MAX 65  /* the share one and one per device */
#define PROTOCOLS_MAX 2   /* the share's and the job's */

/* The receivers and members, shared by the sender's thread and a pause that
 * asks first who has hung up (tms_core_share_reap): guarded by conns_lock,
 * which is taken before the table lock and kept_lock. `changed` tells the
 * thread, back from poll, that a reap closed some of what it polled. */
static pthread_mutex_t conns_lock = PTHREAD_MUTEX_INITIALIZER;
static struct tms_serve_conn *conns;     /* guarded by conns_lock */
static size_t n_conns, cap_conns;
static int changed;
static struct tms_serve_listener listeners[LISTENERS_MAX];  /* guarded by conns_lock */
static size_t n_listeners;
/* Registered at load, before any thread: the thread copies them when it starts. */
static const struct tms_serve_protocol *protocols[PROTOCOLS_MAX];  /* guarded by conns_lock */
static size_t n_protocols;

void tms_serve_add_protocol(const struct tms_serve_protocol *p)
{
    pthread_mutex_lock(&conns_lock);
    if (n_protocols < PROTOCOLS_MAX) protocols[n_protocols++] = p;
    pthread_mutex_unlock(&conns_lock);
}

void tms_serve_lock(void) { pthread_mutex_lock(&serve_lock); }
void tms_serve_unlock(void) { pthread_mutex_unlock(&serve_lock); }

/* Closes the listeners; named: their names go too (this process's own, not
 * a forked child's copies of its parent's). */
static void close_listeners_locked(int named)
{
    int dir = -1;
    char path[PATH_MAX];
    struct tms_err err = {0};
    if (named && n_listeners) (void)tms_share_place("share", &dir, path, sizeof path, &err);
    for (size_t l = 0; l < n_listeners; l++) {
        close(listeners[l].fd);
        if (dir >= 0) (void)tms_os_remove_socket(dir, listeners[l].name);
    }
    n_listeners = 0;
}

/* Under serve_lock and conns_lock: the listeners are closed; each protocol forgets its own. */
static void stopped_locked(void)
{
    for (size_t i = 0; i < n_protocols; i++)
        if (protocols[i]->stopped_locked) protocols[i]->stopped_locked();
}

static uint64_t now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

/* A connection of listener l was refused: its window's budget is spent by one. */
static void refused_locked(size_t l, uint64_t now)
{
    struct tms_serve_listener *li = &listeners[l];
    if (now >= li->window_end_ms) {
        li->window_end_ms = now + REFUSAL_WINDOW_MS;
        li->refusals = 0;
    }
    if (++li->refusals >= REFUSALS_PER_WINDOW && li->resume_ms < li->window_end_ms) li->resume_ms = li->window_end_ms;
}

/* A connection of this user that has not asked, closed to make room: a
 * receiver of the share socket is told to try again (a member of a job asks
 * again at its next pause or resume). */
static void refuse_asking(int fd, int share)
{
    if (share) tms_serve_refuse(fd, "share: too many connections that have not asked yet: try again", 1);
    else close(fd);
}

/* Accepts what waits on listener l, within the caps: another user's
 * connection is closed at once; a peer process holds at most half of the
 * descriptors the thread keeps; one of this user's that has not asked yet
 * takes a place only within the listener's share of them and ASKING_PER_PEER
 * (the oldest of those that have not asked makes room for a new one). */
static void accept_some_locked(size_t l, uint64_t now)
{
    int lfd = listeners[l].fd, share = listeners[l].device < 0;
    size_t cap = tms_os_fd_budget(TMS_OS_FDS_HELD), peer_cap = cap / HELD_PEER_SHARE;
    /* Connections that have not asked share half of the cap among the listeners:
     * however small the descriptor limit, one listener's idle ones leave every
     * other listener, and those who asked, room. */
    size_t asking_max = cap / (HELD_PEER_SHARE * (n_listeners ? n_listeners : 1));
    asking_max = asking_max > ASKING_MAX ? ASKING_MAX : asking_max ? asking_max : 1;
    size_t asking_per_peer = asking_max < ASKING_PER_PEER ? asking_max : ASKING_PER_PEER;
    for (int k = 0; k < ACCEPTS_PER_WAKE && now >= listeners[l].resume_ms; k++) {
        int fd = tms_os_accept(lfd);
        if (fd < 0) {
            errno = -fd;
            /* Out of descriptors or memory: the pending connection stays readable,
             * so the listener rests rather than spin. */
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
                listeners[l].resume_ms = now + LISTEN_REST_MS;
            if (errno == EINTR || errno == ECONNABORTED) continue;
            return;
        }
        struct tms_os_peer peer;
        /* Only this user's processes (the place keeps others out; this holds wherever it could not). */
        if (tms_os_peer_of(fd, &peer) != 0) {
            close(fd);
            refused_locked(l, now);
            continue;
        }
        size_t held = 0, of_peer = 0, asking = 0, asking_of_peer = 0, oldest = SIZE_MAX;
        for (size_t i = 0; i < n_conns; i++) {
            if (conns[i].state == TMS_CONN_DONE) continue;
            held++;
            of_peer += conns[i].pid == peer.pid;
            if (conns[i].state != TMS_CONN_ASKING || conns[i].ready || conns[i].listener != (int)l) continue;
            asking++;
            asking_of_peer += conns[i].pid == peer.pid;
            if (oldest == SIZE_MAX || conns[i].ask_by_ms < conns[oldest].ask_by_ms) oldest = i;
        }
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int ready = poll(&p, 1, 0) > 0;  /* asked already: answered next, it takes no place */
        char why[sizeof ((struct tms_share_reply *)0)->message];
        if (held >= cap || of_peer >= peer_cap) {
            if (held >= cap)
                snprintf(why, sizeof why, "share: pid %d keeps %zu connections and hang-ups of receivers, its limit "
                         "(a quarter of its RLIMIT_NOFILE, 16 to 4096): close some, or raise its limit",
                         (int)getpid(), held);
            else
                snprintf(why, sizeof why, "share: pid %d keeps %zu connections and hang-ups of pid %d, the most one "
                         "process may have of its %zu (a quarter of its RLIMIT_NOFILE): close some",
                         (int)getpid(), of_peer, peer.pid, cap);
            tms_serve_refuse(fd, why, 0);
            refused_locked(l, now);
            continue;
        }
        if (!ready && asking_of_peer >= asking_per_peer) {
            refuse_asking(fd, share);
            refused_locked(l, now);
            continue;
        }
        if (!ready && asking >= asking_max) {
            refuse_asking(conns[oldest].fd, share);
            conns[oldest].fd = -1;
            conns[oldest].state = TMS_CONN_DONE;
            refused_locked(l, now);
        }
        if (n_conns == cap_conns) {
            size_t grown = cap_conns ? cap_conns * 2 : 16;
            struct tms_serve_conn *more = realloc(conns, grown * sizeof *more);
            if (!more) {
                close(fd);
                return;
            }
            conns = more;
            cap_conns = grown;
        }
        conns[n_conns++] = (struct tms_serve_conn){.fd = fd, .pid = peer.pid, .state = TMS_CONN_ASKING,
                                                   .ready = ready, .listener = (int)l,
                                                   .ask_by_ms = now + ASK_WITHIN_MS};
    }
}

static void drop_closed_locked(void)
{
    size_t kept = 0;
    for (size_t i = 0; i < n_conns; i++)
        if (conns[i].state != TMS_CONN_DONE) conns[kept++] = conns[i];
    n_conns = kept;
}

/* Holders that hung up, and watched processes that ended, settled now: a
 * receiver's close (or exit) is complete when it returns, so a pause that
 * follows it finds the memory free. */
static void reap(void)
{
    pthread_mutex_lock(&conns_lock);
    int closed = 0;
    for (size_t i = 0; i < n_conns; i++) {
        if (conns[i].state != TMS_CONN_HOLDING && conns[i].state != TMS_CONN_HUNG_UP) continue;
        struct pollfd p = {.fd = conns[i].fd, .events = POLLIN};
        if (poll(&p, 1, 0) <= 0) continue;
        if (conns[i].state == TMS_CONN_HOLDING) conns[i].protocol->spoke_locked(&conns[i]);
        else conns[i].protocol->ended_locked(&conns[i]);
        closed = 1;
    }
    if (closed) {
        drop_closed_locked();
        changed = 1;
    }
    pthread_mutex_unlock(&conns_lock);
}

/* What the thread polls: the listeners unless they rest, the wake-up, every
 * receiver's socket, every watched process, with of[k] the index in conns of
 * polls[k] (LISTENER + i: listener i; WAKE: the wake-up); *timeout_ms until
 * the first deadline (a connection's, the rest's end, or what expire_ms says
 * of the memory kept for the job). */
#define WAKE (SIZE_MAX - LISTENERS_MAX - 1)
#define LISTENER (SIZE_MAX - LISTENERS_MAX)
static size_t fill_polls_locked(struct pollfd *polls, size_t *of, size_t cap, int wake, uint64_t now, int expire_ms,
                                int *timeout_ms)
{
    uint64_t next = expire_ms >= 0 ? now + (uint64_t)expire_ms : UINT64_MAX;
    size_t n = 0;
    for (size_t l = 0; l < n_listeners && n < cap; l++) {
        if (now < listeners[l].resume_ms) {  /* resting: polled again when its rest ends */
            if (listeners[l].resume_ms < next) next = listeners[l].resume_ms;
            continue;
        }
        of[n] = LISTENER + l, polls[n++] = (struct pollfd){.fd = listeners[l].fd, .events = POLLIN};
    }
    if (wake >= 0 && n < cap) of[n] = WAKE, polls[n++] = (struct pollfd){.fd = wake, .events = POLLIN};
    for (size_t i = 0; i < n_conns && n < cap; i++) {
        of[n] = i;
        polls[n++] = (struct pollfd){.fd = conns[i].fd, .events = POLLIN};
        if (conns[i].state == TMS_CONN_ASKING && conns[i].ask_by_ms < next) next = conns[i].ask_by_ms;
    }
    *timeout_ms = next == UINT64_MAX ? -1 : next <= now ? 0 : (int)(next - now < 60000 ? next - now : 60000);
    return n;
}

static struct tms_serve_conn *conn_with_fd_locked(int fd)
{
    for (size_t i = 0; i < n_conns; i++)
        if (conns[i].fd == fd && conns[i].state != TMS_CONN_DONE) return &conns[i];
    return NULL;
}

static void *serve(void *arg)
{
    int wake = (int)(intptr_t)arg;
    (void)prctl(PR_SET_NAME, "tms-share", 0, 0, 0);  /* named for a person reading /proc (a libc symbol older than pthread_setname_np's) */
    struct pollfd *polls = NULL;
    size_t *of = NULL;
    struct tms_serve_conn *asking = NULL;  /* copies of the connections that asked, answered without the lock */
    size_t poll_cap = 0;
    const struct tms_serve_protocol *known[PROTOCOLS_MAX];  /* the thread's copy: registered at load */
    pthread_mutex_lock(&conns_lock);
    size_t n_known = n_protocols;
    memcpy(known, protocols, sizeof known);
    pthread_mutex_unlock(&conns_lock);
    for (;;) {
        int expire_ms = tms_job_expire();  /* memory kept for the job past its bound goes back: its one expiry */
        pthread_mutex_lock(&conns_lock);
        if (poll_cap < n_conns + n_listeners + 2) {
            size_t want = n_conns + LISTENERS_MAX + 16;
            struct pollfd *more = realloc(polls, want * sizeof *more);
            size_t *more_of = more ? realloc(of, want * sizeof *more_of) : NULL;
            struct tms_serve_conn *more_asking = more_of ? realloc(asking, want * sizeof *more_asking) : NULL;
            if (more) polls = more;
            if (more_of) of = more_of;
            if (more_asking) {
                asking = more_asking;
                poll_cap = want;
            }
        }
        int timeout = -1;
        size_t n = poll_cap ? fill_polls_locked(polls, of, poll_cap, wake, now_ms(), expire_ms, &timeout) : 0;
        changed = 0;
        pthread_mutex_unlock(&conns_lock);
        if (!poll_cap) {
            sleep(1);  /* out of host memory before the first poll: nothing is dropped, it waits */
            continue;
        }
        if (poll(polls, n, timeout) < 0) {
            if (errno == EINTR) continue;
            tms_log_warn("share: the sender's thread stops: poll failed: %s", strerror(errno));
            break;
        }
        pthread_mutex_lock(&conns_lock);
        uint64_t now = now_ms();
        size_t n_asking = 0;
        unsigned char listener_ready[LISTENERS_MAX] = {0};
        /* By index, not by descriptor: a socket closed here may come back as a
         * pidfd of the same number. Nothing but a reap (`changed`) moves conns
         * between the poll and this loop. */
        for (size_t k = 0; !changed && k < n; k++) {
            if (of[k] == WAKE) {
                uint64_t count;
                if (polls[k].revents & POLLIN) (void)!read(wake, &count, sizeof count);
                continue;
            }
            if (of[k] >= LISTENER) {
                listener_ready[of[k] - LISTENER] = (polls[k].revents & POLLIN) != 0;
                continue;
            }
            struct tms_serve_conn *c = &conns[of[k]];
            if (!polls[k].revents || c->fd != polls[k].fd || c->state == TMS_CONN_DONE) continue;
            if (c->state == TMS_CONN_HOLDING) {  /* a holder says one thing more: that it let go */
                c->protocol->spoke_locked(c);
            } else if (c->state == TMS_CONN_HUNG_UP) {
                c->protocol->ended_locked(c);
            } else {
                c->ready = 1;  /* being answered: no new connection takes its place */
                asking[n_asking++] = *c;
            }
        }
        for (size_t i = 0; i < n_conns; i++) {  /* asked nothing in time */
            if (conns[i].state != TMS_CONN_ASKING || conns[i].ready || conns[i].ask_by_ms > now) continue;
            tms_serve_close_conn(&conns[i]);
            refused_locked((size_t)conns[i].listener, now);
        }
        drop_closed_locked();
        for (size_t l = 0; l < n_listeners; l++)
            if (listener_ready[l]) accept_some_locked(l, now);
        pthread_mutex_unlock(&conns_lock);
        for (size_t k = 0; k < n_asking; k++) {
            /* A copy: the listener list may grow (and move) meanwhile. */
            pthread_mutex_lock(&conns_lock);
            struct tms_serve_listener l = listeners[asking[k].listener];
            pthread_mutex_unlock(&conns_lock);
            struct tms_serve_outcome out = tms_serve_answer(asking[k].fd, asking[k].pid, &l, known, n_known);
            pthread_mutex_lock(&conns_lock);
            struct tms_serve_conn *c = conn_with_fd_locked(out.fd);
            if (c && out.holding) {
                c->state = TMS_CONN_HOLDING;
                c->protocol = out.protocol;
                c->va = out.va;
                c->batch = out.batch;
                memcpy(c->token, out.token, sizeof c->token);
            } else if (c) {
                tms_serve_close_conn(c);
                drop_closed_locked();
            } else if (out.holding) {  /* gone meanwhile (a fork's child closed it): nobody holds it */
                out.protocol->unheld_locked(&out, asking[k].pid);
            }
            if (out.refused) refused_locked((size_t)asking[k].listener, now_ms());
            pthread_mutex_unlock(&conns_lock);
        }
    }
    /* No new handle names a socket nobody answers, and no member finds one. */
    pthread_mutex_lock(&serve_lock);
    pthread_mutex_lock(&conns_lock);
    close_listeners_locked(1);
    stopped_locked();
    pthread_mutex_unlock(&conns_lock);
    thread_pid = 0;
    pthread_mutex_unlock(&serve_lock);
    free(polls);
    free(of);
    free(asking);
    return NULL;
}

static void fork_prepare(void)
{
    pthread_mutex_lock(&serve_lock);
    pthread_mutex_lock(&conns_lock);
}
static void fork_parent(void)
{
    pthread_mutex_unlock(&conns_lock);
    pthread_mutex_unlock(&serve_lock);
}
/* The child serves nobody: its copies of the receivers' connections go (the
 * parent's stay), and its first share starts a thread of its own. */
static void fork_child(void)
{
    for (size_t i = 0; i < n_conns; i++)
        if (conns[i].state != TMS_CONN_DONE) close(conns[i].fd);
    n_conns = 0;
    /* A child that outlives its parent must not keep the sockets: receivers and
     * members would wait for an answer. The names stay the parent's. */
    close_listeners_locked(0);
    stopped_locked();
    thread_pid = 0;
    if (wake_fd >= 0) close(wake_fd);
    wake_fd = -1;
    pthread_mutex_unlock(&conns_lock);
    pthread_mutex_unlock(&serve_lock);
}
static void register_fork(void)
{
    static const struct tms_fork_handlers handlers = {fork_prepare, fork_parent, fork_child};
    tms_fork_register(TMS_FORK_SHARE_SERVE, &handlers);
}
void tms_serve_register_fork(void) { pthread_once(&fork_once, register_fork); }

/* The thread, once per process; it polls the listeners added since. */
static int start_thread_locked(struct tms_err *err)
{
    if (thread_pid == getpid()) return TMS_OK;
    if (wake_fd < 0 && (wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) < 0)
        return tms_fail(err, TMS_E_IO, errno, "share: eventfd() failed: %s", strerror(errno));
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&thread, &attr, serve, (void *)(intptr_t)wake_fd);
    pthread_attr_destroy(&attr);
    if (rc) return tms_fail(err, TMS_E_HOST_OOM, rc, "share: cannot start the sender's thread: %s", strerror(rc));
    tms_core_share_set_reaper(reap);
    thread_pid = getpid();
    return TMS_OK;
}

/* The listener goes on the list, for the thread to poll from its next wake-up. */
int tms_serve_listen_locked(int fd, const char *name, int device, const char *job, const char *identity,
                            const char *who, struct tms_err *err)
{
    int rc = start_thread_locked(err);
    if (rc) return rc;
    pthread_mutex_lock(&conns_lock);
    int room = n_listeners < LISTENERS_MAX;
    if (room) {
        struct tms_serve_listener *l = &listeners[n_listeners++];
        *l = (struct tms_serve_listener){.fd = fd, .device = device};
        snprintf(l->name, sizeof l->name, "%s", name);
        snprintf(l->job, sizeof l->job, "%s", job ? job : "");
        snprintf(l->identity, sizeof l->identity, "%s", identity ? identity : "");
        changed = 1;
    }
    pthread_mutex_unlock(&conns_lock);
    if (!room)
        return tms_fail(err, TMS_E_STATE, 0, "%s: this process listens on %d sockets already", who, LISTENERS_MAX);
    uint64_t one = 1;
    (void)!write(wake_fd, &one, sizeof one);
    return TMS_OK;
}

void tms_share_serve_wake(void)
{
    pthread_mutex_lock(&serve_lock);
    uint64_t one = 1;
    if (wake_fd >= 0 && thread_pid == getpid()) (void)!write(wake_fd, &one, sizeof one);
    pthread_mutex_unlock(&serve_lock);
}

/* At exit the names of this process's sockets go with it (a killed
 * process's are removed by the next sender or member that finds them); the
 * sockets stay, answering what already waits, until the process ends. */
__attribute__((destructor)) static void remove_names_at_exit(void)
{
    if (pthread_mutex_trylock(&serve_lock)) return;
    if (!pthread_mutex_trylock(&conns_lock)) {
        int dir = -1;
        char path[PATH_MAX];
        struct tms_err err = {0};
        if (thread_pid == getpid() && n_listeners && tms_share_place("share", &dir, path, sizeof path, &err) == TMS_OK)
            for (size_t l = 0; l < n_listeners; l++) (void)tms_os_remove_socket(dir, listeners[l].name);
        pthread_mutex_unlock(&conns_lock);
    }
    pthread_mutex_unlock(&serve_lock);
}
