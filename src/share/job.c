/* Lending within a job, the sockets' side: the job's name, finding the other members, asking them within a bound, and the connections borrowed memory came over. */
#include "share/job.h"

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
#include "platform/config.h"
#include "platform/driver.h"
#include "platform/fork.h"
#include "platform/log.h"
#include "share/wire.h"

#define MEMBERS_MAX 32   /* members one pause or resume asks */
#define DEVICES_MAX 64
#define LISTEN_BACKLOG 64

/* This process's socket for a device it paused or resumed memory on. */
struct own_socket {
    int device;
    char identity[TMS_JOB_IDENTITY_MAX + 1];
};

/* A socket to another member: asking it (pending), or the connection memory
 * it lent came over, open while any of it is borrowed here (its claim). */
struct member_conn {
    int fd;
    int pending;
    uint64_t via;     /* lent: this process's name for it */
    int lender;
    size_t held;      /* lent pieces not yet returned */
};

/* job_lock guards what follows; nothing waits under it but socket(),
 * close(), a non-blocking send and the sender's thread's registration. */
static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER;
static char job_name[TMS_JOB_NAME_MAX + 1];
static int name_set;        /* set by the face: else TMS_JOB names it */
static int joined;          /* a socket was made: the name is fixed */
static struct own_socket own[DEVICES_MAX];
static size_t n_own;
static struct member_conn *conns;
static size_t n_conns, cap_conns;
static uint64_t last_via;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void fork_prepare(void) { pthread_mutex_lock(&job_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&job_lock); }
/* A forked child borrowed nothing (the host backend does not even map it
 * there) and listens nowhere: its copies of the connections go, so a
 * lender never waits for the child to hang up. */
static void fork_child(void)
{
    for (size_t i = 0; i < n_conns; i++) close(conns[i].fd);
    n_conns = 0;
    n_own = 0;
    joined = 0;
    pthread_mutex_unlock(&job_lock);
}
static void register_fork(void)
{
    static const struct tms_fork_handlers handlers = {fork_prepare, fork_parent, fork_child};
    tms_fork_register(TMS_FORK_SHARE_JOB, &handlers);
}

static void lock(void)
{
    pthread_once(&fork_once, register_fork);
    pthread_mutex_lock(&job_lock);
}
static void unlock(void) { pthread_mutex_unlock(&job_lock); }

static const char *name_locked(void) { return name_set ? job_name : tms_defaults()->job; }

void tms_job_get_name(char *buf, size_t size)
{
    lock();
    snprintf(buf, size, "%s", name_locked());
    unlock();
}

int tms_job_set_name(const char *name, struct tms_err *err)
{
    if (!name) name = "";
    int rc = *name ? tms_setting_check_text(&tms_setting_rows[TMS_SETTING_job], name, err) : TMS_OK;
    if (rc) return rc;
    tms_job_register();
    lock();
    if (joined && strcmp(name, name_locked()) != 0)
        rc = tms_fail(err, TMS_E_STATE, 0,
                      "job: this process is a member of job '%s' since its first pause or resume in it; set the job "
                      "before", name_locked());
    if (!rc) {
        snprintf(job_name, sizeof job_name, "%s", name);
        name_set = 1;
    }
    unlock();
    return rc;
}

/* ---- names ------------------------------------------------------------------------- */

static uint64_t fnv1a(uint64_t h, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s[i]) * 0x100000001b3ull;
    return h;
}

/* "tms-job-<uid>-<hash of the job and the device>-": every member's socket
 * name on that device starts so. */
static void name_prefix(const char *job, const char *identity, char *out, size_t size)
{
    uint64_t h = fnv1a(0xcbf29ce484222325ull, job, strlen(job) + 1);
    h = fnv1a(h, identity, strlen(identity));
    snprintf(out, size, "tms-job-%u-%016llx-", (unsigned)geteuid(), (unsigned long long)h);
}

static size_t abstract_address(struct sockaddr_un *addr, const char *name)
{
    memset(addr, 0, sizeof *addr);
    addr->sun_family = AF_UNIX;
    size_t n = strlen(name);
    if (n > sizeof addr->sun_path - 2) n = sizeof addr->sun_path - 2;
    memcpy(addr->sun_path + 1, name, n);
    return offsetof(struct sockaddr_un, sun_path) + 1 + n;
}

/* The device's identity, and this process's socket for it made if it has
 * none yet: from then on the others find it. */
