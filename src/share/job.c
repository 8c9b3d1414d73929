/* Lending within a job, the sockets' side: the job's name, finding the other members in the user's place, asking them within one bound per call, checking what they lend, and the connections borrowed memory came over. */
#include "share/job.h"

#include <errno.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "platform/config.h"
#include "platform/driver.h"
#include "platform/fork.h"
#include "platform/log.h"
#include "platform/os.h"
#include "share/job_internal.h"
#include "share/place.h"
#include "share/wire.h"

#define MEMBERS_MAX 32   /* members one pause or resume asks */
#define LISTED_MAX 256   /* names looked at to find them (the rest: the sockets of members that ended) */
#define DEVICES_MAX 64
#define LISTEN_BACKLOG 64

/* This process's socket for a device it paused or resumed memory on. */
struct own_socket {
    int device;
    char identity[TMS_JOB_IDENTITY_MAX + 1];
    char name[TMS_OS_SOCKET_NAME_MAX];
};

/* A socket to another member: asking it (pending), or the connection memory
 * it lent came over, open while any of it is borrowed here (its claim), with
 * the identities of the files it lent (memfds), which no later lend may
 * repeat. */
struct member_conn {
    int fd;
    int pending;
    uint64_t via;     /* lent: this process's name for it */
    int lender;
    size_t held;      /* lent pieces not yet returned */
    size_t n_ids;
    uint64_t *keys;   /* n_ids keys, and the identity of the file each came as */
    struct tms_os_id *ids;
};

/* job_lock guards what follows; nothing waits under it but socket(),
 * close(), a non-blocking send, making the listening socket and the sender's
 * thread's registration. */
static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER;
static char job_name[TMS_JOB_NAME_MAX + 1];
static int name_set;        /* set by the face: else TMS_JOB names it */
static int joined;          /* a socket was made: the name is fixed */
static int warned;          /* that no place could be had, once */
static struct own_socket own[DEVICES_MAX];
static size_t n_own;
static struct member_conn *conns;
static size_t n_conns, cap_conns;
static uint64_t last_via;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void free_ids(struct member_conn *c)
{
    free(c->keys);
    free(c->ids);
    c->keys = NULL;
    c->ids = NULL;
    c->n_ids = 0;
}

static void fork_prepare(void) { pthread_mutex_lock(&job_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&job_lock); }
/* A forked child borrowed nothing (the host backend does not even map it
 * there) and listens nowhere: its copies of the connections go, so a
 * lender never waits for the child to hang up. */
