/* What a share handle holds and what sender and receiver say to each other over the sender's Unix socket. */
#ifndef TMS_SHARE_WIRE_H
#define TMS_SHARE_WIRE_H

#include <stddef.h>
#include <stdint.h>

#include "core/core.h"
#include "share/share.h"

#define TMS_SHARE_MAGIC "TMSSHR01"

/* The 64 bytes of a handle. The sender's socket is named by its pid and a
 * random id, in the abstract namespace (no file to leave behind). */
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

/* One reply; status 0 comes with n_chunks descriptors (SCM_RIGHTS). */
struct tms_share_reply {
    int32_t status;
    int32_t n_chunks;
    int32_t device;
    int32_t reserved0;
    uint64_t size, reserved, chunk;
    char message[448];
};

/* "\0tms-share-<pid>-<id>" into addr; returns the address length. */
struct sockaddr_un;
size_t tms_share_address(struct sockaddr_un *addr, uint32_t pid, uint64_t socket_id);

/* 1 if pid and socket_id name this process's own sender thread. */
int tms_share_serving_here(uint32_t pid, uint64_t socket_id);

/* Seconds a receiver waits for the sender's answer before it gives up. */
#define TMS_SHARE_TIMEOUT_S 30

#endif
