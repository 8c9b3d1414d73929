/* Inside the core: the allocation record and the move record, and what the table (table.c), tags
 * (tags.c), statistics (stats.c), allocation (alloc.c), claim and settle (claim.c), the
 * pause/resume state machine (pause.c) and the memory operations (chunks.c) share. */
#ifndef TMS_CORE_INTERNAL_H
#define TMS_CORE_INTERNAL_H

#include <stdint.h>

#include "backup/backup.h"
#include "core/core.h"
#include "core/core_share.h"
#include "core/stats.h"
#include "platform/driver.h"

/* The calling thread's region (core.h), writable: the core's own files and the C tests. */
struct tms_region *tms_region_current(void);

#define TMS_SHARE_PIDS_KEPT 4  /* named in a refused pause's message */

struct tms_alloc {
    tms_va va;
    size_t size;
    size_t reserved;
    size_t chunk;            /* bytes per physical handle; the last may be shorter */
    int n_chunks;
    int device;
    int tag_id;
    int state;               /* TMS_ACTIVE or TMS_PAUSED: what it is between operations */
    int moving;              /* a pause or resume owns it (table.c says what that means) */
    int free_requested;      /* freed while moving: its mover frees it when done */
    int backup;
    int backup_kind;
    int skip_unchanged;      /* the region's: 1, 0, or -1 (tms_core_skip_unchanged at each pause) */
    int restore;             /* without backup: what a resume writes over its memory (enum tms_restore_mode) */
    /* A restore that failed left it mapped, active, with bytes that are not
     * its own (the unmap that would have paused it again failed too): its
     * backup holds the truth, so a pause keeps that backup instead of copying,
     * and the next resume restores it. */
    int wrong_bytes;
    /* Adopted (core.h): mapped by its owner in a range the owner reserved;
     * the core never reserves, frees or hands it to a free() of its own. */
    int adopted;
    uint64_t owner_handle;   /* adopted: the handle its owner knows it by */
    int handle_types;        /* shareable handle types to create it with (0: none) */
    /* Shared with other processes (shares.c): the token its handles carry
     * (all zero until first shared) and the processes that map it now. */
    unsigned char share_token[TMS_SHARE_TOKEN_BYTES];
    int share_holders;
    int share_pids[TMS_SHARE_PIDS_KEPT];
    /* Receivers that hung up without saying they let go while their process
     * lived: they may still map the memory, so the pause that unmaps it
     * reports them instead of counting it released (and drops the marks). */
    int share_hung_up;
    int share_hung_up_pids[TMS_SHARE_PIDS_KEPT];
    uint32_t share_marks_taken;  /* times a pause took the marks: an older mark's end is no news */
    /* Its handle went out through the driver's own export (an adopted
     * segment's cuMemExportToShareableHandle): held until freed, as no
     * receiver tells when it lets go. */
    int exported_by_owner;
    /* Its physical memory (chunks.c): extents back to back from its start,
     * each saying where it came from; a plain allocation's are n_chunks of
     * its own. None while paused. ext points at one_ext while one fits. */
    struct tms_extent *ext;
    int n_ext, ext_cap;
    struct tms_extent one_ext;
    struct tms_backup *host_copy;  /* paused with backup, or retained after resume */
    struct tms_alloc *next;        /* hash chain */
    struct tms_alloc *tag_prev, *tag_next;  /* its tag's list (table.c) */
};

/* One allocation in a pause or resume. The mover fills it outside the table
 * lock; tms_table_settle applies it. Its backup's part is the backup layer's
 * record of the same move (b.held: what a->host_copy is at the claim, b.copy:
 * what it becomes). */
struct tms_move {
    struct tms_alloc *a;
    int state;                  /* the state it settles in */
    struct tms_backup_move b;
    size_t skipped;             /* bytes of its backup this call left out (free in the caller's cache) */
    int wrong;                  /* it held bytes not its own: left so by this resume, or this pause kept its backup */
    struct tms_backup *drop;    /* tms_table_settle: the backup a no longer holds */
};

/* A tag's slot (tags.c). Its fields are guarded by the table lock. */
struct tms_tag {
    const char *name;                                 /* atomic; set when the slot is (re)used */
    int in_use;
    uint32_t refs;                                    /* regions and tokens naming it */
    uint32_t next_free;                               /* free list: slot + 1, 0 ends it */
    struct tms_alloc *allocs;                         /* the tag's allocations */
    struct tms_stats per_device[TMS_STATS_DEVICES];
    uint64_t counted_call[TMS_STATS_DEVICES];         /* last pause/resume call counted in per_device */
};

/* ---- the table lock (table.c) -----------------------------------------------
 * Guards the table, the tags and every field of an allocation that is not
 * moving; never held across a driver call, a copy, host allocation or I/O. */
