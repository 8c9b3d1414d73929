/* The VMM core's public header: the one allocation table, its pause/resume, and everything the faces (module.c, abi.c) and hooks call. */
#ifndef TMS_CORE_H
#define TMS_CORE_H

#include <stddef.h>
#include <stdint.h>

#include "core/report.h"
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

/* ---- sharing, as the faces and hooks see them ------------------------------------
 * The share handles, the sender's and receivers' protocol and the memory
 * exchanged between processes are share/'s (share/share.h and its neighbours); what the
 * core does for them is in core/core_share.h, which only share/ and the core
 * include. */
/* The owner of the allocation adopted at va under owner_handle is exporting
 * its handle itself (delta 1, before the export: *handle gets the handle to
 * export, read under the same lock; -1 undoes it if the export failed): from
 * then on a pause of it is refused until it is freed. TMS_E_STATE while
 * paused, TMS_E_NOT_FOUND if no allocation was adopted there under that handle. */
int tms_core_mark_exported(uint64_t va, uint64_t owner_handle, int delta, uint64_t *handle, struct tms_err *err);

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
