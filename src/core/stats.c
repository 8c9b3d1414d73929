/* Statistics per (tag, device): the gauges kept equal to the table, the counters of pauses and resumes. */
#include <stddef.h>
#include <stdint.h>

#include "core/core.h"
#include "core/core_internal.h"
#include "core/stats.h"

static int stats_slot(int device) { return device < TMS_STATS_DEVICES ? device : TMS_STATS_DEVICES - 1; }

static struct tms_stats *stats_of_locked(int tag_id, int device)
{
    struct tms_tag *t = tms_tag_locked(tag_id);
    return t ? &t->per_device[stats_slot(device)] : NULL;
}

/* A backup's bytes count in the gauge of its kind: bytes_backup_* follow one
 * another in the order of the kinds (stats.h). */
_Static_assert(offsetof(struct tms_stats, bytes_backup_mmap) ==
                       offsetof(struct tms_stats, bytes_backup_pinned) + sizeof(uint64_t) &&
                   offsetof(struct tms_stats, bytes_backup_disk) ==
                       offsetof(struct tms_stats, bytes_backup_pinned) + 2 * sizeof(uint64_t),
               "the bytes_backup_* gauges follow one another");

/* The one place gauges change: an allocation's share is taken out (sign -1)
 * before any change to it and put back (+1) after, so gauges always equal
 * the sum over the table. A moving allocation counts in its settled state. */
void tms_stats_account_locked(const struct tms_alloc *a, int sign)
{
    struct tms_stats *st = stats_of_locked(a->tag_id, a->device);
    if (!st) return;
    uint64_t s = (uint64_t)(int64_t)sign;  /* wraps: adding -1 * x subtracts x */
    st->allocations += s;
    st->bytes_requested += s * a->size;
    st->bytes_reserved += s * a->reserved;
    if (a->state == TMS_ACTIVE) st->bytes_mapped += s * a->reserved;
    else st->bytes_paused += s * a->reserved;
    if (a->host_copy) (&st->bytes_backup_pinned)[tms_backup_kind(a->host_copy)] += s * tms_backup_size(a->host_copy);  /* kind: 0, 1, 2 */
}

/* A pause or resume that changed an allocation counts once per (tag,
 * device) it changed, with its duration, plus the bytes it copied. */
void tms_stats_count_change_locked(const struct tms_alloc *a, const struct tms_move *m, int is_pause, uint64_t ns,
                                   uint64_t call_seq)
{
    struct tms_stats *st = stats_of_locked(a->tag_id, a->device);
    if (!st) return;
    uint64_t *counted = &tms_tag_locked(a->tag_id)->counted_call[stats_slot(a->device)];
    if (is_pause) st->bytes_to_host += m->b.copied, st->bytes_skipped += m->skipped, st->bytes_unchanged += m->b.unchanged;
    else st->bytes_to_device += m->b.copied, st->bytes_verified += m->b.verified;
    if (*counted == call_seq) return;
    *counted = call_seq;
    if (is_pause) st->pauses++, st->pause_ns += ns;
    else st->resumes++, st->resume_ns += ns;
}
