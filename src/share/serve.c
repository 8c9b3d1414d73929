/* The sender: handles for this process's allocations, and the thread that hands their memory to receivers and watches who holds it. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "core/core.h"
#include "platform/driver.h"
#include "platform/fork.h"
#include "platform/log.h"
#include "share/wire.h"

size_t tms_share_address(struct sockaddr_un *addr, uint32_t pid, uint64_t socket_id)
{
    memset(addr, 0, sizeof *addr);
    addr->sun_family = AF_UNIX;
    int n = snprintf(addr->sun_path + 1, sizeof addr->sun_path - 1, "tms-share-%u-%016llx", (unsigned)pid,
                     (unsigned long long)socket_id);
    return offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n;
}

/* The listening socket of this process. A forked child has the parent's
 * descriptor but not its thread: it starts its own on its first share. */
static pthread_mutex_t serve_lock = PTHREAD_MUTEX_INITIALIZER;
static int listen_fd = -1;      /* guarded by serve_lock */
static pid_t serving_pid;       /* guarded by serve_lock: the process whose thread serves listen_fd */
static uint64_t serving_id;     /* guarded by serve_lock */
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void register_fork(void);

/* One receiver: it asks once, then holds what it got until it hangs up. */
struct conn {
    int fd;
    int pid;
    int holding;
    uint64_t ask_by_ms;  /* a connection that has not asked: closed at this time */
    uint64_t va;
    unsigned char token[TMS_SHARE_TOKEN_BYTES];
};

static void hang_up(struct conn *c)
{
    if (c->holding) tms_core_share_detach(c->va, c->token, c->pid);
    close(c->fd);
    c->fd = -1;
}

static int send_reply(int fd, const struct tms_share_reply *reply, const int *fds, int n_fds)
{
    struct iovec iov = {.iov_base = (void *)reply, .iov_len = sizeof *reply};
    union {
        char buf[CMSG_SPACE(sizeof(int) * TMS_SHARE_MAX_CHUNKS)];
        struct cmsghdr align;
    } control;
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
    do n = sendmsg(fd, &msg, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    return n == (ssize_t)sizeof *reply ? 0 : -1;
}

/* What a request ended with: held (the receiver got the descriptors) or to be closed. */
struct outcome {
    int fd;
    int holding;
    uint64_t va;
    unsigned char token[TMS_SHARE_TOKEN_BYTES];
};

/* Answers a request: the memory's descriptors, or why not. Runs without
 * conns_lock: attaching may wait for a pause of that memory, and other
 * tags' pauses (which reap first) must not wait with it. */
static struct outcome answer(int fd, int pid)
{
    struct outcome out = {.fd = fd};
    struct tms_share_request req;
    ssize_t n;
    do n = recv(fd, &req, sizeof req, MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n != (ssize_t)sizeof req || memcmp(req.magic, TMS_SHARE_MAGIC, sizeof req.magic) != 0) return out;
    struct tms_share_reply reply = {0};
    struct tms_share_info info;
    struct tms_err err = {0};
    int fds[TMS_SHARE_MAX_CHUNKS];
    int rc = tms_core_share_attach(req.va, req.token, pid, fds, &info, &err);
    if (rc) {
        reply.status = rc;
        snprintf(reply.message, sizeof reply.message, "%s", err.msg);
        (void)send_reply(fd, &reply, NULL, 0);
        return out;
    }
    reply.n_chunks = info.n_chunks;
    reply.device = info.device;
    reply.size = info.size;
    reply.reserved = info.reserved;
    reply.chunk = info.chunk;
    int sent = send_reply(fd, &reply, fds, info.n_chunks);
    for (int i = 0; i < info.n_chunks; i++) close(fds[i]);
    if (sent) {
        tms_core_share_detach(req.va, req.token, pid);
        return out;
    }
    TMS_DEBUG("shared 0x%llx with pid %d", (unsigned long long)req.va, pid);
    out.holding = 1;
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
static uint64_t listen_resume_ms;  /* the thread's own: descriptors ran out, the listener rests until then */

/* A connection that has not asked by then is closed: it holds a descriptor
 * and a slot, and an honest receiver asks at once. */
#define ASK_WITHIN_MS ((uint64_t)TMS_SHARE_TIMEOUT_S * 1000)
#define LISTEN_REST_MS 100

static uint64_t now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

static void accept_one_locked(int lfd, uint64_t now)
{
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) {
        /* Out of descriptors or memory: the pending connection stays readable,
         * so the listener rests rather than spin. */
        if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM)
            listen_resume_ms = now + LISTEN_REST_MS;
        return;
    }
    struct ucred cred;
    socklen_t len = sizeof cred;
    /* Only this user's processes: anyone can reach an abstract socket. */
    if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != geteuid()) {
        TMS_DEBUG("share: refused a connection from uid %d", len == sizeof cred ? (int)cred.uid : -1);
        close(fd);
        return;
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
    conns[n_conns++] = (struct conn){.fd = fd, .pid = cred.pid, .ask_by_ms = now + ASK_WITHIN_MS};
}