static void fork_child(void)
{
    for (size_t i = 0; i < n_conns; i++) {
        close(conns[i].fd);
        free_ids(&conns[i]);
    }
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

/* "j-<hash of the job and the device>-": every member's socket name on that
 * device starts so, in the user's place (only the user's processes are
 * there: the place is the user's alone). */
static void name_prefix(const char *job, const char *identity, char *out, size_t size)
{
    uint64_t h = fnv1a(0xcbf29ce484222325ull, job, strlen(job) + 1);
    h = fnv1a(h, identity, strlen(identity));
    snprintf(out, size, "j-%016llx-", (unsigned long long)h);
}

/* What a pause or resume asks the members with: the job, the device, the
 * place, and the one deadline of the whole call. */
struct asking {
    char job[TMS_JOB_NAME_MAX + 1];
    char identity[TMS_JOB_IDENTITY_MAX + 1];
    char prefix[32];
    char path[PATH_MAX];
    int dir;
    uint64_t deadline;
};

static uint64_t now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

/* The device's identity, the place and this process's socket for the device,
 * made if it has none yet (from then on the others find it), into *a; the
 * call's deadline starts now. */
static int join_device(int device, struct asking *a, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    if (!drv->device_identity || !drv->export_fd || !drv->import_fd)
        return tms_fail(err, TMS_E_UNSUPPORTED, 0, "job: the %s backend cannot lend memory", drv->name);
    a->deadline = now_ms() + tms_defaults()->job_wait_ms;
    rc = tms_share_place("job", &a->dir, a->path, sizeof a->path, err);
    lock();
    snprintf(a->job, sizeof a->job, "%s", name_locked());
    if (rc) {
        if (!warned) tms_log_warn("%s: this process lends and borrows nothing in job '%s'", err->msg, a->job);
        warned = 1;
        unlock();
        return rc;
    }
    for (size_t i = 0; i < n_own; i++) {
        if (own[i].device != device) continue;
        snprintf(a->identity, sizeof a->identity, "%s", own[i].identity);
        name_prefix(a->job, a->identity, a->prefix, sizeof a->prefix);
        unlock();
        return TMS_OK;
    }
    int drc = drv->device_identity(device, a->identity, sizeof a->identity);
    uint64_t id = 0;
    char name[TMS_OS_SOCKET_NAME_MAX];
    if (drc) rc = tms_driver_fail(err, TMS_E_DRIVER, drv, drc, "job: device %d cannot name itself", device);
    else if (n_own == DEVICES_MAX) rc = tms_fail(err, TMS_E_STATE, 0, "job: more than %d devices", DEVICES_MAX);
    else if (getrandom(&id, sizeof id, 0) != (ssize_t)sizeof id)
        rc = tms_fail(err, TMS_E_HOST_OOM, 0, "job: no random bytes for the socket's name");
    int fd = -1;
    if (!rc) {
        name_prefix(a->job, a->identity, a->prefix, sizeof a->prefix);
        snprintf(name, sizeof name, "%s%u-%016llx", a->prefix, (unsigned)getpid(), (unsigned long long)id);
        int lrc = tms_os_listen_at(a->dir, a->path, name, LISTEN_BACKLOG, &fd);
        if (lrc)
            rc = tms_fail(err, TMS_E_IO, lrc < 0 ? -lrc : 0, "job: cannot listen on %s/%s: %s", a->path, name,
                          lrc < 0 ? strerror(-lrc) : "not a socket");
    }
    if (!rc && (rc = tms_share_serve_job(fd, name, device, a->job, a->identity, err))) {
        close(fd);
        (void)tms_os_remove_socket(a->dir, name);
    }
    if (!rc) {
        struct own_socket *o = &own[n_own++];
        *o = (struct own_socket){.device = device};
        snprintf(o->identity, sizeof o->identity, "%s", a->identity);
        snprintf(o->name, sizeof o->name, "%s", name);
        joined = 1;
        TMS_DEBUG("job '%s': listening on %s/%s for device %d (%s)", a->job, a->path, name, device, a->identity);
    }
    unlock();
    return rc;
}

/* ---- finding and asking the members ------------------------------------------------------- */

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
    if (n_conns < cap_conns && (fd = tms_os_socket(1)) >= 0)
        conns[n_conns++] = (struct member_conn){.fd = fd, .pending = 1};
    unlock();
    return fd;
}

