/* Backups of paused allocations as the core sees them: one call saves, one restores, one record says what moved. */
#ifndef TMS_BACKUP_H
#define TMS_BACKUP_H

#include <stddef.h>
#include <stdint.h>

#include "platform/driver.h"
#include "platform/error.h"

/*
 * A pause hands its backed-up allocations to tms_backup_save, a resume hands
 * its paused ones to tms_backup_restore; each describes one allocation by a
 * struct tms_backup_move. What a backup is (host memory, page-locked or not,
 * a file) and how its bytes move (the copy workers of transfer.c) stays in
 * this layer: the core holds a backup only as a pointer and asks about it
 * through the functions below.
 */

enum tms_backup_kind {
    TMS_BACKUP_PINNED = 0,  /* page-locked host memory */
    TMS_BACKUP_MMAP = 1,    /* pageable anonymous memory, returned to the OS on resume */
    TMS_BACKUP_DISK = 2,    /* a file in the disk backup directory (disk.c); never a CPU backup backend */
    TMS_BACKUP_KINDS
};
/* mmap is the default: it reaches link speed without keeping memory pinned
 * between cycles; pinning a large backup fresh costs seconds (docs/performance.md). */
#define TMS_BACKUP_DEFAULT TMS_BACKUP_MMAP

struct tms_backup;

/* Bytes [off, off + len) of a backup (offsets from its allocation's start). */
struct tms_range {
    size_t off, len;
};

/* One allocation a save or a restore moves. The caller fills the first part. */
struct tms_backup_move {
    int kind;                   /* the allocation's backup kind */
    int device;
    tms_va va;
    size_t size;
    size_t reserved;            /* bytes mapped at va (size rounded up): the most a tail's zeroing may touch */
    struct tms_backup *held;    /* its backup now (a save may write into it again; a restore reads it), or NULL */
    int retain;                 /* its backup is kept while the allocation is active (retain on, or skip_unchanged) */
    /* Save: copy only the chunks whose bytes changed since the backup it
     * reuses was written (fingerprints on the device); the first save of a
     * backup copies all and records them. */
    int skip_unchanged;
    /* Save: record the fingerprint of each chunk the copy carried, found
     * unchanged while it ran. Restore: fingerprint what came back and compare
     * with that record (a mismatch is `bad`, and the move is not whole). */
    int verify;
    /* Save: the bytes to copy (NULL: every one; tms_backup_granule says how
     * ranges are cut); the call takes them. */
    struct tms_range *ranges;
    size_t n_ranges;
    /* Out: */
    struct tms_backup *copy;    /* its backup after the call: held or a new one, NULL if it has none */
    size_t copied;              /* bytes copied */
    size_t unchanged;           /* save: bytes of its ranges found unchanged, not copied */
    int whole;                  /* save: failed, yet its copy is whole and kept; restore: every byte is back */
    size_t verified;            /* restore: bytes fingerprinted and found as they were paused */
    int bad;                    /* restore: some chunk came back other than it was paused (the move is not whole) */
    size_t bad_offset;          /* restore: the first such chunk's offset from the allocation's start */
    const char *unverified;     /* restore: why some restored bytes were not compared (a static text), or NULL */
};

/* What a save or a restore tells its caller while it runs (each optional). */
struct tms_backup_hooks {
    void *arg;
    /* Save: move i is wholly in its backup while the others still copy, in
     * the caller's thread. Called only where every move of the call is saved
     * whole into a backup it reuses and can DMA to at once (a retained,
     * page-locked one), so that the caller may release the device memory
     * early; if the save then fails, such a move's copy is kept (whole). */
    void (*saved)(void *arg, size_t i);
    /* Restore: called in the caller's thread, in move order, before any byte
     * of move i (or of a later move) is copied back, while earlier moves'
     * copies run, and for moves without a backup too. Nonzero stops the
     * restore: move i and the later ones are left unrestored. */
    int (*before_restore)(void *arg, size_t i);
};

/* Saves the device's bytes of the n moves m[0..n) point to: reserves
 * from the host backup budget what they need beyond what the backups they
 * reuse hold (spilling the largest to disk where spill is on and the budget
 * has no room), makes or reuses each backup, and copies. On success each
 * copy holds the move's ranges (every byte if none). On failure the budget is
 * as it was and every backup the call began to overwrite is dropped (a file
 * is removed: the device still holds the truth), so each copy is NULL, but a
 * whole one the saved hook reported, which is kept (whole = 1); a failure
 * before any copy started leaves each copy = held. pre: the devices are
 * synchronized; the memory stays mapped unless the hook lets it go. */
