/* Memory from the provider, the core's side: what a pause hands it after the unmap, what a resume takes from it before the map. */
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/core_internal.h"
#include "platform/log.h"

/* A receiver of a share hung up on a without saying it let go, while its
 * process lives: it may still map the memory, so the memory is released, never
 * kept or lent to another process. */
static int receivers_may_map(const struct tms_alloc *a)
{
    tms_table_lock();  /* the sender's thread marks it under the lock */
    int marked = a->share_hung_up > 0;
    tms_table_unlock();
    return marked;
}

void tms_provide_let_go(const struct tms_driver *drv, struct tms_move *m, size_t n, const unsigned char *unmapped,
                     const struct tms_op_args *args, int *rc, struct tms_err *err)
{
    struct tms_give *items = tms_extents_provider() ? calloc(n ? n : 1, sizeof *items) : NULL;
    size_t k = 0;
    /* Without a provider or the list, everything is released. */
    for (size_t i = 0; items && i < n; i++) {
        struct tms_alloc *a = m[i].a;
        if (!unmapped[i]) continue;
        int keep = tms_extents_exchangeable(drv, a) && !receivers_may_map(a);
        items[k++] = (struct tms_give){.owner = a, .device = a->device, .paused = 1,
                                       .keep = keep ? TMS_KEEP_ASKED : TMS_KEEP_NONE,
                                       .ext = a->ext, .n_ext = a->n_ext,
                                       .report = tms_report_device(args, a->device)};
    }
    tms_extents_give(items, k);
    struct tms_err one_err = {0};
    for (size_t i = 0, j = 0; i < n; i++) {
        struct tms_alloc *a = m[i].a;
        if (!unmapped[i]) continue;
        int given = items ? items[j++].rc : 0;
        int one = tms_extents_release(drv, a, tms_core_tag_name(a->tag_id), &one_err);
        if (given && !one)
            one = tms_driver_fail(&one_err, TMS_E_DRIVER, drv, given,
                                  "release of allocation 0x%llx (%zu bytes), tag '%s', device %d failed",
                                  (unsigned long long)a->va, a->size, tms_core_tag_name(a->tag_id), a->device);
        if (one && !*rc) {
            *rc = one;
            if (err) *err = one_err;
        }
    }
    free(items);
}

void tms_extents_plan(const struct tms_driver *drv, struct tms_move *const *m, size_t n, const struct tms_op_args *args)
{
    const struct tms_provider *p = tms_extents_provider();
    struct tms_provide *items = p ? calloc(n ? n : 1, sizeof *items) : NULL;
    if (!items) return;  /* the driver makes it all */
    struct tms_alloc **of = calloc(n ? n : 1, sizeof *of);
    size_t k = 0;
    for (size_t i = 0; of && i < n; i++) {
        struct tms_alloc *a = m[i]->a;
        if (a->n_ext || !tms_extents_exchangeable(drv, a)) continue;
        of[k] = a;
        items[k++] = (struct tms_provide){.owner = a, .device = a->device, .need = a->reserved,
                                          .report = tms_report_device(args, a->device)};
    }
    if (k) p->provide(items, k, -1, 0);
    for (size_t i = 0; i < k; i++) {
        struct tms_alloc *a = of[i];
        struct tms_provide *it = &items[i];
        if (it->n_planned && tms_extents_reserve(a, it->n_planned) == TMS_OK) {
            memcpy(a->ext, it->planned, (size_t)it->n_planned * sizeof *a->ext);
            a->n_ext = it->n_planned;
        } else if (it->n_planned) {  /* no room to record it: it goes straight back, as a plan never mapped */
            struct tms_extent *own = a->ext;
            int own_cap = a->ext_cap;
            a->ext = it->planned, a->ext_cap = a->n_ext = it->n_planned;
            tms_extents_unplan(drv, a);
            a->ext = own, a->ext_cap = own_cap;
        }
        free(it->planned);
    }
    free(of);
    free(items);
}

void tms_extents_unplan(const struct tms_driver *drv, struct tms_alloc *a)
{
    if (!a->n_ext) return;
    struct tms_give g = {.owner = a, .device = a->device, .keep = TMS_KEEP_ALL, .ext = a->ext, .n_ext = a->n_ext};
    tms_extents_give(&g, 1);
    struct tms_err err = {0};
    if (tms_extents_release(drv, a, tms_core_tag_name(a->tag_id), &err))  /* what the provider did not keep */
        tms_log_warn("releasing memory planned for a resume: %s", err.msg);
}
