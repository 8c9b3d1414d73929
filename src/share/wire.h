/* What a share handle holds and what sender and receiver say to each other over the sender's Unix socket. */
#ifndef TMS_SHARE_WIRE_H
#define TMS_SHARE_WIRE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "core/core.h"
#include "core/core_share.h"
#include "share/share.h"

#define TMS_SHARE_MAGIC "TMSSHR01"

/* The 64 bytes of a handle. The sender's socket is named by its pid and a
 * random id in the user's place (share/place.h), where no other user can
 * name, take or reach it. */
struct tms_share_handle {
    char magic[8];
    uint32_t pid;
    uint32_t reserved0;
    uint64_t socket_id;
    uint64_t va;    /* the allocation's start in the sender */
    uint64_t size;
    unsigned char token[TMS_SHARE_TOKEN_BYTES];
    uint64_t reserved1;
};
_Static_assert(sizeof(struct tms_share_handle) == TMS_SHARE_HANDLE_BYTES, "a handle is a cudaIpcMemHandle_t");

struct tms_share_request {
    char magic[8];
    uint64_t va;
    unsigned char token[TMS_SHARE_TOKEN_BYTES];
};

/* What a receiver sends once it has unmapped the memory, before it hangs up:
 * the one sign the sender takes for "let go". A hang-up without it while the
 * receiver's process lives may leave the memory mapped there. */
#define TMS_SHARE_LET_GO "TMSLETGO"
struct tms_share_let_go {
    char magic[8];
    uint64_t va;    /* the allocation's start in the sender, as the handle says */
};

/* One reply; status 0 comes with n_chunks descriptors (SCM_RIGHTS). chunk 0:
 * the handles' lengths differ (memory a job lent), each given in lens. A
 * refusal with TMS_SHARE_REPLY_BUSY: the sender had too many connections that
 * had not asked, and closed this one before it asked: another try may get in
 * (every other refusal, and a hang-up without a reply, is final). */
#define TMS_SHARE_REPLY_BUSY 1
struct tms_share_reply {
    int32_t status;
    int32_t n_chunks;
    int32_t device;
    int32_t flags;
    uint64_t size, reserved, chunk;
    char message[448];
    uint64_t lens[TMS_SHARE_MAX_CHUNKS];
};

/* ---- lending within a job (job_ask.c asks, serve_job.c answers) --------------------
 * A member's socket is named from the job and the device in the user's
 * place ("j-<hash>-<pid>-<id>"), so the members of a job find each other
 * there and no other user can; a request names the job and the device again,
 * and the member answers only its own job's requests about its own device. */
#define TMS_JOB_MAGIC "TMSJOB01"
#define TMS_JOB_IDENTITY_MAX 95   /* a device's identity (driver.h's device_identity) */
#define TMS_JOB_MAX_NEEDS 256     /* allocations one borrow asks for */
#define TMS_JOB_MAX_PIECES 250    /* handles one lend carries (descriptors in one message: the kernel takes 253) */

/* STATUS: what the member has paused and keeps idle (a status reply). BORROW:
 * kept memory for the needs (a lend reply). RELEASE: the asker's driver ran
 * out of memory: the member releases up to needs[0] bytes it keeps idle (a
 * status reply, `demand` the bytes released). */
enum { TMS_JOB_STATUS = 1, TMS_JOB_BORROW = 2, TMS_JOB_RELEASE = 3 };

struct tms_job_request {
    char magic[8];
    uint32_t op;                 /* TMS_JOB_STATUS, TMS_JOB_BORROW or TMS_JOB_RELEASE */
    uint32_t n_needs;            /* BORROW: entries of needs that follow */
    char job[72];                /* NUL-terminated, TMS_JOB_NAME_MAX at most */
    char device[TMS_JOB_IDENTITY_MAX + 1];
    uint64_t needs[TMS_JOB_MAX_NEEDS];  /* bytes each allocation still needs (only n_needs are sent) */
};
#define TMS_JOB_REQUEST_HEAD offsetof(struct tms_job_request, needs)

struct tms_job_status_reply {
    int32_t status;
    int32_t reserved0;
    uint64_t demand;             /* bytes the member has paused on the device */
    uint64_t idle;               /* of its kept memory, bytes nobody borrows now */
};

/* A lend: n descriptors (SCM_RIGHTS), piece i for need pieces[i].need. The
 * connection it came over stays open while anything of it is borrowed. */
struct tms_job_lend_piece {
    uint32_t need;               /* the index of the need it serves */
    uint32_t reserved0;
    uint64_t size, len, key;     /* the handle's size, bytes of it to map, the lender's name for it */
};
struct tms_job_lend_reply {
    int32_t status;
    uint32_t n;
    struct tms_job_lend_piece pieces[TMS_JOB_MAX_PIECES];
};

/* What a borrower sends on that connection once it released pieces (every
 * piece of the lend with n 0: also when it gave up waiting for the answer).
 * SPENT: the memory was shared on, and another process may still map it: the
 * lender releases those handles and never lends or maps them again. */
#define TMS_JOB_RETURNED "TMSJRET1"
#define TMS_JOB_RETURNED_SPENT 1u
struct tms_job_returned {
    char magic[8];
    uint32_t n;
    uint32_t flags;
    uint64_t keys[TMS_JOB_MAX_PIECES];
};

/* 1 if pid and socket_id name this process's own sender thread. */
int tms_share_serving_here(uint32_t pid, uint64_t socket_id);

/* Seconds a receiver waits for the sender's answer before it gives up. */
#define TMS_SHARE_TIMEOUT_S 30

/* The sender's thread also answers the members of a job on the sockets job.c
 * listens on for device (listen_fd, called name in the place): registered
 * with the job and the device's identity its requests must name. Starts the
 * thread if needed; on success the thread owns the socket, closes it with
 * itself (never before) and removes its name then or at the process's exit. */
int tms_share_serve_job(int listen_fd, const char *name, int device, const char *job, const char *identity,
                        struct tms_err *err);
/* Wakes the sender's thread: memory kept for the job waits for its bound. */
void tms_share_serve_wake(void);

/* sendmsg of buf with n_fds descriptors (MSG_NOSIGNAL | flags); 0 if it all went. */
int tms_share_send(int fd, const void *buf, size_t len, const int *fds, int n_fds, int flags);
/* recvmsg into buf, descriptors into fds (at most max_fds, close-on-exec);
 * the length received (-1: errno), *n_fds the descriptors. */
ssize_t tms_share_recv(int fd, void *buf, size_t len, int *fds, int max_fds, int *n_fds, int flags);

#endif
