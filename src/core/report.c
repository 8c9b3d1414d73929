/* What a pause or resume did, per device: allocations it changed, bytes released or mapped, copied and skipped, free memory around it. */
#include "core/core_internal.h"

static struct tms_op_device *report_device(struct tms_op_report *r, int device)
{
    for (size_t d = 0; d < r->n_devices; d++)
        if (r->devices[d].device == device) return &r->devices[d];
    if (r->n_devices == TMS_REPORT_DEVICES) return NULL;
    struct tms_op_device *d = &r->devices[r->n_devices++];
    *d = (struct tms_op_device){.device = device};
    return d;
}

void tms_report_begin(const struct tms_driver *drv, struct tms_op_report *r, const struct tms_move *m, size_t n)
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

void tms_report_end(const struct tms_driver *drv, struct tms_op_report *r, const struct tms_move *m, size_t n,
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
