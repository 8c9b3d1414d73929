/* What a backup kind implements, and the record every kind shares: backup/ only (the core sees backup.h). */
#ifndef TMS_BACKUP_KIND_H
#define TMS_BACKUP_KIND_H

#include <stddef.h>
#include <stdint.h>

#include "backup/backup.h"
#include "platform/driver.h"
#include "platform/error.h"

/*
 * Neither the core nor the copy workers know how a kind keeps its bytes: each
 * kind is one table of operations below, in a file of its own. Adding a kind
 * is adding such a file, its entry below and its case in tms_backup_ops_of
 * (backup.c).
 */

/* The granule of a kind's partial copies unless it names its own: a huge
 * page, so that a range left out leaves whole pages of a backup untouched. */
#define TMS_BACKUP_GRANULE ((size_t)2 << 20)

/* How the copy workers move a backup's blocks, chosen when a copy is planned. */
enum tms_backup_path {
    TMS_PATH_STAGED,    /* through the workers' pinned staging: write_block / read_block */
    TMS_PATH_DIRECT,    /* a DMA straight to or from page-locked host memory (direct_at) */
    TMS_PATH_PREPARED,  /* device->host: the kind prepares each block first (prepare_block), then as DIRECT, or
                         * as STAGED where it could not */
};

/* Block sizes the copy workers offer: staged copies, direct ones, and a
 * staging slot's size (the most one staged block can be). */
struct tms_block_sizes {
    size_t staged, direct, slot;
};

struct tms_backup_ops {
    const char *name;
    /* A pause that copies part of an allocation copies ranges that start and
     * end on multiples of this (or at the allocation's end). */
    size_t granule;
    int host_memory;     /* its bytes are host memory a CPU view may alias (get_cpu_backup) */
    int must_lock;       /* page-locked is what it promises: lacking the memory to lock a piece fails the copy
                          * (else that piece, and so the backup, only stays pageable) */
    int open_limit;      /* at most this many open at once in one copy (descriptors), 0: no limit */
    int interleave;      /* a copy takes its backups' blocks in turns (I/O in flight on several at once) */
    /* Makes b's storage for b->size bytes of the allocation at va on device. */
    int (*create)(struct tms_backup *b, int device, uint64_t va, struct tms_err *err);
    /* A pause may write into b again. */
    int (*reusable)(const struct tms_backup *b);
    /* Around a copy's blocks (NULL: nothing to do). close after writes makes them durable. */
    int (*open)(struct tms_backup *b, struct tms_err *err);
    int (*close)(struct tms_backup *b, int wrote, struct tms_err *err);
    /* How the bytes [off, off+len) move (a range a copy takes as one item). */
    enum tms_backup_path (*path)(const struct tms_backup *b, int to_host, size_t off, size_t len);
    /* The length of the block at off on path, at most left. */
    size_t (*block_len)(const struct tms_backup *b, enum tms_backup_path path, size_t off, size_t left,
                        const struct tms_block_sizes *sizes);
    /* DIRECT: the host address of byte off. */
    void *(*direct_at)(const struct tms_backup *b, size_t off);
    /* PREPARED: 1 if the block now takes a DMA directly, 0 if it must be staged,
     * or a status (< 0 as -status) with err filled. */
    int (*prepare_block)(struct tms_backup *b, size_t off, size_t len, struct tms_err *err);
    /* STAGED: len bytes between the staging and the backup at off. */
    int (*write_block)(struct tms_backup *b, const void *staging, size_t len, size_t off, struct tms_err *err);
    int (*read_block)(struct tms_backup *b, void *staging, size_t len, size_t off, struct tms_err *err);
    /* A pause's copy into b succeeded (NULL: nothing to record). */
    void (*copied)(struct tms_backup *b);
    /* An active allocation keeps b (to be written again by its next pause). */
    int (*kept_while_active)(const struct tms_backup *b, int retain);
    /* A pause just made b to copy all of an allocation, and b is kept across
     * resume: it will be copied every cycle (NULL: nothing to prepare). */
    void (*will_be_kept)(struct tms_backup *b);
    /* After a pause or resume that keeps b (NULL: nothing). */
    void (*kept)(struct tms_backup *b, int retain);
    /* Frees b's storage (once, at the last reference or on restore). */
    void (*release)(struct tms_backup *b);
    /* A DMA can go straight to b now (page-locked). NULL: never. */
    int (*page_locked)(const struct tms_backup *b);
};

extern const struct tms_backup_ops tms_backup_ops_pageable, tms_backup_ops_pinned, tms_backup_ops_disk;

enum tms_pinning { TMS_PIN_NONE, TMS_PIN_RUNNING, TMS_PIN_DONE, TMS_PIN_FAILED };

/* Reference-counted so a zero-copy view handed to Python keeps the bytes
 * alive after the core has dropped them (resume without retain, free). */
