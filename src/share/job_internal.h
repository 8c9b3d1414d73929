/* Inside the job, what its files share (job.c, job_ask.c, job_borrow.c, job_pool.c, job_lend.c, serve_job.c): the members and the sockets to them, asking them, the memory kept for them, the records of memory they lent. */
#ifndef TMS_SHARE_JOB_INTERNAL_H
#define TMS_SHARE_JOB_INTERNAL_H

#include <limits.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "core/core_share.h"
#include "platform/error.h"
#include "platform/os.h"
#include "share/job.h"
#include "share/wire.h"

/* A handle another member lent, imported here (job_borrow.c). */
struct tms_job_piece {
    size_t need;           /* index of the need it serves */
    uint64_t handle;       /* imported: a handle of this process's backend */
    size_t size, len;      /* the handle's size; bytes of it to map */
    uint64_t key;          /* the lender's name for it, given back when it is returned */
    uint64_t via;          /* job.c's name for the connection it came over */
    int lender;            /* the lender's pid */
    int fd;                /* the descriptor it came as, kept (tms_job_keep_fd; else -1): the driver does not
                            * export an imported handle again, so a share passes this one on */
    int shared_on;         /* a process other than its lender was sent it: it goes back spent */
};

/* What asking the members found, for the report. */
struct tms_job_note {
    int members;           /* members asked */
    int timed_out;         /* of them, those that did not answer within the bound */
    int timed_out_pids[TMS_REPORT_PIDS];
    int bad;               /* of them, those whose lend failed the checks (job_borrow.c) */
};

/* ---- the members and the sockets to them (job.c) ----------------------------------------
 * job.c's job_lock guards the name, this process's sockets and every
 * connection to another member; the other files reach them only through
 * these calls, each holding the lock only within itself, so no caller waits
 * under it. */
/* 1 while the process is in a job. */
int tms_job_on(void);
/* What a pause or resume asks the members with: the job, the device, the
 * place, and the one deadline of the whole call. */
struct tms_job_asking {
    char job[TMS_JOB_NAME_MAX + 1];
    char identity[TMS_JOB_IDENTITY_MAX + 1];
    char prefix[32];
    char path[PATH_MAX];
    int dir;
    uint64_t deadline;
};
/* Another member's socket: its name, and once connected the socket and the
 * pid its credentials give. */
struct tms_job_member {
    char name[TMS_OS_SOCKET_NAME_MAX];
    int fd;
    int pid;
};
/* The monotonic clock in milliseconds, what deadlines are counted in. */
uint64_t tms_job_now_ms(void);
/* The device's identity, the place and this process's socket for the device,
 * made if it has none yet (from then on the others find it), into *a; the
 * call's deadline starts now. */
int tms_job_join_device(int device, struct tms_job_asking *a, struct tms_err *err);
/* The names of the other members' sockets on the device, into m (malloc'd,
 * the caller's to free); how many. The place holds only the user's sockets. */
size_t tms_job_list_members(const struct tms_job_asking *a, struct tms_job_member **m);
/* A new socket to a member, listed (pending) from the start, so a fork at any
 * moment finds it; -1 if none. */
int tms_job_open_conn(void);
/* Closes the listed socket fd and forgets it. */
void tms_job_close_conn(int fd);
/* Whether any of the files ids[0..n) (those with is_file[i]) came here in an
 * earlier lend that is still held. */
int tms_job_conn_holds_file(const int *is_file, const struct tms_os_id *ids, size_t n);
/* The lend r came over the listed socket fd from lender: the socket is kept
 * as its claim, with the identities of the files it lent (ids[i] where
 * is_file[i]). Returns this process's name for the connection (the pieces' via). */
uint64_t tms_job_conn_claim(int fd, int lender, const struct tms_job_lend_reply *r, const int *is_file,
                            const struct tms_os_id *ids);
/* Tells a lender over fd that keys[0..n) (n 0: all it lent) are released here
 * (spent: see wire.h). A full socket drops it. */
void tms_job_send_returned_on(int fd, const uint64_t *keys, size_t n, int spent);
/* The borrowed handles keys[0..n) that came over via are released here:
 * their lender is told (spent: they were shared on, and another process may
 * still map them); the connection closes once nothing of its lend is left. */
void tms_job_send_returned(uint64_t via, const uint64_t *keys, size_t n, int spent);

/* ---- asking the members (job_ask.c), each within the call's one bound -------------------- */
/* How asking one member went: asked (its socket open), timed out, or gone. */
enum { TMS_MEMBER_ASKED, TMS_MEMBER_TIMED_OUT, TMS_MEMBER_GONE };
/* Notes that member pid did not answer within the bound. */
void tms_job_note_timeout(struct tms_job_note *note, int pid);
/* The request op of a's job about a's device, its head filled, its needs none. */
void tms_job_fill_request(struct tms_job_request *req, int op, const struct tms_job_asking *a);
/* Connects to member m (a socket listed as the job's, into m->fd) and checks
 * it runs as this user: TMS_MEMBER_ASKED; TMS_MEMBER_GONE: nobody listens there
 * (its process ended: the name is removed) or it is not a member after all;
 * TMS_MEMBER_TIMED_OUT: its backlog is full. */
int tms_job_connect_member(const struct tms_job_asking *a, struct tms_job_member *m);
/* Sends req (len bytes) to m; TMS_MEMBER_ASKED, else m's socket is closed. */
int tms_job_send_request(struct tms_job_member *m, const struct tms_job_request *req, size_t len);
/* Connects to the members listed and sends each req: those asked keep their
 * socket (m[i].fd), the others are noted (timed out) or dropped. How many
 * were asked (at most 32), first in m. */