static void close_conn_locked(size_t i)
{
    close(conns[i].fd);
    free_ids(&conns[i]);
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

static void note_timeout(struct tms_job_note *note, int pid)
{
    if (note->timed_out < TMS_REPORT_PIDS) note->timed_out_pids[note->timed_out] = pid;
    note->timed_out++;
}

/* Another member's socket: its name, and once connected the socket and the
 * pid its credentials give. */
struct member {
    char name[TMS_OS_SOCKET_NAME_MAX];
    int fd;
    int pid;
};

/* The names of the other members' sockets on the device, into m (malloc'd,
 * the caller's to free); how many. The place holds only the user's sockets. */
static size_t list_members(const struct asking *a, struct member **m)
{
    char (*names)[TMS_OS_SOCKET_NAME_MAX] = malloc(LISTED_MAX * sizeof *names);
    size_t n = 0, k = 0;
    *m = names ? malloc(LISTED_MAX * sizeof **m) : NULL;
    if (*m && tms_os_socket_names(a->dir, a->prefix, names, LISTED_MAX, &n) != 0) n = 0;
    lock();
    for (size_t i = 0; *m && i < n; i++) {
        int mine = 0;
        for (size_t j = 0; j < n_own && !mine; j++) mine = strcmp(own[j].name, names[i]) == 0;
        if (mine) continue;
        (*m)[k] = (struct member){.fd = -1};
        memcpy((*m)[k++].name, names[i], sizeof names[i]);
    }
    unlock();
    free(names);
    return k;
}

enum { ASKED, TIMED_OUT, GONE };

/* Connects to member m (a socket listed in conns, *m->fd) and checks it runs
 * as this user. GONE: nobody listens there (its process ended: the name is
 * removed) or it is not a member after all; TIMED_OUT: its backlog is full. */
static int connect_member(const struct asking *a, struct member *m)
{
    m->pid = atoi(m->name + strlen(a->prefix));
    if ((m->fd = open_conn()) < 0) return GONE;
    int rc = tms_os_connect_at(m->fd, a->dir, a->path, m->name);
    struct tms_os_peer peer;
    if (!rc && tms_os_peer_of(m->fd, &peer) == 0) {
        if (peer.pid > 0) m->pid = peer.pid;  /* from the kernel, not the name */
        return ASKED;
    }
    if (rc == -ECONNREFUSED) (void)tms_os_remove_socket(a->dir, m->name);
    close_conn(m->fd);
    m->fd = -1;
    return rc == -EAGAIN ? TIMED_OUT : GONE;
}

/* Sends req (len bytes) to m; ASKED, else m's socket is closed. */
static int send_request(struct member *m, const struct tms_job_request *req, size_t len)
{
    ssize_t n;
    do n = send(m->fd, req, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n == (ssize_t)len) return ASKED;
    int full = n < 0 && (errno == EAGAIN || errno == ENOBUFS);
    close_conn(m->fd);
    m->fd = -1;
    return full ? TIMED_OUT : GONE;
}

/* Connects to the members listed and sends each req: those asked keep their
 * socket (m[i].fd), the others are noted (timed out) or dropped. How many
 * were asked, at most MEMBERS_MAX, first in m. */
static size_t ask_members(const struct asking *a, struct member *m, size_t n, const struct tms_job_request *req,
                          size_t len, struct tms_job_note *note)
{
    size_t asked = 0;
    for (size_t i = 0; i < n && asked < MEMBERS_MAX; i++) {
        int rc = connect_member(a, &m[i]);
        if (rc == ASKED) rc = send_request(&m[i], req, len);
        if (rc == GONE) continue;
        note->members++;
        if (rc == TIMED_OUT) note_timeout(note, m[i].pid);
        else m[asked++] = m[i];
    }
    return asked;
}

/* Waits until deadline for an answer on fd, with at most max_fds
 * descriptors; its length (0: hung up, -1: none in time or an error,
 * *timed_out says). */
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

/* Takes the members' status replies as they come, until the call's deadline:
 * each one that answered goes to take (which returns 1 once it needs no
 * more); those that did not answer in time are noted timed out. Every
 * member's socket is closed on return. */
static void take_statuses(const struct asking *a, struct member *m, size_t n, struct tms_job_note *note,
                          int (*take)(void *ctx, const struct member *m, const struct tms_job_status_reply *r),
                          void *ctx)
{
    struct pollfd polls[MEMBERS_MAX];
    size_t waiting = n, done = 0;
    while (waiting && !done) {
        size_t k = 0;
        for (size_t i = 0; i < n; i++)
            if (m[i].fd >= 0) polls[k++] = (struct pollfd){.fd = m[i].fd, .events = POLLIN};
        uint64_t now = now_ms();
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
            close_conn(m[i].fd);
            m[i].fd = -1;
            waiting--;
            /* Gone meanwhile, or not of this job after all: it says nothing. */
            if (got == (ssize_t)sizeof reply && !reply.status) done = take(ctx, &m[i], &reply);
        }
    }
    for (size_t i = 0; i < n; i++) {
        if (m[i].fd < 0) continue;
        if (!done) note_timeout(note, m[i].pid);
        close_conn(m[i].fd);
        m[i].fd = -1;
    }
}

static void fill_request(struct tms_job_request *req, int op, const struct asking *a)
{
    memset(req, 0, TMS_JOB_REQUEST_HEAD);
    memcpy(req->magic, TMS_JOB_MAGIC, sizeof req->magic);
    req->op = (uint32_t)op;
    snprintf(req->job, sizeof req->job, "%s", a->job);
    snprintf(req->device, sizeof req->device, "%s", a->identity);
}

int tms_job_on(void)
{
    lock();
    int on = name_locked()[0] != '\0';
    unlock();
    return on;
}

/* ---- keeping --------------------------------------------------------------------------------- */

