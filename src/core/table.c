/* The allocation table: its lock, the hash by address with each tag's list, the address-sorted index for interior pointers, and fork. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>

#include "core/core.h"
#include "core/core_internal.h"
#include "core/span_index.h"
#include "platform/fork.h"

/*
 * table_lock guards the table, the tags' statistics and every field of an
 * allocation that is not moving. It is held only to read or change those:
 * never across a driver call, a copy, a host allocation or I/O, so a pause
 * in progress delays no other caller (a lock spanning a backed-up pause
 * would hold a pass-through free for as long as the copy).
 *
 * A pause or resume marks the allocations it works on as moving
 * (tms_table_claim) and does its driver work with the lock released; only
 * that thread touches their memory, handles and backups until it puts them
 * back (tms_table_settle). Meanwhile: a free of one of them returns at once
 * and the mover finishes it; get_cpu_backup of one, and a pause or resume
 * that selects one, wait for it to settle (table_settled); allocations into
 * a tag being paused are new and active, outside the pause in progress.
 * Nobody waits while moving allocations of its own, so waits cannot cycle.
 */
static pthread_mutex_t table_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t table_settled = PTHREAD_COND_INITIALIZER;  /* a moving allocation settled */
static pthread_once_t fork_handlers_once = PTHREAD_ONCE_INIT;
static struct tms_alloc **buckets;   /* guarded by table_lock */
static size_t bucket_count;          /* power of two */
static size_t alloc_count;           /* atomic reads allowed (tms_core_owns fast path) */
/* Interior pointers (a tensor inside a cached segment) are found in an
 * address-sorted copy of the table, guarded by table_lock. Every insert and
 * unlink makes the copy stale; it is rebuilt only after WALKS_BEFORE_SORT
 * walks of an unchanged table: a rebuild costs a few dozen walks
 * (docs/performance.md), so a table that changes between runs of lookups pays
 * at most about twice what walking alone would, and a long run of lookups
 * (get_cpu_backup of every weight) pays a binary search each. */
#define WALKS_BEFORE_SORT 64
static struct tms_span_index by_address;
static int by_address_stale = 1;
static unsigned walks_since_change;
static uint64_t sorted_lookups;  /* tms_core_sorted_lookups */

static void register_fork_handlers(void);

void tms_table_lock(void)
{
    pthread_once(&fork_handlers_once, register_fork_handlers);
    pthread_mutex_lock(&table_lock);
}

void tms_table_unlock(void) { pthread_mutex_unlock(&table_lock); }

void tms_table_wait_settled(void) { pthread_cond_wait(&table_settled, &table_lock); }

void tms_table_settled_locked(void) { pthread_cond_broadcast(&table_settled); }

size_t tms_table_count(void) { return __atomic_load_n(&alloc_count, __ATOMIC_RELAXED); }

size_t tms_table_buckets_locked(void) { return bucket_count; }

struct tms_alloc *tms_table_bucket_locked(size_t i) { return buckets[i]; }

static size_t bucket_of(tms_va va, size_t count)
{
    /* Granularity-aligned addresses: drop the zero low bits, then mix. */
    uint64_t h = (va >> 21) * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 32) & (count - 1);
}

/* The list of tag_id's allocations; NULL for an id never published. */
static struct tms_alloc **tag_list_locked(int tag_id)
{
    struct tms_tag *t = tms_tag_locked(tag_id);
    return t ? &t->allocs : NULL;
}

int tms_table_insert_locked(struct tms_alloc *a)
{
    struct tms_alloc **tag_head = tag_list_locked(a->tag_id);
    if (!tag_head) return TMS_E_HOST_OOM;  /* only "default" could be missing: interning it ran out of memory */
    if (alloc_count + 1 > bucket_count) {
        size_t count = bucket_count ? bucket_count * 2 : 256;
        struct tms_alloc **grown = calloc(count, sizeof *grown);
        if (!grown) return TMS_E_HOST_OOM;
        for (size_t i = 0; i < bucket_count; i++) {
            for (struct tms_alloc *it = buckets[i], *next; it; it = next) {
                next = it->next;
                size_t b = bucket_of(it->va, count);
                it->next = grown[b];
                grown[b] = it;
            }
        }
        free(buckets);
        buckets = grown;
        bucket_count = count;
    }
    size_t b = bucket_of(a->va, bucket_count);
    a->next = buckets[b];
    buckets[b] = a;
    a->tag_prev = NULL;
    a->tag_next = *tag_head;
    if (*tag_head) (*tag_head)->tag_prev = a;
    *tag_head = a;
    __atomic_store_n(&alloc_count, alloc_count + 1, __ATOMIC_RELAXED);
    by_address_stale = 1;
    walks_since_change = 0;
    tms_stats_account_locked(a, +1);
    return TMS_OK;
}

