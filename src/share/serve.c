/* The sender: handles for this process's allocations, and the thread that hands their memory to receivers (and kept memory to the members of its job) and watches who holds it. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/random.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "core/core_share.h"
#include "platform/driver.h"
#include "platform/fork.h"
#include "platform/log.h"
#include "platform/os.h"
#include "share/place.h"
#include "share/wire.h"

/* The share listening socket of this process, and its thread. A forked
 * child has the parent's descriptors but not its thread: it starts its own
 * on its first share (or lend). */
static pthread_mutex_t serve_lock = PTHREAD_MUTEX_INITIALIZER;
static int listen_fd = -1;      /* guarded by serve_lock */
static pid_t serving_pid;       /* guarded by serve_lock: the process whose thread serves listen_fd */
static uint64_t serving_id;     /* guarded by serve_lock */
static pid_t thread_pid;        /* guarded by serve_lock: the process whose thread runs */
static int wake_fd = -1;        /* guarded by serve_lock: an eventfd the thread polls, kept for the process */
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void register_fork(void);

/* One receiver's connection, or what is left of one that hung up. */
enum conn_state {
    ASKING,   /* accepted; it has not asked yet */
    HOLDING,  /* got the memory's descriptors: holds it until it says it let go */
    HUNG_UP,  /* hung up without saying so while its process lived: its pidfd is watched */
    DONE,     /* closed: dropped from the list */
};

/* What a connection came for: a share's memory, or a job's (job.c). */
enum conn_kind { SHARE, JOB };

struct conn {
    int fd;          /* the socket (ASKING, HOLDING), the process's pidfd (HUNG_UP) */
    int kind;        /* enum conn_kind, once it asked */
    int listener;    /* the listener it came through */
    uint64_t batch;  /* JOB: the lend it holds (tms_core_job_lend) */
    int pid;         /* SO_PEERCRED's: 0 where its process is outside this PID namespace */
    int state;
    int ready;       /* ASKING: it is being answered, or its request was there when accepted */
    uint32_t mark;   /* HUNG_UP: for tms_core_share_gone */
    uint64_t ask_by_ms;
    uint64_t va;
    unsigned char token[TMS_SHARE_TOKEN_BYTES];
};

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
#define LISTEN_BACKLOG 64
#define ACCEPTS_PER_WAKE 16
#define LISTEN_REST_MS 100  /* out of descriptors or memory */
/* Names of senders gone without removing them (killed) that a new sender removes. */
#define SWEEP_MAX 64

/* A listening socket: the share one (device -1), or one a member of a job
 * listens on for device, named `name` in the user's place (share/place.h).
 * Listeners are only added, and closed with the thread (or in a fork's
 * child). Each has its own refusals' window. */
struct listener {
    int fd;
    int device;
    char job[72];
    char identity[TMS_JOB_IDENTITY_MAX + 1];
    char name[TMS_OS_SOCKET_NAME_MAX];
    uint64_t resume_ms;     /* not polled until then */
    uint64_t window_end_ms;
    unsigned refusals;      /* in the window ending at window_end_ms */
};
#define LISTENERS_MAX 65  /* the share one and one per device */

int tms_share_send(int fd, const void *buf, size_t len, const int *fds, int n_fds, int flags)
{
    struct iovec iov = {.iov_base = (void *)buf, .iov_len = len};
    union {
        char buf[CMSG_SPACE(sizeof(int) * TMS_JOB_MAX_PIECES)];
        struct cmsghdr align;
    } control;
    if (n_fds < 0 || n_fds > TMS_JOB_MAX_PIECES) return -1;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (n_fds > 0) {
        memset(&control, 0, sizeof control);
        msg.msg_control = control.buf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n_fds);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&msg);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n_fds);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)n_fds);
    }
    ssize_t n;
    do n = sendmsg(fd, &msg, MSG_NOSIGNAL | flags);
    while (n < 0 && errno == EINTR);
    return n == (ssize_t)len ? 0 : -1;
}

/* A refusal, as the reply always was: without the lengths of a lend's pieces. */
static int send_reply(int fd, const struct tms_share_reply *reply, const int *fds, int n_fds, int flags)
{
    return tms_share_send(fd, reply, offsetof(struct tms_share_reply, lens), fds, n_fds, flags);
}

