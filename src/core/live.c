/* Which bytes of an allocation a backed-up pause copies: all of them, or those outside the ranges its caller says are free. */
#include "core/core_internal.h"

#include <errno.h>
#include <stdlib.h>

/* The first span that ends after va (spans sorted by start, disjoint). */
static size_t first_after(const struct tms_free_span *skip, size_t n, uint64_t va)
{
    size_t lo = 0, hi = n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (skip[mid].start + skip[mid].len <= va) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

int tms_live_plan(int kind, uint64_t va, size_t size, const struct tms_free_span *skip, size_t n_skip,
                  struct tms_range **ranges, size_t *n_ranges, struct tms_err *err)
{
    *ranges = NULL, *n_ranges = 0;
    size_t g = tms_backup_granule(kind), at = 0, n = 0, cap = 0;
    struct tms_range *out = NULL;
    for (size_t i = first_after(skip, n_skip, va); i < n_skip && skip[i].start < va + size; i++) {
        /* The skip as offsets into the allocation, shrunk to whole granules. */
        uint64_t s = skip[i].start > va ? skip[i].start - va : 0;
        uint64_t e = skip[i].start + skip[i].len - va;
        if (e > size) e = size;
        s = (s + g - 1) / g * g;
        if (e < size) e = e / g * g;
        if (s >= e) continue;
        if (s > at) {
            if (n == cap) {
                struct tms_range *grown = realloc(out, (cap = cap ? 2 * cap : 8) * sizeof *out);
                if (!grown) {
                    free(out);
                    return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory planning a backup's ranges");
                }
                out = grown;
            }
            out[n++] = (struct tms_range){at, s - at};
        }
        at = e;
    }
    if (at == 0) {  /* nothing skipped: every byte, as without a plan */
        free(out);
        return TMS_OK;
    }
    if (at < size) {
        struct tms_range *grown = n == cap ? realloc(out, (cap + 1) * sizeof *out) : out;
        if (!grown) {
            free(out);
            return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory planning a backup's ranges");
        }
        out = grown;
        out[n++] = (struct tms_range){at, size - at};
    }
    /* Everything skipped: an empty array, not NULL (NULL means every byte). */
    if (!out && !(out = malloc(sizeof *out)))
        return tms_fail(err, TMS_E_HOST_OOM, ENOMEM, "out of host memory planning a backup's ranges");
    *ranges = out, *n_ranges = n;
    return TMS_OK;
}
