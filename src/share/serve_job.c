/* The job's side of the sender's thread: a member's STATUS, BORROW and RELEASE answered, a borrower's returns and hang-up, the members' sockets registered. */
#include <errno.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "share/job_internal.h"
#include "platform/log.h"
#include "share/serve.h"
#include "share/wire.h"

/* Answers a member of the job l listens for: what it has paused and keeps
 * idle on the device, or kept memory for what it needs. */
static struct tms_serve_outcome answer_job(int fd, int pid, const struct tms_serve_listener *l,
                                           const union tms_serve_request *msg, size_t len)
{
    const struct tms_job_request *req = &msg->job;
    struct tms_serve_outcome out = {.fd = fd, .refused = 1};
    int named = len >= TMS_JOB_REQUEST_HEAD && (len - TMS_JOB_REQUEST_HEAD) % sizeof(uint64_t) == 0 &&
                req->n_needs == (len - TMS_JOB_REQUEST_HEAD) / sizeof(uint64_t) && req->n_needs <= TMS_JOB_MAX_NEEDS &&
                memchr(req->job, 0, sizeof req->job) && memchr(req->device, 0, sizeof req->device);
    /* Only its own job's members, about its own device: another job's process
     * gets nothing, and so does one asking the share socket (device -1). */
    int ours = named && l->device >= 0 && strcmp(req->job, l->job) == 0 && strcmp(req->device, l->identity) == 0;
    if (ours && (req->op == TMS_JOB_STATUS || (req->op == TMS_JOB_RELEASE && req->n_needs == 1))) {
        struct tms_job_status_reply reply = {0};
        size_t demand = 0, idle = 0;
        if (req->op == TMS_JOB_STATUS) tms_job_status(l->device, &demand, &idle);
        else demand = tms_job_pool_release(l->device, req->needs[0]);
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
    reply.status = tms_job_lend(l->device, req->needs, req->n_needs, pid, lent, fds, &k, &batch, &err);
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
        (void)tms_job_returned(batch, NULL, 0, 0);  /* nothing reached it */
        return out;
    }
    TMS_DEBUG("lent %zu kept handles on device %d to pid %d", k, l->device, pid);
    out.holding = 1;
    out.batch = batch;
    return out;
}

/* Whether a job's lend still has handles out, asking without changing it
 * (key 0 names none). */
static size_t still_lent(uint64_t batch)
{
    const uint64_t none = 0;
    return tms_job_returned(batch, &none, 1, 0);
}

/* A borrower's socket is readable: it returned pieces (and hangs up once
 * nothing of the lend is left), or it hung up. What it hung up on still
 * counts as lent until its process ends: it may map the memory. */
static void borrower_spoke_locked(struct tms_serve_conn *c)
{
    struct tms_job_returned msg;
    ssize_t n;
    do n = recv(c->fd, &msg, sizeof msg, MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n < 0 && errno == EAGAIN) return;
    size_t head = offsetof(struct tms_job_returned, keys);
    if (n >= (ssize_t)head && memcmp(msg.magic, TMS_JOB_RETURNED, sizeof msg.magic) == 0 &&
        msg.n <= TMS_JOB_MAX_PIECES && (size_t)n == head + msg.n * sizeof msg.keys[0]) {
        if (tms_job_returned(c->batch, msg.keys, msg.n, (msg.flags & TMS_JOB_RETURNED_SPENT) != 0) == 0)
            tms_serve_close_conn(c);
        return;
    }
    if (!still_lent(c->batch)) {
        tms_serve_close_conn(c);
        return;
    }
    int pidfd = -1, ended = tms_serve_peer_ended(c->fd, c->pid, &pidfd);
    tms_serve_close_conn(c);
    if (ended == 1) {  /* it may have shared the memory on: never used again */
        (void)tms_job_returned(c->batch, NULL, 0, 1);
        return;
    }
    TMS_DEBUG("job: pid %d hung up on borrowed memory without returning it", c->pid);
    if (pidfd < 0) return;  /* counted lent for as long as this process lives */
    c->fd = pidfd;
    c->state = TMS_CONN_HUNG_UP;
}

/* A borrower that hung up has ended: it may have shared the memory on, so it is never used again. */
static void borrower_ended_locked(struct tms_serve_conn *c)
{
    (void)tms_job_returned(c->batch, NULL, 0, 1);
    tms_serve_close_conn(c);
}

static void lend_unheld_locked(const struct tms_serve_outcome *out, int pid)
{
    (void)pid;
    (void)tms_job_returned(out->batch, NULL, 0, 1);
}

static const struct tms_serve_protocol job_protocol = {
    .magic = TMS_JOB_MAGIC,
    .answer = answer_job,
    .spoke_locked = borrower_spoke_locked,
    .ended_locked = borrower_ended_locked,
    .unheld_locked = lend_unheld_locked,
};

__attribute__((constructor)) static void register_job_protocol(void) { tms_serve_add_protocol(&job_protocol); }

int tms_share_serve_job(int fd, const char *name, int device, const char *job, const char *identity,
                        struct tms_err *err)
{
    tms_serve_register_fork();
    tms_serve_lock();
    int rc = tms_serve_listen_locked(fd, name, device, job, identity, "job", err);
    tms_serve_unlock();
    return rc;
}