/* What a request ended with: held (the receiver got the descriptors) or to be closed. */
struct outcome {
    int fd;
    int holding;
    int refused;     /* malformed, or the memory could not be given: counts against the flood budget */
    int kind;
    uint64_t va;
    unsigned char token[TMS_SHARE_TOKEN_BYTES];
    uint64_t batch;
};

/* Answers a member of the job l listens for: what it has paused and keeps
 * idle on the device, or kept memory for what it needs. */
static struct outcome answer_job(int fd, int pid, const struct listener *l, const struct tms_job_request *req,
                                 size_t len)
{
    struct outcome out = {.fd = fd, .refused = 1, .kind = JOB};
    int named = len >= TMS_JOB_REQUEST_HEAD && (len - TMS_JOB_REQUEST_HEAD) % sizeof(uint64_t) == 0 &&
                req->n_needs == (len - TMS_JOB_REQUEST_HEAD) / sizeof(uint64_t) && req->n_needs <= TMS_JOB_MAX_NEEDS &&
                memchr(req->job, 0, sizeof req->job) && memchr(req->device, 0, sizeof req->device);
    /* Only its own job's members, about its own device: another job's process gets nothing. */
    int ours = named && l->device >= 0 && strcmp(req->job, l->job) == 0 && strcmp(req->device, l->identity) == 0;
    if (ours && (req->op == TMS_JOB_STATUS || (req->op == TMS_JOB_RELEASE && req->n_needs == 1))) {
        struct tms_job_status_reply reply = {0};
        size_t demand = 0, idle = 0;
        if (req->op == TMS_JOB_STATUS) tms_core_job_status(l->device, &demand, &idle);
        else demand = tms_core_job_release(l->device, req->needs[0]);
        reply.demand = demand;
        reply.idle = idle;
        (void)tms_share_send(fd, &reply, sizeof reply, NULL, 0, 0);
        out.refused = 0;
        return out;
    }
    struct tms_job_lend_reply reply = {0};
    if (!ours || req->op != TMS_JOB_BORROW) {
        reply.status = TMS_E_ARG;
        (void)tms_share_send(fd, &reply, offsetof(struct tms_job_lend_reply, pieces), NULL, 0, 0);
        return out;
    }
    struct tms_job_lent lent[TMS_JOB_MAX_PIECES];
    int fds[TMS_JOB_MAX_PIECES];
    size_t k = 0;
    uint64_t batch = 0;
    struct tms_err err = {0};
    reply.status = tms_core_job_lend(l->device, req->needs, req->n_needs, pid, lent, fds, &k, &batch, &err);
    reply.n = (uint32_t)k;
    for (size_t i = 0; i < k; i++) {
        reply.pieces[i].need = (uint32_t)lent[i].need;
        reply.pieces[i].size = lent[i].size;
        reply.pieces[i].len = lent[i].len;
        reply.pieces[i].key = lent[i].key;
    }
    int sent = tms_share_send(fd, &reply, offsetof(struct tms_job_lend_reply, pieces) + k * sizeof reply.pieces[0],
                              fds, (int)k, 0);
    for (size_t i = 0; i < k; i++) close(fds[i]);
    out.refused = reply.status != TMS_OK;
    if (!k) return out;
    if (sent) {
        (void)tms_core_job_returned(batch, NULL, 0, 0);  /* nothing reached it */
        return out;
    }
    TMS_DEBUG("lent %zu kept handles on device %d to pid %d", k, l->device, pid);
    out.holding = 1;
    out.batch = batch;
    return out;
}

/* Answers a request: the memory's descriptors, or why not. Runs without
 * conns_lock: attaching may wait for a pause of that memory, and other
 * tags' pauses (which reap first) must not wait with it. */
