/* The receiver: another process's allocation mapped here from its handle, held open over the sender's socket until closed. */
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "core/core_share.h"
#include "platform/driver.h"
#include "platform/fork.h"
#include "platform/log.h"
#include "platform/os.h"
#include "share/place.h"
#include "share/wire.h"

/* One opened handle. The connection stays open while it is mapped: its
 * hang-up (a close, or this process's exit) tells the sender. */
struct opened {
    uint64_t va;
    size_t size, reserved, chunk;  /* chunk 0: each handle's length in lens (memory a job lent the sender) */
    size_t lens[TMS_SHARE_MAX_CHUNKS];
    int n_chunks;
    int conn;
    int refs;
    int device;
    int pending;     /* being opened: listed only so a fork's child closes its connection */
    struct tms_share_handle key;  /* the handle it was opened from */
    tms_phys handles[TMS_SHARE_MAX_CHUNKS];
    struct opened *next;
};

/* Connections a sender closed before they asked (it had too many that had
 * not asked yet, and said so) are tried again this many times in all. */
#define OPEN_TRIES 3

static pthread_mutex_t open_lock = PTHREAD_MUTEX_INITIALIZER;
static struct opened *opened_list;  /* guarded by open_lock */
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void fork_prepare(void) { pthread_mutex_lock(&open_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&open_lock); }
/* A forked child does not hold what its parent opened: its copies of the
 * connections would keep the sender counting the parent as a holder after
 * the parent closed. */
static void fork_child(void)
{
    for (struct opened *o = opened_list, *next; o; o = next) {
        next = o->next;
        close(o->conn);
        free(o);
    }
    opened_list = NULL;
    pthread_mutex_unlock(&open_lock);
}
static void register_fork(void)
{
    static const struct tms_fork_handlers handlers = {fork_prepare, fork_parent, fork_child};
    tms_fork_register(TMS_FORK_SHARE_OPEN, &handlers);
}

static int same_mapping(const struct opened *o, const struct tms_share_handle *h, int device)
{
    return !o->pending && o->device == device && o->key.pid == h->pid && o->key.socket_id == h->socket_id &&
           o->key.va == h->va && memcmp(o->key.token, h->token, sizeof h->token) == 0;
}

/* Connects o's socket to the sender named by h, in the user's place, and
 * checks it runs as this user. The socket is made under open_lock and kept
 * in o, which is listed: a fork at any moment finds it and closes the
 * child's copy. */
static int connect_sender(struct opened *o, const struct tms_share_handle *h, struct tms_err *err)
{
    int dir = -1;
    char path[PATH_MAX], name[TMS_OS_SOCKET_NAME_MAX];
    int rc = tms_share_place("open_shared", &dir, path, sizeof path, err);
    if (rc) return rc;
    pthread_mutex_lock(&open_lock);
    if (o->conn >= 0) close(o->conn);  /* a try before this one */
    int fd = o->conn = tms_os_socket(0);
    pthread_mutex_unlock(&open_lock);
    if (fd < 0) return tms_fail(err, TMS_E_IO, -fd, "open_shared: socket() failed: %s", strerror(-fd));
    (void)tms_os_socket_timeouts(fd, TMS_SHARE_TIMEOUT_S);  /* without them, the sender's own deadline still holds */
    tms_share_sender_name(name, sizeof name, h->pid, (unsigned long long)h->socket_id);
    rc = tms_os_connect_at(fd, dir, path, name);
    if (rc == -ECONNREFUSED || rc == -ENOENT)
        return tms_fail(err, TMS_E_STATE, -rc,
                        "open_shared: the process that shared 0x%llx (pid %u) is gone, or keeps its sockets in "
                        "another place than %s (a sender and its receivers must be one user that sees one such "
                        "directory: the same $XDG_RUNTIME_DIR, or /dev/shm shared between containers)",
                        (unsigned long long)h->va, (unsigned)h->pid, path);
    if (rc)
        return tms_fail(err, TMS_E_IO, rc < 0 ? -rc : 0, "open_shared: cannot reach pid %u at %s/%s: %s",
                        (unsigned)h->pid, path, name, rc < 0 ? strerror(-rc) : "not a socket");
    struct tms_os_peer peer;
    if (tms_os_peer_of(fd, &peer) != 0)
        return tms_fail(err, TMS_E_ARG, 0, "open_shared: the socket of pid %u belongs to another user: refused",
                        (unsigned)h->pid);
    return TMS_OK;
}

