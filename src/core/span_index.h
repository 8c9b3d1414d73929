/* An address-sorted copy of non-overlapping [start, end) spans: which span
 * holds an address, by binary search. It is built whole and never updated in
 * place; its user decides when a copy is stale and rebuilds it (table.c). */
#ifndef TMS_SPAN_INDEX_H
#define TMS_SPAN_INDEX_H

#include <stddef.h>
#include <stdint.h>

struct tms_span {
    uint64_t start, end;
    const void *owner;
};

struct tms_span_index {
    struct tms_span *spans;
    size_t count, cap;
};

/* Empties ix and makes room for count spans: 0, or -1 out of host memory
 * (ix then stays empty and usable). */
int tms_span_index_clear(struct tms_span_index *ix, size_t count);
/* Adds [start, end) (start <= end) in the room tms_span_index_clear made:
 * 0, or -1 if that is full (nothing added). */
int tms_span_index_add(struct tms_span_index *ix, uint64_t start, uint64_t end, const void *owner);
/* Call once after the adds, before any find. */
void tms_span_index_sort(struct tms_span_index *ix);
/* The owner of the span holding addr, or NULL. */
const void *tms_span_index_find(const struct tms_span_index *ix, uint64_t addr);
void tms_span_index_free(struct tms_span_index *ix);

#endif
