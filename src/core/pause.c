/* Pause and resume: the driver work on claimed allocations, with the table lock released. */
#include "core/core.h"

#include <stdlib.h>
#include <string.h>

#include "core/core_internal.h"
#include "platform/log.h"
#include "backup/transfer.h"

static struct tms_transfer transfer_of(const struct tms_alloc *a, struct tms_backup *copy)
{
    return (struct tms_transfer){.device = a->device, .dev = a->va, .backup = copy, .n = a->size};
}

/* Copies run in batches holding at most a kind's open limit of open
 * backups (files: descriptors), each batch's backups closed once it has run. */
struct batcher {
    const struct tms_driver *drv;
    int to_host;
    struct tms_transfer *items;
    size_t start, count, open;
    int rc;              /* the first failure */
    struct tms_err err;
};

/* Closes the batch's backups; after a pause's copies, a close that finds a
 * write not durable fails the batch. */
static void batch_close(struct batcher *b, int copied)
{
    for (size_t i = b->start; i < b->count; i++) {
        struct tms_err e = {0};
        int rc = tms_backup_close(b->items[i].backup, b->to_host && copied, &e);
        if (rc && !b->rc) b->rc = rc, b->err = e;
    }
    b->start = b->count;
    b->open = 0;
}

static void batch_run(struct batcher *b)
{
    struct tms_err e = {0};
    int rc = tms_transfer_run(b->drv, b->to_host, b->items + b->start, b->count - b->start, &e);
    if (rc && !b->rc) b->rc = rc, b->err = e;
    batch_close(b, !rc);
}

static void batch_add(struct batcher *b, struct tms_transfer t)
{
    b->items[b->count++] = t;
    int limit = tms_backup_open_limit(t.backup);
    if (limit && ++b->open == (size_t)limit) batch_run(b);
}

/* Forgets the backup a move would install, dropping it if it is new. */
static void discard_copy(struct tms_move *m)
{
    if (m->copy != m->a->host_copy) tms_backup_unref(m->copy);
    m->copy = NULL;
}

/* Queued kernels may still write the memory: copy and unmap only after. */
static int synchronize_devices(const struct tms_driver *drv, const struct tms_move *m, size_t n, struct tms_err *err)
{
    uint64_t done = 0;  /* bit per device; devices >= 64 are synchronized every time */
    for (size_t i = 0; i < n; i++) {
        int device = m[i].a->device;
        if (device < 64 && (done >> device & 1)) continue;
        int rc = drv->synchronize(device);
        if (rc)
            return tms_fail(err, TMS_E_DRIVER, rc, "synchronize of device %d before pause failed: %s (%d)", device,
                            drv->code_name(rc), rc);
        if (device < 64) done |= 1ull << device;
    }
    return TMS_OK;
}

/* Makes (or reuses) the backups and fills them. On failure every backup
 * this call touched is dropped (a file is removed): the device still holds
 * the truth, and a half-overwritten copy must not be served as a backup. */
static int backup_all(const struct tms_driver *drv, struct tms_move *m, size_t n, struct tms_err *err)
{
    struct batcher b = {.drv = drv, .to_host = 1, .items = calloc(n, sizeof *b.items)};
    if (!b.items) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning %zu backups", n);
    int rc = TMS_OK;
    for (size_t i = 0; i < n && !rc && !b.rc; i++) {
        const struct tms_alloc *a = m[i].a;
        if (!a->backup) continue;
        /* Settle drops the old backup if this is another one. */
        rc = tms_backup_for_pause(drv, a->backup_kind, a->device, a->size, a->va, &m[i].copy, err);
        if (!rc) batch_add(&b, transfer_of(a, m[i].copy));
    }
    if (rc) batch_close(&b, 0);
    else batch_run(&b);
    if (!rc && b.rc) {
        rc = b.rc;
        if (err) *err = b.err;
    }
    for (size_t i = 0; i < n && !rc; i++)
        if (m[i].copy) tms_backup_copied(m[i].copy);
    free(b.items);
    if (rc)
        for (size_t i = 0; i < n; i++) discard_copy(&m[i]);
    return rc;
}

/* Unmaps and releases each allocation; one whose unmap fails stays active
 * and whole (and keeps its new copy only as a retained one). */
static int unmap_all(const struct tms_driver *drv, struct tms_move *m, size_t n, struct tms_err *err)
{
    int rc = TMS_OK, retain = tms_core_retain();
    for (size_t i = 0; i < n; i++) {
        struct tms_alloc *a = m[i].a;
        const char *tag = tms_core_tag_name(a->tag_id);
        struct tms_err one_err = {0};
        int one = tms_chunks_unmap(drv, a, tag, &one_err);
        if (one == TMS_OK) {
            m[i].state = TMS_PAUSED;
            m[i].copied = m[i].copy ? a->size : 0;
            one = tms_chunks_release(drv, a, tag, &one_err);  /* paused all the same: reported, not undone */
        } else if (m[i].copy && !tms_backup_kept_while_active(m[i].copy, retain)) {
            discard_copy(&m[i]);  /* still active: the device holds the bytes */
        }
        if (one && !rc) {
            rc = one;
            if (err) *err = one_err;
        }
    }
    return rc;
}

/* Backups kept across the call are told so (a retained one is page-locked
 * in the background: it is copied every cycle). */
static void keep_copies(const struct tms_move *m, size_t n, int retain)
{
    for (size_t i = 0; i < n; i++)
        if (m[i].copy) tms_backup_kept(m[i].copy, retain);
}