ssize_t tms_share_recv(int fd, void *buf, size_t len, int *fds, int max_fds, int *n_fds, int flags)
{
    union {
        char buf[CMSG_SPACE(sizeof(int) * TMS_JOB_MAX_PIECES)];
        struct cmsghdr align;
    } control;
    struct iovec iov = {.iov_base = buf, .iov_len = len};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    ssize_t n;
    do n = recvmsg(fd, &msg, MSG_CMSG_CLOEXEC | flags);
    while (n < 0 && errno == EINTR);
    *n_fds = 0;
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&msg); n >= 0 && cm; cm = CMSG_NXTHDR(&msg, cm)) {
        if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
        size_t count = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; i++) {
            int got;
            memcpy(&got, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
            if (*n_fds < max_fds) fds[(*n_fds)++] = got;
            else close(got);  /* more than asked for: not kept */
        }
    }
    /* A cut message or cut descriptors are refused whole: what arrived is closed. */
    if (n >= 0 && (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC))) {
        for (int i = 0; i < *n_fds; i++) close(fds[i]);
        *n_fds = 0;
        errno = EMSGSIZE;
        return -1;
    }
    return n;
}

/* Sends the request and takes the answer with its descriptors. *busy: the
 * sender closed the connection before it asked, saying so (it kept too many
 * that had not asked: another try may get in). A hang-up without a reply is
 * final: the sender is going, or refused what it could not read. */
static int ask(int fd, const struct tms_share_handle *h, struct tms_share_reply *reply, int *fds, int *n_fds,
               int *busy, struct tms_err *err)
{
    struct tms_share_request req = {.va = h->va};
    memcpy(req.magic, TMS_SHARE_MAGIC, sizeof req.magic);
    memcpy(req.token, h->token, sizeof req.token);
    ssize_t n;
    *busy = 0;
    do n = send(fd, &req, sizeof req, MSG_NOSIGNAL);
    while (n < 0 && errno == EINTR);
    int send_errno = n == (ssize_t)sizeof req ? 0 : n < 0 ? errno : EIO;
    /* A request that could not be sent may have crossed the sender's refusal: read it. */
    n = tms_share_recv(fd, reply, sizeof *reply, fds, TMS_SHARE_MAX_CHUNKS, n_fds, send_errno ? MSG_DONTWAIT : 0);
    /* A sender that closed with this request unread reset the connection, and the reset is
     * read before the reply it sent first: that reply, if any, comes next. */
    if (n < 0 && errno == ECONNRESET) {
        n = tms_share_recv(fd, reply, sizeof *reply, fds, TMS_SHARE_MAX_CHUNKS, n_fds, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == ECONNRESET)) n = 0;
    }
    int truncated = n < 0 && errno == EMSGSIZE;
    if (send_errno && n <= 0)
        return tms_fail(err, TMS_E_IO, send_errno, "open_shared: cannot ask pid %u: %s", (unsigned)h->pid,
                        strerror(send_errno));
    if (n == 0 || (n < 0 && errno == ECONNRESET))
        return tms_fail(err, TMS_E_STATE, 0, "open_shared: pid %u hung up without an answer", (unsigned)h->pid);
    if (n < 0 && !truncated)
        return tms_fail(err, TMS_E_IO, errno, "open_shared: no answer from pid %u%s: %s", (unsigned)h->pid,
                        errno == EAGAIN ? " within the timeout" : "", strerror(errno));
    /* Chunks of one size (and refusals) come without the lengths. */
    if (n != (ssize_t)sizeof *reply &&
        !(n == (ssize_t)offsetof(struct tms_share_reply, lens) && (reply->chunk || reply->status)))
        return tms_fail(err, TMS_E_ARG, 0, "open_shared: a malformed answer from pid %u", (unsigned)h->pid);
    reply->message[sizeof reply->message - 1] = '\0';
    *busy = reply->status && (reply->flags & TMS_SHARE_REPLY_BUSY);
    return TMS_OK;
}