static int join_device(int device, char *job, char *identity, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    if (!drv->device_identity || !drv->export_fd || !drv->import_fd)
        return tms_fail(err, TMS_E_UNSUPPORTED, 0, "job: the %s backend cannot lend memory", drv->name);
    lock();
    snprintf(job, TMS_JOB_NAME_MAX + 1, "%s", name_locked());
    for (size_t i = 0; i < n_own; i++) {
        if (own[i].device != device) continue;
        snprintf(identity, TMS_JOB_IDENTITY_MAX + 1, "%s", own[i].identity);
        unlock();
        return TMS_OK;
    }
    int drc = drv->device_identity(device, identity, TMS_JOB_IDENTITY_MAX + 1);
    uint64_t id = 0;
    char prefix[64], name[108];
    if (drc) rc = tms_driver_fail(err, TMS_E_DRIVER, drv, drc, "job: device %d cannot name itself", device);
    else if (n_own == DEVICES_MAX) rc = tms_fail(err, TMS_E_STATE, 0, "job: more than %d devices", DEVICES_MAX);
    else if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id)
        rc = tms_fail(err, TMS_E_HOST_OOM, 0, "job: no random bytes for the socket's name");
    int fd = -1;
    if (!rc) {
        name_prefix(job, identity, prefix, sizeof prefix);
        snprintf(name, sizeof name, "%s%u-%016llx", prefix, (unsigned)getpid(), (unsigned long long)id);
        struct sockaddr_un addr;
        socklen_t len = (socklen_t)abstract_address(&addr, name);
        fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0 || bind(fd, (struct sockaddr *)&addr, len) != 0 || listen(fd, LISTEN_BACKLOG) != 0)
            rc = tms_fail(err, TMS_E_IO, errno, "job: cannot listen on @%s: %s", name, strerror(errno));
    }
    if (!rc) rc = tms_share_serve_job(fd, device, job, identity, err);  /* the thread owns it from here */
    else if (fd >= 0) close(fd);
    if (!rc) {
        own[n_own++] = (struct own_socket){.device = device};
        snprintf(own[n_own - 1].identity, sizeof own[n_own - 1].identity, "%s", identity);
        joined = 1;
        TMS_DEBUG("job '%s': listening on @%s for device %d (%s)", job, name, device, identity);
    }
    unlock();
    return rc;
}

/* ---- finding the members ------------------------------------------------------------ */

struct member {
    char name[108];
    int pid;
};

/* The other members on a device: listening sockets named with the prefix, in
 * /proc/net/unix (the network namespace's), one per process. */
static size_t find_members(const char *prefix, struct member *out, size_t max)
{
    FILE *f = fopen("/proc/net/unix", "re");
    if (!f) return 0;
    char *line = NULL;
    size_t cap = 0, n = 0, plen = strlen(prefix);
    int self = getpid();
    while (n < max && getline(&line, &cap, f) > 0) {
        unsigned long flags = 0;
        char *path = strchr(line, '@');
        /* Num RefCount Protocol Flags ...: a listening socket has __SO_ACCEPTCON (1 << 16). */
        if (!path || sscanf(line, "%*s %*s %*s %lx", &flags) != 1 || !(flags & 0x10000)) continue;
        path++;
        path[strcspn(path, "\n")] = '\0';
        if (strncmp(path, prefix, plen) != 0 || strlen(path) >= sizeof out->name) continue;
        int pid = atoi(path + plen);
        if (pid <= 0 || pid == self) continue;
        int dup = 0;
        for (size_t i = 0; i < n && !dup; i++) dup = out[i].pid == pid;
        if (dup) continue;
        snprintf(out[n].name, sizeof out[n].name, "%s", path);
        out[n++].pid = pid;
    }
    free(line);
    fclose(f);
    return n;
}

/* ---- asking a member ------------------------------------------------------------------ */

static uint64_t now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

/* A socket listed under the lock from the start, so a fork at any moment finds it. */
static int open_conn(void)
{
    lock();
    int fd = -1;
    if (n_conns == cap_conns) {
        size_t grown = cap_conns ? cap_conns * 2 : 16;
        struct member_conn *more = realloc(conns, grown * sizeof *more);
        if (more) conns = more, cap_conns = grown;
    }
    if (n_conns < cap_conns && (fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0)) >= 0)
        conns[n_conns++] = (struct member_conn){.fd = fd, .pending = 1};
    unlock();
    return fd;
}

static void close_conn_locked(size_t i)
{
    close(conns[i].fd);
    conns[i] = conns[--n_conns];
}