static struct outcome answer(int fd, int pid, const struct listener *l)
{
    struct outcome out = {.fd = fd, .refused = 1};
    union {
        struct tms_share_request share;
        struct tms_job_request job;
    } msg;
    ssize_t n;
    do n = recv(fd, &msg, sizeof msg, MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n >= 8 && memcmp(msg.job.magic, TMS_JOB_MAGIC, sizeof msg.job.magic) == 0)
        return answer_job(fd, pid, l, &msg.job, (size_t)n);
    const struct tms_share_request req = msg.share;
    if (n != (ssize_t)sizeof req || memcmp(req.magic, TMS_SHARE_MAGIC, sizeof req.magic) != 0) return out;
    struct tms_share_reply reply = {0};
    struct tms_share_info info;
    struct tms_err err = {0};
    int fds[TMS_SHARE_MAX_CHUNKS];
    int rc = tms_core_share_attach(req.va, req.token, pid, fds, &info, &err);
    if (rc) {
        reply.status = rc;
        snprintf(reply.message, sizeof reply.message, "%s", err.msg);
        (void)send_reply(fd, &reply, NULL, 0, 0);
        return out;
    }
    reply.n_chunks = info.n_chunks;
    reply.device = info.device;
    reply.size = info.size;
    reply.reserved = info.reserved;
    reply.chunk = info.chunk;
    for (int i = 0; !info.chunk && i < info.n_chunks; i++) reply.lens[i] = info.lens[i];
    /* The lengths only where they differ: chunks of one size go as they always did. */
    size_t len = info.chunk ? offsetof(struct tms_share_reply, lens) : sizeof reply;
    int sent = tms_share_send(fd, &reply, len, fds, info.n_chunks, 0);
    for (int i = 0; i < info.n_chunks; i++) close(fds[i]);
    if (sent) {
        (void)tms_core_share_detach(req.va, req.token, pid, 1);  /* nothing reached it */
        return out;
    }
    TMS_DEBUG("shared 0x%llx with pid %d", (unsigned long long)req.va, pid);
    out.holding = 1;
    out.refused = 0;
    out.va = req.va;
    memcpy(out.token, req.token, sizeof out.token);
    return out;
}

/* The receivers, shared by the sender's thread and a pause that asks first
 * who has hung up (tms_core_share_reap): guarded by conns_lock, which is
 * taken before the table lock. `changed` tells the thread, back from poll,
 * that a reap closed some of what it polled. */
static pthread_mutex_t conns_lock = PTHREAD_MUTEX_INITIALIZER;
static struct conn *conns;     /* guarded by conns_lock */
static size_t n_conns, cap_conns;
static int changed;
static struct listener listeners[LISTENERS_MAX];  /* guarded by conns_lock */
static size_t n_listeners;

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

static uint64_t now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

/* A connection of listener l was refused: its window's budget is spent by one. */
static void refused_locked(size_t l, uint64_t now)
{
    struct listener *li = &listeners[l];
    if (now >= li->window_end_ms) {
        li->window_end_ms = now + REFUSAL_WINDOW_MS;
        li->refusals = 0;
    }
    if (++li->refusals >= REFUSALS_PER_WINDOW && li->resume_ms < li->window_end_ms) li->resume_ms = li->window_end_ms;
}

static void close_conn(struct conn *c)
{
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    c->state = DONE;
}

/* 1 if the process behind a socket has ended, else 0 with *pidfd a
 * descriptor to watch it by, or -1 where the kernel cannot tell (os.h). */
static int peer_ended(int sock, int pid, int *pidfd)
{
    return tms_os_peer_process(sock, pid, pidfd) == TMS_OS_ENDED;
}

/* Whether a job's lend still has handles out, asking without changing it
 * (key 0 names none). */
static size_t still_lent(uint64_t batch)
{
    const uint64_t none = 0;
    return tms_core_job_returned(batch, &none, 1, 0);
}

/* A borrower's socket is readable: it returned pieces (and hangs up once
 * nothing of the lend is left), or it hung up. What it hung up on still
 * counts as lent until its process ends: it may map the memory. */