struct tms_save_info {
    uint64_t fingerprint_ns;    /* spent fingerprinting (unchanged memory found, and what the copies carried) */
    char why_not[160];          /* "" or why moves to skip unchanged memory were copied whole (no kernel, a failed run) */
    char why_not_recorded[160]; /* "" or why moves to verify have no record of some chunks */
};
int tms_backup_save(const struct tms_driver *drv, struct tms_backup_move *const *m, size_t n, int spill,
                    const struct tms_backup_hooks *hooks, struct tms_save_info *info, struct tms_err *err);

/* Copies each move's held backup (what its last save wrote) back to the
 * device, calling before_restore first (that is where the caller maps the
 * memory). A move to verify is fingerprinted on the device as soon as its
 * bytes are back, before its storage goes: one whose bytes differ from what
 * its save recorded keeps its backup and is not whole (bad, bad_offset).
 * A move whose every byte is back (and checked) has whole = 1, and copy = held if
 * the backup is kept while active (its retain, or its kind keeps it), else NULL
 * (its storage went as soon as its bytes were back). A backup that cannot be
 * opened stops the restore there as a failed hook does. Returns the first
 * failure in move order (a hook's own is the caller's to report: the call
 * returns TMS_OK for it); a move left with whole = 0 keeps copy = held.
 * pre: nothing else writes the device ranges. */
struct tms_restore_info {
    uint64_t verify_ns;         /* spent fingerprinting what came back */
};
int tms_backup_restore(const struct tms_driver *drv, struct tms_backup_move *const *m, size_t n,
                       const struct tms_backup_hooks *hooks, struct tms_restore_info *info, struct tms_err *err);

/* Drops the backup a move would install if it is not the one it held. */
void tms_backup_move_discard(struct tms_backup_move *m);

/* ---- asking about a backup -------------------------------------------------- */
int tms_backup_kind(const struct tms_backup *b);
size_t tms_backup_size(const struct tms_backup *b);
/* Bytes its last save wrote (its ranges). */
size_t tms_backup_held(const struct tms_backup *b);
/* The bytes of a host-memory backup (a CPU view aliases them), else NULL. */
void *tms_backup_host(const struct tms_backup *b);
/* Is b page-locked now (a DMA can go straight to it)? */
int tms_backup_pinned(const struct tms_backup *b);
/* Does an active allocation keep b (to be written again by its next pause)? */
int tms_backup_kept_while_active(const struct tms_backup *b, int retain);
/* After a pause or resume that keeps b (a retained one is page-locked in the background). */
void tms_backup_kept(struct tms_backup *b, int retain);
/* A zero-copy view of b is handed out: its bytes may change behind the
 * library, so its fingerprints are never trusted again. */
void tms_backup_viewed(struct tms_backup *b);

void tms_backup_ref(struct tms_backup *b);
void tms_backup_unref(struct tms_backup *b);

/* ---- kinds -------------------------------------------------------------------- */
/* The granule of kind's partial copies. */
size_t tms_backup_granule(int kind);
/* Does kind keep a host copy (a CPU backup), rather than a file? */
int tms_backup_kind_is_host(int kind);
/* The name of kind: "pinned", "mmap" or "disk". */
const char *tms_backup_kind_name(int kind);
/* A CPU backup backend's name ("pinned" or "mmap") as its kind; TMS_E_ARG for any other. */
int tms_backup_kind_parse(const char *name, int *kind);
/* The kind of TMS_INIT_CPU_BACKUP_BACKEND, else TMS_BACKUP_DEFAULT. */
int tms_backup_default_kind(void);
/* The kind a region's allocations are backed up as: a disk backup wins over a
 * CPU one of cpu_kind (the upstream library's rule for settings made one at a time). */
int tms_backup_kind_of_region(int cpu_kind, int disk);
/* The directory of the disk kind's files from now on, and the one in use
 * (disk.c; backup/files.h says what is checked). */
int tms_backup_set_disk_dir(const char *dir, struct tms_err *err);
void tms_backup_disk_dir(char *buf, size_t n);

/* ---- the copy workers ------------------------------------------------------------ */
/* Starts them and pins their staging ahead of the first pause, on a thread of
 * their own, once per process, in the context of device (one the process uses). */
void tms_backup_warm_later(const struct tms_driver *drv, int device);
/* Bytes copied so far by the copy running now (or the last), and its size. */
void tms_backup_copy_progress(size_t *done, size_t *total);

#endif
