/* The job's members, the sockets' side: the job's name, this process's socket per device, the other members found in the user's place, and the connections to them (while asking, and while memory lent over them is borrowed here). */
#include "share/job.h"

#include <errno.h>
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

#define LISTED_MAX 256   /* names looked at to find the members (the rest: the sockets of members that ended) */
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

int tms_job_on(void)
{
    lock();
    int on = name_locked()[0] != '\0';
    unlock();
    return on;
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

/* ---- joining --------------------------------------------------------------------------------- */

uint64_t tms_job_now_ms(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

int tms_job_join_device(int device, struct tms_job_asking *a, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    if (!drv->device_identity || !drv->export_fd || !drv->import_fd)
        return tms_fail(err, TMS_E_UNSUPPORTED, 0, "job: the %s backend cannot lend memory", drv->name);
    a->deadline = tms_job_now_ms() + tms_defaults()->job_wait_ms;
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

/* ---- the other members and the sockets to them ------------------------------------------- */

/* A socket listed under the lock from the start, so a fork at any moment finds it. */
int tms_job_open_conn(void)
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

void tms_job_close_conn(int fd)
{
    lock();
    for (size_t i = 0; i < n_conns; i++)
        if (conns[i].fd == fd) {
            close_conn_locked(i);
            break;
        }
    unlock();
}

size_t tms_job_list_members(const struct tms_job_asking *a, struct tms_job_member **m)
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
        (*m)[k] = (struct tms_job_member){.fd = -1};
        memcpy((*m)[k++].name, names[i], sizeof names[i]);
    }
    unlock();
    free(names);
    return k;
}

int tms_job_conn_holds_file(const int *is_file, const struct tms_os_id *ids, size_t n)
{
    int held = 0;
    lock();
    for (size_t c = 0; c < n_conns && !held; c++)
        for (size_t k = 0; k < conns[c].n_ids && !held; k++)
            for (size_t i = 0; i < n && !held; i++) held = is_file[i] && tms_os_same_id(&ids[i], &conns[c].ids[k]);
    unlock();
    return held;
}

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

uint64_t tms_job_conn_claim(int fd, int lender, const struct tms_job_lend_reply *r, const int *is_file,
                            const struct tms_os_id *ids)
{
    lock();
    uint64_t via = ++last_via;
    for (size_t i = 0; i < n_conns; i++)
        if (conns[i].fd == fd) {
            conns[i] = (struct member_conn){.fd = fd, .via = via, .lender = lender, .held = r->n};
            remember_files_locked(&conns[i], r, is_file, ids);
        }
    unlock();
    return via;
}

/* ---- returning ------------------------------------------------------------------------------- */

void tms_job_send_returned_on(int fd, const uint64_t *keys, size_t n, int spent)
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

void tms_job_send_returned(uint64_t via, const uint64_t *keys, size_t n, int spent)
{
    lock();
    for (size_t i = 0; i < n_conns; i++) {
        struct member_conn *c = &conns[i];
        if (c->pending || c->via != via) continue;
        tms_job_send_returned_on(c->fd, keys, n, spent);
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
