/* Which of many non-overlapping address spans holds an address (span_index.h). */
#include "core/span_index.h"

#include <stdlib.h>

int tms_span_index_clear(struct tms_span_index *ix, size_t count)
{
    ix->count = 0;
    if (count <= ix->cap) return 0;
    size_t cap = count > 2 * ix->cap ? count : 2 * ix->cap;  /* a table growing one by one: few reallocs */
    struct tms_span *grown = realloc(ix->spans, cap * sizeof *grown);
    if (!grown) return -1;
    ix->spans = grown;
    ix->cap = cap;
    return 0;
}

int tms_span_index_add(struct tms_span_index *ix, uint64_t start, uint64_t end, const void *owner)
{
    if (ix->count == ix->cap) return -1;
    ix->spans[ix->count++] = (struct tms_span){.start = start, .end = end, .owner = owner};
    return 0;
}

static int by_start(const void *x, const void *y)
{
    uint64_t a = ((const struct tms_span *)x)->start, b = ((const struct tms_span *)y)->start;
    return (a > b) - (a < b);
}

void tms_span_index_sort(struct tms_span_index *ix)
{
    if (ix->count > 1) qsort(ix->spans, ix->count, sizeof *ix->spans, by_start);
}

const void *tms_span_index_find(const struct tms_span_index *ix, uint64_t addr)
{
    size_t lo = 0, hi = ix->count;  /* the span sought, if any, is the last with start <= addr */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (ix->spans[mid].start <= addr) lo = mid + 1;
        else hi = mid;
    }
    if (lo == 0) return NULL;
    const struct tms_span *s = &ix->spans[lo - 1];
    return addr < s->end ? s->owner : NULL;
}

void tms_span_index_free(struct tms_span_index *ix)
{
    free(ix->spans);
    *ix = (struct tms_span_index){0};
}