static void borrower_spoke_locked(struct conn *c)
{
    struct tms_job_returned msg;
    ssize_t n;
    do n = recv(c->fd, &msg, sizeof msg, MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n < 0 && errno == EAGAIN) return;
    size_t head = offsetof(struct tms_job_returned, keys);
    if (n >= (ssize_t)head && memcmp(msg.magic, TMS_JOB_RETURNED, sizeof msg.magic) == 0 &&
        msg.n <= TMS_JOB_MAX_PIECES && (size_t)n == head + msg.n * sizeof msg.keys[0]) {
        if (tms_core_job_returned(c->batch, msg.keys, msg.n, (msg.flags & TMS_JOB_RETURNED_SPENT) != 0) == 0)
            close_conn(c);
        return;
    }
    if (!still_lent(c->batch)) {
        close_conn(c);
        return;
    }
    int pidfd = -1, ended = peer_ended(c->fd, c->pid, &pidfd);
    close_conn(c);
    if (ended == 1) {  /* it may have shared the memory on: never used again */
        (void)tms_core_job_returned(c->batch, NULL, 0, 1);
        return;
    }
    TMS_DEBUG("job: pid %d hung up on borrowed memory without returning it", c->pid);
    if (pidfd < 0) return;  /* counted lent for as long as this process lives */
    c->fd = pidfd;
    c->state = HUNG_UP;
}

/* A holder's socket is readable: it said it let go (and hangs up), or it
 * hung up without saying so. Only a process that has ended is taken to have
 * let go without saying it: its mappings went with it. */
static void holder_spoke_locked(struct conn *c)
{
    if (c->kind == JOB) {
        borrower_spoke_locked(c);
        return;
    }
    struct tms_share_let_go msg;
    ssize_t n;
    do n = recv(c->fd, &msg, sizeof msg, MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n < 0 && errno == EAGAIN) return;
    int said = n == (ssize_t)sizeof msg && memcmp(msg.magic, TMS_SHARE_LET_GO, sizeof msg.magic) == 0 &&
               msg.va == c->va;
    int pidfd = -1, ended = said ? 1 : peer_ended(c->fd, c->pid, &pidfd);
    uint32_t mark = tms_core_share_detach(c->va, c->token, c->pid, ended == 1);
    close_conn(c);
    if (ended == 1) return;
    TMS_DEBUG("share: pid %d hung up on 0x%llx without saying it let go", c->pid, (unsigned long long)c->va);
    if (pidfd < 0) return;  /* marked until the memory's next pause */
    c->fd = pidfd;
    c->state = HUNG_UP;
    c->mark = mark;
}

/* A watched process has ended: whatever it mapped went with it. */
static void ended_locked(struct conn *c)
{
    if (c->kind == JOB) (void)tms_core_job_returned(c->batch, NULL, 0, 1);  /* it may have shared it on */
    else tms_core_share_gone(c->va, c->token, c->pid, c->mark);
    close_conn(c);
}

/* Tells a receiver of this user why it gets nothing, if it listens, and hangs
 * up. What it asked is read first: a socket closed with a message unread
 * resets the connection, and the receiver would see the reset, not the reply. */
static void refuse(int fd, const char *why, int busy)
{
    struct tms_share_reply reply = {.status = TMS_E_STATE, .flags = busy ? TMS_SHARE_REPLY_BUSY : 0};
    snprintf(reply.message, sizeof reply.message, "%s", why);
    (void)send_reply(fd, &reply, NULL, 0, MSG_DONTWAIT);
    char asked[sizeof(struct tms_job_request)];
    for (int i = 0; i < 4 && recv(fd, asked, sizeof asked, MSG_DONTWAIT) > 0; i++) continue;
    close(fd);
}

/* A connection of this user that has not asked, closed to make room: a
 * receiver of the share socket is told to try again (a member of a job asks
 * again at its next pause or resume). */
static void refuse_asking(int fd, int share)
{
    if (share) refuse(fd, "share: too many connections that have not asked yet: try again", 1);
    else close(fd);
}

/* Accepts what waits on listener l, within the caps: another user's
 * connection is closed at once; a peer process holds at most half of the
 * descriptors the thread keeps; one of this user's that has not asked yet
 * takes a place only within ASKING_MAX and ASKING_PER_PEER of the listener
 * (the oldest of those that have not asked makes room for a new one). */
