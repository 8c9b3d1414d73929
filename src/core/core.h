/* The VMM core's public header: the one allocation table, its pause/resume, and everything the faces (module.c, abi.c) and hooks call. */
#ifndef TMS_CORE_H
#define TMS_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "core/stats.h"
#include "platform/config.h"
#include "platform/error.h"
#include "platform/host_budget.h"

/* A host backup (backup/backup.h): the faces hold one only as a view's
 * reference (tms_core_backup_of, tms_core_backup_bytes, tms_core_backup_release). */
struct tms_backup;

#define TMS_TAG_DEFAULT_ID 0  /* the tag "default", interned first */

enum tms_alloc_state {
    TMS_ACTIVE = 0,
    TMS_PAUSED = 1,
    /* Only in tms_core_list: a pause or resume is moving it now. */
    TMS_PAUSING = 2,
    TMS_RESUMING = 3,
};

/* One row of tms_core_list(): a copy, safe to read without the core lock. */
struct tms_alloc_info {
    uint64_t ptr;
    size_t size;         /* requested */
    size_t reserved;     /* after rounding to the granularity */
    int device;
    int tag_id;
    int state;           /* enum tms_alloc_state */
    int backup;          /* backup enabled for this allocation */
    int backup_kind;
    int has_host_copy;   /* a host backup exists now (paused, or retained) */
    int host_copy_pinned; /* ... and it is page-locked (pinned, or a retained one pinned since) */
    int n_chunks;
    int adopted;         /* mapped by its owner (tms_core_adopt), not allocated by the core */
    int backup_to_file;  /* backed up to a file (a disk backup), not host memory */
    size_t backup_bytes; /* bytes its backup holds now (its last pause copied), 0 without one */
    size_t skipped_bytes; /* bytes that pause left out: free in the caller's cache */
    int wrong_bytes;     /* active with bytes that are not its own: a failed restore could not pause it again */
    int restore;         /* what it holds after a resume without backup (enum tms_restore_mode) */
};

/* ---- regions: what the calling thread's allocations get ---------------------
 * Each thread has its own, initialised from the TMS_INIT_* settings on first
 * use; only that thread reads or writes it, so the hooks read it without a
 * lock. One policy for every face: a region the Python API asks for names a
 * non-empty UTF-8 tag, and asks for a CPU backup (pinned or mmap; backend
 * NULL: TMS_INIT_CPU_BACKUP_BACKEND) or a disk backup, not both; a backend is
 * named only with a CPU backup. Settings made one at a time (the C ABI) let
 * the disk backup win, as the upstream library does. */
struct tms_region {
    int active;       /* inside a region and not disabled */
    int tag_id;
    int backup;       /* keep a host copy across pause */
    int backup_kind;  /* the CPU backup's kind (tms_core_backup_kind_parse): pinned or mmap */
    int disk_backup;  /* back up to a file instead; wins over backup when both are set */
    int skip_unchanged; /* a pause copies only chunks changed since the backup was written (keeping the
                         * backup while active): 1, 0, or -1: the process's setting decides at the pause */
    int restore;        /* what memory paused without backup holds after resume (enum tms_restore_mode),
                         * or -1: TMS_RESTORE decides */
};

/* What a resume writes over memory that was paused without backup: nothing
 * (its bytes are undefined: whatever the new memory held), zeros, or 0xFF in
 * every byte (NaN in every float type, -1 in signed integers), so that a read
 * of discarded memory shows at once. */
enum tms_restore_mode { TMS_RESTORE_NONE = 0, TMS_RESTORE_ZERO = 1, TMS_RESTORE_POISON = 2 };
/* A mode by name ("none", "zero", "poison"): TMS_E_ARG for any other. */
int tms_core_restore_mode_parse(const char *name, int *mode);
const char *tms_core_restore_mode_name(int mode);
/* The default of regions that do not say (TMS_RESTORE). */
int tms_core_restore_mode_default(void);

/* The calling thread's region. */
const struct tms_region *tms_core_region(void);
/* Its settings one at a time (the C ABI's setters). */
void tms_core_region_set_active(int active);
void tms_core_region_set_backup(int backup);
void tms_core_region_set_backup_kind(int kind);
void tms_core_region_set_disk_backup(int disk);
void tms_core_region_set_skip_unchanged(int skip);  /* 1, 0 or -1 (the process's setting) */
void tms_core_region_set_restore(int mode);         /* enum tms_restore_mode, or -1 (TMS_RESTORE) */
/* Makes tag (checked as for a region) the calling thread's region tag,
 * holding a reference on it until the thread names another or ends. */