static int add_demand(void *ctx, const struct member *m, const struct tms_job_status_reply *r)
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
    struct asking a;
    struct tms_err err = {0};
    /* A member that paused is found by the others from now on, whatever it keeps. */
    if (join_device(device, &a, &err)) {
        TMS_DEBUG("%s", err.msg);
        return 0;
    }
    if (!releasable) return 0;
    struct member *m = NULL;
    size_t n = list_members(&a, &m), want = 0;
    struct tms_job_request req;
    fill_request(&req, TMS_JOB_STATUS, &a);
    if (m) take_statuses(&a, m, ask_members(&a, m, n, &req, TMS_JOB_REQUEST_HEAD, note), note, add_demand, &want);
    free(m);
    return want ? releasable : 0;
}

/* ---- releasing ------------------------------------------------------------------------------- */

/* The driver is out of memory here: the members release what they keep idle
 * on the device, up to bytes in all, asked in turn within one bound. */
size_t tms_job_ask_release(int device, size_t bytes)
{
    struct asking a;
    struct tms_err err = {0};
    if (join_device(device, &a, &err)) return 0;
    struct member *m = NULL;
    size_t n = list_members(&a, &m), freed = 0, asked = 0;
    struct tms_job_request req;
    fill_request(&req, TMS_JOB_RELEASE, &a);
    req.n_needs = 1;
    for (size_t i = 0; m && i < n && asked < MEMBERS_MAX && freed < bytes && now_ms() < a.deadline; i++) {
        req.needs[0] = bytes - freed;
        if (connect_member(&a, &m[i]) != ASKED) continue;
        asked++;
        int timed_out, n_fds;
        struct tms_job_status_reply reply;
        ssize_t got = send_request(&m[i], &req, TMS_JOB_REQUEST_HEAD + sizeof req.needs[0]) == ASKED
                          ? take_answer(m[i].fd, a.deadline, &reply, sizeof reply, NULL, 0, &n_fds, &timed_out)
                          : -1;
        if (m[i].fd >= 0) close_conn(m[i].fd);
        if (got == (ssize_t)sizeof reply && !reply.status) freed += reply.demand;
    }
    free(m);
    TMS_DEBUG("job '%s': members released %zu bytes kept on device %d (%zu asked)", a.job, freed, device, bytes);
    return freed;
}

/* ---- borrowing ------------------------------------------------------------------------------- */

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
    int held = 0;
    lock();
    for (size_t c = 0; c < n_conns && !held; c++)
        for (size_t k = 0; k < conns[c].n_ids && !held; k++)
            for (uint32_t i = 0; i < r->n && !held; i++) held = is_file[i] && tms_os_same_id(&ids[i], &conns[c].ids[k]);
    unlock();
    if (held) *why = "a file this process holds already";
    return !held;
}

/* What one borrow of the members' memory needs as it goes. */
struct borrowing {
    const struct tms_driver *drv;
    const struct asking *a;
    int device;
    size_t gran, n, total;     /* needs asked, bytes still needed */
    size_t left[TMS_JOB_MAX_NEEDS];
    struct tms_job_request *req;
    struct tms_job_lend_reply *reply;
    struct tms_job_piece *out;
    size_t got, cap;
    struct tms_job_note *note;
};

/* Keeps the identities of the files a lend came as with its connection (keys[i], ids[i] where is_file[i]). */
static void remember_files_locked(struct member_conn *c, const struct tms_job_lend_reply *r, const int *is_file,
                                  const struct tms_os_id *ids)
{
    size_t n = 0;
    for (uint32_t i = 0; i < r->n; i++) n += is_file[i] != 0;
    if (!n || !(c->keys = malloc(n * sizeof *c->keys)) || !(c->ids = malloc(n * sizeof *c->ids))) {
        free_ids(c);
        return;  /* without memory for them, later lends are checked against the rest only */
    }
    for (uint32_t i = 0; i < r->n; i++)
        if (is_file[i]) c->keys[c->n_ids] = r->pieces[i].key, c->ids[c->n_ids++] = ids[i];
}

/* One BORROW of member m: the pieces it lent, checked, imported, appended to
 * b->out and taken off b->left. Returns how many (0 where it lent nothing,
 * timed out or failed; a lend that fails the checks is refused whole and
 * noted); *full: it lent all one answer carries, and may lend more. */