static void drop_closed_locked(void)
{
    size_t kept = 0;
    for (size_t i = 0; i < n_conns; i++)
        if (conns[i].fd >= 0) conns[kept++] = conns[i];
    n_conns = kept;
}

/* Holders that hung up, let go now: a receiver's close (or exit) is complete
 * when it returns, so a pause that follows it finds the memory free. */
static void reap(void)
{
    pthread_mutex_lock(&conns_lock);
    int closed = 0;
    for (size_t i = 0; i < n_conns; i++) {
        if (!conns[i].holding) continue;
        struct pollfd p = {.fd = conns[i].fd, .events = POLLIN};
        if (poll(&p, 1, 0) > 0) {
            hang_up(&conns[i]);
            closed = 1;
        }
    }
    if (closed) {
        drop_closed_locked();
        changed = 1;
    }
    pthread_mutex_unlock(&conns_lock);
}

/* What the thread polls: the listener unless it rests, and every connection;
 * *timeout_ms until the first deadline (a connection's, or the rest's end). */
static size_t fill_polls_locked(struct pollfd *polls, size_t cap, int lfd, uint64_t now, int *timeout_ms)
{
    uint64_t next = UINT64_MAX;
    size_t n = 0;
    if (now >= listen_resume_ms) polls[n++] = (struct pollfd){.fd = lfd, .events = POLLIN};
    else next = listen_resume_ms;
    for (size_t i = 0; i < n_conns && n < cap; i++) {
        polls[n++] = (struct pollfd){.fd = conns[i].fd, .events = POLLIN};
        if (!conns[i].holding && conns[i].ask_by_ms < next) next = conns[i].ask_by_ms;
    }
    *timeout_ms = next == UINT64_MAX ? -1 : next <= now ? 0 : (int)(next - now < 60000 ? next - now : 60000);
    return n;
}

static struct conn *conn_with_fd_locked(int fd)
{
    for (size_t i = 0; i < n_conns; i++)
        if (conns[i].fd == fd) return &conns[i];
    return NULL;
}