static void accept_some_locked(size_t l, uint64_t now)
{
    int lfd = listeners[l].fd, share = listeners[l].device < 0;
    size_t cap = tms_os_fd_budget(TMS_OS_FDS_HELD), peer_cap = cap / HELD_PEER_SHARE;
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
            if (conns[i].state == DONE) continue;
            held++;
            of_peer += conns[i].pid == peer.pid;
            if (conns[i].state != ASKING || conns[i].ready || conns[i].listener != (int)l) continue;
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
            refuse(fd, why, 0);
            refused_locked(l, now);
            continue;
        }
        if (!ready && asking_of_peer >= ASKING_PER_PEER) {
            refuse_asking(fd, share);
            refused_locked(l, now);
            continue;
        }
        if (!ready && asking >= ASKING_MAX) {
            refuse_asking(conns[oldest].fd, share);
            conns[oldest].fd = -1;
            conns[oldest].state = DONE;
            refused_locked(l, now);
        }
        if (n_conns == cap_conns) {
            size_t grown = cap_conns ? cap_conns * 2 : 16;
            struct conn *more = realloc(conns, grown * sizeof *more);
            if (!more) {
                close(fd);
                return;
            }
            conns = more;
            cap_conns = grown;
        }
        conns[n_conns++] = (struct conn){.fd = fd, .pid = peer.pid, .state = ASKING, .ready = ready,
                                         .listener = (int)l, .ask_by_ms = now + ASK_WITHIN_MS};
    }
}

static void drop_closed_locked(void)
{
    size_t kept = 0;
    for (size_t i = 0; i < n_conns; i++)
        if (conns[i].state != DONE) conns[kept++] = conns[i];
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
        if (conns[i].state != HOLDING && conns[i].state != HUNG_UP) continue;
        struct pollfd p = {.fd = conns[i].fd, .events = POLLIN};
        if (poll(&p, 1, 0) <= 0) continue;
        if (conns[i].state == HOLDING) holder_spoke_locked(&conns[i]);
        else ended_locked(&conns[i]);
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
        if (conns[i].state == ASKING && conns[i].ask_by_ms < next) next = conns[i].ask_by_ms;
    }
    *timeout_ms = next == UINT64_MAX ? -1 : next <= now ? 0 : (int)(next - now < 60000 ? next - now : 60000);
    return n;
}

static struct conn *conn_with_fd_locked(int fd)
{
    for (size_t i = 0; i < n_conns; i++)
        if (conns[i].fd == fd && conns[i].state != DONE) return &conns[i];
    return NULL;
}

