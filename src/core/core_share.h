/* The core's side of sharing and lending, for share/ alone: the tokens and descriptors of shared allocations, and the pool of memory a job lends. */
#ifndef TMS_CORE_SHARE_H
#define TMS_CORE_SHARE_H

#include <stddef.h>
#include <stdint.h>

#include "core/core.h"

/* ---- sharing with other processes (shares.c; the wire and the threads: share/) ----------
 * A shared allocation carries a random token in its handles; a process that
 * opens one holds it until it closes, and a pause of memory someone holds is
 * refused (TMS_E_STATE naming the tag and the processes). A receiver that
 * hangs up without saying it let go, while its process lives, may still map
 * the memory: the next pause goes ahead but reports it (tms_op_unconfirmed). */
#define TMS_SHARE_TOKEN_BYTES 16
#define TMS_SHARE_MAX_CHUNKS 64  /* physical handles one share carries (descriptors in one message) */

struct tms_share_info {
    uint64_t va;               /* the allocation's start */
    size_t size, reserved, chunk;  /* chunk 0: the handles' lengths differ, each in lens */
    int n_chunks, device, tag_id;
    unsigned char token[TMS_SHARE_TOKEN_BYTES];
    size_t lens[TMS_SHARE_MAX_CHUNKS];  /* chunk 0: bytes of each handle mapped, in order (memory a job lent) */
};

/* The allocation holding ptr (start or inside), given its token on first
 * share. TMS_E_NOT_FOUND if ptr is not ours, TMS_E_UNSUPPORTED if it was made
 * without exportable handles. */
int tms_core_share_find(uint64_t ptr, struct tms_share_info *out, struct tms_err *err);
/* For a receiver with process id pid: if the allocation at va carries token
 * and is active, exports each chunk's handle as a descriptor into fds
 * (n_chunks of them, the caller's to close) and counts pid as holding it
 * until tms_core_share_detach. */
int tms_core_share_attach(uint64_t va, const unsigned char *token, int pid, int *fds, struct tms_share_info *out,
                          struct tms_err *err);
/* pid holds it no more. let_go 1: it said it let go, or its process ended;
 * 0: it hung up without saying so while its process lives, and is marked
 * until tms_core_share_gone or the pause that unmaps the memory; returns
 * what tms_core_share_gone is to be given for that mark. */
uint32_t tms_core_share_detach(uint64_t va, const unsigned char *token, int pid, int let_go);
/* The process of a receiver marked by tms_core_share_detach(..., 0) ended: its mark goes. */
void tms_core_share_gone(uint64_t va, const unsigned char *token, int pid, uint32_t mark);
/* Before a pause decides: the sender's thread settles receivers that have
 * hung up by now, and those marked whose process has ended (it learns of
 * them on its own time otherwise). */
void tms_core_share_reap(void);
void tms_core_share_set_reaper(void (*fn)(void));

/* ---- lending within a job (pool.c, lend.c; the job's sockets: share/job.c) -------------
 * Processes of one user that name one job and use one GPU lend each other
 * the physical memory a pause releases, so that a resume right after
 * another member's pause need not wait for the driver to clean it. A pause
 * keeps what the other members will ask for (ops->keep) in this process's
 * pool; a resume maps its own kept memory again, then what members lend
 * (ops->borrow), then asks the driver. The job layer registers the ops;
 * without them nothing is kept or borrowed. */
struct tms_job_piece {     /* a handle another member lent, imported here */
    size_t need;           /* index of the need (tms_job_ops.borrow) it serves */
    uint64_t handle;       /* imported: a handle of this process's backend */
    size_t size, len;      /* the handle's size; bytes of it to map (a prefix) */
    uint64_t key;          /* the lender's name for it, given back when it is returned */
    uint64_t via;          /* the job layer's name for the connection it came over */
    int lender;            /* the lender's pid */
    int fd;                /* the descriptor it came as, kept (tms_core_job_keep_fd; else -1): the driver
                            * does not export an imported handle again, so a share passes this one on */
};

struct tms_job_note {      /* what asking the members found, for the report */
    int members;           /* members asked */
    int timed_out;         /* of them, those that did not answer within the bound */
    int timed_out_pids[TMS_REPORT_PIDS];
    int bad;               /* of them, those whose lend failed the checks (share/job.c) */
};

struct tms_job_ops {
    /* 1 while the process is in a job. */
    int (*on)(void);
    /* A pause is about to release `releasable` bytes it could lend on device:
     * how many of them to keep (what the other members will ask for). */
    size_t (*keep)(int device, size_t releasable, struct tms_job_note *note);
    /* A resume needs needs[i] more bytes for n allocations on device: the
     * members' lent handles, imported (*pieces: malloc'd, the caller's). */
    int (*borrow)(int device, const size_t *needs, size_t n, struct tms_job_piece **pieces, size_t *n_pieces,
                  struct tms_job_note *note);
    /* The borrowed handles keys[0..n) that came over via are unmapped and released here;
     * spent: they were shared on, and another process may still map them. */
    void (*returned)(uint64_t via, const uint64_t *keys, size_t n, int spent);
    /* The pool changed: idle memory now waits for its bound (the job's thread sleeps until the first). */
    void (*wake)(void);
    /* The driver is out of memory on device: the members release up to
     * bytes of what they keep idle there. Returns the bytes they released. */
    size_t (*release)(int device, size_t bytes);
};
void tms_core_job_set_ops(const struct tms_job_ops *ops);

/* The member side, for the job's thread. What this process has paused on
 * device (its demand) and keeps idle for the job. */
void tms_core_job_status(int device, size_t *demand, size_t *idle);

#define TMS_JOB_MAX_PIECES 250  /* handles one lend carries (descriptors in one message: the kernel takes 253) */
struct tms_job_lent {
    size_t need;           /* the need it serves */
    size_t size, len;      /* the handle's size; bytes of it the borrower maps */
    uint64_t key;
};
/* Lends kept memory on device for needs[0..n) to process pid: at most
 * TMS_JOB_MAX_PIECES handles, exported into fds (the caller's to close),
 * counted lent under *batch until tms_core_job_returned. *n_out may be 0. */
int tms_core_job_lend(int device, const uint64_t *needs, size_t n, int pid, struct tms_job_lent *out, int *fds,
                      size_t *n_out, uint64_t *batch, struct tms_err *err);
/* The borrower of batch released keys[0..n) (n 0: every handle of it, as
 * when its process ended): they are idle again, kept within the bound; spent
 * (shared on, or its process ended: another process may still map them):
 * released at the next expiry instead, never lent or taken back. Returns how
 * many of the batch are still lent. */
size_t tms_core_job_returned(uint64_t batch, const uint64_t *keys, size_t n, int spent);
/* Releases up to bytes of the memory kept idle on device (another member ran
 * out of memory there): the bytes released. */
size_t tms_core_job_release(int device, size_t bytes);
/* Releases the kept memory nobody borrowed within the bound (TMS_JOB_HOLD_MS);
 * milliseconds until the next would go, -1 if none waits. */
int tms_core_job_expire(void);
/* Whether a borrowed piece may keep the descriptor it came as (tms_job_piece.fd;
 * a share of memory on it passes that one on): 1, counted, while fewer than
 * tms_core_job_fd_cap() are kept, else 0. A kept one is closed, and counted
 * off, when the piece is returned. */
int tms_core_job_keep_fd(void);
/* A quarter of the process's descriptor limit. */
size_t tms_core_job_fd_cap(void);

#endif