static int pause_tags(const char *const *tags, size_t n_tags, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    uint64_t start = tms_now_ns();
    struct tms_move *m;
    size_t n;
    if ((rc = tms_table_claim(tags, n_tags, TMS_ACTIVE, &m, &n, err)) || n == 0) return rc;
    rc = synchronize_devices(drv, m, n, err);
    /* All backups first: if one fails, nothing has been unmapped yet. */
    if (!rc) rc = backup_all(drv, m, n, err);
    if (!rc) rc = unmap_all(drv, m, n, err);
    if (tms_core_retain()) keep_copies(m, n, 1);
    uint64_t ns = tms_now_ns() - start;
    tms_table_settle(drv, m, n, 1, ns);
    TMS_DEBUG("pause %s%s: %zu allocations, %.3f ms, status %d", tags ? tags[0] : "<all>", n_tags > 1 ? " (and more)" : "",
              n, (double)ns / 1e6, rc);
    return rc;
}

/* An allocation whose restore failed goes back to paused, its backup kept
 * for a retry. If its memory cannot even be unmapped it is left mapped and
 * active with its backup, and the message says its contents are incomplete. */
static void unrestore(const struct tms_driver *drv, struct tms_move *m, struct tms_err *err)
{
    struct tms_alloc *a = m->a;
    const char *tag = tms_core_tag_name(a->tag_id);
    struct tms_err undo_err = {0};
    if (tms_chunks_unmap(drv, a, tag, &undo_err) == TMS_OK) {
        if (tms_chunks_release(drv, a, tag, &undo_err))
            tms_log_warn("after a failed restore of 0x%llx: %s", (unsigned long long)a->va, undo_err.msg);
        return;
    }
    m->state = TMS_ACTIVE;
    tms_err_append(err, "allocation 0x%llx (tag '%s') stays mapped with incomplete contents, its backup kept: %s",
                   (unsigned long long)a->va, tag, undo_err.msg);
}

static int resume_tags(const char *const *tags, size_t n_tags, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    uint64_t start = tms_now_ns();
    struct tms_move *m;
    size_t n, mapped = 0;
    if ((rc = tms_table_claim(tags, n_tags, TMS_PAUSED, &m, &n, err)) || n == 0) return rc;
    struct batcher b = {.drv = drv, .to_host = 0, .items = calloc(n, sizeof *b.items)};
    struct tms_transfer *copies = b.items;
    int retain = tms_core_retain();
    if (!copies) rc = tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning %zu restores", n);
    /* Map what fits; on the first failure (typically OOM, or a backup file
     * that cannot be opened) stop, so the rest stay paused with their
     * backups and a retry resumes them. */
    for (; !rc && mapped < n; mapped++) {
        struct tms_alloc *a = m[mapped].a;
        struct tms_backup *copy = m[mapped].copy;
        if (copy && (rc = tms_backup_open(copy, err))) break;
        if ((rc = tms_chunks_map(drv, a, tms_core_tag_name(a->tag_id), err))) {
            if (copy) (void)tms_backup_close(copy, 0, NULL);
            break;
        }
        if (!copy) continue;
        struct tms_transfer t = transfer_of(a, copy);
        if (!tms_backup_kept_while_active(copy, retain)) t.restored = tms_backup_release_restored, t.restored_arg = copy;
        batch_add(&b, t);
    }
    if (copies) batch_run(&b);
    if (b.rc && !rc) {
        rc = b.rc;
        if (err) *err = b.err;
    }
    /* An allocation is active only once all its bytes are back. */
    for (size_t i = 0, c = 0; i < mapped; i++) {
        int restored = !m[i].copy || copies[c].done == copies[c].n;
        if (m[i].copy) c++;
        if (!restored) {
            unrestore(drv, &m[i], err);
            continue;
        }
        m[i].state = TMS_ACTIVE;
        m[i].copied = m[i].copy ? m[i].a->size : 0;
        if (m[i].copy && !tms_backup_kept_while_active(m[i].copy, retain)) m[i].copy = NULL;  /* settle drops it */
    }
    if (retain) keep_copies(m, n, 1);
    free(copies);
    uint64_t ns = tms_now_ns() - start;
    tms_table_settle(drv, m, n, 0, ns);
    TMS_DEBUG("resume %s%s: %zu allocations, %.3f ms, status %d", tags ? tags[0] : "<all>", n_tags > 1 ? " (and more)" : "",
              n, (double)ns / 1e6, rc);
    return rc;
}

int tms_core_check_tags(const char *op, const char *const *tags, size_t n, struct tms_err *err)
{
    if (!tags || !n) return tms_fail(err, TMS_E_ARG, 0, "%s: the list of tags is empty", op);
    for (size_t i = 0; i < n; i++) {
        int rc = tms_tag_check(tags[i], err);
        if (rc) return rc;
        for (size_t j = 0; j < i; j++)
            if (!strcmp(tags[i], tags[j])) return tms_fail(err, TMS_E_ARG, 0, "%s: tag '%s' is listed twice", op, tags[i]);
    }
    return TMS_OK;
}

int tms_core_pause(const char *tag, struct tms_err *err)
{
    int rc = tag ? tms_tag_check(tag, err) : TMS_OK;
    return rc ? rc : pause_tags(tag ? &tag : NULL, tag ? 1 : 0, err);
}

int tms_core_resume(const char *tag, struct tms_err *err)
{
    int rc = tag ? tms_tag_check(tag, err) : TMS_OK;
    return rc ? rc : resume_tags(tag ? &tag : NULL, tag ? 1 : 0, err);
}

int tms_core_pause_tags(const char *const *tags, size_t n, struct tms_err *err)
{
    int rc = tms_core_check_tags("pause", tags, n, err);
    return rc ? rc : pause_tags(tags, n, err);
}

int tms_core_resume_tags(const char *const *tags, size_t n, struct tms_err *err)
{
    int rc = tms_core_check_tags("resume", tags, n, err);
    return rc ? rc : resume_tags(tags, n, err);
}
