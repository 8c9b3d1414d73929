/* The core's side of sharing and of the memory provider, for share/ alone: the tokens and descriptors of shared allocations, and the provider an allocation's memory may come from. */
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
    size_t lens[TMS_SHARE_MAX_CHUNKS];  /* chunk 0: bytes of each handle mapped, in order (memory lent in pieces) */
};

/* The allocation holding ptr (start or inside), given its token on first
 * share. TMS_E_NOT_FOUND if ptr is not ours, TMS_E_UNSUPPORTED if it was made
 * without exportable handles. */
int tms_core_share_find(uint64_t ptr, struct tms_share_info *out, struct tms_err *err);
/* The descriptor of an extent a provider gave (its id), for a receiver pid:
 * with fd NULL, only noted as sent to pid (before any is exported); else a
 * copy into *fd (the caller's), or a failure saying why there is none. */
typedef int (*tms_lent_fd_fn)(uint64_t id, int pid, int *fd, struct tms_err *err);
/* For a receiver with process id pid: if the allocation at va carries token
 * and is active, exports each extent's handle as a descriptor into fds
 * (n_chunks of them, the caller's to close; a provider's extents through
 * lent_fd, as the driver does not export an imported handle again) and
 * counts pid as holding it until tms_core_share_detach. */
int tms_core_share_attach(uint64_t va, const unsigned char *token, int pid, int *fds, struct tms_share_info *out,
                          tms_lent_fd_fn lent_fd, struct tms_err *err);
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

/* ---- where an allocation's memory comes from (chunks.c; the provider: share/) ----
 * An allocation's physical memory is a list of extents back to back from its
 * start. Each names where its memory came from and how it goes back, as
 * mimalloc's mi_memid_t does: the core makes, maps, exports and releases its
 * own (TMS_MEM_OWN); memory a provider gave (TMS_MEM_LENT) goes back to the
 * provider, whose id the core never interprets. */
enum tms_mem_kind {
    TMS_MEM_NONE = 0,  /* taken: the provider holds it now (tms_provider.give) */
    TMS_MEM_OWN,       /* this process's handle, made by its driver for the core */
    TMS_MEM_LENT,      /* another process's, imported by the provider */
};
struct tms_memid {
    int kind;          /* enum tms_mem_kind */
    uint64_t id;       /* TMS_MEM_LENT: the provider's name for it */
};
struct tms_extent {
    uint64_t handle;   /* a physical handle of this process's backend */
    size_t len;        /* bytes of the allocation it backs */
    size_t size;       /* the handle's size (the driver maps a handle whole) */
    struct tms_memid from;
};

/* Ways a give keeps own memory for the others (tms_give.keep). */
enum { TMS_KEEP_NONE = 0, TMS_KEEP_ASKED, TMS_KEEP_ALL };

/* One allocation whose memory a pause or free unmapped (or a resume planned and never mapped). */
struct tms_give {
    const void *owner;            /* the allocation: a name the provider keeps its memory under */
    int device;
    int keep;                     /* TMS_KEEP_*: none; as much as the others will ask for (a pause of
                                   * exchangeable memory); all (a plan never mapped: it was kept before) */
    int paused;                   /* a pause let it go: the others hear of this process, whatever it keeps */
    int gone;                     /* freed: nothing kept under owner is its any more */
    struct tms_extent *ext;       /* its extents: each the provider takes it marks TMS_MEM_NONE */
    int n_ext;
    struct tms_op_device *report; /* its device's row of the call's report, or NULL */
    int rc;                       /* out: the driver's first failure releasing memory the provider took back */
};

/* One allocation a resume maps, whose memory may come from the provider. */
struct tms_provide {
    const void *owner;
    int device;
    size_t need;                  /* bytes it maps */
    struct tms_extent *planned;   /* out: its memory from its start (malloc'd, the caller's), or NULL */
    int n_planned;
    struct tms_op_device *report;
};

/* Physical memory from beyond this process's driver, one entry each way (as
 * backup/backup.h is for the backups): give after an unmap, provide before a
 * map. Registered by share/; without it the core makes and releases all. */
struct tms_provider {
    /* After unmap: items[0..n), sorted by device. The provider takes what is
     * its (TMS_MEM_LENT) and the own memory it keeps; the core releases the rest. */
    void (*give)(struct tms_give *items, size_t n);
    /* Before map: plans items[0..n) (sorted by device). With n 0, the driver
     * refused room bytes on device: returns 1 if memory was let go for it. */
    int (*provide)(struct tms_provide *items, size_t n, int device, size_t room);
};
void tms_core_set_provider(const struct tms_provider *p);

/* Bytes of the allocations paused on device, not moving, made exportable by
 * the core (not adopted): what their resumes may ask other processes for. */
size_t tms_core_paused_demand(int device);

#endif