void tms_table_unlink_locked(struct tms_alloc **link)
{
    struct tms_alloc *a = *link;
    *link = a->next;
    if (a->tag_prev) a->tag_prev->tag_next = a->tag_next;
    else tms_tag_slot_locked(a->tag_id)->allocs = a->tag_next;
    if (a->tag_next) a->tag_next->tag_prev = a->tag_prev;
    __atomic_store_n(&alloc_count, alloc_count - 1, __ATOMIC_RELAXED);
    by_address_stale = 1;
    walks_since_change = 0;
    tms_stats_account_locked(a, -1);
}

struct tms_alloc **tms_table_link_locked(tms_va va)
{
    if (!bucket_count) return NULL;
    for (struct tms_alloc **link = &buckets[bucket_of(va, bucket_count)]; *link; link = &(*link)->next)
        if ((*link)->va == va) return link;
    return NULL;
}

struct tms_alloc *tms_table_find_locked(tms_va va)
{
    struct tms_alloc **link = tms_table_link_locked(va);
    return link ? *link : NULL;
}

/* Two nested loops: `break` inside leaves only the inner one. */
#define FOR_EACH_ALLOC(a)                               \
    for (size_t bucket_ = 0; bucket_ < bucket_count; bucket_++) \
        for (struct tms_alloc *a = buckets[bucket_]; a; a = a->next)

/* Sorts the table by address into by_address; out of host memory it stays stale. */
static void index_by_address_locked(void)
{
    if (tms_span_index_clear(&by_address, alloc_count)) return;
    FOR_EACH_ALLOC(a) {
        if (tms_span_index_add(&by_address, a->va, a->va + a->reserved, a)) return;  /* alloc_count is wrong: walk */
    }
    tms_span_index_sort(&by_address);
    by_address_stale = 0;
}

/* The allocation holding ptr: by hash when ptr is its start, else by address.
 * Allocations never overlap (each has a range of its own: reserved here, or
 * mapped by its owner, and the driver maps nothing over a mapping), so at
 * most one holds ptr. */
const struct tms_alloc *tms_table_owner_locked(uint64_t ptr)
{
    const struct tms_alloc *owner = tms_table_find_locked(ptr);
    if (owner) return owner;
    if (by_address_stale && ++walks_since_change > WALKS_BEFORE_SORT) index_by_address_locked();
    if (!by_address_stale) {
        sorted_lookups++;
        return tms_span_index_find(&by_address, ptr);
    }
    FOR_EACH_ALLOC(a) {
        if (ptr >= a->va && ptr < a->va + a->reserved) return a;
    }
    return NULL;
}

/* ---- fork ------------------------------------------------------------------ */

/* The lock is never held for long, so fork waits for it and the child gets
 * a consistent table. The threads that were moving allocations do not exist
 * in the child and their driver work stopped midway, so what those
 * allocations hold there is unknown: the child drops their records (their
 * addresses stay reserved) and keeps every settled allocation. */
/* Receivers holding any allocation now, or marked as hung up (shares.c): a
 * pause asks the sender's thread about hang-ups only while there are some. */
static int share_holders_total;  /* atomic */

void tms_table_share_holders_add(int delta) { __atomic_add_fetch(&share_holders_total, delta, __ATOMIC_RELAXED); }
int tms_table_share_holders(void) { return __atomic_load_n(&share_holders_total, __ATOMIC_RELAXED); }

static void fork_prepare(void) { pthread_mutex_lock(&table_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&table_lock); }

static void fork_child(void)
{
    pthread_cond_init(&table_settled, NULL);
    for (size_t b = 0; b < bucket_count; b++) {
        for (struct tms_alloc **link = &buckets[b]; *link;) {
            struct tms_alloc *a = *link;
            /* The parent's receivers hold the parent's memory, not the child's. */
            a->share_holders = 0;
            a->share_hung_up = 0;
            a->exported_by_owner = 0;
            if (!a->moving) {
                link = &a->next;
                continue;
            }
            tms_table_unlink_locked(link);
            if (a->ext != &a->one_ext) free(a->ext);
            free(a);  /* its backup's pinned pages belong to the parent's driver state */
        }
    }
    __atomic_store_n(&share_holders_total, 0, __ATOMIC_RELAXED);
    pthread_mutex_unlock(&table_lock);
}

static void register_fork_handlers(void)
{
    static const struct tms_fork_handlers handlers = {fork_prepare, fork_parent, fork_child};
    tms_fork_register(TMS_FORK_TABLE, &handlers);
}

uint64_t tms_core_sorted_lookups(void)
{
    tms_table_lock();
    uint64_t n = sorted_lookups;
    tms_table_unlock();
    return n;
}