static size_t borrow_once(struct borrowing *b, struct member *m, int *full)
{
    *full = 0;
    b->req->n_needs = (uint32_t)b->n;
    for (size_t i = 0; i < b->n; i++) b->req->needs[i] = b->left[i];
    int timed_out = 0, n_fds = 0, fds[TMS_JOB_MAX_PIECES], is_file[TMS_JOB_MAX_PIECES];
    struct tms_os_id ids[TMS_JOB_MAX_PIECES];
    int asked = connect_member(b->a, m);
    if (asked == ASKED) asked = send_request(m, b->req, TMS_JOB_REQUEST_HEAD + b->n * sizeof b->req->needs[0]);
    ssize_t got = asked == ASKED ? take_answer(m->fd, b->a->deadline, b->reply, sizeof *b->reply, fds,
                                               TMS_JOB_MAX_PIECES, &n_fds, &timed_out)
                                 : -1;
    if (asked == TIMED_OUT || timed_out) note_timeout(b->note, m->pid);
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
        if (m->fd >= 0 && asked == ASKED) send_returned(m->fd, NULL, 0, 0);
        if (m->fd >= 0) close_conn(m->fd);
        m->fd = -1;
        return 0;
    }
    if (!r->n) {
        close_conn(m->fd);
        m->fd = -1;
        return 0;
    }
    lock();
    uint64_t via = ++last_via;
    for (size_t i = 0; i < n_conns; i++)
        if (conns[i].fd == m->fd) {
            conns[i] = (struct member_conn){.fd = m->fd, .via = via, .lender = m->pid, .held = r->n};
            remember_files_locked(&conns[i], r, is_file, ids);
        }
    unlock();
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
static int borrow_from(void *ctx, const struct member *answered, const struct tms_job_status_reply *r)
{
    struct borrowing *b = ctx;
    if (!r->idle) return 0;
    struct member m = *answered;
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
    struct asking a;
    struct tms_err err = {0};
    struct borrowing b = {.device = device, .a = &a, .note = note};
    *pieces = NULL;
    *n_pieces = 0;
    if (join_device(device, &a, &err) || tms_driver_get(&b.drv, &err) || b.drv->granularity(device, &b.gran) ||
        !b.gran) {
        TMS_DEBUG("job: no borrowing on device %d: %s", device, err.msg);
        return TMS_OK;
    }
    b.n = n < TMS_JOB_MAX_NEEDS ? n : TMS_JOB_MAX_NEEDS;  /* the rest from the driver */
    for (size_t i = 0; i < b.n; i++) b.total += b.left[i] = needs[i];
    struct member *m = NULL;
    size_t n_members = list_members(&a, &m);
    b.req = malloc(sizeof *b.req);
    b.reply = malloc(sizeof *b.reply);
    if (m && b.req && b.reply && b.total) {
        fill_request(b.req, TMS_JOB_STATUS, &a);
        size_t asked = ask_members(&a, m, n_members, b.req, TMS_JOB_REQUEST_HEAD, note);
        fill_request(b.req, TMS_JOB_BORROW, &a);
        take_statuses(&a, m, asked, note, borrow_from, &b);
    }
    free(m);
    free(b.req);
    free(b.reply);
    *pieces = b.out;
    *n_pieces = b.got;
    return TMS_OK;
}

void tms_job_send_returned(uint64_t via, const uint64_t *keys, size_t n, int spent)
{
    lock();
    for (size_t i = 0; i < n_conns; i++) {
        struct member_conn *c = &conns[i];
        if (c->pending || c->via != via) continue;
        send_returned(c->fd, keys, n, spent);
        c->held = c->held > n ? c->held - n : 0;
        /* Its files may come back in a later lend: they are not this process's any more. */
        for (size_t k = 0; k < c->n_ids;) {
            int back = 0;
            for (size_t j = 0; j < n && !back; j++) back = c->keys[k] == keys[j];
            if (back) c->keys[k] = c->keys[--c->n_ids], c->ids[k] = c->ids[c->n_ids];
            else k++;
        }
        /* Nothing of it is borrowed any more: the claim ends. */
        if (!c->held) close_conn_locked(i);
        break;
    }
    unlock();
}
