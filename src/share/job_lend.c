/* The job as the core's provider: what a pause gives it (borrowed memory back to its lenders, own memory kept as the members will ask) and what it provides a resume (its own kept memory, then what members lend). */
#include "share/job.h"

#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/core_share.h"
#include "platform/driver.h"
#include "platform/log.h"
#include "share/job_internal.h"

static void note_timeouts(struct tms_op_device *d, const struct tms_job_note *note)
{
    for (int i = 0; i < note->timed_out; i++) {
        if (d->timed_out < TMS_REPORT_PIDS) d->timed_out_pids[d->timed_out] = note->timed_out_pids[i];
        d->timed_out++;
    }
}

/* Gives back what members lent of e[0..n): each imported handle released
 * here first, then its lender told (it may lend the memory again only once
 * nothing here maps it); each taken is marked. *bytes grows by theirs.
 * Returns the first release failure's code. */
static int return_borrowed(const struct tms_driver *drv, struct tms_extent *e, int n, size_t *bytes)
{
    int first = 0;
    struct back {
        uint64_t via, key;
        int spent;
    } *back = NULL;
    size_t n_back = 0;
    for (int i = 0; i < n; i++) {
        if (e[i].from.kind != TMS_MEM_LENT) continue;
        struct tms_job_piece p;
        int known = tms_job_borrowed_drop(e[i].from.id, &p);
        if (known && p.fd >= 0) close(p.fd);
        int rc = drv->release(e[i].handle);
        if (rc && !drv->is_shutdown(rc) && !first) first = rc;
        if (bytes) *bytes += e[i].len;
        e[i].from.kind = TMS_MEM_NONE;
        if (!known) continue;
        if (!back && !(back = calloc((size_t)n, sizeof *back))) continue;  /* untold: counted lent until this process ends */
        back[n_back++] = (struct back){.via = p.via, .key = p.key, .spent = p.shared_on != 0};
    }
    uint64_t keys[TMS_JOB_MAX_PIECES];
    /* One message per connection and spent-ness: pieces that came over one lie together. */
    for (size_t i = 0; i < n_back; i++) {
        int seen = 0;
        for (size_t j = 0; j < i && !seen; j++) seen = back[j].via == back[i].via && back[j].spent == back[i].spent;
        if (seen) continue;
        size_t k = 0;
        for (size_t j = i; j < n_back; j++) {
            if (back[j].via != back[i].via || back[j].spent != back[i].spent) continue;
            keys[k++] = back[j].key;
            if (k == TMS_JOB_MAX_PIECES) tms_job_send_returned(back[i].via, keys, k, back[i].spent), k = 0;
        }
        if (k) tms_job_send_returned(back[i].via, keys, k, back[i].spent);
    }
    free(back);
    return first;
}

/* Bytes of the item's own memory a pause could keep. */
static size_t own_bytes(const struct tms_give *g)
{
    size_t n = 0;
    for (int i = 0; i < g->n_ext; i++) n += g->ext[i].from.kind == TMS_MEM_OWN ? g->ext[i].size : 0;
    return n;
}

/* Keeps g's own memory for the job: all of it, or within keep bytes (*kept
 * counts); what is kept is taken (the core releases the rest). */
static void keep_own(struct tms_give *g, size_t keep, size_t *kept)
{
    for (int k = 0; k < g->n_ext; k++) {
        struct tms_extent *e = &g->ext[k];
        if (e->from.kind != TMS_MEM_OWN) continue;
        if (g->keep == TMS_KEEP_ASKED && !(*kept < keep && tms_job_pool_fits(e->size, keep - *kept))) continue;
        if (tms_job_pool_keep(g->device, e->handle, e->size, g->owner, k) != TMS_OK) continue;
        if (g->keep == TMS_KEEP_ASKED) *kept += e->size;
        e->from.kind = TMS_MEM_NONE;
    }
}

