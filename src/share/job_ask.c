/* Asking the job's members, within one bound per call: connecting to them, sending a request, taking their answers as they come; what a pause keeps as they answer, and what they release when the driver runs out here. */
#include "share/job_internal.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "platform/log.h"
#include "platform/os.h"
#include "share/wire.h"

#define MEMBERS_MAX 32   /* members one pause or resume asks */

/* ---- asking ---------------------------------------------------------------------------------- */

void tms_job_note_timeout(struct tms_job_note *note, int pid)
{
    if (note->timed_out < TMS_REPORT_PIDS) note->timed_out_pids[note->timed_out] = pid;
    note->timed_out++;
}

void tms_job_fill_request(struct tms_job_request *req, int op, const struct tms_job_asking *a)
{
    memset(req, 0, TMS_JOB_REQUEST_HEAD);
    memcpy(req->magic, TMS_JOB_MAGIC, sizeof req->magic);
    req->op = (uint32_t)op;
    snprintf(req->job, sizeof req->job, "%s", a->job);
    snprintf(req->device, sizeof req->device, "%s", a->identity);
}

int tms_job_connect_member(const struct tms_job_asking *a, struct tms_job_member *m)
{
    m->pid = atoi(m->name + strlen(a->prefix));
    if ((m->fd = tms_job_open_conn()) < 0) return TMS_MEMBER_GONE;
    int rc = tms_os_connect_at(m->fd, a->dir, a->path, m->name);
    struct tms_os_peer peer;
    if (!rc && tms_os_peer_of(m->fd, &peer) == 0) {
        if (peer.pid > 0) m->pid = peer.pid;  /* from the kernel, not the name */
        return TMS_MEMBER_ASKED;
    }
    if (rc == -ECONNREFUSED) (void)tms_os_remove_socket(a->dir, m->name);
    tms_job_close_conn(m->fd);
    m->fd = -1;
    return rc == -EAGAIN ? TMS_MEMBER_TIMED_OUT : TMS_MEMBER_GONE;
}

int tms_job_send_request(struct tms_job_member *m, const struct tms_job_request *req, size_t len)
{
    ssize_t n;
    do n = send(m->fd, req, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n == (ssize_t)len) return TMS_MEMBER_ASKED;
    int full = n < 0 && (errno == EAGAIN || errno == ENOBUFS);
    tms_job_close_conn(m->fd);
    m->fd = -1;
    return full ? TMS_MEMBER_TIMED_OUT : TMS_MEMBER_GONE;
}

size_t tms_job_ask_members(const struct tms_job_asking *a, struct tms_job_member *m, size_t n,
                           const struct tms_job_request *req, size_t len, struct tms_job_note *note)
{
    size_t asked = 0;
    for (size_t i = 0; i < n && asked < MEMBERS_MAX; i++) {
        int rc = tms_job_connect_member(a, &m[i]);
        if (rc == TMS_MEMBER_ASKED) rc = tms_job_send_request(&m[i], req, len);
        if (rc == TMS_MEMBER_GONE) continue;
        note->members++;
        if (rc == TMS_MEMBER_TIMED_OUT) tms_job_note_timeout(note, m[i].pid);
        else m[asked++] = m[i];
    }
    return asked;
}

ssize_t tms_job_take_answer(int fd, uint64_t deadline, void *buf, size_t len, int *fds, int max_fds, int *n_fds,
                            int *timed_out)
{
    *timed_out = 0;
    *n_fds = 0;
    for (;;) {
        uint64_t now = tms_job_now_ms();
        if (now >= deadline) {
            *timed_out = 1;
            return -1;
        }
        struct pollfd p = {.fd = fd, .events = POLLIN};
        int r = poll(&p, 1, (int)(deadline - now));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            *timed_out = r == 0;
            return -1;
        }
        return tms_share_recv(fd, buf, len, fds, max_fds, n_fds, MSG_DONTWAIT);
    }
}