/* A status from another process, as one of ours (the set the faces map). */
static int sender_status(int32_t status)
{
    switch (status) {
    case TMS_E_OOM: case TMS_E_HOST_OOM: case TMS_E_DRIVER: case TMS_E_STATE: case TMS_E_ARG: case TMS_E_NOT_FOUND:
    case TMS_E_UNSUPPORTED: case TMS_E_IO: return status;
    default: return TMS_E_STATE;
    }
}

/* Handles of lengths that differ (chunk 0): each a whole number of granules,
 * adding up to the allocation. */
static int lens_add_up(const struct tms_share_reply *r, size_t gran)
{
    uint64_t sum = 0;
    for (int i = 0; i < r->n_chunks; i++) {
        if (!r->lens[i] || r->lens[i] % gran || r->lens[i] > r->reserved - sum) return 0;
        sum += r->lens[i];
    }
    return sum == r->reserved;
}

/* What the sender said must describe memory this process can map: sizes that
 * add up, in whole granules, one descriptor per chunk. */
static int check_reply(const struct tms_share_reply *r, int n_fds, size_t gran, const struct tms_share_handle *h,
                       struct tms_err *err)
{
    int ok = r->n_chunks >= 1 && r->n_chunks <= TMS_SHARE_MAX_CHUNKS && n_fds == r->n_chunks && gran &&
             r->reserved % gran == 0 && r->size <= r->reserved && r->size == h->size &&
             (r->chunk ? r->chunk % gran == 0 && r->reserved > (uint64_t)(r->n_chunks - 1) * r->chunk &&
                             r->reserved <= (uint64_t)r->n_chunks * r->chunk
                       : lens_add_up(r, gran));
    if (ok) return TMS_OK;
    return tms_fail(err, TMS_E_ARG, 0,
                    "open_shared: pid %u described 0x%llx as %llu bytes in %d chunks of %llu (%d descriptors): refused",
                    (unsigned)h->pid, (unsigned long long)h->va, (unsigned long long)r->reserved, r->n_chunks,
                    (unsigned long long)r->chunk, n_fds);
}

static size_t chunk_bytes(const struct opened *o, int i)
{
    if (!o->chunk) return o->lens[i];
    size_t start = (size_t)i * o->chunk;
    return o->reserved - start < o->chunk ? o->reserved - start : o->chunk;
}

static uint64_t chunk_offset(const struct opened *o, int i)
{
    if (o->chunk) return (uint64_t)i * o->chunk;
    uint64_t off = 0;
    for (int j = 0; j < i; j++) off += o->lens[j];
    return off;
}

/* Unmaps and releases what map_opened made; returns the first failure's code. */
static int unmap_opened(const struct tms_driver *drv, struct opened *o, int mapped, int imported, int reserved)
{
    int first = 0;
    for (int i = 0; i < mapped; i++) {
        int rc = drv->unmap(o->va + chunk_offset(o, i), chunk_bytes(o, i));
        if (rc && !first) first = rc;
    }
    for (int i = 0; i < imported; i++) {
        int rc = drv->release(o->handles[i]);
        if (rc && !first) first = rc;
    }
    if (reserved) {
        int rc = drv->unreserve(o->va, o->reserved);
        if (rc && !first) first = rc;
    }
    return first;
}

