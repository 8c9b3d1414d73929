/* Lending within a job, the core's side: what a pause keeps for the other members, and where a resume's memory comes from. */
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/core_internal.h"
#include "platform/log.h"

int tms_lend_on(void)
{
    const struct tms_job_ops *ops = tms_pool_ops();
    return ops && ops->on();
}

/* Memory of a may be kept and lent: its own handles, made exportable, of an
 * allocation the core made (an adopted one's handle is its owner's). */
static int lendable(const struct tms_driver *drv, const struct tms_alloc *a)
{
    return !a->adopted && a->handle_types && drv->export_fd && drv->import_fd && drv->device_identity;
}

/* A receiver of a share hung up on a without saying it let go, while its
 * process lives: it may still map the memory, so the memory is released, never
 * kept or lent to another member. */
static int receivers_may_map(const struct tms_alloc *a)
{
    tms_table_lock();  /* the sender's thread marks it under the lock */
    int marked = a->share_hung_up > 0;
    tms_table_unlock();
    return marked;
}

/* Bytes of a's own handles a pause could keep. */
static size_t own_bytes(const struct tms_alloc *a)
{
    if (!a->ext) return a->reserved;
    size_t n = 0;
    for (int i = 0; i < a->n_ext; i++) n += a->ext[i].key ? 0 : a->ext[i].size;
    return n;
}

static void note_timeouts(struct tms_op_device *d, const struct tms_job_note *note)
{
    for (int i = 0; i < note->timed_out; i++) {
        if (d->timed_out < TMS_REPORT_PIDS) d->timed_out_pids[d->timed_out] = note->timed_out_pids[i];
        d->timed_out++;
    }
}

/* One own handle of a: kept for the job within keep bytes, else released. */
static int let_go_handle(const struct tms_driver *drv, const struct tms_alloc *a, tms_phys h, size_t size, int order,
                         int may_keep, size_t keep, size_t *kept)
{
    if (may_keep && *kept < keep && tms_pool_fits(size, keep - *kept) &&
        tms_pool_keep(a->device, h, size, a, order) == TMS_OK) {
        *kept += size;
        return 0;
    }
    int rc = drv->release(h);
    return rc && !drv->is_shutdown(rc) ? rc : 0;
}

void tms_lend_let_go(const struct tms_driver *drv, struct tms_move *m, size_t n, const unsigned char *unmapped,
                     const struct tms_op_args *args, int *rc, struct tms_err *err)
{
    const struct tms_job_ops *ops = tms_pool_ops();
    int first = 0;
    const struct tms_move *failed = NULL;
    /* Borrowed memory first: its lenders count it idle before they answer how much to keep. */
    for (size_t i = 0; i < n; i++) {
        struct tms_alloc *a = m[i].a;
        if (!unmapped[i] || !a->ext) continue;
        struct tms_op_device *d = tms_report_device(args, a->device);
        size_t back = 0;
        int r = tms_pool_return_borrowed(drv, a->device, a->ext, a->n_ext, &back);
        if (d) d->returned += back;
        if (r && !first) first = r, failed = &m[i];
    }
    for (size_t start = 0, end; start < n; start = end) {
        int device = m[start].a->device;
        for (end = start; end < n && m[end].a->device == device;) end++;  /* moves are sorted by device */
        size_t releasable = 0;
        unsigned char *may = calloc(end - start, 1);  /* without it, nothing is kept */
        for (size_t i = start; may && i < end; i++) {
            may[i - start] = unmapped[i] && lendable(drv, m[i].a) && !receivers_may_map(m[i].a);
            if (may[i - start]) releasable += own_bytes(m[i].a);
        }
        struct tms_job_note note = {0};
        size_t keep = ops ? ops->keep(device, releasable, &note) : 0, kept = 0;
        struct tms_op_device *d = tms_report_device(args, device);
        if (d) note_timeouts(d, &note);
        for (size_t i = start; i < end; i++) {
            struct tms_alloc *a = m[i].a;
            if (!unmapped[i]) continue;
            int may_keep = may && may[i - start], r = 0;
            if (a->ext) {
                for (int k = 0; k < a->n_ext; k++) {
                    if (a->ext[k].key) continue;
                    int one = let_go_handle(drv, a, a->ext[k].handle, a->ext[k].size, k, may_keep, keep, &kept);
                    if (one && !r) r = one;
                }
                free(a->ext);
                a->ext = NULL;
                a->n_ext = 0;
            } else {
                for (int k = 0; k < a->n_chunks; k++) {
                    int one = let_go_handle(drv, a, a->handles[k], tms_chunk_size(a, k), k, may_keep, keep, &kept);
                    if (one && !r) r = one;
                }
            }
            if (r && !first) first = r, failed = &m[i];
        }
        free(may);
        if (d) d->kept += kept;
        if (kept && ops) ops->wake();
    }
    if (first && !*rc) {
        *rc = TMS_E_DRIVER;
        const struct tms_alloc *a = failed->a;
        tms_driver_fail(err, TMS_E_DRIVER, drv, first, "release of allocation 0x%llx (%zu bytes), tag '%s', device %d failed",
                        (unsigned long long)a->va, a->size, tms_core_tag_name(a->tag_id), a->device);
    }
}

