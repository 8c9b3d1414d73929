/* The allocation table: lookup by address, the claim and settle of a pause or resume, fork, and copies of it for readers. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/core.h"
#include "core/core_internal.h"
#include "core/span_index.h"
#include "platform/fork.h"
#include "platform/log.h"

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
static uint64_t call_seq;            /* guarded by table_lock: numbers pause/resume calls */
/* Interior pointers (a tensor inside a cached segment) are found in an
 * address-sorted copy of the table, guarded by table_lock. Every insert and
 * unlink makes the copy stale; it is rebuilt only after WALKS_BEFORE_SORT
 * walks of an unchanged table. A rebuild (a walk plus a sort) took as long as
 * 16-74 walks from 100 to 40,000 allocations (development host), so a table
 * that changes between runs of lookups pays at most about twice what walking
 * alone would, and a long run of lookups (get_cpu_backup of every weight)
 * pays a binary search each. */
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

size_t tms_table_count(void) { return __atomic_load_n(&alloc_count, __ATOMIC_RELAXED); }

uint64_t tms_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

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
static const struct tms_alloc *owner_of_locked(uint64_t ptr)
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

void tms_alloc_destroy(struct tms_alloc *a)
{
    if (a->handles != &a->one_handle) free(a->handles);
    tms_backup_unref(a->host_copy);
    free(a);
}

/* ---- fork ------------------------------------------------------------------ */

/* The lock is never held for long, so fork waits for it and the child gets
 * a consistent table. The threads that were moving allocations do not exist
 * in the child and their driver work stopped midway, so what those
 * allocations hold there is unknown: the child drops their records (their
 * addresses stay reserved) and keeps every settled allocation. */
static void fork_prepare(void) { pthread_mutex_lock(&table_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&table_lock); }

static void fork_child(void)
{
    pthread_cond_init(&table_settled, NULL);
    for (size_t b = 0; b < bucket_count; b++) {
        for (struct tms_alloc **link = &buckets[b]; *link;) {
            struct tms_alloc *a = *link;
            if (!a->moving) {
                link = &a->next;
                continue;
            }
            tms_table_unlink_locked(link);
            if (a->handles != &a->one_handle) free(a->handles);
            free(a);  /* its backup's pinned pages belong to the parent's driver state */
        }
    }
    pthread_mutex_unlock(&table_lock);
}

static void register_fork_handlers(void)
{
    static const struct tms_fork_handlers handlers = {fork_prepare, fork_parent, fork_child};
    tms_fork_register(TMS_FORK_TABLE, &handlers);
}

/* ---- claim and settle (the moves of pause.c) -------------------------------- */

/* The allocations of tag_id (a plain variable; -1: every tag): its own list,
 * so a pause of a small tag beside many allocations of others does not walk
 * them all. As in FOR_EACH_ALLOC,
 * `break` leaves only the inner loop: with tag_id -1, one bucket. */
#define FOR_EACH_OF_TAG(a, tag_id)                                                   \
    for (size_t bucket_ = 0; bucket_ < ((tag_id) < 0 ? bucket_count : 1); bucket_++) \
        for (struct tms_alloc *a = (tag_id) < 0 ? buckets[bucket_] : tms_tag_slot_locked(tag_id)->allocs; a; \
             a = (tag_id) < 0 ? a->next : a->tag_next)

/* Moves run in address order: the driver's unmap and map cost per
 * allocation grows with a scattered order (docs/performance.md). */
static int by_device_and_address(const void *x, const void *y)
{
    const struct tms_alloc *a = ((const struct tms_move *)x)->a, *b = ((const struct tms_move *)y)->a;
    if (a->device != b->device) return a->device < b->device ? -1 : 1;
    return (a->va > b->va) - (a->va < b->va);
}

static int state_error(struct tms_err *err, int from, const char *tag, size_t n_tags, size_t other)
{
    const char *op = from == TMS_ACTIVE ? "pause" : "resume";
    const char *why = from == TMS_ACTIVE ? "already paused" : "not paused";
    const char *which = from == TMS_ACTIVE ? "none active" : "all active";
    if (!tag) return tms_fail(err, TMS_E_STATE, 0, "%s of all tags: %s (%zu allocations, %s)", op, why, other, which);
    if (n_tags == 1)
        return tms_fail(err, TMS_E_STATE, 0, "%s of tag '%s': %s (%zu allocations, %s)", op, tag, why, other, which);
    return tms_fail(err, TMS_E_STATE, 0, "%s of tag '%s' (one of %zu tags): %s (%zu allocations, %s); no tag of the "
                    "list was %s", op, tag, n_tags, why, other, which, from == TMS_ACTIVE ? "paused" : "resumed");
}