static void give(struct tms_give *items, size_t n)
{
    const struct tms_driver *drv;
    int any_kept = 0, asks = 0;
    /* Borrowed memory first: its lenders count it idle before they answer how much to keep. */
    for (size_t i = 0; i < n; i++) {
        if (items[i].gone) tms_job_pool_forget(items[i].owner);
        asks |= items[i].paused || items[i].keep != TMS_KEEP_NONE;
        if (!items[i].n_ext || tms_driver_get(&drv, NULL)) continue;  /* nothing is mapped without a driver */
        size_t back = 0;
        items[i].rc = return_borrowed(drv, items[i].ext, items[i].n_ext, &back);
        if (items[i].report) items[i].report->returned += back;
    }
    if (!asks) return;  /* a free: nothing is kept */
    int on = tms_job_on();
    for (size_t start = 0, end; start < n; start = end) {
        int device = items[start].device;
        for (end = start; end < n && items[end].device == device;) end++;  /* sorted by device */
        size_t releasable = 0, keep = 0, kept = 0;
        int paused = 0;
        for (size_t i = start; i < end; i++) {
            paused |= items[i].paused;
            if (items[i].keep == TMS_KEEP_ASKED) releasable += own_bytes(&items[i]);
        }
        /* A member that paused is found by the others from now on, whatever it keeps. */
        struct tms_job_note note = {0};
        if (paused && on) keep = tms_job_ask_keep(device, releasable, &note);
        if (items[start].report) note_timeouts(items[start].report, &note);
        for (size_t i = start; i < end; i++) {
            if (items[i].keep == TMS_KEEP_NONE || (items[i].keep == TMS_KEEP_ASKED && !keep)) continue;
            size_t before = kept;
            keep_own(&items[i], keep, &kept);
            any_kept |= kept > before || items[i].keep == TMS_KEEP_ALL;
        }
        if (items[start].report) items[start].report->kept += kept;
    }
    if (any_kept) tms_share_serve_wake();  /* the bound starts: the sender's thread expires it */
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

/* Appends a piece to an item's plan, recorded; 0 if there was no memory for it. */
static int plan_piece(struct tms_provide *it, const struct tms_job_piece *p)
{
    struct tms_extent *more = realloc(it->planned, ((size_t)it->n_planned + 1) * sizeof *more);
    if (!more) return 0;
    it->planned = more;
    uint64_t id = tms_job_borrowed_add(it->device, p);
    if (!id) return 0;
    it->planned[it->n_planned++] = (struct tms_extent){.handle = p->handle, .len = p->len, .size = p->size,
                                                       .from = {.kind = TMS_MEM_LENT, .id = id}};
    return 1;
}

/* Borrows for items[start..end) of one device what their own kept memory left. */
static void borrow_device(const struct tms_driver *drv, struct tms_provide *items, size_t start, size_t end)
{
    size_t *needs = calloc(end - start, sizeof *needs), *of = calloc(end - start, sizeof *of), k = 0, asked = 0;
    for (size_t i = start; needs && of && i < end; i++) {
        size_t have = 0;
        for (int e = 0; e < items[i].n_planned; e++) have += items[i].planned[e].len;
        if (have >= items[i].need) continue;
        needs[k] = items[i].need - have;
        asked += needs[k];
        of[k++] = i;
    }
    struct tms_job_piece *pieces = NULL;
    size_t n_pieces = 0;
    struct tms_job_note note = {0};
    int device = items[start].device;
    if (k && tms_job_borrow(device, needs, k, &pieces, &n_pieces, &note) != TMS_OK) n_pieces = 0;
    for (size_t i = 0; i < n_pieces; i++) {
        struct tms_provide *it = pieces[i].need < k ? &items[of[pieces[i].need]] : NULL;
        if (it && plan_piece(it, &pieces[i])) continue;
        /* Without a record for it, it goes straight back. */
        int rc = drv->release(pieces[i].handle);
        if (rc && !drv->is_shutdown(rc))
            tms_log_warn("job: releasing lent memory without a record failed: %s (%d)", drv->code_name(rc), rc);
        if (pieces[i].fd >= 0) close(pieces[i].fd);
        tms_job_send_returned(pieces[i].via, &pieces[i].key, 1, 0);
        pieces[i].len = 0;
    }
    struct tms_op_device *d = k ? items[start].report : NULL;
    if (d) report_borrow(d, pieces, n_pieces, asked, &note);
    free(pieces);
    free(needs);
    free(of);
}

/* The driver is out of memory for size bytes on device: memory kept for the
 * job there is released, this process's first, then the members' (asked).
 * 1 if any was, and a create is worth trying again. */
static int make_room(int device, size_t size)
{
    int on = tms_job_on();
    if (!on && !tms_job_pool_any()) return 0;
    size_t freed = tms_job_pool_release(device, size);
    if (freed < size && on) freed += tms_job_ask_release(device, size - freed);
    return freed > 0;
}

static int provide(struct tms_provide *items, size_t n, int device, size_t room)
{
    if (!n) return make_room(device, room);
    const struct tms_driver *drv;
    int on = tms_job_on();
    if ((!on && !tms_job_pool_any()) || tms_driver_get(&drv, NULL)) return 0;  /* no job: the driver makes it all */
    for (size_t i = 0; i < n; i++) {
        size_t reused = tms_job_pool_take(items[i].owner, &items[i].planned, &items[i].n_planned);
        if (reused && items[i].report) items[i].report->reused += reused;
    }
    for (size_t start = 0, end; on && start < n; start = end) {
        for (end = start; end < n && items[end].device == items[start].device;) end++;
        borrow_device(drv, items, start, end);
    }
    return 0;
}

static const struct tms_provider job_provider = {.give = give, .provide = provide};

void tms_job_register(void) { tms_core_set_provider(&job_provider); }
