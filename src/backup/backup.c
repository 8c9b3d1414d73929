/* Backups of paused allocations: the contract's dispatch, references and statistics; each kind is its own file. */
#include "backup/kind.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "backup/ledger.h"
#include "platform/config.h"
#include "platform/log.h"

const struct tms_backup_ops *tms_backup_ops_of(int kind)
{
    switch (kind) {
    case TMS_BACKUP_PINNED: return &tms_backup_ops_pinned;
    case TMS_BACKUP_DISK: return &tms_backup_ops_disk;
    default: return &tms_backup_ops_pageable;
    }
}

int tms_backup_spill_kind(void) { return TMS_BACKUP_DISK; }

int tms_backup_kind_is_host(int kind) { return kind >= 0 && kind < TMS_BACKUP_KINDS && tms_backup_ops_of(kind)->host_memory; }

const char *tms_backup_kind_name(int kind) { return tms_backup_ops_of(kind)->name; }

int tms_backup_kind_parse(const char *name, int *kind)
{
    for (int k = 0; k < TMS_BACKUP_KINDS; k++)
        if (tms_backup_kind_is_host(k) && strcmp(name, tms_backup_kind_name(k)) == 0) return *kind = k, TMS_OK;
    return TMS_E_ARG;
}

int tms_backup_default_kind(void)
{
    int kind = TMS_BACKUP_DEFAULT;
    const char *name = tms_defaults()->init_backup_backend;
    if (name[0]) (void)tms_backup_kind_parse(name, &kind);
    return kind;
}

int tms_backup_kind_of_region(int cpu_kind, int disk) { return disk ? TMS_BACKUP_DISK : cpu_kind; }

int tms_backup_new(const struct tms_driver *drv, int kind, int device, size_t size, uint64_t va,
                   struct tms_backup **out, struct tms_err *err)
{
    struct tms_backup *b = calloc(1, sizeof *b);
    if (!b) return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory for a backup record");
    *b = (struct tms_backup){.ops = tms_backup_ops_of(kind), .kind = kind, .size = size, .device = device, .refs = 1,
                             .drv = drv};
    int rc = b->ops->create(b, device, va, err);
    if (rc) {
        free(b);
        return rc;
    }
    *out = b;
    return TMS_OK;
}

int tms_backup_for_pause(const struct tms_driver *drv, int kind, int device, size_t size, uint64_t va,
                         struct tms_backup **b, struct tms_err *err)
{
    if (*b && (*b)->kind == kind && (*b)->ops->reusable(*b)) {
        /* One that cannot be opened again (a file replaced meanwhile) is left
         * for the caller to drop: the pause writes a new one. */
        struct tms_err reopen = {0};
        if (tms_backup_open(*b, &reopen) == TMS_OK) return TMS_OK;
    }
    *b = NULL;
    int rc = tms_backup_new(drv, kind, device, size, va, b, err);
    return rc ? rc : tms_backup_open(*b, err);
}

int tms_backup_open(struct tms_backup *b, struct tms_err *err) { return b->ops->open ? b->ops->open(b, err) : TMS_OK; }

int tms_backup_close(struct tms_backup *b, int wrote, struct tms_err *err)
{
    return b->ops->close ? b->ops->close(b, wrote, err) : TMS_OK;
}

int tms_backup_open_limit(const struct tms_backup *b) { return b->ops->open_limit; }

int tms_backup_interleaves(const struct tms_backup *b) { return b->ops->interleave; }

enum tms_backup_path tms_backup_path(const struct tms_backup *b, int to_host, size_t off, size_t len)
{
    return b->ops->path(b, to_host, off, len);
}

size_t tms_backup_block_len(const struct tms_backup *b, enum tms_backup_path path, size_t off, size_t left,
                            const struct tms_block_sizes *sizes)
{
    return b->ops->block_len(b, path, off, left, sizes);
}

void *tms_backup_direct_at(const struct tms_backup *b, size_t off) { return b->ops->direct_at(b, off); }

int tms_backup_prepare_block(struct tms_backup *b, size_t off, size_t len, struct tms_err *err)
{
    return b->ops->prepare_block(b, off, len, err);
}

int tms_backup_write_block(struct tms_backup *b, const void *staging, size_t len, size_t off, struct tms_err *err)
{
    return b->ops->write_block(b, staging, len, off, err);
}

int tms_backup_read_block(struct tms_backup *b, void *staging, size_t len, size_t off, struct tms_err *err)
{
    return b->ops->read_block(b, staging, len, off, err);
}

void *tms_backup_host(const struct tms_backup *b) { return b->ops->host_memory ? b->host : NULL; }

int tms_backup_pinned(const struct tms_backup *b) { return b->ops->page_locked && b->ops->page_locked(b); }

void tms_backup_copied(struct tms_backup *b)
{
    if (b->ops->copied) b->ops->copied(b);
}

int tms_backup_kept_while_active(const struct tms_backup *b, int retain) { return b->ops->kept_while_active(b, retain); }

void tms_backup_will_be_kept(struct tms_backup *b)
{
    if (b->ops->will_be_kept) b->ops->will_be_kept(b);
}

void tms_backup_kept(struct tms_backup *b, int retain)
{
    if (b->ops->kept) b->ops->kept(b, retain);
}

void tms_backup_ref(struct tms_backup *b) { __atomic_add_fetch(&b->refs, 1, __ATOMIC_RELAXED); }

void tms_backup_unref(struct tms_backup *b)
{
    if (!b || __atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL) != 0) return;
    b->ops->release(b);
    tms_ledger_release(b->reserved);
    free(b->ranges);
    tms_backup_forget_fingerprints(b);
    free(b);
}

void tms_backup_forget_fingerprints(struct tms_backup *b)
{
    free(b->fp);
    free(b->fp_valid);
    b->fp = NULL, b->fp_valid = NULL, b->n_fp = 0;
}

void tms_backup_viewed(struct tms_backup *b) { __atomic_store_n(&b->viewed, 1, __ATOMIC_RELEASE); }

size_t tms_backup_granule(int kind)
{
    size_t g = tms_backup_ops_of(kind)->granule;
    return g ? g : TMS_BACKUP_GRANULE;
}

void tms_backup_set_ranges(struct tms_backup *b, struct tms_range *ranges, size_t n_ranges)
{
    free(b->ranges);
    b->ranges = ranges;
    b->n_ranges = ranges ? n_ranges : 0;
}

size_t tms_backup_held(const struct tms_backup *b)
{
    if (!b->ranges) return b->size;
    size_t n = 0;
    for (size_t i = 0; i < b->n_ranges; i++) n += b->ranges[i].len;
    return n;
}

void tms_backup_release_restored(void *backup)
{
    struct tms_backup *b = backup;
    /* Another reference is a zero-copy view (or the page-locking thread):
     * the bytes stay until the last one goes. None can be taken meanwhile:
     * the core's backup_of waits while the allocation moves. */
    if (!b->ops->host_memory || __atomic_load_n(&b->refs, __ATOMIC_ACQUIRE) != 1) return;
    b->ops->release(b);
    tms_ledger_release(b->reserved);
    b->reserved = 0;
    tms_backup_forget_fingerprints(b);
    TMS_DEBUG("backup of %zu bytes restored and released by its copy worker", b->size);
}

int tms_backup_kind(const struct tms_backup *b) { return b->kind; }

size_t tms_backup_size(const struct tms_backup *b) { return b->size; }