struct tms_backup {
    const struct tms_backup_ops *ops;
    int kind;                        /* enum tms_backup_kind */
    size_t size;
    int device;                      /* the allocation's: host memory calls run in its context */
    int refs;                        /* atomic */
    const struct tms_driver *drv;
    /* Host-memory kinds (host.h): */
    void *host;                      /* the bytes; NULL once released */
    int pinning;                     /* atomic, enum tms_pinning: TMS_PIN_DONE once page-locked */
    unsigned char *locked;           /* per piece: registered now; NULL until a piece may be */
    struct tms_backup *pin_next;     /* in the queue of backups to page-lock (retained.c) */
    /* Other kinds' own state (disk.c: its file). */
    void *kind_state;
    /* What its last pause wrote: n_ranges ranges, or every byte if ranges is
     * NULL. Set by the core while it owns the allocation (moving). */
    struct tms_range *ranges;
    size_t n_ranges;
    size_t reserved;                 /* bytes of the host backup budget it holds (backup/ledger.h) */
    /* What its host copy holds, chunk by chunk (skip.c): the fingerprint of
     * each TMS_FP_CHUNK of the allocation as its save copied it, trusted only
     * where fp_valid says, under key fp_generation. Written by the save that
     * owns the allocation (moving). A zero-copy view may change the bytes
     * behind it: once one was handed out, none is trusted again (viewed). */
    struct tms_fp *fp;
    unsigned char *fp_valid;
    size_t n_fp;
    uint64_t fp_generation;
    int viewed;                      /* atomic */
};

/* The kind of an allocation's backup, by enum tms_backup_kind. */
const struct tms_backup_ops *tms_backup_ops_of(int kind);

/* New backup of size bytes for the allocation at va on device, with one
 * reference. TMS_E_HOST_OOM naming size and kind; TMS_E_IO for a file. */
int tms_backup_new(const struct tms_driver *drv, int kind, int device, size_t size, uint64_t va,
                   struct tms_backup **out, struct tms_err *err);

/* What a pause writes into: *b itself if it can be written again (opened),
 * else a new one (opened; the old one stays for the caller to drop). */
int tms_backup_for_pause(const struct tms_driver *drv, int kind, int device, size_t size, uint64_t va,
                         struct tms_backup **b, struct tms_err *err);

/* ---- the operations of b's kind, for the copy workers and the core ---------- */
int tms_backup_open(struct tms_backup *b, struct tms_err *err);
int tms_backup_close(struct tms_backup *b, int wrote, struct tms_err *err);
int tms_backup_open_limit(const struct tms_backup *b);
int tms_backup_interleaves(const struct tms_backup *b);
enum tms_backup_path tms_backup_path(const struct tms_backup *b, int to_host, size_t off, size_t len);
size_t tms_backup_block_len(const struct tms_backup *b, enum tms_backup_path path, size_t off, size_t left,
                            const struct tms_block_sizes *sizes);
void *tms_backup_direct_at(const struct tms_backup *b, size_t off);
int tms_backup_prepare_block(struct tms_backup *b, size_t off, size_t len, struct tms_err *err);
int tms_backup_write_block(struct tms_backup *b, const void *staging, size_t len, size_t off, struct tms_err *err);
int tms_backup_read_block(struct tms_backup *b, void *staging, size_t len, size_t off, struct tms_err *err);


void tms_backup_copied(struct tms_backup *b);
void tms_backup_will_be_kept(struct tms_backup *b);

/* A resume restored every byte of backup (a struct tms_backup *) and drops
 * it: its storage goes now, on the copy worker, while other allocations'
 * copies still run, unless a zero-copy view still holds it. The record stays
 * until the last reference. */
void tms_backup_release_restored(void *backup);

/* ---- fingerprints of what a backup holds (skip.c, verify.c) ---------------------------
 * Zeroes the bytes of move m's last chunk past its end, where its size is not
 * whole chunks: no copy carries them, so that chunk fingerprints alike at its
 * pause and at its resume. 1 if that chunk (or none) may be fingerprinted, 0
 * where the bytes could not be zeroed (no fill, a failed one, or a chunk that
 * runs past what is mapped). */
int tms_fp_zero_tail(const struct tms_driver *drv, const struct tms_backup_move *m);
/* After move m's bytes are back from backup b: fingerprints the chunks b
 * recorded and compares (m->verified, m->bad, m->bad_offset, m->unverified);
 * *ns grows by the time it took. pre: what came back is in place, and the
 * last chunk's tail was zeroed as at its pause (*tail_zeroed). */
void tms_verify_restored(const struct tms_driver *drv, const struct tms_backup *b, struct tms_backup_move *m,
                         int tail_zeroed, uint64_t *ns);

/* b holds ranges (taken, NULL: every byte) from now on. */
void tms_backup_set_ranges(struct tms_backup *b, struct tms_range *ranges, size_t n_ranges);
/* The kind a host backup is made as when the host backup budget has no room for it. */
int tms_backup_spill_kind(void);
/* Its fingerprints go (its host copy is gone or no longer trusted). */
void tms_backup_forget_fingerprints(struct tms_backup *b);

#endif