int tms_core_set_region_tag(const char *tag, struct tms_err *err);

struct tms_region_request {
    const char *tag;
    int cpu_backup;
    const char *backend;  /* NULL: the default */
    int disk_backup;
};
/* Checks a region a user asks for; *kind gets the CPU backup kind it makes. */
int tms_core_check_region(const struct tms_region_request *req, int *kind, struct tms_err *err);
/* Sets the calling thread's region; its tag (checked as above) is
 * referenced while it stays the thread's. */
int tms_core_set_region(int active, const char *tag, int backup, int kind, int disk, struct tms_err *err);

/* A CPU backup backend's name ("pinned" or "mmap") as its kind: TMS_E_ARG for any other. */
int tms_core_backup_kind_parse(const char *name, int *kind);
/* The name of a backup kind: "pinned", "mmap" or "disk". */
const char *tms_core_backup_kind_name(int kind);

/* ---- tags ------------------------------------------------------------------- */

/* Interns tag (a non-empty UTF-8 string, else TMS_E_ARG) and returns its
 * id. A tag nothing references (no allocation, no region naming it) may be
 * reclaimed once many tags exist, and its id reused. */
int tms_core_tag_id(const char *tag, int *id, struct tms_err *err);
/* Name of a tag; the string lives for the process. */
const char *tms_core_tag_name(int id);
/* A reference on a tag held by a copy of a region (expandable segments). */
void tms_core_tag_ref(int id);
void tms_core_tag_unref(int id);
/* A tag as a region or a pause takes it: non-empty UTF-8. */
int tms_core_check_tag(const char *tag, struct tms_err *err);
/* What a pause or resume of several tags checks first: each tag, none twice (op names the call). */
int tms_core_check_tags(const char *op, const char *const *tags, size_t n, struct tms_err *err);

/* ---- allocations ------------------------------------------------------------- */

/* Allocates size bytes on device (-1: the calling thread's current device)
 * with the settings of region r. size 0 gives NULL, like cudaMalloc.
 * TMS_E_OOM when the device is full or the margin would be crossed. */
int tms_core_alloc(size_t size, int device, const struct tms_region *r, void **ptr, struct tms_err *err);

/* Frees an allocation (active or paused) and drops its backup.
 * TMS_E_NOT_FOUND if ptr is not an allocation of the core. One that a pause
 * or resume is moving now is freed by that call when it is done with it:
 * this returns at once. */
int tms_core_free(void *ptr, struct tms_err *err);

/* Cheap test used by the hooks to route cudaFree. */
int tms_core_owns(const void *ptr);
/* 1 if ptr lies in an allocation of the table (its start or inside it, adopted or not). */
int tms_core_holds(const void *ptr);

/* ---- pause and resume ---------------------------------------------------------
 * tag NULL = every tag. A tag with no allocations is a no-op. Pausing a tag
 * whose allocations are all paused (or resuming one all active) is
 * TMS_E_STATE naming the tag. A call that selects allocations another
 * pause or resume is moving first waits for them, then decides: two pauses
 * of one tag give one pause and one TMS_E_STATE, as one after the other.
 * Allocations made while a pause runs are not part of it. */
int tms_core_pause(const char *tag, struct tms_err *err);
int tms_core_resume(const char *tag, struct tms_err *err);

/* [start, start + len) of device memory. */
struct tms_free_span {
    uint64_t start, len;
};

#define TMS_REPORT_DEVICES 16

#define TMS_REPORT_PIDS 4

/* Why a resume in a job took memory from the driver rather than from other
 * members (tms_op_device.fallback). */
enum tms_job_fallback {
    TMS_JOB_NOT_ASKED = 0,   /* no job, or its own kept memory was enough */
    TMS_JOB_NO_MEMBER,       /* no other member of the job on the device */
    TMS_JOB_TIMED_OUT,       /* a member did not answer within the bound (timed_out_pids) */
    TMS_JOB_NOTHING_TO_LEND, /* the members answered, with less than was needed */
    TMS_JOB_ENOUGH,          /* the members lent all that was needed: nothing from the driver */
    TMS_JOB_BAD_LEND,        /* a member lent memory that failed the checks: refused whole (tms_job_note.bad) */
};

