/* The sender's thread and the protocols it answers: what serve.c, serve_wire.c, serve_share.c and serve_job.c share, and only they include. */
#ifndef TMS_SHARE_SERVE_H
#define TMS_SHARE_SERVE_H

#include <stddef.h>
#include <stdint.h>
#include <unistd.h>

#include "platform/error.h"
#include "platform/os.h"
#include "share/wire.h"

/*
 * One thread polls every listener and connection (serve.c). What a request
 * asks and what a holder says back is a protocol's: the share's receivers
 * (serve_share.c) and the job's members (serve_job.c), one table of
 * operations each. The protocols call serve.c to start the thread and to
 * listen, so serve.c names neither (no two files call each other): each
 * registers its table at load and the thread calls it through the table.
 * serve_wire.c reads, sends and refuses for all of them, and calls none.
 */

/* A connection, or what is left of one that hung up. */
enum tms_serve_state {
    TMS_CONN_ASKING,   /* accepted; it has not asked yet */
    TMS_CONN_HOLDING,  /* got the memory's descriptors: holds it until it says it let go */
    TMS_CONN_HUNG_UP,  /* hung up without saying so while its process lived: its pidfd is watched */
    TMS_CONN_DONE,     /* closed: dropped from the list */
};

struct tms_serve_protocol;

/* A connection: serve.c's list, guarded by conns_lock; a protocol changes one
 * only in the operations it is handed under that lock. */
struct tms_serve_conn {
    int fd;          /* the socket (ASKING, HOLDING), the process's pidfd (HUNG_UP) */
    const struct tms_serve_protocol *protocol;  /* what it holds from, once it holds */
    int listener;    /* the listener it came through */
    uint64_t batch;  /* a job's: the lend it holds (tms_job_lend) */
    int pid;         /* SO_PEERCRED's: 0 where its process is outside this PID namespace */
    int state;       /* enum tms_serve_state */
    int ready;       /* ASKING: it is being answered, or its request was there when accepted */
    uint32_t mark;   /* a share's, HUNG_UP: for tms_core_share_gone */
    uint64_t ask_by_ms;
    uint64_t va;     /* a share's: the allocation it holds, and its token */
    unsigned char token[TMS_SHARE_TOKEN_BYTES];
};

/* A listening socket: the share one (device -1), or one a member of a job
 * listens on for device, named `name` in the user's place (share/place.h).
 * Listeners are only added, and closed with the thread (or in a fork's
 * child). Each has its own refusals' window. */
struct tms_serve_listener {
    int fd;
    int device;
    char job[72];
    char identity[TMS_JOB_IDENTITY_MAX + 1];
    char name[TMS_OS_SOCKET_NAME_MAX];
    uint64_t resume_ms;     /* not polled until then */
    uint64_t window_end_ms;
    unsigned refusals;      /* in the window ending at window_end_ms */
};

/* A request as the thread reads it, before it knows whose: room for either protocol's. */
union tms_serve_request {
    struct tms_share_request share;
    struct tms_job_request job;
};

/* What a request ended with: held (the peer got the descriptors) or to be closed. */
struct tms_serve_outcome {
    int fd;
    int holding;
    int refused;     /* malformed, or the memory could not be given: counts against the flood budget */
    const struct tms_serve_protocol *protocol;  /* that answered (set by the thread; NULL: none did) */
    uint64_t va;     /* a share's, with its token */
    unsigned char token[TMS_SHARE_TOKEN_BYTES];
    uint64_t batch;  /* a job's lend */
};

/* A protocol: a request goes to the one whose magic it starts with, whatever
 * listener it came through (each answer checks what that listener serves:
 * one thread always answered both on every socket). */
struct tms_serve_protocol {
    const char *magic;   /* the first 8 bytes of its requests */
    /* Answers the request of len bytes in req on fd, from pid, through l.
     * Runs without conns_lock: attaching may wait for a pause of that memory,
     * and other tags' pauses (which reap first) must not wait with it. */
    struct tms_serve_outcome (*answer)(int fd, int pid, const struct tms_serve_listener *l,
                                       const union tms_serve_request *req, size_t len);
    /* Under conns_lock: c holds what an answer gave and its socket is
     * readable: it says it let go, or it hung up. */
    void (*spoke_locked)(struct tms_serve_conn *c);
    /* Under conns_lock: the process c watches (HUNG_UP) has ended: whatever it mapped went with it. */
    void (*ended_locked)(struct tms_serve_conn *c);
    /* Under conns_lock: out was handed over a connection gone meanwhile (a
     * fork's child closed it): nobody holds it. */
    void (*unheld_locked)(const struct tms_serve_outcome *out, int pid);
    /* Under serve_lock and conns_lock: the thread stopped, or this is a
     * fork's child, which has none: its sockets are closed (NULL: nothing to forget). */
    void (*stopped_locked)(void);
};

/* Registers a protocol: at load, from a constructor in its file, so that the
 * thread answers both whichever of them started it. */
void tms_serve_add_protocol(const struct tms_serve_protocol *p);

/* serve_lock (serve.c): the thread's start and wake-up, and what the share
 * protocol keeps of its socket (serve_share.c); taken before conns_lock. A
 * caller that may start the thread registers the fork handlers of both locks
 * first (once), as a lock's handlers are registered before it is first taken. */
void tms_serve_register_fork(void);
void tms_serve_lock(void);
void tms_serve_unlock(void);

/* Under serve_lock: starts the thread in this process if it does not run,
 * adds the listening socket fd (called name in the place; device -1 for the
 * share one) for it to poll, and wakes it. TMS_E_STATE, the message starting
 * with who, if it polls as many as it can already; the caller keeps fd then. */
int tms_serve_listen_locked(int fd, const char *name, int device, const char *job, const char *identity,
                            const char *who, struct tms_err *err);

/* Reads the request waiting on fd and hands it to the protocol of known[]
 * whose magic it starts with; refused, nothing sent, if none. Without
 * conns_lock, as the answers run. */
struct tms_serve_outcome tms_serve_answer(int fd, int pid, const struct tms_serve_listener *l,
                                          const struct tms_serve_protocol *const *known, size_t n_known);

/* A share's reply as a refusal always was: without the lengths of a lend's pieces. */
int tms_serve_send_reply(int fd, const struct tms_share_reply *reply, int flags);

/* Tells a peer of this user why it gets nothing (a share's reply, busy: try
 * again), if it listens, and closes fd. */
void tms_serve_refuse(int fd, const char *why, int busy);

/* Under conns_lock: c is closed, and dropped from the list when the thread next sweeps it. */
static inline void tms_serve_close_conn(struct tms_serve_conn *c)
{
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
    c->state = TMS_CONN_DONE;
}

/* 1 if the process behind a socket has ended, else 0 with *pidfd a
 * descriptor to watch it by, or -1 where the kernel cannot tell (os.h). */
static inline int tms_serve_peer_ended(int sock, int pid, int *pidfd)
{
    return tms_os_peer_process(sock, pid, pidfd) == TMS_OS_ENDED;
}

#endif