size_t tms_job_ask_members(const struct tms_job_asking *a, struct tms_job_member *m, size_t n,
                           const struct tms_job_request *req, size_t len, struct tms_job_note *note);
/* Waits until deadline for an answer on fd, with at most max_fds
 * descriptors; its length (0: hung up, -1: none in time or an error,
 * *timed_out says). */
ssize_t tms_job_take_answer(int fd, uint64_t deadline, void *buf, size_t len, int *fds, int max_fds, int *n_fds,
                            int *timed_out);
/* Takes the status replies of the n members asked as they come, until the
 * call's deadline: each one that answered goes to take (which returns 1 once
 * it needs no more); those that did not answer in time are noted timed out.
 * Every member's socket is closed on return. */
void tms_job_take_statuses(const struct tms_job_asking *a, struct tms_job_member *m, size_t n,
                           struct tms_job_note *note,
                           int (*take)(void *ctx, const struct tms_job_member *m, const struct tms_job_status_reply *r),
                           void *ctx);
/* A pause is about to release `releasable` bytes it could lend on device
 * (joining the job there first): how many of them to keep. */
size_t tms_job_ask_keep(int device, size_t releasable, struct tms_job_note *note);
/* The driver is out of memory on device: the members release up to bytes of
 * what they keep idle there. Returns the bytes they released. */
size_t tms_job_ask_release(int device, size_t bytes);

/* ---- borrowing from the members (job_borrow.c) -------------------------------------------- */
/* A resume needs needs[i] more bytes for n allocations on device: the
 * members' lent handles, imported (*pieces: malloc'd, the caller's). */
int tms_job_borrow(int device, const size_t *needs, size_t n, struct tms_job_piece **pieces, size_t *n_pieces,
                   struct tms_job_note *note);

/* ---- own memory kept for the members (job_pool.c) -------------------------------------
 * Its lock is a leaf: nothing else is taken under it, and no driver call runs
 * under it (handles are exported and released after it is dropped). */
/* Whether anything is kept, lent or borrowed now (no lock). */
int tms_job_pool_any(void);
/* Keeps an own exportable handle of the paused allocation owner (its
 * order-th piece), idle for the job until the bound; TMS_E_HOST_OOM: not
 * kept, the caller releases it. */
int tms_job_pool_keep(int device, uint64_t handle, size_t size, const void *owner, int order);
/* owner resumes: its idle kept handles back as its own extents, in order
 * (*ext malloc'd, NULL if none); those lent out stay the job's. Returns their bytes. */
size_t tms_job_pool_take(const void *owner, struct tms_extent **ext, int *n_ext);
/* owner is freed: its idle handles released, those lent out the job's. */
void tms_job_pool_forget(const void *owner);
/* Whether a handle of size bytes may serve a need of want (the driver maps a handle whole). */
int tms_job_pool_fits(size_t size, size_t want);
/* Releases up to bytes of the memory kept idle on device (this process or
 * another member ran out of memory there): the bytes released. */
size_t tms_job_pool_release(int device, size_t bytes);
/* The job's one expiry: releases the kept memory nobody borrowed within the
 * bound (TMS_JOB_HOLD_MS); milliseconds until the next would go, -1 if none
 * waits. Run by the sender's thread, woken whenever memory is kept. */
int tms_job_expire(void);

/* ---- the member side, for the sender's thread (serve_job.c) ---------------------------- */
/* What this process has paused on device (its demand) and keeps idle for the job. */
void tms_job_status(int device, size_t *demand, size_t *idle);
struct tms_job_lent {
    size_t need;           /* the need it serves */
    size_t size, len;      /* the handle's size; bytes of it the borrower maps */
    uint64_t key;
};
/* Lends kept memory on device for needs[0..n) to process pid: at most
 * TMS_JOB_MAX_PIECES handles, exported into fds (the caller's to close),
 * counted lent under *batch until tms_job_returned. *n_out may be 0. */
int tms_job_lend(int device, const uint64_t *needs, size_t n, int pid, struct tms_job_lent *out, int *fds,
                 size_t *n_out, uint64_t *batch, struct tms_err *err);
/* The borrower of batch released keys[0..n) (n 0: every handle of it, as
 * when its process ended): they are idle again, kept within the bound; spent
 * (shared on, or its process ended: another process may still map them):
 * released at the next expiry instead, never lent or taken back. Returns how
 * many of the batch are still lent. */
size_t tms_job_returned(uint64_t batch, const uint64_t *keys, size_t n, int spent);

/* ---- memory the members lent, as this process maps it ----------------------------------- */
/* Records a piece imported on device: the id its extent carries
 * (tms_memid.id), counted borrowed; 0 without memory for the record. */
uint64_t tms_job_borrowed_add(int device, const struct tms_job_piece *p);
/* The piece of id is given back: its record into *out (its descriptor the
 * caller's to close) and removed, counted off. 0 if there is none. */
int tms_job_borrowed_drop(uint64_t id, struct tms_job_piece *out);
/* A share sends the piece of id to pid (core_share.h: tms_lent_fd_fn). */
int tms_job_lent_fd(uint64_t id, int pid, int *fd, struct tms_err *err);
/* Whether a borrowed piece may keep the descriptor it came as: 1, counted,
 * while fewer than a quarter of the process's descriptor limit are kept,
 * else 0. A kept one is closed, and counted off, when the piece is returned. */
int tms_job_keep_fd(void);

#endif
