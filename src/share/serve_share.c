/* The share's side of the sender's thread: handles exported, a receiver's request answered, a holder's let-go or hang-up, the share socket started and dead senders' names swept. */
#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/core_share.h"
#include "platform/driver.h"
#include "platform/log.h"
#include "platform/os.h"
#include "share/job_internal.h"
#include "share/place.h"
#include "share/serve.h"
#include "share/wire.h"

#define LISTEN_BACKLOG 64
/* Names of senders gone without removing them (killed) that a new sender removes. */
#define SWEEP_MAX 64

/* The share socket of this process, under serve_lock (serve.c's, taken
 * through tms_serve_lock; the thread's stop and a fork's child forget it
 * through share_stopped_locked, under the same lock). A forked child has the
 * parent's descriptors but not its thread: it starts its own on its first share. */
static pid_t serving_pid;       /* guarded by serve_lock: the process whose thread serves the share socket */
static uint64_t serving_id;     /* guarded by serve_lock */

/* Answers a receiver's request: the memory's descriptors, or why not. */
static struct tms_serve_outcome answer_share(int fd, int pid, const struct tms_serve_listener *l,
                                             const union tms_serve_request *msg, size_t len)
{
    (void)l;  /* any listener: a handle names the allocation and its token, not the socket */
    struct tms_serve_outcome out = {.fd = fd, .refused = 1};
    const struct tms_share_request req = msg->share;
    if (len != sizeof req || memcmp(req.magic, TMS_SHARE_MAGIC, sizeof req.magic) != 0) return out;
    struct tms_share_reply reply = {0};
    struct tms_share_info info;
    struct tms_err err = {0};
    int fds[TMS_SHARE_MAX_CHUNKS];
    int rc = tms_core_share_attach(req.va, req.token, pid, fds, &info, tms_job_lent_fd, &err);
    if (rc) {
        reply.status = rc;
        snprintf(reply.message, sizeof reply.message, "%s", err.msg);
        (void)tms_serve_send_reply(fd, &reply, 0);
        return out;
    }
    reply.n_chunks = info.n_chunks;
    reply.device = info.device;
    reply.size = info.size;
    reply.reserved = info.reserved;
    reply.chunk = info.chunk;
    for (int i = 0; !info.chunk && i < info.n_chunks; i++) reply.lens[i] = info.lens[i];
    /* The lengths only where they differ: chunks of one size go as they always did. */
    size_t sent_len = info.chunk ? offsetof(struct tms_share_reply, lens) : sizeof reply;
    int sent = tms_share_send(fd, &reply, sent_len, fds, info.n_chunks, 0);
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

/* A holder's socket is readable: it said it let go (and hangs up), or it
 * hung up without saying so. Only a process that has ended is taken to have
 * let go without saying it: its mappings went with it. */
static void holder_spoke_locked(struct tms_serve_conn *c)
{
    struct tms_share_let_go msg;
    ssize_t n;
    do n = recv(c->fd, &msg, sizeof msg, MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n < 0 && errno == EAGAIN) return;
    int said = n == (ssize_t)sizeof msg && memcmp(msg.magic, TMS_SHARE_LET_GO, sizeof msg.magic) == 0 &&
               msg.va == c->va;
    int pidfd = -1, ended = said ? 1 : tms_serve_peer_ended(c->fd, c->pid, &pidfd);
    uint32_t mark = tms_core_share_detach(c->va, c->token, c->pid, ended == 1);
    tms_serve_close_conn(c);
    if (ended == 1) return;
    TMS_DEBUG("share: pid %d hung up on 0x%llx without saying it let go", c->pid, (unsigned long long)c->va);
    if (pidfd < 0) return;  /* marked until the memory's next pause */
    c->fd = pidfd;
    c->state = TMS_CONN_HUNG_UP;
    c->mark = mark;
}

static void holder_ended_locked(struct tms_serve_conn *c)
{
    tms_core_share_gone(c->va, c->token, c->pid, c->mark);
    tms_serve_close_conn(c);
}

static void share_unheld_locked(const struct tms_serve_outcome *out, int pid)
{
    (void)tms_core_share_detach(out->va, out->token, pid, 1);
}

/* The thread that served the share socket is gone: the next share starts another. */
static void share_stopped_locked(void) { serving_pid = 0; }

static const struct tms_serve_protocol share_protocol = {
    .magic = TMS_SHARE_MAGIC,
    .answer = answer_share,
    .spoke_locked = holder_spoke_locked,
    .ended_locked = holder_ended_locked,
    .unheld_locked = share_unheld_locked,
    .stopped_locked = share_stopped_locked,
};

__attribute__((constructor)) static void register_share_protocol(void) { tms_serve_add_protocol(&share_protocol); }

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
    rc = tms_serve_listen_locked(fd, name, -1, NULL, NULL, "share", err);
    if (rc) {
        close(fd);
        (void)tms_os_remove_socket(dir, name);
        return rc;
    }
    serving_pid = pid;
    serving_id = fresh;
    *id = fresh;
    return TMS_OK;
}

int tms_share_serving_here(uint32_t pid, uint64_t socket_id)
{
    tms_serve_register_fork();  /* a fork while the lock is held leaves it free in the child */
    tms_serve_lock();
    int here = serving_pid == getpid() && (uint32_t)serving_pid == pid && serving_id == socket_id;
    tms_serve_unlock();
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
    tms_serve_register_fork();
    uint64_t id = 0;
    tms_serve_lock();
    rc = start_locked(&id, err);
    tms_serve_unlock();
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