static void close_conn(int fd)
{
    lock();
    for (size_t i = 0; i < n_conns; i++)
        if (conns[i].fd == fd) {
            close_conn_locked(i);
            break;
        }
    unlock();
}

enum { ASKED, TIMED_OUT, REFUSED };

/* Connects to a member and sends it req (len bytes); ASKED with *fd open. */
static int send_request(const struct member *m, const struct tms_job_request *req, size_t len, int *fd)
{
    *fd = open_conn();
    if (*fd < 0) return REFUSED;
    struct sockaddr_un addr;
    socklen_t alen = (socklen_t)abstract_address(&addr, m->name);
    int rc;
    do rc = connect(*fd, (struct sockaddr *)&addr, alen);
    while (rc && errno == EINTR);
    /* A full backlog: the member is not accepting (stopped, or swamped). */
    if (rc) return errno == EAGAIN ? TIMED_OUT : REFUSED;
    struct ucred cred;
    socklen_t clen = sizeof cred;
    /* Another user's socket under a job's name is nobody's member. */
    if (getsockopt(*fd, SOL_SOCKET, SO_PEERCRED, &cred, &clen) != 0 || cred.uid != geteuid()) return REFUSED;
    ssize_t n;
    do n = send(*fd, req, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n == (ssize_t)len) return ASKED;
    return n < 0 && (errno == EAGAIN || errno == ENOBUFS) ? TIMED_OUT : REFUSED;
}

/* Waits until deadline for the answer, with at most max_fds descriptors;
 * its length (0: hung up, -1: none in time or an error, *timed_out says). */