/* The byte counts of one device's part of a pause or resume, declared once:
 * X(field, the name the faces give it, what it counts). The C struct below,
 * the dict the Python face returns and Python's Report are made from it. */
#define TMS_REPORT_BYTES(X)                                                                                    \
    X(released, "released_bytes", "bytes of device memory a pause unmapped, or a resume mapped")              \
    X(mapped, "mapped_bytes", "bytes of device memory a resume mapped (0 for a pause)")                       \
    X(copied, "copied_bytes", "bytes copied to (pause) or from (resume) backups")                             \
    X(skipped, "skipped_bytes", "bytes of backed-up allocations not copied: free blocks of PyTorch's cache")  \
    X(unchanged, "unchanged_bytes", "bytes not copied because they had not changed since their backup was "    \
      "written (skip_unchanged)")                                                                              \
    X(verified, "verified_bytes", "bytes a resume restored and found, by their fingerprints, as they were "   \
      "paused")                                                                                                \
    X(kept, "kept_bytes", "of released_bytes, those a pause kept for the other members of its job")           \
    X(returned, "returned_bytes", "borrowed bytes a pause gave back to the members of its job that lent them") \
    X(reused, "reused_bytes", "bytes a resume mapped from memory this process kept for its job")              \
    X(borrowed, "borrowed_bytes", "bytes a resume mapped from memory other members of its job lent")

/* One device's part of a pause or resume. */
struct tms_op_device {
    int device;
    size_t allocations;   /* paused (resumed) by the call */
#define TMS_REPORT_FIELD(field, name, doc) size_t field;
    TMS_REPORT_BYTES(TMS_REPORT_FIELD)
#undef TMS_REPORT_FIELD
    size_t free_before, free_after;  /* the driver's free bytes around the call (0 if it could not say) */
    int free_measured;    /* free_before and free_after were asked for (tms_op_args.measure_free) */
    /* Lending within a job: the first lenders of a resume with their bytes,
     * and why the driver served the rest. */
    int lenders;          /* members it borrowed from; the first TMS_REPORT_PIDS in lender_pids */
    int lender_pids[TMS_REPORT_PIDS];
    size_t lender_bytes[TMS_REPORT_PIDS];
    int fallback;         /* enum tms_job_fallback (resume) */
    int timed_out;        /* members that did not answer in time (pause or resume); the first listed */
    int timed_out_pids[TMS_REPORT_PIDS];
};

#define TMS_REPORT_UNCONFIRMED 64

/* An allocation a pause unmapped while a receiver may still map its memory:
 * the receiver hung up without saying it let go, and its process lived. Its
 * bytes are not in its device's `released`. */
struct tms_op_unconfirmed {
    uint64_t va;
    size_t reserved;      /* bytes unmapped here */
    int device;
    int receivers;        /* that hung up without letting go */
    int pids[TMS_REPORT_PIDS];  /* the first of them; 0 past `receivers` */
    const char *tag;      /* pooled: valid for the process's life */
};

struct tms_op_report {
    uint64_t ns;
    size_t n_devices;     /* devices beyond TMS_REPORT_DEVICES are left out */
    struct tms_op_device devices[TMS_REPORT_DEVICES];
    size_t n_unconfirmed; /* all of them; the first TMS_REPORT_UNCONFIRMED are listed */
    struct tms_op_unconfirmed unconfirmed[TMS_REPORT_UNCONFIRMED];
    uint64_t fingerprint_ns;  /* a pause's time spent fingerprinting (unchanged memory, and what it copied) */
    uint64_t verify_ns;       /* a resume's time spent checking what it restored */
    char why_not_skipped[160];  /* "" or why memory that was to skip unchanged chunks was copied whole */
    char why_not_verified[160]; /* "" or why some bytes backed up (pause) or restored (resume) are not checked */
    /* Allocations a failed resume left mapped and active with bytes that are
     * not theirs (the unmap that would have paused them again failed too):
     * their backups hold the truth, and their next pause keeps it. */
    size_t n_wrong;
    uint64_t wrong[TMS_REPORT_PIDS];
};