static int map_opened(const struct tms_driver *drv, struct opened *o, const int *fds, size_t gran, int *left,
                      struct tms_err *err)
{
    *left = 0;
    int imported = 0, mapped = 0, reserved = 0, rc = 0;
    const char *op = "import";
    for (; imported < o->n_chunks; imported++)
        if ((rc = drv->import_fd(o->device, fds[imported], &o->handles[imported]))) break;
    if (!rc) {
        op = "address reserve";
        if (!(rc = drv->reserve(o->reserved, gran, &o->va))) reserved = 1;
    }
    if (!rc) {
        op = "map";
        for (; mapped < o->n_chunks; mapped++)
            if ((rc = drv->map(o->device, o->va + chunk_offset(o, mapped), chunk_bytes(o, mapped),
                               o->handles[mapped])))
                break;
    }
    if (!rc) return TMS_OK;
    tms_driver_fail(err, tms_driver_status(drv, rc), drv, rc,
                    "open_shared: %s of pid %u's allocation 0x%llx (%zu bytes) on device %d failed%s", op,
                    (unsigned)o->key.pid, (unsigned long long)o->key.va, o->reserved, o->device,
                    op[0] == 'm' ? " (another GPU's memory needs peer access between the two)" : "");
    int urc = unmap_opened(drv, o, mapped, imported, reserved);
    if (urc) tms_driver_fail_append(err, drv, urc, "undoing it failed");
    *left = urc != 0;
    return tms_driver_status(drv, rc);
}

/* Takes one more reference on h opened for device, if it is. */
static struct opened *reuse(const struct tms_share_handle *h, int device)
{
    pthread_mutex_lock(&open_lock);
    struct opened *o = opened_list;
    while (o && !same_mapping(o, h, device)) o = o->next;
    if (o) o->refs++;
    pthread_mutex_unlock(&open_lock);
    return o;
}

/* Takes o out of the list and closes its connection (under the lock: a fork
 * either sees both or neither); the sender then stops counting this process.
 * let_go: nothing of it is mapped here, and the sender is told so first (a
 * hang-up alone leaves it unsure, for as long as this process lives). */