void tms_table_lock(void);
void tms_table_unlock(void);
/* Waits, with the lock held, until a moving allocation settles; wakes those waiting. */
void tms_table_wait_settled(void);
void tms_table_settled_locked(void);
size_t tms_table_count(void);  /* allocations now (read without the lock) */
int tms_table_insert_locked(struct tms_alloc *a);
void tms_table_unlink_locked(struct tms_alloc **link);
/* The link to the allocation starting at va, or NULL. */
struct tms_alloc **tms_table_link_locked(tms_va va);
struct tms_alloc *tms_table_find_locked(tms_va va);
/* The allocation holding ptr (its start or inside it), or NULL. */
const struct tms_alloc *tms_table_owner_locked(uint64_t ptr);
/* The hash's buckets, for the walks below. */
size_t tms_table_buckets_locked(void);
struct tms_alloc *tms_table_bucket_locked(size_t i);

/* Every allocation, under the lock. Two nested loops: `break` inside leaves
 * only the inner one. */
#define TMS_FOR_EACH_ALLOC(a)                                                                      \
    for (size_t bucket_ = 0, buckets_ = tms_table_buckets_locked(); bucket_ < buckets_; bucket_++) \
        for (struct tms_alloc *a = tms_table_bucket_locked(bucket_); a; a = a->next)

/* The allocations of tag_id (a plain variable; -1: every tag): its own list,
 * so a pause of a small tag beside many allocations of others does not walk
 * them all. As in TMS_FOR_EACH_ALLOC, `break` leaves only the inner loop:
 * with tag_id -1, one bucket. */
#define TMS_FOR_EACH_OF_TAG(a, tag_id)                                                                      \
    for (size_t bucket_ = 0, buckets_ = (tag_id) < 0 ? tms_table_buckets_locked() : 1; bucket_ < buckets_; \
         bucket_++)                                                                                          \
        for (struct tms_alloc *a = (tag_id) < 0 ? tms_table_bucket_locked(bucket_)                           \
                                                : tms_tag_slot_locked(tag_id)->allocs;                       \
             a; a = (tag_id) < 0 ? a->next : a->tag_next)

/* Receivers holding shared allocations or marked as hung up (shares.c counts
 * them; a forked child starts at none). */
void tms_table_share_holders_add(int delta);
int tms_table_share_holders(void);

/* ---- tags (tags.c), under the table lock ------------------------------------ */
int tms_tags_intern_locked(const char *tag, int *id, struct tms_err *err);
/* The id of tag, -1 if it has none. */
int tms_tags_find_locked(const char *tag);
/* The tag of id if in use, else NULL; "default" (id 0) always exists. */
struct tms_tag *tms_tag_locked(int id);
/* References of regions and tokens (ids of "default" and unknown ones are ignored). */
void tms_tag_ref_locked(int id);
void tms_tag_unref_locked(int id);
/* Slots made so far (ids below it), and one of them in use or not. */
int tms_tags_count(void);
struct tms_tag *tms_tag_slot_locked(int id);

/* ---- statistics (stats.c), under the table lock ---------------------------- */
/* An allocation's share of the gauges taken out (sign -1) or put back (+1). */
void tms_stats_account_locked(const struct tms_alloc *a, int sign);
/* A pause or resume that changed a: counted once per (tag, device) of call call_seq. */
void tms_stats_count_change_locked(const struct tms_alloc *a, const struct tms_move *m, int is_pause, uint64_t ns,
                                   uint64_t call_seq);

/* ---- allocations (alloc.c) --------------------------------------------------- */
void tms_alloc_destroy(struct tms_alloc *a);
/* The driver side of a free of an allocation already out of the table; if its
 * memory cannot be unmapped it goes back into the table and the free fails. */
int tms_alloc_release_detached(const struct tms_driver *drv, struct tms_alloc *a, struct tms_err *err);

/* Waits until no allocation of the tags (NULL: every tag) is moving, then
 * marks those in state `from` as moving and returns them: from then on only
 * the caller touches their memory, handles and backups. *n = 0 with TMS_OK
 * when the tags hold nothing; TMS_E_STATE naming a tag that holds allocations
 * but none in `from`, and then nothing is claimed. */
int tms_table_claim(const char *const *tags, size_t n_tags, int from, struct tms_move **moves, size_t *n,
                    struct tms_err *err);

/* Puts claimed allocations back with their new state and backup, counts the
 * call (ns long) in the statistics, wakes whoever waits for them, then drops
 * the backups they no longer hold and finishes the frees that arrived
 * meanwhile. Frees moves. */
void tms_table_settle(const struct tms_driver *drv, struct tms_move *moves, size_t n, int is_pause, uint64_t ns);

/* ---- pause (pause.c) and resume (resume.c), the checks done (op.c) ---------- */
int tms_core_pause_moves(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err);
int tms_core_resume_moves(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err);
/* Maps the claimed paused allocations m[0..n) in order, each just before its
 * backup (b.held) is copied back, and settles each: active once every byte is
 * back (and, with verify_restore, found as it was paused: *verify_ns grows by
 * the time that took); one whose restore failed or came back other than it
 * was paused goes back to paused with its backup (or, if it cannot even be
 * unmapped, stays active marked wrong_bytes, said in err). The first map
 * that fails stops the mapping: the rest stay paused. Returns the first
 * failure. */
