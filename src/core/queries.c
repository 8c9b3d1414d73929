/* Reading the table: an allocation by address, its host backup as a view, copies of the table and of the statistics. */
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/core_internal.h"

int tms_core_adopted_at(uint64_t ptr, uint64_t *owner_handle, tms_phys *handle)
{
    if (tms_table_count() == 0) return TMS_E_NOT_FOUND;
    int rc = TMS_E_NOT_FOUND;
    tms_table_lock();
    const struct tms_alloc *owner = tms_table_owner_locked(ptr);
    if (owner && owner->adopted) {
        *owner_handle = owner->owner_handle;
        *handle = owner->state == TMS_ACTIVE && !owner->moving ? owner->ext[0].handle : 0;
        rc = TMS_OK;
    }
    tms_table_unlock();
    return rc;
}


int tms_core_backup_of(uint64_t ptr, size_t n, int writable, struct tms_backup **out, size_t *offset,
                       struct tms_err *err)
{
    int rc = TMS_OK;
    *out = NULL;
    tms_table_lock();
    const struct tms_alloc *owner;
    for (;;) {
        owner = tms_table_owner_locked(ptr);
        if (!owner || !owner->moving) break;
        tms_table_wait_settled();  /* its backup is being written or dropped */
    }
    if (!owner || owner->free_requested) {
        /* memory of someone else: no backup here, as for an active allocation */
    } else if (n > owner->size || ptr - owner->va > owner->size - n) {
        rc = tms_fail(err, TMS_E_ARG, 0, "range 0x%llx + %zu bytes runs past allocation 0x%llx of %zu bytes",
                      (unsigned long long)ptr, n, (unsigned long long)owner->va, owner->size);
    } else if (owner->host_copy && tms_backup_host(owner->host_copy)) {  /* a file is no CPU backup */
        tms_backup_ref(owner->host_copy);
        if (writable) tms_backup_viewed(owner->host_copy);  /* what it recorded no longer proves anything */
        *out = owner->host_copy;
        *offset = (size_t)(ptr - owner->va);
    }
    tms_table_unlock();
    return rc;
}

static struct tms_alloc_info info_of_locked(const struct tms_alloc *a)
{
    int state = a->state;
    if (a->moving) state = a->state == TMS_ACTIVE ? TMS_PAUSING : TMS_RESUMING;
    /* A moving allocation's backup is its mover's: its ranges may change. */
    int counted = a->host_copy && !a->moving;
    size_t held = counted ? tms_backup_held(a->host_copy) : 0;
    return (struct tms_alloc_info){
        .backup_bytes = held, .skipped_bytes = counted ? a->size - held : 0, .wrong_bytes = !a->moving && a->wrong_bytes,
        .restore = a->restore,
        .ptr = a->va, .size = a->size, .reserved = a->reserved, .device = a->device,
        .tag_id = a->tag_id, .state = state, .backup = a->backup, .backup_kind = a->backup_kind,
        .has_host_copy = a->host_copy != NULL, .n_chunks = !a->moving && a->n_ext ? a->n_ext : a->n_chunks,
        .adopted = a->adopted,
        .host_copy_pinned = a->host_copy && tms_backup_pinned(a->host_copy),
        .backup_to_file = a->backup && !tms_backup_kind_is_host(a->host_copy && !a->moving ? tms_backup_kind(a->host_copy)
                                                                                          : a->backup_kind),
    };
}

int tms_core_list(struct tms_alloc_info **rows, size_t *count, struct tms_err *err)
{
    size_t n = tms_table_count() + 16, i = 0;
    struct tms_alloc_info *out = NULL;
    for (;;) {  /* sized outside the lock; again if the table grew meanwhile */
        free(out);
        out = calloc(n, sizeof *out);
        if (!out) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory listing %zu allocations", n);
        tms_table_lock();
        if (tms_table_count() <= n) break;
        n = tms_table_count() + 16;
        tms_table_unlock();
    }
    TMS_FOR_EACH_ALLOC(a) {
        out[i++] = info_of_locked(a);
    }
    tms_table_unlock();
    *rows = out;
    *count = i;
    return TMS_OK;
}

int tms_core_find(uint64_t ptr, struct tms_alloc_info *row)
{
    if (tms_table_count() == 0) return TMS_E_NOT_FOUND;
    tms_table_lock();
    const struct tms_alloc *owner = tms_table_owner_locked(ptr);
    if (owner) *row = info_of_locked(owner);
    tms_table_unlock();
    return owner ? TMS_OK : TMS_E_NOT_FOUND;
}

int tms_core_selects_backup(const char *const *tags, size_t n_tags)
{
    int found = 0;
    tms_table_lock();
    for (size_t t = 0; t < (tags ? n_tags : 1) && !found; t++) {
        int id = tags ? tms_tags_find_locked(tags[t]) : -1;
        if (tags && id < 0) continue;
        TMS_FOR_EACH_OF_TAG(a, id) {
            if (a->backup && a->state == TMS_ACTIVE) {
                found = 1;
                break;
            }
        }
    }
    tms_table_unlock();
    return found;
}

int tms_core_stats(struct tms_stats_row **rows, size_t *count, struct tms_err *err)
{
    size_t n = 0, cap = 16;
    struct tms_stats_row *out = malloc(cap * sizeof *out);
    static const struct tms_stats zero;
    tms_table_lock();
    int tags = tms_tags_count();
    for (int t = 0; out && t < tags; t++) {
        const struct tms_tag *tag = tms_tag_slot_locked(t);
        for (int d = 0; d < TMS_STATS_DEVICES; d++) {
            const struct tms_stats *st = &tag->per_device[d];
            if (!memcmp(st, &zero, sizeof zero)) continue;
            if (n == cap) {
                struct tms_stats_row *grown = realloc(out, 2 * cap * sizeof *out);
                if (!grown) {
                    free(out);
                    out = NULL;
                    break;
                }
                out = grown;
                cap *= 2;
            }
            out[n++] = (struct tms_stats_row){.tag_id = t, .device = d, .stats = *st};
        }
    }
    tms_table_unlock();
    if (!out) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory copying statistics");
    *rows = out;
    *count = n;
    return TMS_OK;
}

size_t tms_core_paused_demand(int device)
{
    size_t paused = 0;
    tms_table_lock();
    TMS_FOR_EACH_ALLOC(a) {
        /* What a resume will ask the provider for (tms_extents_exchangeable): a resume in flight has asked already. */
        if (a->device == device && a->state == TMS_PAUSED && !a->moving && !a->adopted && a->handle_types)
            paused += a->reserved;
    }
    tms_table_unlock();
    return paused;
}
