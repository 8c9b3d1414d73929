/* What a pause or resume did, per device: allocations it changed, bytes released or mapped, copied and skipped, free memory around it, memory receivers may still map, memory kept for, and taken from, other processes. */
#include "core/core_internal.h"

#include <stdio.h>

static struct tms_op_device *report_device(struct tms_op_report *r, int device)
{
    for (size_t d = 0; d < r->n_devices; d++)
        if (r->devices[d].device == device) return &r->devices[d];
    if (r->n_devices == TMS_REPORT_DEVICES) return NULL;
    struct tms_op_device *d = &r->devices[r->n_devices++];
    *d = (struct tms_op_device){.device = device};
    return d;
}

struct tms_op_device *tms_report_device(const struct tms_op_args *args, int device)
{
    return args->report ? report_device(args->report, device) : NULL;
}

void tms_report_begin(const struct tms_driver *drv, const struct tms_op_args *args, const struct tms_move *m, size_t n)
{
    struct tms_op_report *r = args->report;
    if (!r) return;
    for (size_t i = 0; i < n; i++) {
        struct tms_op_device *d = report_device(r, m[i].a->device);
        if (!d || d->allocations++) continue;
        /* The driver's answer costs a call per device: only where the caller asks. */
        if (!(d->free_measured = args->measure_free)) continue;
        size_t total;
        if (drv->mem_get_info(d->device, &d->free_before, &total)) d->free_before = 0;
    }
    for (size_t k = 0; k < r->n_devices; k++) r->devices[k].allocations = 0;
}

/* An allocation the pause unmapped that receivers may still map: listed, not released. */
static void add_unconfirmed(struct tms_op_report *r, const struct tms_alloc *a, int receivers, const int *pids)
{
    if (r->n_unconfirmed++ >= TMS_REPORT_UNCONFIRMED) return;
    struct tms_op_unconfirmed *u = &r->unconfirmed[r->n_unconfirmed - 1];
    *u = (struct tms_op_unconfirmed){.va = a->va, .reserved = a->reserved, .device = a->device,
                                     .receivers = receivers, .tag = tms_core_tag_name(a->tag_id)};
    for (int k = 0; k < TMS_REPORT_PIDS && k < TMS_SHARE_PIDS_KEPT; k++) u->pids[k] = pids[k];
}

void tms_report_end(const struct tms_driver *drv, const struct tms_op_args *args, const struct tms_move *m, size_t n,
                    uint64_t ns)
{
    struct tms_op_report *r = args->report;
    /* Marks of receivers that hung up are the unmapped memory's: taken even
     * without a report, so the memory mapped next is not blamed on them. */
    int locked = 0;
    for (size_t i = 0; i < n; i++) {
        int hung_up = 0, pids[TMS_SHARE_PIDS_KEPT];
        if (m[i].state == TMS_PAUSED && m[i].a->state == TMS_ACTIVE) {
            if (!locked) tms_table_lock(), locked = 1;
            hung_up = tms_shares_take_hung_up_locked(m[i].a, pids);
        }
        if (r && m[i].wrong && r->n_wrong++ < TMS_REPORT_PIDS) r->wrong[r->n_wrong - 1] = m[i].a->va;
        if (!r || m[i].state == m[i].a->state) continue;  /* left as it was */
        struct tms_op_device *d = report_device(r, m[i].a->device);
        if (!d) continue;
        d->allocations++;
        if (hung_up) add_unconfirmed(r, m[i].a, hung_up, pids);
        else d->released += m[i].a->reserved;
        if (m[i].state == TMS_ACTIVE) d->mapped += m[i].a->reserved;
        d->copied += m[i].b.copied;
        d->unchanged += m[i].b.unchanged;
        d->skipped += m[i].skipped;
        d->verified += m[i].b.verified;
        if (!r->why_not_verified[0] && m[i].b.copied) {
            const char *why = !m[i].b.verify && m[i].a->backup ? "verify_restore is off"
                              : m[i].state == TMS_ACTIVE ? m[i].b.unverified : NULL;
            if (why) snprintf(r->why_not_verified, sizeof r->why_not_verified, "%s", why);
        }
    }
    if (locked) tms_table_unlock();
    if (!r) return;
    r->ns = ns;
    for (size_t k = 0; k < r->n_devices; k++) {
        if (!r->devices[k].free_measured) continue;
        size_t total;
        if (drv->mem_get_info(r->devices[k].device, &r->devices[k].free_after, &total)) r->devices[k].free_after = 0;
    }
}