static ssize_t take_answer(int fd, uint64_t deadline, void *buf, size_t len, int *fds, int max_fds, int *n_fds,
                           int *timed_out)
{
    *timed_out = 0;
    *n_fds = 0;
    for (;;) {
        uint64_t now = now_ms();
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

static void note_timeout(struct tms_job_note *note, int pid)
{
    if (note->timed_out < TMS_REPORT_PIDS) note->timed_out_pids[note->timed_out] = pid;
    note->timed_out++;
}

static void fill_request(struct tms_job_request *req, int op, const char *job, const char *identity)
{
    memset(req, 0, TMS_JOB_REQUEST_HEAD);
    memcpy(req->magic, TMS_JOB_MAGIC, sizeof req->magic);
    req->op = (uint32_t)op;
    snprintf(req->job, sizeof req->job, "%s", job);
    snprintf(req->device, sizeof req->device, "%s", identity);
}

static int job_on(void)
{
    lock();
    int on = name_locked()[0] != '\0';
    unlock();
    return on;
}

/* What a pause keeps: all it releases while another member on device has
 * paused more than it keeps idle itself (it will ask for memory soon), else
 * nothing. All of it, not just what the others will ask for: what goes back
 * to the driver is scrubbed at once, and that scrubbing slows the copies of
 * the resume that follows, wherever that resume's memory comes from. The
 * bound gives it back later, and a member out of memory asks for it first. */
static size_t keep(int device, size_t releasable, struct tms_job_note *note)
{
    char job[TMS_JOB_NAME_MAX + 1], identity[TMS_JOB_IDENTITY_MAX + 1], prefix[64];
    struct tms_err err = {0};
    /* A member that paused is found by the others from now on, whatever it keeps. */
    if (join_device(device, job, identity, &err)) {
        TMS_DEBUG("%s", err.msg);
        return 0;
    }
    if (!releasable) return 0;
    name_prefix(job, identity, prefix, sizeof prefix);
    struct member members[MEMBERS_MAX];
    size_t n = find_members(prefix, members, MEMBERS_MAX), want = 0;
    struct tms_job_request req;
    fill_request(&req, TMS_JOB_STATUS, job, identity);
    unsigned wait_ms = tms_defaults()->job_wait_ms;
    for (size_t i = 0; i < n && !want; i++) {
        note->members++;
        int fd, asked = send_request(&members[i], &req, TMS_JOB_REQUEST_HEAD, &fd), timed_out = 0, n_fds;
        struct tms_job_status_reply reply;
        ssize_t got = asked == ASKED ? take_answer(fd, now_ms() + wait_ms, &reply, sizeof reply, NULL, 0, &n_fds, &timed_out)
                                     : -1;
        if (fd >= 0) close_conn(fd);
        if (asked == TIMED_OUT || timed_out) {
            note_timeout(note, members[i].pid);
            continue;
        }
        if (got != (ssize_t)sizeof reply || reply.status) continue;  /* gone, or not of this job after all */
        if (reply.demand > reply.idle) want += reply.demand - reply.idle;
    }
    return want ? releasable : 0;
}

/* The driver is out of memory here: the members release what they keep idle
 * on the device, up to bytes in all. */
static size_t release(int device, size_t bytes)
{
    char job[TMS_JOB_NAME_MAX + 1], identity[TMS_JOB_IDENTITY_MAX + 1], prefix[64];
    struct tms_err err = {0};
    if (join_device(device, job, identity, &err)) return 0;
    name_prefix(job, identity, prefix, sizeof prefix);
    struct member members[MEMBERS_MAX];
    size_t n = find_members(prefix, members, MEMBERS_MAX), freed = 0;
    struct tms_job_request req;
    fill_request(&req, TMS_JOB_RELEASE, job, identity);
    req.n_needs = 1;
    for (size_t i = 0; i < n && freed < bytes; i++) {
        req.needs[0] = bytes - freed;
        int fd, asked = send_request(&members[i], &req, TMS_JOB_REQUEST_HEAD + sizeof req.needs[0], &fd), timed_out = 0,
                n_fds;
        struct tms_job_status_reply reply;
        ssize_t got = asked == ASKED ? take_answer(fd, now_ms() + tms_defaults()->job_wait_ms, &reply, sizeof reply,
                                                   NULL, 0, &n_fds, &timed_out)
                                     : -1;
        if (fd >= 0) close_conn(fd);
        if (got == (ssize_t)sizeof reply && !reply.status) freed += reply.demand;
    }
    TMS_DEBUG("job '%s': members released %zu bytes kept on device %d (%zu asked)", job, freed, device, bytes);
    return freed;
}

/* Tells a lender over fd that keys[0..n) (n 0: all it lent) are released here (spent: see wire.h). */
static void send_returned(int fd, const uint64_t *keys, size_t n, int spent)
{
    struct tms_job_returned msg;
    memcpy(msg.magic, TMS_JOB_RETURNED, sizeof msg.magic);
    msg.n = (uint32_t)n;
    msg.flags = spent ? TMS_JOB_RETURNED_SPENT : 0;
    if (n) memcpy(msg.keys, keys, n * sizeof *keys);
    ssize_t r;
    do r = send(fd, &msg, offsetof(struct tms_job_returned, keys) + n * sizeof *keys, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (r < 0 && errno == EINTR);
    /* Not sent (a full socket): the lender counts it lent until this process ends, never less. */
}

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

/* What one borrow of the members' memory needs as it goes. */
struct borrowing {
    const struct tms_driver *drv;
    int device;
    size_t gran, n, total;     /* needs asked, bytes still needed */
    size_t left[TMS_JOB_MAX_NEEDS];
    struct tms_job_request *req;
    struct tms_job_lend_reply *reply;
    struct tms_job_piece *out;
    size_t got, cap;
};

/* One BORROW of member m: the pieces it lent, imported, appended to b->out
 * and taken off b->left. Returns how many (0 where it lent nothing, timed
 * out or failed); *full: it lent all one answer carries, and may lend more. */
static size_t borrow_once(struct borrowing *b, const struct member *m, struct tms_job_note *note, int *full)
{
    *full = 0;
    b->req->n_needs = (uint32_t)b->n;
    for (size_t i = 0; i < b->n; i++) b->req->needs[i] = b->left[i];
    int fd, timed_out = 0, n_fds = 0, fds[TMS_JOB_MAX_PIECES];
    int asked = send_request(m, b->req, TMS_JOB_REQUEST_HEAD + b->n * sizeof b->req->needs[0], &fd);
    ssize_t got = asked == ASKED ? take_answer(fd, now_ms() + tms_defaults()->job_wait_ms, b->reply, sizeof *b->reply,
                                               fds, TMS_JOB_MAX_PIECES, &n_fds, &timed_out)
                                 : -1;
    if (asked == TIMED_OUT || timed_out) note_timeout(note, m->pid);
    const struct tms_job_lend_reply *r = b->reply;
    int ok = got > 0 && lend_ok(r, got, n_fds, b->left, b->n, b->gran);
    if (ok && b->got + r->n > b->cap) {
        size_t cap = b->got + r->n + TMS_JOB_MAX_PIECES;
        struct tms_job_piece *more = realloc(b->out, cap * sizeof *more);
        if (more) b->out = more, b->cap = cap;
        else ok = 0;
    }
    size_t imported = 0;
    for (; ok && imported < r->n; imported++) {
        struct tms_job_piece *p = &b->out[b->got + imported];
        tms_phys h;
        int irc = b->drv->import_fd(b->device, fds[imported], &h);
        if (irc) {
            TMS_DEBUG("job: import of pid %d's lent memory failed: %s (%d)", m->pid, b->drv->code_name(irc), irc);
            ok = 0;
            break;
        }
        *p = (struct tms_job_piece){.need = r->pieces[imported].need, .handle = h, .size = r->pieces[imported].size,
                                    .len = r->pieces[imported].len, .key = r->pieces[imported].key, .lender = m->pid,
                                    .fd = -1};
    }
    for (size_t i = 0; ok && i < imported; i++)
        if (tms_core_job_keep_fd()) b->out[b->got + i].fd = fds[i], fds[i] = -1;  /* the piece keeps it */
    for (int i = 0; i < n_fds; i++)
        if (fds[i] >= 0) close(fds[i]);
    if (!ok) {
        for (size_t i = 0; i < imported; i++) (void)b->drv->release(b->out[b->got + i].handle);
        /* Whatever it lent (or will, once it answers) is not taken: all of it back. */
        if (fd >= 0 && asked == ASKED) send_returned(fd, NULL, 0, 0);
        if (fd >= 0) close_conn(fd);
        return 0;
    }
    if (!r->n) {
        close_conn(fd);
        return 0;
    }
    lock();
    uint64_t via = ++last_via;
    for (size_t i = 0; i < n_conns; i++)
        if (conns[i].fd == fd) conns[i] = (struct member_conn){.fd = fd, .via = via, .lender = m->pid, .held = r->n};
    unlock();
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

/* Borrows from each member in turn what the allocations still need (from one
 * member again while its answers come full). */
static int borrow(int device, const size_t *needs, size_t n, struct tms_job_piece **pieces, size_t *n_pieces,
                  struct tms_job_note *note)
{
    char job[TMS_JOB_NAME_MAX + 1], identity[TMS_JOB_IDENTITY_MAX + 1], prefix[64];
    struct tms_err err = {0};
    struct borrowing b = {.device = device};
    *pieces = NULL;
    *n_pieces = 0;
    if (join_device(device, job, identity, &err) || tms_driver_get(&b.drv, &err) ||
        b.drv->granularity(device, &b.gran) || !b.gran) {
        TMS_DEBUG("job: no borrowing on device %d: %s", device, err.msg);
        return TMS_OK;
    }
    b.n = n < TMS_JOB_MAX_NEEDS ? n : TMS_JOB_MAX_NEEDS;  /* the rest from the driver */
    for (size_t i = 0; i < b.n; i++) b.total += b.left[i] = needs[i];
    name_prefix(job, identity, prefix, sizeof prefix);
    struct member members[MEMBERS_MAX];
    size_t n_members = find_members(prefix, members, MEMBERS_MAX);
    b.req = malloc(sizeof *b.req);
    b.reply = malloc(sizeof *b.reply);
    if (b.req) fill_request(b.req, TMS_JOB_BORROW, job, identity);
    for (size_t m = 0; b.req && b.reply && m < n_members && b.total; m++) {
        note->members++;
        int full = 1;
        for (size_t lent; full && b.total;)
            if ((lent = borrow_once(&b, &members[m], note, &full)))
                TMS_DEBUG("job '%s': borrowed %zu pieces from pid %d on device %d", job, lent, members[m].pid, device);
    }
    free(b.req);
    free(b.reply);
    *pieces = b.out;
    *n_pieces = b.got;
    return TMS_OK;
}

static void returned(uint64_t via, const uint64_t *keys, size_t n, int spent)
{
    lock();
    for (size_t i = 0; i < n_conns; i++) {
        if (conns[i].pending || conns[i].via != via) continue;
        send_returned(conns[i].fd, keys, n, spent);
        conns[i].held = conns[i].held > n ? conns[i].held - n : 0;
        /* Nothing of it is borrowed any more: the claim ends. */
        if (!conns[i].held) close_conn_locked(i);
        break;
    }
    unlock();
}

static void wake(void) { tms_share_serve_wake(); }

static const struct tms_job_ops job_ops = {
    .on = job_on, .keep = keep, .borrow = borrow, .returned = returned, .wake = wake, .release = release,
};

void tms_job_register(void) { tms_core_job_set_ops(&job_ops); }
