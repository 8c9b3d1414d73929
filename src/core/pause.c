/* Pause and resume: the driver work on claimed allocations, with the table lock released. */
#include "core/core.h"

#include <stdlib.h>
#include <string.h>

#include "core/core_internal.h"
#include "platform/log.h"
#include "backup/ledger.h"
#include "backup/transfer.h"

/* Copies run in batches holding at most a kind's open limit of open
 * backups (files: descriptors), each batch's backups closed once it has run. */
struct batcher {
    const struct tms_driver *drv;
    int to_host;
    struct tms_transfer *items;   /* every item of the call */
    size_t start, count;          /* the batch: items[start, count) */
    struct tms_backup **open;     /* the batch's backups, each once */
    size_t n_open;
    int rc;                       /* the first failure */
    struct tms_err err;
};

/* Closes the batch's backups; after a pause's copies, a close that finds a
 * write not durable fails the batch. */
static void batch_close(struct batcher *b, int copied)
{
    for (size_t i = 0; i < b->n_open; i++) {
        struct tms_err e = {0};
        int rc = tms_backup_close(b->open[i], b->to_host && copied, &e);
        if (rc && !b->rc) b->rc = rc, b->err = e;
    }
    b->start = b->count;
    b->n_open = 0;
}

static void batch_run(struct batcher *b)
{
    struct tms_err e = {0};
    int rc = tms_transfer_run(b->drv, b->to_host, b->items + b->start, b->count - b->start, &e);
    if (rc && !b->rc) b->rc = rc, b->err = e;
    batch_close(b, !rc);
}

/* Adds the copy of an open backup: one item per range it holds (none: the
 * whole allocation), each between the allocation at va and the same bytes
 * of the backup. */
static void batch_add(struct batcher *b, struct tms_move *m, const struct tms_range *ranges, size_t n_ranges)
{
    const struct tms_alloc *a = m->a;
    m->first_item = b->count;
    m->n_items = ranges ? n_ranges : 1;
    for (size_t r = 0; r < m->n_items; r++)
        b->items[b->count++] = (struct tms_transfer){
            .device = a->device, .dev = a->va, .backup = m->copy,
            .offset = ranges ? ranges[r].off : 0, .n = ranges ? ranges[r].len : a->size};
    b->open[b->n_open++] = m->copy;
    int limit = tms_backup_open_limit(m->copy);
    if (limit && b->n_open == (size_t)limit) batch_run(b);
}

static int batch_start(struct batcher *b, const struct tms_driver *drv, int to_host, size_t items, size_t backups,
                       struct tms_err *err)
{
    *b = (struct batcher){.drv = drv, .to_host = to_host};
    b->items = calloc(items ? items : 1, sizeof *b->items);
    b->open = calloc(backups ? backups : 1, sizeof *b->open);
    if (b->items && b->open) return TMS_OK;
    free(b->items);
    free(b->open);
    return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning the copies of %zu backups", backups);
}

static void batch_end(struct batcher *b)
{
    free(b->items);
    free(b->open);
}