int tms_table_claim(const char *const *tags, size_t n_tags, int from, struct tms_move **moves, size_t *n,
                    struct tms_err *err)
{
    *moves = NULL;
    *n = 0;
    int rc = TMS_OK;
    size_t lists = tags ? n_tags : 1, want = 0;
    int *ids = calloc(lists, sizeof *ids);
    if (!ids) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory listing %zu tags", lists);
    tms_table_lock();
    /* Every tag's allocations settled first, then one decision for all of them. */
    for (int settled = 0; !settled;) {
        settled = 1;
        want = 0;
        for (size_t t = 0; t < lists && !rc; t++) {
            ids[t] = tags ? tms_tags_find_locked(tags[t]) : -1;
            if (tags && ids[t] < 0) continue;  /* never used: nothing to do, as upstream */
            size_t count[2] = {0, 0}, moving = 0;
            FOR_EACH_OF_TAG(a, ids[t]) {
                if (a->moving) moving++;
                else count[a->state]++;
            }
            if (moving) {
                settled = 0;
                break;
            }
            size_t other = count[from == TMS_ACTIVE ? TMS_PAUSED : TMS_ACTIVE];
            if (!count[from] && other) rc = state_error(err, from, tags ? tags[t] : NULL, n_tags, other);
            want += count[from];
        }
        if (!settled) pthread_cond_wait(&table_settled, &table_lock);
    }
    struct tms_move *m = !rc && want ? calloc(want, sizeof *m) : NULL;
    if (!rc && want && !m) rc = tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory listing %zu allocations", want);
    size_t i = 0;
    for (size_t t = 0; m && t < lists; t++) {
        if (tags && ids[t] < 0) continue;
        FOR_EACH_OF_TAG(a, ids[t]) {
            if (a->state != from) continue;
            a->moving = 1;
            m[i++] = (struct tms_move){.a = a, .state = from, .copy = a->host_copy};
        }
    }
    *moves = m;
    *n = i;
    tms_table_unlock();
    free(ids);
    if (*moves) qsort(*moves, *n, sizeof **moves, by_device_and_address);  /* ours alone now */
    return rc;
}

int tms_core_selects_backup(const char *const *tags, size_t n_tags)
{
    int found = 0;
    tms_table_lock();
    for (size_t t = 0; t < (tags ? n_tags : 1) && !found; t++) {
        int id = tags ? tms_tags_find_locked(tags[t]) : -1;
        if (tags && id < 0) continue;
        FOR_EACH_OF_TAG(a, id) {
            if (a->backup && a->state == TMS_ACTIVE) {
                found = 1;
                break;
            }
        }
    }
    tms_table_unlock();
    return found;
}

void tms_table_settle(const struct tms_driver *drv, struct tms_move *m, size_t n, int is_pause, uint64_t ns)
{
    tms_table_lock();
    call_seq++;
    for (size_t i = 0; i < n; i++) {
        struct tms_alloc *a = m[i].a;
        int changed = a->state != m[i].state;
        tms_stats_account_locked(a, -1);
        m[i].drop = NULL;
        if (m[i].copy != a->host_copy) {
            m[i].drop = a->host_copy;
            a->host_copy = m[i].copy;
        }
        a->state = m[i].state;
        tms_stats_account_locked(a, +1);
        a->moving = 0;
        if (changed) tms_stats_count_change_locked(a, m[i].copied, m[i].skipped, is_pause, ns, call_seq);
        if (a->free_requested) tms_table_unlink_locked(tms_table_link_locked(a->va));
        else m[i].a = NULL;  /* what is left in m[].a: frees to finish */
    }
    pthread_cond_broadcast(&table_settled);
    tms_table_unlock();
    for (size_t i = 0; i < n; i++) {
        tms_backup_unref(m[i].drop);
        if (!m[i].a) continue;
        tms_va va = m[i].a->va;
        struct tms_err e = {0};
        if (tms_alloc_release_detached(drv, m[i].a, &e))
            tms_log_warn("free of 0x%llx, finished after its %s: %s", (unsigned long long)va,
                         is_pause ? "pause" : "resume", e.msg);
    }
    free(m);
}