int tms_core_restore_moves(const struct tms_driver *drv, struct tms_move *const *m, size_t n, int retain,
                           uint64_t *verify_ns, struct tms_err *err);
uint64_t tms_core_now_ns(void);
/* Does a pause of a copy only what changed (and keep its backup while active)? */
int tms_alloc_skips_unchanged(const struct tms_alloc *a);
/* Is a's backup kept while it is active (retain on, or it skips unchanged memory)?
 * A pause and a resume ask the same question: the one place it is decided. */
int tms_alloc_keeps_backup(const struct tms_alloc *a, int retain);

/* Physical memory of one allocation (chunks.c): its extents, one path
 * each way whatever they came from. tag names it in messages. */
size_t tms_chunk_size(const struct tms_alloc *a, int i);
/* Room for n extents in a->ext (kept); TMS_E_HOST_OOM. */
int tms_extents_reserve(struct tms_alloc *a, int n);
/* Maps the extents a->ext lists (a plan, maybe none) in order, after creating
 * the rest in chunks of a->chunk; on failure leaves nothing mapped, created
 * nothing, and the plan as it was. */
int tms_extents_map(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err);
/* Unmaps every extent; if one fails, those already unmapped are mapped back
 * so the allocation stays whole. pre: no work in flight touches it. */
int tms_extents_unmap(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err);
/* Lets go of the memory of an unmapped allocation: what a provider gave goes
 * back to it, the rest is released; a->n_ext becomes 0. A failure leaks a
 * handle and changes nothing else: it is reported, not undone. */
int tms_extents_release(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err);
/* Hands the provider the unmapped memory of items[0..n) (sorted by device)
 * before it is released (tms_extents_release releases what it leaves). */
void tms_extents_give(struct tms_give *items, size_t n);
/* Whether a provider is set (and memory may come from it or go to it). */
const struct tms_provider *tms_extents_provider(void);
/* Whether the memory of a may be kept and lent to, or come from, other
 * processes: its own, exportable, of an allocation the core made. */
int tms_extents_exchangeable(const struct tms_driver *drv, const struct tms_alloc *a);
/* A freed allocation: what a provider keeps for it is its no more. */
void tms_extents_forget(struct tms_alloc *a);

/* ---- memory from the provider for a pause and a resume (provide.c) ------------------- */
/* After a pause unmapped m[i] (unmapped[i] set): the provider takes back the
 * memory that came from it and keeps own memory as the others will ask for it; the rest
 * is released. Failures of releases are reported (first in *rc, err), not undone. */
void tms_provide_let_go(const struct tms_driver *drv, struct tms_move *m, size_t n, const unsigned char *unmapped,
                     const struct tms_op_args *args, int *rc, struct tms_err *err);
/* Before a resume maps m[0..n): each exchangeable allocation's memory planned by
 * the provider (a->ext); the driver makes the rest when it is mapped. */
void tms_extents_plan(const struct tms_driver *drv, struct tms_move *const *m, size_t n, const struct tms_op_args *args);
/* A plan that was not mapped: given back to the provider, which keeps it again. */
void tms_extents_unplan(const struct tms_driver *drv, struct tms_alloc *a);

/* The report's row of device (NULL without a report, or past TMS_REPORT_DEVICES). */
struct tms_op_device *tms_report_device(const struct tms_op_args *args, int device);

/* Under the table lock: takes a's marks of receivers that hung up without
 * letting go (shares.c): returns how many, the first of their pids in pids
 * (TMS_SHARE_PIDS_KEPT entries, 0 past the count). */
int tms_shares_take_hung_up_locked(struct tms_alloc *a, int *pids);

/* The report of a call (report.c; args->report NULL: none): the devices of
 * the claimed allocations (with their free memory now, if args asks); then
 * what changed, before tms_table_settle applies it, and the free memory after. */
void tms_report_begin(const struct tms_driver *drv, const struct tms_op_args *args, const struct tms_move *m,
                      size_t n);
void tms_report_end(const struct tms_driver *drv, const struct tms_op_args *args, const struct tms_move *m, size_t n,
                    uint64_t ns);

/* The ranges (offsets) of the allocation [va, va+size) a pause backing it up
 * as kind copies: those outside skip (sorted by start, disjoint), each skip
 * first shrunk to whole granules of the kind. *ranges NULL: every byte; else
 * n_ranges ranges (maybe none) in an array the caller owns. TMS_E_HOST_OOM. */
int tms_live_plan(int kind, uint64_t va, size_t size, const struct tms_free_span *skip, size_t n_skip,
                  struct tms_range **ranges, size_t *n_ranges, struct tms_err *err);

#endif