/* How one pause or resume runs; every field optional (zeroed: as tms_core_pause). */
struct tms_op_args {
    /* Pause only: device ranges whose bytes nobody will read (blocks free in
     * PyTorch's cache), sorted by start and disjoint. Backups copy the rest of
     * each allocation; a skipped range comes back with undefined contents. */
    const struct tms_free_span *skip;
    size_t n_skip;
    struct tms_op_report *report;  /* filled on success and on failure */
    int measure_free;              /* the report asks the driver for its free memory before and after */
};

/* Would a pause of the tags (NULL: every tag) back up anything: does one of
 * them hold an active allocation with a backup? */
int tms_core_selects_backup(const char *const *tags, size_t n_tags);

/* tags NULL with n_tags 0: every tag; else several tags, all or nothing,
 * decided under the table lock: if any tag cannot be paused (resumed), none
 * is, and the error names it. Tags must differ (tms_core_check_tags). */
int tms_core_pause_ex(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err);
int tms_core_resume_ex(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err);

/* ---- host backups as views ------------------------------------------------------ */

/* The host backup covering [ptr, ptr+n): *out gets a new reference (caller
 * releases it) and *offset the position of ptr in it; *out = NULL if ptr is in
 * no allocation or the allocation has no host copy now. TMS_E_ARG if the range
 * starts inside an allocation and runs past its end. Waits while a pause or
 * resume is moving that allocation (its backup is being written). writable:
 * the caller may write the bytes (a zero-copy view), so the backup's record of
 * what it holds is no longer trusted (tms_backup_viewed). */
int tms_core_backup_of(uint64_t ptr, size_t n, int writable, struct tms_backup **out, size_t *offset,
                       struct tms_err *err);
/* The bytes a host backup holds (a view of it aliases them), and letting go
 * of the view's reference. */
void *tms_core_backup_bytes(const struct tms_backup *b);
void tms_core_backup_release(struct tms_backup *b);

/* ---- reading the table ------------------------------------------------------------ */

/* Statistics of every (tag, device) with a nonzero field (caller frees
 * *rows). Reads counters kept up to date: no table walk, no driver call. */
int tms_core_stats(struct tms_stats_row **rows, size_t *count, struct tms_err *err);

/* A copy of the table (caller frees *rows). */
int tms_core_list(struct tms_alloc_info **rows, size_t *count, struct tms_err *err);
/* The row of the allocation holding ptr; TMS_E_NOT_FOUND if none. */
int tms_core_find(uint64_t ptr, struct tms_alloc_info *row);
/* How many lookups of an address inside an allocation so far used the
 * address-sorted copy of the table rather than a walk (tests). */
uint64_t tms_core_sorted_lookups(void);

/* ---- adopted memory (hooks/cumem.c: PyTorch's expandable segments) ----------------
 * Memory its owner reserved, created and mapped itself, taken into the table
 * so pause and resume treat it as any allocation: backup, unmap and release
 * on pause; new physical memory mapped at the same address on resume. The
 * owner knows it by owner_handle and gives it back with tms_core_disown.
 * handle: a physical handle of the process's backend (tms_phys). */

/* Errors if mapping bytes more on device would cross memory_margin_bytes
 * (TMS_E_OOM naming the tag) or the device cannot be asked. */
int tms_core_check_margin(int device, size_t bytes, int tag_id, struct tms_err *err);

/* Takes [va, va+size) (mapped with handle, readable and writable by device)
 * into the table as an active allocation with region r's settings.
 * handle_types: the shareable types its owner created it with, kept for
 * the handles a resume creates. */
int tms_core_adopt(uint64_t va, size_t size, int device, uint64_t handle, uint64_t owner_handle, int handle_types,
                   const struct tms_region *r, struct tms_err *err);

/* Takes the adopted allocation at va out of the table (its owner unmaps it),
 * first waiting for a pause or resume moving it. *handle: its physical
 * handle, still mapped, if it was active; 0 if paused (nothing is mapped
 * then and its backup is dropped). *owner_handle and *size: what
 * tms_core_adopt got. TMS_E_NOT_FOUND if no adopted allocation starts at
 * va; TMS_E_ARG (nothing changed) if it is longer than max_size. */
int tms_core_disown(uint64_t va, size_t max_size, uint64_t *handle, uint64_t *owner_handle, size_t *size,
                    struct tms_err *err);

/* The adopted allocation holding ptr: *owner_handle and *handle (its
 * physical handle now; 0 while paused or moving). TMS_E_NOT_FOUND if none. */