/* ---- queries ----------------------------------------------------------------- */

int tms_core_adopted_at(uint64_t ptr, uint64_t *owner_handle, tms_phys *handle)
{
    if (__atomic_load_n(&alloc_count, __ATOMIC_RELAXED) == 0) return TMS_E_NOT_FOUND;
    int rc = TMS_E_NOT_FOUND;
    tms_table_lock();
    const struct tms_alloc *owner = owner_of_locked(ptr);
    if (owner && owner->adopted) {
        *owner_handle = owner->owner_handle;
        *handle = owner->state == TMS_ACTIVE && !owner->moving ? owner->one_handle : 0;
        rc = TMS_OK;
    }
    tms_table_unlock();
    return rc;
}


int tms_core_backup_of(uint64_t ptr, size_t n, struct tms_backup **out, size_t *offset, struct tms_err *err)
{
    int rc = TMS_OK;
    *out = NULL;
    tms_table_lock();
    const struct tms_alloc *owner;
    for (;;) {
        owner = owner_of_locked(ptr);
        if (!owner || !owner->moving) break;
        pthread_cond_wait(&table_settled, &table_lock);  /* its backup is being written or dropped */
    }
    if (!owner || owner->free_requested) {
        /* memory of someone else: no backup here, as for an active allocation */
    } else if (n > owner->size || ptr - owner->va > owner->size - n) {
        rc = tms_fail(err, TMS_E_ARG, 0, "range 0x%llx + %zu bytes runs past allocation 0x%llx of %zu bytes",
                      (unsigned long long)ptr, n, (unsigned long long)owner->va, owner->size);
    } else if (owner->host_copy && tms_backup_host(owner->host_copy)) {  /* a file is no CPU backup */
        tms_backup_ref(owner->host_copy);
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
        .backup_bytes = held, .skipped_bytes = counted ? a->size - held : 0,
        .ptr = a->va, .size = a->size, .reserved = a->reserved, .device = a->device,
        .tag_id = a->tag_id, .state = state, .backup = a->backup, .backup_kind = a->backup_kind,
        .has_host_copy = a->host_copy != NULL, .n_chunks = a->n_chunks, .adopted = a->adopted,
        .host_copy_pinned = a->host_copy && tms_backup_pinned(a->host_copy),
        .backup_to_file = a->backup && !tms_backup_kind_is_host(a->host_copy && !a->moving ? a->host_copy->kind
                                                                                          : a->backup_kind),
    };
}

int tms_core_list(struct tms_alloc_info **rows, size_t *count, struct tms_err *err)
{
    size_t n = __atomic_load_n(&alloc_count, __ATOMIC_RELAXED) + 16, i = 0;
    struct tms_alloc_info *out = NULL;
    for (;;) {  /* sized outside the lock; again if the table grew meanwhile */
        free(out);
        out = calloc(n, sizeof *out);
        if (!out) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory listing %zu allocations", n);
        tms_table_lock();
        if (alloc_count <= n) break;
        n = alloc_count + 16;
        tms_table_unlock();
    }
    FOR_EACH_ALLOC(a) {
        out[i++] = info_of_locked(a);
    }
    tms_table_unlock();
    *rows = out;
    *count = i;
    return TMS_OK;
}

uint64_t tms_core_sorted_lookups(void)
{
    tms_table_lock();
    uint64_t n = sorted_lookups;
    tms_table_unlock();
    return n;
}

int tms_core_find(uint64_t ptr, struct tms_alloc_info *row)
{
    if (__atomic_load_n(&alloc_count, __ATOMIC_RELAXED) == 0) return TMS_E_NOT_FOUND;
    tms_table_lock();
    const struct tms_alloc *owner = owner_of_locked(ptr);
    if (owner) *row = info_of_locked(owner);
    tms_table_unlock();
    return owner ? TMS_OK : TMS_E_NOT_FOUND;
}