/* Bytes of the copy of m's backup (all its items done?). */
static size_t items_done(const struct batcher *b, const struct tms_move *m, int *complete)
{
    size_t done = 0;
    *complete = 1;
    for (size_t k = m->first_item; k < m->first_item + m->n_items; k++) {
        done += b->items[k].done;
        if (b->items[k].done != b->items[k].n) *complete = 0;
    }
    return done;
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

/* The ranges each backed-up allocation's pause copies, and how many items
 * and backups that makes. */
static int plan_all(struct tms_move *m, size_t n, const struct tms_op_args *args, size_t *items, size_t *backups,
                    struct tms_err *err)
{
    *items = *backups = 0;
    for (size_t i = 0; i < n; i++) {
        const struct tms_alloc *a = m[i].a;
        if (!a->backup) continue;
        if (args->n_skip) {
            int rc = tms_live_plan(a->backup_kind, a->va, a->size, args->skip, args->n_skip, &m[i].ranges,
                                   &m[i].n_ranges, err);
            if (rc) return rc;
        }
        *items += m[i].ranges ? m[i].n_ranges : 1;
        ++*backups;
    }
    return TMS_OK;
}

static size_t planned_bytes(const struct tms_move *m)
{
    if (!m->ranges) return m->a->size;
    size_t n = 0;
    for (size_t r = 0; r < m->n_ranges; r++) n += m->ranges[r].len;
    return n;
}

/* The budget an allocation's host backup holds now, if this pause reuses it. */
static size_t held_now(const struct tms_alloc *a)
{
    return a->host_copy && a->host_copy->kind == a->backup_kind ? a->host_copy->reserved : 0;
}

static int by_need_desc(const void *x, const void *y)
{
    const struct tms_move *a = *(struct tms_move *const *)x, *b = *(struct tms_move *const *)y;
    return (a->need < b->need) - (a->need > b->need);
}

/* Reserves from the host backup budget what this pause's host backups need
 * beyond what those it reuses hold (*reserved). Where the budget has no room
 * and spilling is on, the largest go to disk instead until the rest fits;
 * else the error names the budget, and nothing has changed. */
static int reserve_all(struct tms_move *m, size_t n, size_t *reserved, struct tms_err *err)
{
    size_t need = 0, room = 0, candidates = 0;
    *reserved = 0;
    for (size_t i = 0; i < n; i++) {
        m[i].need = 0;
        if (!m[i].a->backup || !tms_backup_kind_is_host(m[i].a->backup_kind)) continue;
        m[i].need = planned_bytes(&m[i]);
        size_t have = held_now(m[i].a);
        if (m[i].need > have) need += m[i].need - have, candidates++;
    }
    struct tms_err why = {0};
    int rc = tms_ledger_reserve(need, &room, &why);
    if (rc == TMS_OK) {
        *reserved = need;
        return TMS_OK;
    }
    if (rc != TMS_E_HOST_OOM || !tms_core_spill()) {
        if (err) *err = why;
        return rc;
    }
    struct tms_move **order = calloc(candidates ? candidates : 1, sizeof *order);
    if (!order) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning %zu backups", candidates);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (m[i].need > held_now(m[i].a)) order[k++] = &m[i];
    qsort(order, k, sizeof *order, by_need_desc);
    for (size_t i = 0; i < k && need > room; i++) {
        order[i]->spill = 1;
        need -= order[i]->need - held_now(order[i]->a);
    }
    free(order);
    if ((rc = tms_ledger_reserve(need, NULL, err)) == TMS_OK) *reserved = need;
    return rc;
}

/* After a pause's copies: each host backup holds what it needs from the
 * budget (reserved covered the growth); what a reused one held beyond goes back. */
static void settle_budget(struct tms_move *m, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        struct tms_backup *b = m[i].copy;
        if (!b || !tms_backup_kind_is_host(b->kind)) continue;
        if (b->reserved > m[i].need) tms_ledger_release(b->reserved - m[i].need);
        b->reserved = m[i].need;
    }
}

static void forget_plans(struct tms_move *m, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(m[i].ranges);
        m[i].ranges = NULL;
    }
}

/* Makes (or reuses) the backups and fills them. On failure every backup
 * this call touched is dropped (a file is removed): the device still holds
 * the truth, and a half-overwritten copy must not be served as a backup. */