int tms_core_adopted_at(uint64_t ptr, uint64_t *owner_handle, uint64_t *handle);

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
/* The owner of the allocation adopted at va under owner_handle is exporting
 * its handle itself (delta 1, before the export: *handle gets the handle to
 * export, read under the same lock; -1 undoes it if the export failed): from
 * then on a pause of it is refused until it is freed. TMS_E_STATE while
 * paused, TMS_E_NOT_FOUND if no allocation was adopted there under that handle. */
int tms_core_mark_exported(uint64_t va, uint64_t owner_handle, int delta, uint64_t *handle, struct tms_err *err);
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
/* Bytes on device this process keeps idle for the job, has lent to other
 * members, and maps from memory other members lent. */
void tms_core_job_memory(int device, size_t *kept, size_t *lent, size_t *borrowed);

/* ---- process-wide settings -------------------------------------------------------- */

/* One setter and one getter per RUN row of platform/config.h's table, named there
 * (tms_core_set_margin / tms_core_margin, tms_core_set_retain / tms_core_retain, ...) and made
 * by core/settings.c: the environment's value until a face sets another. */
#define TMS_CORE_SETTING_ACCESSORS(type, set, get)                                                             \
    void set(TMS_SETTING_CTYPE(type) value);                                                                   \
    TMS_SETTING_CTYPE(type) get(void);
#define TMS_CORE_SETTING_ROW(name, type, env, dflt, range, accepts, when, doc)                                 \
    TMS_SETTING_IF_RUN(when, TMS_CORE_SETTING_ACCESSORS(type, TMS_SETTING_SETTER(when), TMS_SETTING_GETTER(when)))
TMS_SETTINGS(TMS_CORE_SETTING_ROW)

/* The host backup budget: shared by the processes of a user that name one ledger
 * (platform/host_budget.h: one record from the ledger to the faces). */
int tms_core_host_budget(struct tms_ledger_info *info, struct tms_err *err);

/* ---- the process's services, for the faces (facade.c) ---------------------- */
int tms_core_set_disk_dir(const char *dir, struct tms_err *err);
void tms_core_disk_dir(char *buf, size_t n);
/* Chooses the backend before first use ("cuda", "hip", "host"). */
int tms_core_use_backend(const char *name, struct tms_err *err);
/* Loads the backend if needed; its name. */
int tms_core_backend(const char **name, struct tms_err *err);
/* The loaded backend's name, or NULL. */
const char *tms_core_loaded_backend(void);
/* The platform the process's PyTorch was built for ("cuda" or "hip"): the
 * backend's default when neither TMS_BACKEND nor TMS_PLATFORM says. */
void tms_core_set_platform_hint(const char *platform);
/* Free and total bytes of device (loads the backend). */
int tms_core_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes, struct tms_err *err);
/* Starts the copy workers and pins their staging on a thread of its own (in
 * the context of the caller's current device), once per process; the first
 * backed-up allocation does the same. */
int tms_core_warm_backups(struct tms_err *err);
/* The calling thread's device: the one its regions' allocations land on (loads the backend). */
int tms_core_current_device(int *device, struct tms_err *err);
/* *active: 1 if the process already uses device (a context is active on it),
 * else 0; asks without creating anything on the device. */
int tms_core_device_active(int device, int *active, struct tms_err *err);
/* Bytes copied so far by the backup copy running now (or the last), and its size. */
void tms_core_copy_progress(size_t *done, size_t *total);
/* Fingerprints of the n chunks of 2 MiB from va on device as a pause takes
 * them (platform/fingerprint.h), for tests: TMS_E_UNSUPPORTED where the
 * backend has none, TMS_E_DRIVER with the code where its kernel fails. */
#define TMS_CORE_FP_CHUNK ((size_t)2 << 20)
int tms_core_fingerprint(int device, uint64_t va, size_t n, uint64_t (*out)[4], struct tms_err *err);
/* The same on the CPU over len bytes in chunks of chunk bytes (whole 256 KiB
 * blocks), under the process's key, or under key (4 x 256 uint32 NH words,
 * then 4 uint64 points) where it is not NULL. */
int tms_core_fingerprint_bytes(const void *data, size_t len, size_t chunk, const void *key, uint64_t (*out)[4],
                               struct tms_err *err);
/* The message of this thread's last failed hook or C ABI call ("" if none). */
const char *tms_core_last_error(void);
void tms_core_keep_error(const struct tms_err *err);

#endif