void tms_job_take_statuses(const struct tms_job_asking *a, struct tms_job_member *m, size_t n,
                           struct tms_job_note *note,
                           int (*take)(void *ctx, const struct tms_job_member *m, const struct tms_job_status_reply *r),
                           void *ctx)
{
    struct pollfd polls[MEMBERS_MAX];
    size_t waiting = n, done = 0;
    while (waiting && !done) {
        size_t k = 0;
        for (size_t i = 0; i < n; i++)
            if (m[i].fd >= 0) polls[k++] = (struct pollfd){.fd = m[i].fd, .events = POLLIN};
        uint64_t now = tms_job_now_ms();
        if (now >= a->deadline) break;
        int r = poll(polls, k, (int)(a->deadline - now));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) break;
        for (size_t i = 0, j = 0; i < n && !done; i++) {
            if (m[i].fd < 0) continue;
            if (!polls[j++].revents) continue;
            struct tms_job_status_reply reply;
            int n_fds;
            ssize_t got = tms_share_recv(m[i].fd, &reply, sizeof reply, NULL, 0, &n_fds, MSG_DONTWAIT);
            tms_job_close_conn(m[i].fd);
            m[i].fd = -1;
            waiting--;
            /* Gone meanwhile, or not of this job after all: it says nothing. */
            if (got == (ssize_t)sizeof reply && !reply.status) done = take(ctx, &m[i], &reply);
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (m[i].fd < 0) continue;
        if (!done) tms_job_note_timeout(note, m[i].pid);
        tms_job_close_conn(m[i].fd);
        m[i].fd = -1;
    }
}

/* ---- keeping --------------------------------------------------------------------------------- */

static int add_demand(void *ctx, const struct tms_job_member *m, const struct tms_job_status_reply *r)
{
    (void)m;
    size_t *want = ctx;
    if (r->demand > r->idle) *want += r->demand - r->idle;
    return *want != 0;  /* one member waiting for memory is enough to keep it all */
}

/* What a pause keeps: all it releases while another member on device has
 * paused more than it keeps idle itself (it will ask for memory soon), else
 * nothing. All of it, not just what the others will ask for: what goes back
 * to the driver is scrubbed at once, and that scrubbing slows the copies of
 * the resume that follows, wherever that resume's memory comes from. The
 * bound gives it back later, and a member out of memory asks for it first.
 * The members are asked together, within one bound. */
size_t tms_job_ask_keep(int device, size_t releasable, struct tms_job_note *note)
{
    struct tms_job_asking a;
    struct tms_err err = {0};
    /* A member that paused is found by the others from now on, whatever it keeps. */
    if (tms_job_join_device(device, &a, &err)) {
        TMS_DEBUG("%s", err.msg);
        return 0;
    }
    if (!releasable) return 0;
    struct tms_job_member *m = NULL;
    size_t n = tms_job_list_members(&a, &m), want = 0;
    struct tms_job_request req;
    tms_job_fill_request(&req, TMS_JOB_STATUS, &a);
    if (m)
        tms_job_take_statuses(&a, m, tms_job_ask_members(&a, m, n, &req, TMS_JOB_REQUEST_HEAD, note), note, add_demand,
                              &want);
    free(m);
    return want ? releasable : 0;
}

/* ---- releasing ------------------------------------------------------------------------------- */

/* The driver is out of memory here: the members release what they keep idle
 * on the device, up to bytes in all, asked in turn within one bound. */
size_t tms_job_ask_release(int device, size_t bytes)
{
    struct tms_job_asking a;
    struct tms_err err = {0};
    if (tms_job_join_device(device, &a, &err)) return 0;
    struct tms_job_member *m = NULL;
    size_t n = tms_job_list_members(&a, &m), freed = 0, asked = 0;
    struct tms_job_request req;
    tms_job_fill_request(&req, TMS_JOB_RELEASE, &a);
    req.n_needs = 1;
    for (size_t i = 0; m && i < n && asked < MEMBERS_MAX && freed < bytes && tms_job_now_ms() < a.deadline; i++) {
        req.needs[0] = bytes - freed;
        if (tms_job_connect_member(&a, &m[i]) != TMS_MEMBER_ASKED) continue;
        asked++;
        int timed_out, n_fds;
        struct tms_job_status_reply reply;
        int sent = tms_job_send_request(&m[i], &req, TMS_JOB_REQUEST_HEAD + sizeof req.needs[0]);
        ssize_t got = sent == TMS_MEMBER_ASKED
                          ? tms_job_take_answer(m[i].fd, a.deadline, &reply, sizeof reply, NULL, 0, &n_fds, &timed_out)
                          : -1;
        if (m[i].fd >= 0) tms_job_close_conn(m[i].fd);
        if (got == (ssize_t)sizeof reply && !reply.status) freed += reply.demand;
    }
    free(m);
    TMS_DEBUG("job '%s': members released %zu bytes kept on device %d (%zu asked)", a.job, freed, device, bytes);
    return freed;
}