static int backup_all(const struct tms_driver *drv, struct tms_move *m, size_t n, const struct tms_op_args *args,
                      struct tms_err *err)
{
    size_t n_items, n_backups, reserved = 0;
    struct batcher b;
    int rc = plan_all(m, n, args, &n_items, &n_backups, err);
    if (!rc && n_backups) rc = reserve_all(m, n, &reserved, err);
    if (!rc && n_backups && (rc = batch_start(&b, drv, 1, n_items, n_backups, err))) {
        tms_ledger_copied(reserved);
        tms_ledger_release(reserved);
    }
    if (rc || !n_backups) {
        forget_plans(m, n);
        return rc;
    }
    for (size_t i = 0; i < n && !rc && !b.rc; i++) {
        const struct tms_alloc *a = m[i].a;
        if (!a->backup) continue;
        /* Settle drops the old backup if this is another one. */
        int kind = m[i].spill ? tms_backup_spill_kind() : a->backup_kind;
        rc = tms_backup_for_pause(drv, kind, a->device, a->size, a->va, &m[i].copy, err);
        if (!rc) batch_add(&b, &m[i], m[i].ranges, m[i].n_ranges);
    }
    if (rc) batch_close(&b, 0);
    else batch_run(&b);
    if (!rc && b.rc) {
        rc = b.rc;
        if (err) *err = b.err;
    }
    for (size_t i = 0; i < n && !rc; i++) {
        if (!m[i].copy) continue;
        int complete;
        m[i].copied = items_done(&b, &m[i], &complete);
        m[i].skipped = m[i].a->size - m[i].copied;
        tms_backup_copied(m[i].copy);
        tms_backup_set_ranges(m[i].copy, m[i].ranges, m[i].n_ranges);  /* the backup's from now on */
        m[i].ranges = NULL;
    }
    batch_end(&b);
    forget_plans(m, n);
    tms_ledger_copied(reserved);  /* what the backups keep is host memory now: no longer in flight */
    if (rc) {
        tms_ledger_release(reserved);  /* no backup of this call keeps it */
        for (size_t i = 0; i < n; i++) discard_copy(&m[i]);
    } else {
        settle_budget(m, n);
    }
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

/* ---- the report of a call ---------------------------------------------------- */

static struct tms_op_device *report_device(struct tms_op_report *r, int device)
{
    for (size_t d = 0; d < r->n_devices; d++)
        if (r->devices[d].device == device) return &r->devices[d];
    if (r->n_devices == TMS_REPORT_DEVICES) return NULL;
    struct tms_op_device *d = &r->devices[r->n_devices++];
    *d = (struct tms_op_device){.device = device};
    return d;
}

/* The devices of the claimed allocations, with their free memory now. */
static void report_begin(const struct tms_driver *drv, struct tms_op_report *r, const struct tms_move *m, size_t n)
{
    if (!r) return;
    for (size_t i = 0; i < n; i++) {
        struct tms_op_device *d = report_device(r, m[i].a->device);
        if (!d || d->allocations++) continue;
        size_t total;
        if (drv->mem_get_info(d->device, &d->free_before, &total)) d->free_before = 0;
    }
    for (size_t k = 0; k < r->n_devices; k++) r->devices[k].allocations = 0;
}

/* What changed, before tms_table_settle applies it. */
static void report_end(const struct tms_driver *drv, struct tms_op_report *r, const struct tms_move *m, size_t n,
                       uint64_t ns)
{
    if (!r) return;
    r->ns = ns;
    for (size_t i = 0; i < n; i++) {
        if (m[i].state == m[i].a->state) continue;  /* left as it was */
        struct tms_op_device *d = report_device(r, m[i].a->device);
        if (!d) continue;
        d->allocations++;
        d->released += m[i].a->reserved;
        d->copied += m[i].copied;
        d->skipped += m[i].skipped;
    }
    for (size_t k = 0; k < r->n_devices; k++) {
        size_t total;
        if (drv->mem_get_info(r->devices[k].device, &r->devices[k].free_after, &total)) r->devices[k].free_after = 0;
    }
}

/* ---- pause and resume -------------------------------------------------------- */

static int pause_tags(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    uint64_t start = tms_now_ns();
    struct tms_move *m;
    size_t n;
    if ((rc = tms_table_claim(tags, n_tags, TMS_ACTIVE, &m, &n, err)) || n == 0) return rc;
    report_begin(drv, args->report, m, n);
    rc = synchronize_devices(drv, m, n, err);
    /* All backups first: if one fails, nothing has been unmapped yet. */
    if (!rc) rc = backup_all(drv, m, n, args, err);
    if (!rc) rc = unmap_all(drv, m, n, err);
    if (tms_core_retain()) keep_copies(m, n, 1);
    uint64_t ns = tms_now_ns() - start;
    report_end(drv, args->report, m, n, ns);
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

static size_t items_of(const struct tms_backup *copy) { return copy->ranges ? copy->n_ranges : 1; }

static int resume_tags(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    uint64_t start = tms_now_ns();
    struct tms_move *m;
    size_t n, mapped = 0, n_items = 0, n_backups = 0;
    if ((rc = tms_table_claim(tags, n_tags, TMS_PAUSED, &m, &n, err)) || n == 0) return rc;
    report_begin(drv, args->report, m, n);
    for (size_t i = 0; i < n; i++)
        if (m[i].copy) n_items += items_of(m[i].copy), n_backups++;
    struct batcher b;
    int retain = tms_core_retain(), planned = !(rc = batch_start(&b, drv, 0, n_items, n_backups, err));
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
        size_t first = b.count;
        batch_add(&b, &m[mapped], copy->ranges, copy->n_ranges);
        /* A backup not kept goes once its last item is restored. */
        if (!tms_backup_kept_while_active(copy, retain) && m[mapped].n_items) {
            __atomic_store_n(&copy->parts_left, (int)m[mapped].n_items, __ATOMIC_RELEASE);
            for (size_t k = first; k < first + m[mapped].n_items; k++)
                b.items[k].restored = tms_backup_part_restored, b.items[k].restored_arg = copy;
        }
    }
    if (planned) batch_run(&b);
    if (b.rc && !rc) {
        rc = b.rc;
        if (err) *err = b.err;
    }
    /* An allocation is active only once all its bytes are back. */
    for (size_t i = 0; i < mapped; i++) {
        int restored = 1;
        if (m[i].copy) m[i].copied = items_done(&b, &m[i], &restored);
        if (!restored) {
            unrestore(drv, &m[i], err);
            continue;
        }
        m[i].state = TMS_ACTIVE;
        if (m[i].copy) m[i].skipped = m[i].a->size - m[i].copied;
        if (m[i].copy && !tms_backup_kept_while_active(m[i].copy, retain)) m[i].copy = NULL;  /* settle drops it */
    }
    if (retain) keep_copies(m, n, 1);
    if (planned) batch_end(&b);
    uint64_t ns = tms_now_ns() - start;
    report_end(drv, args->report, m, n, ns);
    tms_table_settle(drv, m, n, 0, ns);
    TMS_DEBUG("resume %s%s: %zu allocations, %.3f ms, status %d", tags ? tags[0] : "<all>", n_tags > 1 ? " (and more)" : "",
              n, (double)ns / 1e6, rc);
    return rc;
}

int tms_core_check_tags(const char *op, const char *const *tags, size_t n, struct tms_err *err)
{
    if (!tags || !n) return tms_fail(err, TMS_E_ARG, 0, "%s: the list of tags is empty", op);
    for (size_t i = 0; i < n; i++) {
        int rc = tms_core_check_tag(tags[i], err);
        if (rc) return rc;
        for (size_t j = 0; j < i; j++)
            if (!strcmp(tags[i], tags[j])) return tms_fail(err, TMS_E_ARG, 0, "%s: tag '%s' is listed twice", op, tags[i]);
    }
    return TMS_OK;
}

static const struct tms_op_args no_args;

int tms_core_pause(const char *tag, struct tms_err *err)
{
    int rc = tag ? tms_core_check_tag(tag, err) : TMS_OK;
    return rc ? rc : pause_tags(tag ? &tag : NULL, tag ? 1 : 0, &no_args, err);
}

int tms_core_resume(const char *tag, struct tms_err *err)
{
    int rc = tag ? tms_core_check_tag(tag, err) : TMS_OK;
    return rc ? rc : resume_tags(tag ? &tag : NULL, tag ? 1 : 0, &no_args, err);
}

/* Checks what a call names and what it may skip. */
static int check_op(const char *op, const char *const *tags, size_t n_tags, const struct tms_op_args *args,
                    struct tms_err *err)
{
    int rc = tags ? tms_core_check_tags(op, tags, n_tags, err) : TMS_OK;
    if (rc) return rc;
    if (args->n_skip && !args->skip) return tms_fail(err, TMS_E_ARG, 0, "%s: %zu skip ranges and no array", op, args->n_skip);
    for (size_t i = 0; i < args->n_skip; i++) {
        const struct tms_free_span *s = &args->skip[i];
        if (s->start + s->len < s->start)
            return tms_fail(err, TMS_E_ARG, 0, "%s: skip range %zu (0x%llx, %llu bytes) wraps around", op, i,
                            (unsigned long long)s->start, (unsigned long long)s->len);
        if (i && s->start < args->skip[i - 1].start + args->skip[i - 1].len)
            return tms_fail(err, TMS_E_ARG, 0, "%s: skip range %zu (0x%llx) overlaps or precedes the one before", op, i,
                            (unsigned long long)s->start);
    }
    if (args->report) *args->report = (struct tms_op_report){0};
    return TMS_OK;
}

int tms_core_pause_ex(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err)
{
    if (!args) args = &no_args;
    int rc = check_op("pause", tags, n_tags, args, err);
    return rc ? rc : pause_tags(tags, tags ? n_tags : 0, args, err);
}

int tms_core_resume_ex(const char *const *tags, size_t n_tags, const struct tms_op_args *args, struct tms_err *err)
{
    if (!args) args = &no_args;
    if (args->n_skip) return tms_fail(err, TMS_E_ARG, 0, "resume: skip ranges are a pause's");
    int rc = check_op("resume", tags, n_tags, args, err);
    return rc ? rc : resume_tags(tags, tags ? n_tags : 0, args, err);
}