static void *serve(void *arg)
{
    int lfd = (int)(intptr_t)arg;
    struct pollfd *polls = NULL;
    struct conn *asking = NULL;  /* copies of the connections that asked, answered without the lock */
    size_t poll_cap = 0;
    for (;;) {
        pthread_mutex_lock(&conns_lock);
        if (poll_cap < n_conns + 1) {
            struct pollfd *more = realloc(polls, (n_conns + 16) * sizeof *more);
            struct conn *more_asking = more ? realloc(asking, (n_conns + 16) * sizeof *more_asking) : NULL;
            if (more) polls = more;
            if (more_asking) {
                asking = more_asking;
                poll_cap = n_conns + 16;
            }
        }
        int timeout = -1;
        size_t n = poll_cap ? fill_polls_locked(polls, poll_cap, lfd, now_ms(), &timeout) : 0;
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
        int listener_ready = 0;
        for (size_t k = 0; !changed && k < n; k++) {
            if (polls[k].fd == lfd) {
                listener_ready = (polls[k].revents & POLLIN) != 0;
                continue;
            }
            struct conn *c = conn_with_fd_locked(polls[k].fd);
            if (!c || !polls[k].revents) continue;
            /* A holder says nothing more: readable means it hung up (or broke the protocol). */
            if (c->holding) hang_up(c);
            else asking[n_asking++] = *c;
        }
        for (size_t i = 0; i < n_conns; i++) {  /* asked nothing in time */
            if (conns[i].fd < 0 || conns[i].holding || conns[i].ask_by_ms > now) continue;
            int is_asking = 0;
            for (size_t k = 0; k < n_asking; k++) is_asking |= asking[k].fd == conns[i].fd;
            if (!is_asking) hang_up(&conns[i]);
        }
        drop_closed_locked();
        if (listener_ready) accept_one_locked(lfd, now);
        pthread_mutex_unlock(&conns_lock);
        for (size_t k = 0; k < n_asking; k++) {
            struct outcome out = answer(asking[k].fd, asking[k].pid);
            pthread_mutex_lock(&conns_lock);
            struct conn *c = conn_with_fd_locked(out.fd);
            if (c && out.holding) {
                c->holding = 1;
                c->va = out.va;
                memcpy(c->token, out.token, sizeof c->token);
            } else if (c) {
                hang_up(c);
                drop_closed_locked();
            } else if (out.holding) {  /* gone meanwhile (a fork's child closed it): nobody holds it */
                tms_core_share_detach(out.va, out.token, asking[k].pid);
            }
            pthread_mutex_unlock(&conns_lock);
        }
    }
    pthread_mutex_lock(&serve_lock);
    if (listen_fd == lfd) {  /* no new handle names a socket nobody answers */
        close(lfd);
        listen_fd = -1;
        serving_pid = 0;
    }
    pthread_mutex_unlock(&serve_lock);
    free(polls);
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
    for (size_t i = 0; i < n_conns; i++) close(conns[i].fd);
    n_conns = 0;
    /* A child that outlives its parent must not keep the name: receivers would wait for an answer. */
    if (listen_fd >= 0) close(listen_fd);
    listen_fd = -1;
    serving_pid = 0;
    pthread_mutex_unlock(&conns_lock);
    pthread_mutex_unlock(&serve_lock);
}
static void register_fork(void)
{
    static const struct tms_fork_handlers handlers = {fork_prepare, fork_parent, fork_child};
    tms_fork_register(TMS_FORK_SHARE_SERVE, &handlers);
}

/* The listening socket and its thread, once per process. */
static int start_locked(uint64_t *id, struct tms_err *err)
{
    pid_t pid = getpid();
    if (serving_pid == pid) {
        *id = serving_id;
        return TMS_OK;
    }
    uint64_t fresh;
    if (getrandom(&fresh, sizeof fresh, 0) != (ssize_t)sizeof fresh)
        return tms_fail(err, TMS_E_HOST_OOM, 0, "share: no random bytes for the socket's name");
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) return tms_fail(err, TMS_E_IO, errno, "share: socket() failed: %s", strerror(errno));
    struct sockaddr_un addr;
    size_t len = tms_share_address(&addr, (uint32_t)pid, fresh);
    if (bind(fd, (struct sockaddr *)&addr, (socklen_t)len) != 0 || listen(fd, SOMAXCONN) != 0) {
        int e = errno;
        close(fd);
        return tms_fail(err, TMS_E_IO, e, "share: cannot listen on the abstract socket @%s: %s", addr.sun_path + 1,
                        strerror(e));
    }
    pthread_t thread;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&thread, &attr, serve, (void *)(intptr_t)fd);
    pthread_attr_destroy(&attr);
    if (rc) {
        close(fd);
        return tms_fail(err, TMS_E_HOST_OOM, rc, "share: cannot start the sender's thread: %s", strerror(rc));
    }
    tms_core_share_set_reaper(reap);
    listen_fd = fd;
    serving_pid = pid;
    serving_id = fresh;
    *id = fresh;
    return TMS_OK;
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