static void drop(struct opened *o, int let_go)
{
    pthread_mutex_lock(&open_lock);
    struct opened **link = &opened_list;
    while (*link && *link != o) link = &(*link)->next;
    if (*link) *link = o->next;
    if (o->conn >= 0) {
        if (let_go) {
            struct tms_share_let_go msg = {.va = o->key.va};
            memcpy(msg.magic, TMS_SHARE_LET_GO, sizeof msg.magic);
            (void)send(o->conn, &msg, sizeof msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        }
        close(o->conn);
    }
    pthread_mutex_unlock(&open_lock);
    free(o);
}

int tms_share_open(const unsigned char *handle, int device, uint64_t *va, size_t *size, struct tms_err *err)
{
    struct tms_share_handle h;
    memcpy(&h, handle, sizeof h);
    if (memcmp(h.magic, TMS_SHARE_MAGIC, sizeof h.magic) != 0)
        return tms_fail(err, TMS_E_ARG, 0, "open_shared: not a handle of torch_memory_saver");
    pthread_once(&fork_once, register_fork);
    if (tms_share_serving_here(h.pid, h.socket_id))
        return tms_fail(err, TMS_E_ARG, 0,
                        "open_shared: 0x%llx was shared by this process: use its own memory, a handle is for another "
                        "process", (unsigned long long)h.va);
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    if (!drv->import_fd)
        return tms_fail(err, TMS_E_UNSUPPORTED, 0, "open_shared: the %s backend cannot import memory", drv->name);
    if (device < 0 && (rc = drv->current_device(&device)))
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "open_shared: cannot tell the current device");
    int count = 0;
    if ((rc = drv->device_count(&count))) return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "device count failed");
    if (device >= count) return tms_fail(err, TMS_E_ARG, 0, "open_shared: device %d does not exist (%d devices)", device, count);
    struct opened *o = reuse(&h, device);
    if (o) {
        *va = o->va;
        *size = o->size;
        return TMS_OK;
    }
    size_t gran = 0;
    if ((rc = drv->granularity(device, &gran)))
        return tms_driver_fail(err, TMS_E_DRIVER, drv, rc, "granularity query on device %d failed", device);
    if (!(o = calloc(1, sizeof *o))) return tms_fail(err, TMS_E_HOST_OOM, 0, "open_shared: out of host memory");
    *o = (struct opened){.conn = -1, .refs = 1, .device = device, .key = h, .pending = 1};
    pthread_mutex_lock(&open_lock);
    o->next = opened_list;
    opened_list = o;
    pthread_mutex_unlock(&open_lock);
    int fds[TMS_SHARE_MAX_CHUNKS], n_fds = 0, busy = 1, left = 0;
    struct tms_share_reply reply;
    for (int tries = 0; busy && tries < OPEN_TRIES; tries++) {
        busy = 0;
        rc = connect_sender(o, &h, err);
        if (!rc) rc = ask(o->conn, &h, &reply, fds, &n_fds, &busy, err);
    }
    if (!rc && reply.status)
        rc = tms_fail(err, sender_status(reply.status), 0, "open_shared: pid %u refused: %s", (unsigned)h.pid, reply.message);
    if (!rc) rc = check_reply(&reply, n_fds, gran, &h, err);
    if (!rc) {
        o->size = reply.size;
        o->reserved = reply.reserved;
        o->chunk = reply.chunk;
        o->n_chunks = reply.n_chunks;
        for (int i = 0; !o->chunk && i < o->n_chunks; i++) o->lens[i] = reply.lens[i];
        rc = map_opened(drv, o, fds, gran, &left, err);
    }
    for (int i = 0; i < n_fds; i++) close(fds[i]);
    if (rc) {
        drop(o, !left);
        return rc;
    }
    pthread_mutex_lock(&open_lock);
    o->pending = 0;
    pthread_mutex_unlock(&open_lock);
    TMS_DEBUG("opened pid %u's 0x%llx at 0x%llx (%zu bytes, device %d)", (unsigned)h.pid, (unsigned long long)h.va,
              (unsigned long long)o->va, o->size, device);
    *va = o->va;
    *size = o->size;
    return TMS_OK;
}

int tms_share_is_open(uint64_t va)
{
    pthread_mutex_lock(&open_lock);
    struct opened *o = opened_list;
    while (o && (o->pending || o->va != va)) o = o->next;
    pthread_mutex_unlock(&open_lock);
    return o != NULL;
}

size_t tms_share_open_count(void)
{
    size_t n = 0;
    pthread_mutex_lock(&open_lock);
    for (struct opened *o = opened_list; o; o = o->next) n += !o->pending;
    pthread_mutex_unlock(&open_lock);
    return n;
}

int tms_share_close(uint64_t va, struct tms_err *err)
{
    pthread_mutex_lock(&open_lock);
    struct opened *o = opened_list;
    while (o && (o->pending || o->va != va)) o = o->next;
    int found = o != NULL, last = found && --o->refs == 0;
    if (last) o->pending = 1;  /* closing: no reuse, and still listed for a fork until its connection is closed */
    pthread_mutex_unlock(&open_lock);
    if (!found) return tms_fail(err, TMS_E_NOT_FOUND, 0, "close_shared: 0x%llx is not an opened handle", (unsigned long long)va);
    if (!last) return TMS_OK;  /* opened more than once: the last close unmaps */
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (!rc) {
        int urc = unmap_opened(drv, o, o->n_chunks, o->n_chunks, 1);
        if (urc)
            rc = tms_driver_fail(err, TMS_E_DRIVER, drv, urc, "close_shared: unmap of 0x%llx (%zu bytes) failed",
                                 (unsigned long long)va, o->reserved);
    }
    drop(o, rc == TMS_OK);  /* unmapped first, then told: the sender may free once told */
    return rc;
}
