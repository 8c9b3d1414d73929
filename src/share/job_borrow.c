/* Borrowing from the job's members: each asked how much it keeps idle, those that keep some asked for it, and what they lend checked (every piece sized as asked, every file sealed and new here) before it is imported. */
#include "share/job_internal.h"

#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "platform/driver.h"
#include "platform/log.h"
#include "platform/os.h"
#include "share/wire.h"

/* What a lender's answer says must be memory this process can map. */
/* A lent handle maps whole (the driver maps no part of one): its length is its size. */
static int lend_ok(const struct tms_job_lend_reply *r, ssize_t got, int n_fds, const size_t *left, size_t n,
                   size_t gran)
{
    size_t head = offsetof(struct tms_job_lend_reply, pieces);
    if (got < (ssize_t)head || r->status || r->n > TMS_JOB_MAX_PIECES || (size_t)got != head + r->n * sizeof r->pieces[0] ||
        (int)r->n != n_fds)
        return 0;
    size_t want[TMS_JOB_MAX_NEEDS];
    memcpy(want, left, n * sizeof *left);
    for (uint32_t i = 0; i < r->n; i++) {
        const struct tms_job_lend_piece *p = &r->pieces[i];
        if (p->need >= n || !p->key || !p->len || p->len % gran || p->size % gran || p->len != p->size ||
            p->len > want[p->need])
            return 0;
        want[p->need] -= p->len;
    }
    return 1;
}

/* The files a lend's descriptors are, where they are files (the host
 * backend's memfds; a GPU driver's descriptors are not, and its import checks
 * them): each sealed against shrinking, at least the size it is lent as, and
 * none the same file as another piece of the lend or as a piece this process
 * holds already (one file mapped twice would be two allocations' bytes).
 * 1 if they pass, with is_file[i] and ids[i] of each. */
static int pieces_ok(const struct tms_job_lend_reply *r, const int *fds, int *is_file, struct tms_os_id *ids,
                     const char **why)
{
    for (uint32_t i = 0; i < r->n; i++) {
        int v = tms_os_check_sealed(fds[i], r->pieces[i].size, &ids[i]);
        is_file[i] = v == 0;
        if (v == TMS_OS_NOT_FILE) continue;
        if (v) {
            *why = v == TMS_OS_UNSEALED ? "a file it could still shrink" : v == TMS_OS_SHORT ? "a file shorter than lent"
                                                                                          : "a file that cannot be read";
            return 0;
        }
        for (uint32_t j = 0; j < i; j++)
            if (is_file[j] && tms_os_same_id(&ids[i], &ids[j])) {
                *why = "one file as two pieces";
                return 0;
            }
    }
    int held = tms_job_conn_holds_file(is_file, ids, r->n);
    if (held) *why = "a file this process holds already";
    return !held;
}

/* What one borrow of the members' memory needs as it goes. */
struct borrowing {
    const struct tms_driver *drv;
    const struct tms_job_asking *a;
    int device;
    size_t gran, n, total;     /* needs asked, bytes still needed */
    size_t left[TMS_JOB_MAX_NEEDS];
    struct tms_job_request *req;
    struct tms_job_lend_reply *reply;
    struct tms_job_piece *out;
    size_t got, cap;
    struct tms_job_note *note;
};

/* One BORROW of member m: the pieces it lent, checked, imported, appended to
 * b->out and taken off b->left. Returns how many (0 where it lent nothing,
 * timed out or failed; a lend that fails the checks is refused whole and
 * noted); *full: it lent all one answer carries, and may lend more. */