static void *serve(void *arg)
{
    int wake = (int)(intptr_t)arg;
    (void)prctl(PR_SET_NAME, "tms-share", 0, 0, 0);  /* named for a person reading /proc (a libc symbol older than pthread_setname_np's) */
    struct pollfd *polls = NULL;
    size_t *of = NULL;
    struct conn *asking = NULL;  /* copies of the connections that asked, answered without the lock */
    size_t poll_cap = 0;
    for (;;) {
        int expire_ms = tms_core_job_expire();  /* memory kept for the job past its bound goes back */
        pthread_mutex_lock(&conns_lock);
        if (poll_cap < n_conns + n_listeners + 2) {
            size_t want = n_conns + LISTENERS_MAX + 16;
            struct pollfd *more = realloc(polls, want * sizeof *more);
            size_t *more_of = more ? realloc(of, want * sizeof *more_of) : NULL;
            struct conn *more_asking = more_of ? realloc(asking, want * sizeof *more_asking) : NULL;
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
            struct conn *c = &conns[of[k]];
            if (!polls[k].revents || c->fd != polls[k].fd || c->state == DONE) continue;
            if (c->state == HOLDING) {  /* a holder says one thing more: that it let go */
                holder_spoke_locked(c);
            } else if (c->state == HUNG_UP) {
                ended_locked(c);
            } else {
                c->ready = 1;  /* being answered: no new connection takes its place */
                asking[n_asking++] = *c;
            }
        }
        for (size_t i = 0; i < n_conns; i++) {  /* asked nothing in time */
            if (conns[i].state != ASKING || conns[i].ready || conns[i].ask_by_ms > now) continue;
            close_conn(&conns[i]);
            refused_locked((size_t)conns[i].listener, now);
        }
        drop_closed_locked();
        for (size_t l = 0; l < n_listeners; l++)
            if (listener_ready[l]) accept_some_locked(l, now);
        pthread_mutex_unlock(&conns_lock);
        for (size_t k = 0; k < n_asking; k++) {
            /* A copy: the listener list may grow (and move) meanwhile. */
            pthread_mutex_lock(&conns_lock);
            struct listener l = listeners[asking[k].listener];
            pthread_mutex_unlock(&conns_lock);
            struct outcome out = answer(asking[k].fd, asking[k].pid, &l);
            pthread_mutex_lock(&conns_lock);
            struct conn *c = conn_with_fd_locked(out.fd);
            if (c && out.holding) {
                c->state = HOLDING;
                c->kind = out.kind;
                c->va = out.va;
                c->batch = out.batch;
                memcpy(c->token, out.token, sizeof c->token);
            } else if (c) {
                close_conn(c);
                drop_closed_locked();
            } else if (out.holding && out.kind == JOB) {  /* gone meanwhile (a fork's child closed it) */
                (void)tms_core_job_returned(out.batch, NULL, 0, 1);
            } else if (out.holding) {  /* gone meanwhile (a fork's child closed it): nobody holds it */
                (void)tms_core_share_detach(out.va, out.token, asking[k].pid, 1);
            }
            if (out.refused) refused_locked((size_t)asking[k].listener, now_ms());
            pthread_mutex_unlock(&conns_lock);
        }
    }
    /* No new handle names a socket nobody answers, and no member finds one. */
    pthread_mutex_lock(&serve_lock);
    pthread_mutex_lock(&conns_lock);
    close_listeners_locked(1);
    pthread_mutex_unlock(&conns_lock);
    listen_fd = -1;
    serving_pid = 0;
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
        if (conns[i].state != DONE) close(conns[i].fd);
    n_conns = 0;
    /* A child that outlives its parent must not keep the sockets: receivers and
     * members would wait for an answer. The names stay the parent's. */
    close_listeners_locked(0);
    listen_fd = -1;
    serving_pid = 0;
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

/* Adds a listener for the thread to poll; 0 if there is no room. */
static int add_listener(int fd, const char *name, int device, const char *job, const char *identity)
{
    pthread_mutex_lock(&conns_lock);
    int ok = n_listeners < LISTENERS_MAX;
    if (ok) {
        struct listener *l = &listeners[n_listeners++];
        *l = (struct listener){.fd = fd, .device = device};
        snprintf(l->name, sizeof l->name, "%s", name);
        snprintf(l->job, sizeof l->job, "%s", job ? job : "");
        snprintf(l->identity, sizeof l->identity, "%s", identity ? identity : "");
        changed = 1;
    }
    pthread_mutex_unlock(&conns_lock);
    return ok;
}

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

void tms_share_serve_wake(void)
{
    pthread_mutex_lock(&serve_lock);
    uint64_t one = 1;
    if (wake_fd >= 0 && thread_pid == getpid()) (void)!write(wake_fd, &one, sizeof one);
    pthread_mutex_unlock(&serve_lock);
}

int tms_share_serve_job(int fd, const char *name, int device, const char *job, const char *identity,
                        struct tms_err *err)
{
    pthread_once(&fork_once, register_fork);
    pthread_mutex_lock(&serve_lock);
    int rc = start_thread_locked(err);
    if (!rc && !add_listener(fd, name, device, job, identity))
        rc = tms_fail(err, TMS_E_STATE, 0, "job: this process listens on %d sockets already", LISTENERS_MAX);
    uint64_t one = 1;
    if (!rc) (void)!write(wake_fd, &one, sizeof one);
    pthread_mutex_unlock(&serve_lock);
    return rc;
}

/* Removes the names of senders killed before they could remove them: of
 * the first names listed, those whose pid runs nowhere this process sees and
 * on which nobody listens (a sender in another PID namespace still answers). */
#define SWEEP_LISTED 1024
static void sweep_senders(int dir, const char *path)
{
    char (*names)[TMS_OS_SOCKET_NAME_MAX] = malloc(SWEEP_LISTED * sizeof *names);
    size_t n = 0, tried = 0;
    if (!names || tms_os_socket_names(dir, "s-", names, SWEEP_LISTED, &n) != 0) n = 0;
    for (size_t i = 0; i < n && tried < SWEEP_MAX; i++) {
        unsigned pid = 0;
        if (sscanf(names[i], "s-%u-", &pid) != 1 || tms_os_process_runs((int)pid)) continue;
        int fd = tms_os_socket(1);
        if (fd < 0) break;
        tried++;
        int rc = tms_os_connect_at(fd, dir, path, names[i]);
        close(fd);
        if (rc == -ECONNREFUSED) (void)tms_os_remove_socket(dir, names[i]);
    }
    free(names);
}

/* The share listening socket (and the thread), once per process: named by
 * its pid and a random id in the user's place, where no other user reaches it. */
static int start_locked(uint64_t *id, struct tms_err *err)
{
    pid_t pid = getpid();
    if (serving_pid == pid) {
        *id = serving_id;
        return TMS_OK;
    }
    int dir = -1;
    char path[PATH_MAX], name[TMS_OS_SOCKET_NAME_MAX];
    int rc = tms_share_place("share", &dir, path, sizeof path, err);
    if (rc) return rc;
    uint64_t fresh;
    if (getrandom(&fresh, sizeof fresh, 0) != (ssize_t)sizeof fresh)
        return tms_fail(err, TMS_E_HOST_OOM, 0, "share: no random bytes for the socket's name");
    sweep_senders(dir, path);
    tms_share_sender_name(name, sizeof name, (unsigned)pid, (unsigned long long)fresh);
    /* Non-blocking: the thread accepts what waits until none is left. */
    int fd = -1;
    rc = tms_os_listen_at(dir, path, name, LISTEN_BACKLOG, &fd);
    if (rc)
        return tms_fail(err, TMS_E_IO, rc < 0 ? -rc : 0, "share: cannot listen on %s/%s: %s", path, name,
                        rc < 0 ? strerror(-rc) : "not a socket");
    rc = start_thread_locked(err);
    if (!rc && !add_listener(fd, name, -1, NULL, NULL))
        rc = tms_fail(err, TMS_E_STATE, 0, "share: this process listens on %d sockets already", LISTENERS_MAX);
    if (rc) {
        close(fd);
        (void)tms_os_remove_socket(dir, name);
        return rc;
    }
    uint64_t one = 1;
    (void)!write(wake_fd, &one, sizeof one);
    listen_fd = fd;
    serving_pid = pid;
    serving_id = fresh;
    *id = fresh;
    return TMS_OK;
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

int tms_share_serving_here(uint32_t pid, uint64_t socket_id)
{
    pthread_mutex_lock(&serve_lock);
    int here = serving_pid == getpid() && (uint32_t)serving_pid == pid && serving_id == socket_id;
    pthread_mutex_unlock(&serve_lock);
    return here;
}

int tms_share_export(uint64_t ptr, unsigned char *handle, uint64_t *base, size_t *size, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    if (!drv->export_fd)
        return tms_fail(err, TMS_E_UNSUPPORTED, 0, "share: the %s backend cannot share memory with another process",
                        drv->name);
    struct tms_share_info info;
    rc = tms_core_share_find(ptr, &info, err);
    if (rc) return rc;
    pthread_once(&fork_once, register_fork);
    uint64_t id = 0;
    pthread_mutex_lock(&serve_lock);
    rc = start_locked(&id, err);
    pthread_mutex_unlock(&serve_lock);
    if (rc) return rc;
    struct tms_share_handle h = {.pid = (uint32_t)getpid(), .socket_id = id, .va = info.va, .size = info.size};
    memcpy(h.magic, TMS_SHARE_MAGIC, sizeof h.magic);
    memcpy(h.token, info.token, sizeof h.token);
    memcpy(handle, &h, sizeof h);
    *base = info.va;
    *size = info.size;
    return TMS_OK;
}

int tms_share_is_handle(const unsigned char *handle)
{
    return handle && memcmp(handle, TMS_SHARE_MAGIC, 8) == 0;
}