/* The report's account of where a device's memory came from. */
static void report_borrow(struct tms_op_device *d, const struct tms_job_piece *p, size_t n, size_t asked,
                          const struct tms_job_note *note)
{
    size_t got = 0;
    for (size_t i = 0; i < n; i++) {
        got += p[i].len;
        int k = 0;
        while (k < d->lenders && k < TMS_REPORT_PIDS && d->lender_pids[k] != p[i].lender) k++;
        if (k == d->lenders) {
            d->lenders++;
            if (k < TMS_REPORT_PIDS) d->lender_pids[k] = p[i].lender;
        }
        if (k < TMS_REPORT_PIDS) d->lender_bytes[k] += p[i].len;
    }
    d->borrowed += got;
    note_timeouts(d, note);
    d->fallback = got >= asked      ? TMS_JOB_ENOUGH
                  : note->bad       ? TMS_JOB_BAD_LEND
                  : note->timed_out ? TMS_JOB_TIMED_OUT
                  : !note->members  ? TMS_JOB_NO_MEMBER
                                    : TMS_JOB_NOTHING_TO_LEND;
}

/* Appends a piece to a's plan; 0 if there was no memory for the record. */
static int plan_piece(struct tms_alloc *a, const struct tms_job_piece *p)
{
    struct tms_extent *more = realloc(a->ext, ((size_t)a->n_ext + 1) * sizeof *more);
    if (!more) return 0;
    a->ext = more;
    a->ext[a->n_ext++] = (struct tms_extent){.handle = p->handle, .len = p->len, .size = p->size, .key = p->key,
                                             .via = p->via, .lender = p->lender, .fd = p->fd};
    return 1;
}

/* Borrows for the allocations m[start..end) of one device what their own kept memory left. */
static void borrow_device(const struct tms_driver *drv, const struct tms_job_ops *ops, struct tms_move *const *m,
                          size_t start, size_t end, const struct tms_op_args *args)
{
    size_t *needs = calloc(end - start, sizeof *needs), *of = calloc(end - start, sizeof *of), k = 0, asked = 0;
    for (size_t i = start; needs && of && i < end; i++) {
        struct tms_alloc *a = m[i]->a;
        if (!lendable(drv, a)) continue;
        size_t have = 0;
        for (int e = 0; e < a->n_ext; e++) have += a->ext[e].len;
        if (have >= a->reserved) continue;
        needs[k] = a->reserved - have;
        asked += needs[k];
        of[k++] = i;
    }
    struct tms_job_piece *pieces = NULL;
    size_t n_pieces = 0;
    struct tms_job_note note = {0};
    if (k && ops->borrow(m[start]->a->device, needs, k, &pieces, &n_pieces, &note) != TMS_OK) n_pieces = 0;
    for (size_t i = 0; i < n_pieces; i++) {
        struct tms_alloc *a = pieces[i].need < k ? m[of[pieces[i].need]]->a : NULL;
        if (a && plan_piece(a, &pieces[i])) continue;
        /* Without a record for it, it goes straight back. */
        struct tms_extent e = {.handle = pieces[i].handle, .len = pieces[i].len, .size = pieces[i].size,
                               .key = pieces[i].key, .via = pieces[i].via, .lender = pieces[i].lender,
                               .fd = pieces[i].fd};
        tms_pool_count_borrowed(m[start]->a->device, e.len);
        (void)tms_pool_return_borrowed(drv, m[start]->a->device, &e, 1, NULL);
        pieces[i].len = 0;
    }
    struct tms_op_device *d = k ? tms_report_device(args, m[start]->a->device) : NULL;
    if (d) report_borrow(d, pieces, n_pieces, asked, &note);
    free(pieces);
    free(needs);
    free(of);
}

void tms_lend_plan(const struct tms_driver *drv, struct tms_move *const *m, size_t n, const struct tms_op_args *args)
{
    int on = tms_lend_on();
    if (!on && !tms_pool_any()) return;  /* no job: every allocation maps as it always did */
    (void)tms_core_job_expire();
    for (size_t i = 0; i < n; i++) {
        struct tms_alloc *a = m[i]->a;
        if (a->ext || !lendable(drv, a)) continue;
        size_t reused = tms_pool_take(a, &a->ext, &a->n_ext);
        struct tms_op_device *d = reused ? tms_report_device(args, a->device) : NULL;
        if (d) d->reused += reused;
    }
    const struct tms_job_ops *ops = tms_pool_ops();
    for (size_t start = 0, end; on && ops && start < n; start = end) {
        int device = m[start]->a->device;
        for (end = start; end < n && m[end]->a->device == device;) end++;
        borrow_device(drv, ops, m, start, end, args);
    }
}

void tms_lend_unplan(const struct tms_driver *drv, struct tms_alloc *a)
{
    if (!a->ext) return;
    /* Not counted as mapped: the count goes up and down again as it is returned. */
    size_t lent = 0;
    for (int i = 0; i < a->n_ext; i++) lent += a->ext[i].key ? a->ext[i].len : 0;
    tms_pool_count_borrowed(a->device, lent);
    (void)tms_pool_return_borrowed(drv, a->device, a->ext, a->n_ext, NULL);
    for (int i = 0; i < a->n_ext; i++) {
        if (a->ext[i].key) continue;
        if (tms_pool_keep(a->device, a->ext[i].handle, a->ext[i].size, a, i) == TMS_OK) continue;
        int rc = drv->release(a->ext[i].handle);
        if (rc && !drv->is_shutdown(rc))
            tms_log_warn("releasing memory of 0x%llx planned for a resume failed: %s (%d)", (unsigned long long)a->va,
                         drv->code_name(rc), rc);
    }
    free(a->ext);
    a->ext = NULL;
    a->n_ext = 0;
}