static size_t borrow_once(struct borrowing *b, struct tms_job_member *m, int *full)
{
    *full = 0;
    b->req->n_needs = (uint32_t)b->n;
    for (size_t i = 0; i < b->n; i++) b->req->needs[i] = b->left[i];
    int timed_out = 0, n_fds = 0, fds[TMS_JOB_MAX_PIECES], is_file[TMS_JOB_MAX_PIECES];
    struct tms_os_id ids[TMS_JOB_MAX_PIECES];
    int asked = tms_job_connect_member(b->a, m);
    if (asked == TMS_MEMBER_ASKED)
        asked = tms_job_send_request(m, b->req, TMS_JOB_REQUEST_HEAD + b->n * sizeof b->req->needs[0]);
    ssize_t got = asked == TMS_MEMBER_ASKED ? tms_job_take_answer(m->fd, b->a->deadline, b->reply, sizeof *b->reply,
                                                                  fds, TMS_JOB_MAX_PIECES, &n_fds, &timed_out)
                                            : -1;
    if (asked == TMS_MEMBER_TIMED_OUT || timed_out) tms_job_note_timeout(b->note, m->pid);
    const struct tms_job_lend_reply *r = b->reply;
    const char *why = "an answer that does not add up";
    int answered = got >= (ssize_t)sizeof r->status && !r->status, ok = answered && lend_ok(r, got, n_fds, b->left, b->n, b->gran);
    ok = ok && pieces_ok(r, fds, is_file, ids, &why);
    if (ok && b->got + r->n > b->cap) {
        size_t cap = b->got + r->n + TMS_JOB_MAX_PIECES;
        struct tms_job_piece *more = realloc(b->out, cap * sizeof *more);
        if (more) b->out = more, b->cap = cap;
        else answered = ok = 0;  /* out of host memory: not the lender's fault */
    }
    size_t imported = 0;
    for (; ok && imported < r->n; imported++) {
        struct tms_job_piece *p = &b->out[b->got + imported];
        tms_phys h;
        int irc = b->drv->import_fd(b->device, fds[imported], &h);
        if (irc) {
            TMS_DEBUG("job: import of pid %d's lent memory failed: %s (%d)", m->pid, b->drv->code_name(irc), irc);
            why = "memory this process cannot import";
            ok = 0;
            break;
        }
        *p = (struct tms_job_piece){.need = r->pieces[imported].need, .handle = h, .size = r->pieces[imported].size,
                                    .len = r->pieces[imported].len, .key = r->pieces[imported].key, .lender = m->pid,
                                    .fd = -1};
    }
    for (size_t i = 0; ok && i < imported; i++)
        if (tms_job_keep_fd()) b->out[b->got + i].fd = fds[i], fds[i] = -1;  /* the piece keeps it */
    for (int i = 0; i < n_fds; i++)
        if (fds[i] >= 0) close(fds[i]);
    if (!ok) {
        for (size_t i = 0; i < imported; i++) (void)b->drv->release(b->out[b->got + i].handle);
        if (answered && (r->n || n_fds)) {  /* it lent something this process will not map: the driver's instead */
            b->note->bad++;
            TMS_DEBUG("job: pid %d lent %s: refused, the driver's memory instead", m->pid, why);
        }
        /* Whatever it lent (or will, once it answers) is not taken: all of it back. */
        if (m->fd >= 0 && asked == TMS_MEMBER_ASKED) tms_job_send_returned_on(m->fd, NULL, 0, 0);
        if (m->fd >= 0) tms_job_close_conn(m->fd);
        m->fd = -1;
        return 0;
    }
    if (!r->n) {
        tms_job_close_conn(m->fd);
        m->fd = -1;
        return 0;
    }
    uint64_t via = tms_job_conn_claim(m->fd, m->pid, r, is_file, ids);
    m->fd = -1;  /* the claim's now, closed once every piece is returned */
    for (uint32_t i = 0; i < r->n; i++) {
        struct tms_job_piece *p = &b->out[b->got + i];
        p->via = via;
        b->left[p->need] -= p->len;
        b->total -= p->len;
    }
    b->got += r->n;
    *full = r->n == TMS_JOB_MAX_PIECES;
    return r->n;
}

/* A member answered how much it keeps idle: borrowed from at once where it
 * keeps any (again while its answers come full); 1 once nothing is needed. */
static int borrow_from(void *ctx, const struct tms_job_member *answered, const struct tms_job_status_reply *r)
{
    struct borrowing *b = ctx;
    if (!r->idle) return 0;
    struct tms_job_member m = *answered;
    int full = 1;
    for (size_t lent; full && b->total;)
        if ((lent = borrow_once(b, &m, &full)))
            TMS_DEBUG("job '%s': borrowed %zu pieces from pid %d on device %d", b->a->job, lent, m.pid, b->device);
    return b->total == 0;
}

/* Borrows what the allocations still need: every member is asked how much it
 * keeps idle at once, and those that keep some are asked for it as their
 * answers come, all within the call's one bound. */
int tms_job_borrow(int device, const size_t *needs, size_t n, struct tms_job_piece **pieces, size_t *n_pieces,
                   struct tms_job_note *note)
{
    struct tms_job_asking a;
    struct tms_err err = {0};
    struct borrowing b = {.device = device, .a = &a, .note = note};
    *pieces = NULL;
    *n_pieces = 0;
    if (tms_job_join_device(device, &a, &err) || tms_driver_get(&b.drv, &err) || b.drv->granularity(device, &b.gran) ||
        !b.gran) {
        TMS_DEBUG("job: no borrowing on device %d: %s", device, err.msg);
        return TMS_OK;
    }
    b.n = n < TMS_JOB_MAX_NEEDS ? n : TMS_JOB_MAX_NEEDS;  /* the rest from the driver */
    for (size_t i = 0; i < b.n; i++) b.total += b.left[i] = needs[i];
    struct tms_job_member *m = NULL;
    size_t n_members = tms_job_list_members(&a, &m);
    b.req = malloc(sizeof *b.req);
    b.reply = malloc(sizeof *b.reply);
    if (m && b.req && b.reply && b.total) {
        tms_job_fill_request(b.req, TMS_JOB_STATUS, &a);
        size_t asked = tms_job_ask_members(&a, m, n_members, b.req, TMS_JOB_REQUEST_HEAD, note);
        tms_job_fill_request(b.req, TMS_JOB_BORROW, &a);
        tms_job_take_statuses(&a, m, asked, note, borrow_from, &b);
    }
    free(m);
    free(b.req);
    free(b.reply);
    *pieces = b.out;
    *n_pieces = b.got;
    return TMS_OK;
}
