/* The VMM core: the process's one allocation table, its tags and statistics, allocate and free. */
#include "core/core.h"

#include <limits.h>
#include <stddef.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/core_internal.h"
#include "platform/driver.h"
#include "platform/log.h"
#include "platform/parse.h"
#include "core/span_index.h"
#include "core/stats.h"

/*
 * table_lock guards the table, the tags' statistics and every field of an
 * allocation that is not moving. It is held only to read or change those:
 * never across a driver call, a copy, a host allocation or I/O, so a pause
 * in progress delays no other caller (issue 12: a pass-through free waited
 * 3.2 s behind a 2 GiB pause when the lock spanned the whole pause).
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
static size_t margin_bytes;          /* atomic */
static int retain_override = -1;     /* atomic; -1: TMS_RETAIN_CPU_BACKUP decides */
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

static void lock_table(void)
{
    pthread_once(&fork_handlers_once, register_fork_handlers);
    pthread_mutex_lock(&table_lock);
}

static void unlock_table(void) { pthread_mutex_unlock(&table_lock); }

uint64_t tms_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* ---- tags ---------------------------------------------------------------- */

/*
 * A tag lives in a slot of pages that never move, found by name through a
 * hash index. Its references are its allocations and the regions (of
 * threads, and of expandable-segment handles not yet adopted) that name it.
 * Once more than TAGS_BEFORE_RECLAIM slots are in use, interning a new tag
 * first reclaims the slots nobody references (their statistics go with
 * them), so a process that makes tags without end keeps a bounded table.
 * Names are never freed: a reader may hold one without the lock (Python
 * building a row, a log line), and a reused slot's old id then names the new
 * tag rather than freed memory.
 */
#define TAG_PAGE_SIZE 64
#define TAG_PAGES 1024
#define TAGS_BEFORE_RECLAIM 1024
struct tag_name {
    struct tag_name *next;  /* every name ever made: reachable for the process's life */
    char text[];
};
struct tag_entry {
    const char *name;                                 /* atomic; set when the slot is (re)used */
    int in_use;
    uint32_t refs;                                    /* guarded by table_lock */
    uint32_t next_free;                               /* free list: slot + 1, 0 ends it */
    struct tms_alloc *allocs;                         /* guarded by table_lock: the tag's allocations */
    struct tms_stats per_device[TMS_STATS_DEVICES];   /* guarded by table_lock */
    uint64_t counted_call[TMS_STATS_DEVICES];         /* last call_seq counted in per_device */
};
static struct tag_entry *tag_pages[TAG_PAGES];  /* filled under table_lock */
static int tag_slots;     /* slots made so far; stored with release once a slot is complete */
static int tags_in_use;   /* guarded by table_lock */
static uint32_t tag_free_head;
static struct tag_name *tag_names;
/* name -> slot, open addressing: -1 empty, -2 removed. Guarded by table_lock. */
static int32_t *tag_index;
static size_t tag_index_cap, tag_index_used;
static pthread_key_t region_tag_key;  /* a thread's reference to its region's tag, dropped at its exit */
static pthread_once_t region_tag_once = PTHREAD_ONCE_INIT;

static struct tag_entry *tag_at(int id) { return &tag_pages[id / TAG_PAGE_SIZE][id % TAG_PAGE_SIZE]; }
static int tags_published(void) { return __atomic_load_n(&tag_slots, __ATOMIC_ACQUIRE); }

static uint64_t name_hash(const char *s)
{
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

static int32_t *index_slot_locked(const char *tag, int for_insert)
{
    size_t mask = tag_index_cap - 1, i = (size_t)name_hash(tag) & mask;
    int32_t *removed = NULL;
    for (;; i = (i + 1) & mask) {
        int32_t v = tag_index[i];
        if (v == -1) return for_insert && removed ? removed : &tag_index[i];
        if (v == -2) {
            if (!removed) removed = &tag_index[i];
        } else if (strcmp(tag_at(v)->name, tag) == 0) {
            return &tag_index[i];
        }
    }
}

static int index_grow_locked(void)
{
    size_t cap = tag_index_cap ? tag_index_cap * 2 : 64;
    int32_t *grown = malloc(cap * sizeof *grown), *old = tag_index;
    if (!grown) return -1;
    for (size_t i = 0; i < cap; i++) grown[i] = -1;
    size_t old_cap = tag_index_cap;
    tag_index = grown, tag_index_cap = cap, tag_index_used = 0;
    for (size_t i = 0; i < old_cap; i++)
        if (old[i] >= 0) *index_slot_locked(tag_at(old[i])->name, 1) = old[i], tag_index_used++;
    free(old);
    return 0;
}

static int tag_find_locked(const char *tag)
{
    if (!tag_index_cap) return -1;
    int32_t v = *index_slot_locked(tag, 0);
    return v >= 0 ? v : -1;
}

/* Frees the slots nobody references (never "default"). */
static void reclaim_tags_locked(void)
{
    for (int id = 1; id < tags_published(); id++) {
        struct tag_entry *t = tag_at(id);
        if (!t->in_use || t->refs || t->allocs) continue;
        int32_t *at = index_slot_locked(t->name, 0);
        if (*at == id) *at = -2;
        t->in_use = 0;
        memset(t->per_device, 0, sizeof t->per_device);
        memset(t->counted_call, 0, sizeof t->counted_call);
        t->next_free = tag_free_head;
        tag_free_head = (uint32_t)id + 1;
        tags_in_use--;
    }
}

static int tag_intern_locked(const char *tag, int *id, struct tms_err *err)
{
    if (tags_published() == 0 && strcmp(tag, "default") != 0) {
        int ignored;
        int rc = tag_intern_locked("default", &ignored, err);  /* keeps TMS_TAG_DEFAULT_ID == 0 */
        if (rc) return rc;
    }
    int found = tag_find_locked(tag);
    if (found >= 0) return *id = found, TMS_OK;
    if (tags_in_use >= TAGS_BEFORE_RECLAIM) reclaim_tags_locked();
    if ((tag_index_used + 1) * 2 > tag_index_cap && index_grow_locked())
        return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory interning tag '%s'", tag);
    size_t len = strlen(tag);
    struct tag_name *name = malloc(sizeof *name + len + 1);
    if (!name) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory interning tag '%s'", tag);
    int n = tag_free_head ? (int)tag_free_head - 1 : tags_published();
    if (n == TAG_PAGE_SIZE * TAG_PAGES) {
        free(name);
        return tms_fail(err, TMS_E_ARG, 0, "too many tags in use (%d, each with allocations or a region): cannot "
                        "add '%s'", n, tag);
    }
    struct tag_entry **page = &tag_pages[n / TAG_PAGE_SIZE];
    if (!*page && !(*page = calloc(TAG_PAGE_SIZE, sizeof **page))) {
        free(name);
        return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory interning tag '%s'", tag);
    }
    memcpy(name->text, tag, len + 1);
    name->next = tag_names;
    tag_names = name;
    struct tag_entry *t = tag_at(n);
    if (tag_free_head) tag_free_head = t->next_free;
    t->in_use = 1;
    t->refs = 0;
    t->allocs = NULL;
    __atomic_store_n(&t->name, name->text, __ATOMIC_RELEASE);
    int32_t *at = index_slot_locked(tag, 1);
    if (*at == -1) tag_index_used++;
    *at = n;
    tags_in_use++;
    if (n == tags_published()) __atomic_store_n(&tag_slots, n + 1, __ATOMIC_RELEASE);
    *id = n;
    return TMS_OK;
}

/* "default" is tag 0 from the start: threads begin with it (TMS_INIT_ENABLE)
 * before any region names one. */
static void default_tag_locked(void)
{
    int id;
    if (tags_published() == 0) (void)tag_intern_locked("default", &id, NULL);
}

static int check_tag(const char *tag, struct tms_err *err)
{
    size_t bad;
    if (!tag || !*tag) return tms_fail(err, TMS_E_ARG, 0, "tag must be a non-empty string");
    if (!tms_utf8_valid(tag, &bad))
        return tms_fail(err, TMS_E_ARG, 0, "tag is not valid UTF-8 (byte 0x%02x at offset %zu)",
                        (unsigned)(unsigned char)tag[bad], bad);
    return TMS_OK;
}

int tms_core_tag_id(const char *tag, int *id, struct tms_err *err)
{
    int rc = check_tag(tag, err);
    if (rc) return rc;
    lock_table();
    rc = tag_intern_locked(tag, id, err);
    unlock_table();
    return rc;
}

const char *tms_core_tag_name(int id)
{
    if (id >= 0 && id < tags_published()) return __atomic_load_n(&tag_at(id)->name, __ATOMIC_ACQUIRE);
    return id == TMS_TAG_DEFAULT_ID ? "default" : "?";
}

void tms_core_tag_ref(int id)
{
    lock_table();
    if (id > 0 && id < tags_published()) tag_at(id)->refs++;
    unlock_table();
}

void tms_core_tag_unref(int id)
{
    lock_table();
    if (id > 0 && id < tags_published() && tag_at(id)->refs) tag_at(id)->refs--;
    unlock_table();
}

/* The key holds the thread's region tag id + 1, so its reference goes when the thread ends. */
static void drop_thread_tag(void *value) { tms_core_tag_unref((int)(intptr_t)value - 1); }
static void make_region_tag_key(void) { (void)pthread_key_create(&region_tag_key, drop_thread_tag); }

int tms_core_set_region_tag(const char *tag, struct tms_err *err)
{
    int rc = check_tag(tag, err), id = 0;
    if (rc) return rc;
    pthread_once(&region_tag_once, make_region_tag_key);
    struct tms_region *r = tms_region_current();
    lock_table();
    rc = tag_intern_locked(tag, &id, err);
    if (!rc && id != r->tag_id) {
        if (id > 0) tag_at(id)->refs++;
        if (r->tag_id > 0 && r->tag_id < tags_published() && tag_at(r->tag_id)->refs) tag_at(r->tag_id)->refs--;
        r->tag_id = id;
    }
    unlock_table();
    if (!rc) (void)pthread_setspecific(region_tag_key, (void *)(intptr_t)(id + 1));
    return rc;
}

/* ---- statistics ---------------------------------------------------------- */

static int stats_slot(int device) { return device < TMS_STATS_DEVICES ? device : TMS_STATS_DEVICES - 1; }

static struct tms_stats *stats_of_locked(int tag_id, int device)
{
    default_tag_locked();
    if (tag_id < 0 || tag_id >= tags_published()) return NULL;
    return &tag_at(tag_id)->per_device[stats_slot(device)];
}

/* A backup's bytes count in the gauge of its kind: the fields follow enum tms_backup_kind. */
_Static_assert(offsetof(struct tms_stats, bytes_backup_mmap) ==
                       offsetof(struct tms_stats, bytes_backup_pinned) + TMS_BACKUP_MMAP * sizeof(uint64_t) &&
                   offsetof(struct tms_stats, bytes_backup_disk) ==
                       offsetof(struct tms_stats, bytes_backup_pinned) + TMS_BACKUP_DISK * sizeof(uint64_t) &&
                   TMS_BACKUP_PINNED == 0,
               "bytes_backup_<kind> in the order of enum tms_backup_kind");

/* The one place gauges change: an allocation's share is taken out (sign -1)
 * before any change to it and put back (+1) after, so gauges always equal
 * the sum over the table. A moving allocation counts in its settled state. */
static void account_locked(const struct tms_alloc *a, int sign)
{
    struct tms_stats *st = stats_of_locked(a->tag_id, a->device);
    if (!st) return;
    uint64_t s = (uint64_t)(int64_t)sign;  /* wraps: adding -1 * x subtracts x */
    st->allocations += s;
    st->bytes_requested += s * a->size;
    st->bytes_reserved += s * a->reserved;
    if (a->state == TMS_ACTIVE) st->bytes_mapped += s * a->reserved;
    else st->bytes_paused += s * a->reserved;
    if (a->host_copy) (&st->bytes_backup_pinned)[a->host_copy->kind] += s * a->host_copy->size;
}

/* A pause or resume that changed an allocation counts once per (tag,
 * device) it changed, with its duration, plus the bytes it copied. */
static void count_change_locked(const struct tms_alloc *a, size_t copied, int is_pause, uint64_t ns)
{
    struct tms_stats *st = stats_of_locked(a->tag_id, a->device);
    if (!st) return;
    uint64_t *counted = &tag_at(a->tag_id)->counted_call[stats_slot(a->device)];
    if (is_pause) st->bytes_to_host += copied;
    else st->bytes_to_device += copied;
    if (*counted == call_seq) return;
    *counted = call_seq;
    if (is_pause) st->pauses++, st->pause_ns += ns;
    else st->resumes++, st->resume_ns += ns;
}

int tms_core_stats(struct tms_stats_row **rows, size_t *count, struct tms_err *err)
{
    size_t n = 0, cap = 16;
    struct tms_stats_row *out = malloc(cap * sizeof *out);
    static const struct tms_stats zero;
    lock_table();
    int tags = tags_published();
    for (int t = 0; out && t < tags; t++) {
        for (int d = 0; d < TMS_STATS_DEVICES; d++) {
            const struct tms_stats *st = &tag_at(t)->per_device[d];
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
    unlock_table();
    if (!out) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory copying statistics");
    *rows = out;
    *count = n;
    return TMS_OK;
}

/* ---- table --------------------------------------------------------------- */

static size_t bucket_of(tms_va va, size_t count)
{
    /* Granularity-aligned addresses: drop the zero low bits, then mix. */
    uint64_t h = (va >> 21) * 0x9E3779B97F4A7C15ull;
    return (size_t)(h >> 32) & (count - 1);
}

/* The list of tag_id's allocations; NULL for an id never published. */
static struct tms_alloc **tag_list_locked(int tag_id)
{
    default_tag_locked();  /* id 0 is every thread's tag before any region names one */
    return tag_id >= 0 && tag_id < tags_published() ? &tag_at(tag_id)->allocs : NULL;
}

static int table_insert_locked(struct tms_alloc *a)
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
    account_locked(a, +1);
    return TMS_OK;
}

static void table_unlink_locked(struct tms_alloc **link)
{
    struct tms_alloc *a = *link;
    *link = a->next;
    if (a->tag_prev) a->tag_prev->tag_next = a->tag_next;
    else tag_at(a->tag_id)->allocs = a->tag_next;
    if (a->tag_next) a->tag_next->tag_prev = a->tag_prev;
    __atomic_store_n(&alloc_count, alloc_count - 1, __ATOMIC_RELAXED);
    by_address_stale = 1;
    walks_since_change = 0;
    account_locked(a, -1);
}

static struct tms_alloc **table_link_locked(tms_va va)
{
    if (!bucket_count) return NULL;
    for (struct tms_alloc **link = &buckets[bucket_of(va, bucket_count)]; *link; link = &(*link)->next)
        if ((*link)->va == va) return link;
    return NULL;
}

static struct tms_alloc *table_find_locked(tms_va va)
{
    struct tms_alloc **link = table_link_locked(va);
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
    const struct tms_alloc *owner = table_find_locked(ptr);
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

static void alloc_destroy(struct tms_alloc *a)
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
            table_unlink_locked(link);
            if (a->handles != &a->one_handle) free(a->handles);
            free(a);  /* its backup's pinned pages belong to the parent's driver state */
        }
    }
    pthread_mutex_unlock(&table_lock);
}

static void register_fork_handlers(void) { (void)pthread_atfork(fork_prepare, fork_parent, fork_child); }

/* ---- claim and settle (the moves of pause.c) -------------------------------- */

/* The allocations of tag_id (a plain variable; -1: every tag): its own list,
 * so a pause of a small tag beside many allocations of others does not walk
 * them all (pause + resume of 1 allocation beside 6,000 of another tag: 54
 * against 12 us on the host backend when it did). As in FOR_EACH_ALLOC,
 * `break` leaves only the inner loop: with tag_id -1, one bucket. */
#define FOR_EACH_OF_TAG(a, tag_id)                                                   \
    for (size_t bucket_ = 0; bucket_ < ((tag_id) < 0 ? bucket_count : 1); bucket_++) \
        for (struct tms_alloc *a = (tag_id) < 0 ? buckets[bucket_] : tag_at(tag_id)->allocs; a; \
             a = (tag_id) < 0 ? a->next : a->tag_next)

/* Moves run in address order: the driver's unmap and map cost grows with a
 * scattered order (hash order: 61 vs 45 us per allocation at 10,000,
 * benchmarks/alloc_count.py on the lent H100). */
static int by_device_and_address(const void *x, const void *y)
{
    const struct tms_alloc *a = ((const struct tms_move *)x)->a, *b = ((const struct tms_move *)y)->a;
    if (a->device != b->device) return a->device < b->device ? -1 : 1;
    return (a->va > b->va) - (a->va < b->va);
}

int tms_table_claim(const char *tag, int from, struct tms_move **moves, size_t *n, struct tms_err *err)
{
    *moves = NULL;
    *n = 0;
    int tag_id = -1, rc = TMS_OK;
    size_t count[2], moving;
    lock_table();
    for (;;) {
        if (tag && (tag_id = tag_find_locked(tag)) < 0) goto out;  /* never used: nothing to do, as upstream */
        count[TMS_ACTIVE] = count[TMS_PAUSED] = moving = 0;
        FOR_EACH_OF_TAG(a, tag_id) {
            if (a->moving) moving++;
            else count[a->state]++;
        }
        if (!moving) break;
        pthread_cond_wait(&table_settled, &table_lock);
    }
    size_t want = count[from], other = count[from == TMS_ACTIVE ? TMS_PAUSED : TMS_ACTIVE];
    if (!want && !other) goto out;
    if (!want) {
        rc = from == TMS_ACTIVE
                 ? tms_fail(err, TMS_E_STATE, 0, "pause of %s%s%s: already paused (%zu allocations, none active)",
                            tag ? "tag '" : "all tags", tag ? tag : "", tag ? "'" : "", other)
                 : tms_fail(err, TMS_E_STATE, 0, "resume of %s%s%s: not paused (%zu allocations, all active)",
                            tag ? "tag '" : "all tags", tag ? tag : "", tag ? "'" : "", other);
        goto out;
    }
    struct tms_move *m = calloc(want, sizeof *m);
    if (!m) {
        rc = tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory listing %zu allocations", want);
        goto out;
    }
    size_t i = 0;
    FOR_EACH_OF_TAG(a, tag_id) {
        if (a->state != from) continue;
        a->moving = 1;
        m[i++] = (struct tms_move){.a = a, .state = from, .copy = a->host_copy};
    }
    *moves = m;
    *n = i;
out:
    unlock_table();
    if (*moves) qsort(*moves, *n, sizeof **moves, by_device_and_address);  /* ours alone now */
    return rc;
}

static int release_detached(const struct tms_driver *drv, struct tms_alloc *a, struct tms_err *err);

void tms_table_settle(const struct tms_driver *drv, struct tms_move *m, size_t n, int is_pause, uint64_t ns)
{
    lock_table();
    call_seq++;
    for (size_t i = 0; i < n; i++) {
        struct tms_alloc *a = m[i].a;
        int changed = a->state != m[i].state;
        account_locked(a, -1);
        m[i].drop = NULL;
        if (m[i].copy != a->host_copy) {
            m[i].drop = a->host_copy;
            a->host_copy = m[i].copy;
        }
        a->state = m[i].state;
        account_locked(a, +1);
        a->moving = 0;
        if (changed) count_change_locked(a, m[i].copied, is_pause, ns);
        if (a->free_requested) table_unlink_locked(table_link_locked(a->va));
        else m[i].a = NULL;  /* what is left in m[].a: frees to finish */
    }
    pthread_cond_broadcast(&table_settled);
    unlock_table();
    for (size_t i = 0; i < n; i++) {
        tms_backup_unref(m[i].drop);
        if (!m[i].a) continue;
        tms_va va = m[i].a->va;
        struct tms_err e = {0};
        if (release_detached(drv, m[i].a, &e))
            tms_log_warn("free of 0x%llx, finished after its %s: %s", (unsigned long long)va,
                         is_pause ? "pause" : "resume", e.msg);
    }
    free(m);
}

/* ---- allocate / free ----------------------------------------------------- */

static int check_margin(const struct tms_driver *drv, int device, size_t reserved, size_t size, const char *tag,
                        struct tms_err *err)
{
    size_t margin = tms_core_margin();
    if (!margin) return TMS_OK;
    size_t free_bytes = 0, total = 0;
    int rc = drv->mem_get_info(device, &free_bytes, &total);
    if (rc)
        return tms_fail(err, TMS_E_DRIVER, rc, "mem_get_info on device %d failed: %s (%d)", device,
                        drv->code_name(rc), rc);
    if (free_bytes < reserved || free_bytes - reserved < margin)
        return tms_fail(err, TMS_E_OOM, 0,
                        "allocation of %zu bytes (tag '%s', device %d) would leave %zu of %zu free bytes, "
                        "below memory_margin_bytes=%zu",
                        size, tag, device, free_bytes > reserved ? free_bytes - reserved : 0, free_bytes, margin);
    return TMS_OK;
}

int tms_core_check_margin(int device, size_t bytes, int tag_id, struct tms_err *err)
{
    if (!tms_core_margin()) return TMS_OK;
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    return rc ? rc : check_margin(drv, device, bytes, bytes, tms_core_tag_name(tag_id), err);
}

/* n rounded up to a multiple of unit (> 0); 0 if that does not fit a size_t. */
static size_t round_up(size_t n, size_t unit)
{
    size_t rem = n % unit;
    if (!rem) return n;
    return n > SIZE_MAX - (unit - rem) ? 0 : n + (unit - rem);
}

int tms_core_alloc(size_t size, int device, const struct tms_region *r, void **ptr, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    if (device < -1) return tms_fail(err, TMS_E_ARG, 0, "device %d does not exist (-1: the current one)", device);
    if (size == 0) return *ptr = NULL, TMS_OK;
    const char *tag = tms_core_tag_name(r->tag_id);
    int count = 0;
    if (device < 0 && (rc = drv->current_device(&device)))
        return tms_fail(err, TMS_E_DRIVER, rc, "cannot tell the current device: %s (%d)", drv->code_name(rc), rc);
    if ((rc = drv->device_count(&count)))
        return tms_fail(err, TMS_E_DRIVER, rc, "device count failed: %s (%d)", drv->code_name(rc), rc);
    if (device >= count)
        return tms_fail(err, TMS_E_ARG, 0, "device %d does not exist (%d devices)", device, count);
    size_t gran = 0;
    if ((rc = drv->granularity(device, &gran)))
        return tms_fail(err, TMS_E_DRIVER, rc, "granularity query on device %d failed: %s (%d)", device,
                        drv->code_name(rc), rc);
    size_t reserved = gran ? round_up(size, gran) : 0;
    if (!reserved)
        return tms_fail(err, TMS_E_OOM, 0, "allocation of %zu bytes (tag '%s', device %d) is larger than any device", size,
                        tag, device);
    if ((rc = check_margin(drv, device, reserved, size, tag, err))) return rc;

    const struct tms_defaults *defaults = tms_defaults();
    size_t chunk = defaults->chunk_bytes_set ? defaults->chunk_bytes : drv->default_chunk_bytes();
    chunk = chunk ? round_up(chunk, gran) : reserved;
    if (!chunk || chunk > reserved) chunk = reserved;  /* TMS_CHUNK_BYTES is bounded: 0 only if it were not */
    size_t n_chunks = reserved / chunk + (reserved % chunk != 0);
    if (n_chunks > INT_MAX)
        return tms_fail(err, TMS_E_OOM, 0,
                        "allocation of %zu bytes (tag '%s', device %d) is larger than any device (%zu chunks of %zu bytes)",
                        size, tag, device, n_chunks, chunk);
    struct tms_alloc *a = calloc(1, sizeof *a);
    if (!a) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory for an allocation record");
    a->size = size;
    a->reserved = reserved;
    a->chunk = chunk;
    a->n_chunks = (int)n_chunks;
    a->device = device;
    a->tag_id = r->tag_id;
    a->state = TMS_ACTIVE;
    a->backup = r->backup || r->disk_backup;
    a->backup_kind = r->disk_backup ? TMS_BACKUP_DISK : r->backup_kind;
    a->handles = a->n_chunks == 1 ? &a->one_handle : calloc(n_chunks, sizeof *a->handles);
    if (!a->handles) {
        free(a);
        return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory for %zu chunk handles", n_chunks);
    }
    rc = drv->reserve(reserved, gran, &a->va);
    if (rc) {
        alloc_destroy(a);
        return tms_fail(err, drv->is_oom(rc) ? TMS_E_OOM : TMS_E_DRIVER, rc,
                        "address reserve of %zu bytes (tag '%s', device %d) failed: %s (%d)", reserved, tag, device,
                        drv->code_name(rc), rc);
    }
    if ((rc = tms_chunks_map(drv, a, tag, err))) {
        int urc = drv->unreserve(a->va, reserved);
        if (urc) tms_err_append(err, "undoing it, address free failed: %s (%d)", drv->code_name(urc), urc);
        alloc_destroy(a);
        return rc;
    }
    lock_table();
    rc = table_insert_locked(a);
    unlock_table();
    if (rc) {
        tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory growing the allocation table");
        if (tms_chunks_unmap(drv, a, tag, err) == TMS_OK) (void)tms_chunks_release(drv, a, tag, err);
        int urc = drv->unreserve(a->va, reserved);
        if (urc) tms_err_append(err, "undoing it, address free failed: %s (%d)", drv->code_name(urc), urc);
        alloc_destroy(a);
        return TMS_E_HOST_OOM;
    }
    *ptr = (void *)(uintptr_t)a->va;
    TMS_DEBUG("alloc 0x%llx size %zu reserved %zu chunks %d device %d tag '%s' backup %s", (unsigned long long)a->va,
              size, reserved, a->n_chunks, device, tag, a->backup ? tms_backup_kind_name(a->backup_kind) : "none");
    return TMS_OK;
}

int tms_core_owns(const void *ptr)
{
    if (!ptr || __atomic_load_n(&alloc_count, __ATOMIC_RELAXED) == 0) return 0;
    lock_table();
    const struct tms_alloc *a = table_find_locked((tms_va)(uintptr_t)ptr);
    int owned = a && !a->adopted;  /* adopted memory is its owner's to give back (tms_core_disown) */
    unlock_table();
    return owned;
}

/* The driver side of a free, for an allocation already out of the table.
 * If its memory cannot be unmapped it goes back into the table (a live
 * mapping must not be lost) and the free fails. */
static int release_detached(const struct tms_driver *drv, struct tms_alloc *a, struct tms_err *err)
{
    const char *tag = tms_core_tag_name(a->tag_id);
    tms_va va = a->va;
    int rc;
    if (a->state == TMS_ACTIVE) {
        /* cuMemUnmap does not wait for queued kernels, unlike cudaFree. */
        rc = drv->synchronize(a->device);
        if (rc && drv->is_shutdown(rc)) {
            alloc_destroy(a);  /* process exit: the driver already took the memory */
            return TMS_OK;
        }
        if (rc)
            tms_fail(err, TMS_E_DRIVER, rc, "synchronize of device %d before freeing 0x%llx (%zu bytes) failed: %s (%d)",
                     a->device, (unsigned long long)va, a->size, drv->code_name(rc), rc);
        else
            rc = tms_chunks_unmap(drv, a, tag, err);
        if (rc) {
            a->free_requested = 0;
            lock_table();
            int irc = table_insert_locked(a);
            unlock_table();
            if (irc) tms_err_append(err, "its record could not be kept either (out of host memory): it leaks");
            return rc;
        }
        struct tms_err release_err = {0};
        if (tms_chunks_release(drv, a, tag, &release_err))  /* a leaked handle must not fail the free */
            tms_log_warn("free of 0x%llx: %s", (unsigned long long)va, release_err.msg);
    }
    TMS_DEBUG("free 0x%llx size %zu device %d tag '%s' (%s)", (unsigned long long)va, a->size, a->device, tag,
              a->state == TMS_ACTIVE ? "active" : "paused");
    rc = drv->unreserve(a->va, a->reserved);
    int shutdown = rc && drv->is_shutdown(rc);
    size_t size = a->size;
    alloc_destroy(a);
    if (rc && !shutdown)
        return tms_fail(err, TMS_E_DRIVER, rc, "address free of 0x%llx (%zu bytes), tag '%s' failed: %s (%d)",
                        (unsigned long long)va, size, tag, drv->code_name(rc), rc);
    return TMS_OK;
}

int tms_core_free(void *ptr, struct tms_err *err)
{
    tms_va va = (tms_va)(uintptr_t)ptr;
    const struct tms_driver *drv = NULL;
    /* The core owns nothing before its driver is loaded; once it is, this
     * cannot fail, so no record is taken out and then lost. */
    int loaded = tms_driver_loaded_name() && tms_driver_get(&drv, NULL) == TMS_OK;
    struct tms_alloc *a = NULL;
    int deferred = 0;
    if (loaded) {
        lock_table();
        struct tms_alloc **link = table_link_locked(va);
        a = link ? *link : NULL;
        if (a && (a->free_requested || a->adopted)) {
            a = NULL;
        } else if (a && a->moving) {
            a->free_requested = 1;
            deferred = 1;
        } else if (a) {
            table_unlink_locked(link);
        }
        unlock_table();
    }
    if (!a) return tms_fail(err, TMS_E_NOT_FOUND, 0, "free of 0x%llx: not an allocation of torch_memory_saver",
                            (unsigned long long)va);
    if (deferred) {
        TMS_DEBUG("free 0x%llx: being paused or resumed, its mover frees it", (unsigned long long)va);
        return TMS_OK;
    }
    return release_detached(drv, a, err);
}

/* ---- adopted memory ------------------------------------------------------- */

int tms_core_adopt(uint64_t va, size_t size, int device, tms_phys handle, uint64_t owner_handle, int handle_types,
                   const struct tms_region *r, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    struct tms_alloc *a = calloc(1, sizeof *a);
    if (!a) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory for an allocation record");
    *a = (struct tms_alloc){
        .va = va, .size = size, .reserved = size, .chunk = size, .n_chunks = 1, .device = device,
        .tag_id = r->tag_id, .state = TMS_ACTIVE, .backup = r->backup || r->disk_backup,
        .backup_kind = r->disk_backup ? TMS_BACKUP_DISK : r->backup_kind, .adopted = 1,
        .owner_handle = owner_handle, .handle_types = handle_types, .one_handle = handle,
    };
    a->handles = &a->one_handle;
    lock_table();
    if (table_find_locked(va)) {
        rc = tms_fail(err, TMS_E_STATE, 0, "adopting 0x%llx (%zu bytes): the table already holds an allocation there",
                      (unsigned long long)va, size);
    } else if (table_insert_locked(a)) {
        rc = tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory growing the allocation table");
    }
    unlock_table();
    if (rc) {
        free(a);
        return rc;
    }
    TMS_DEBUG("adopt 0x%llx size %zu device %d tag '%s' backup %s", (unsigned long long)va, size, device,
              tms_core_tag_name(r->tag_id), a->backup ? tms_backup_kind_name(a->backup_kind) : "none");
    return TMS_OK;
}

int tms_core_disown(uint64_t va, size_t max_size, tms_phys *handle, uint64_t *owner_handle, size_t *size,
                    struct tms_err *err)
{
    struct tms_alloc *a;
    size_t found_size = 0;
    lock_table();
    for (;;) {
        struct tms_alloc **link = table_link_locked(va);
        a = link ? *link : NULL;
        if (a && !a->adopted) a = NULL;
        if (!a || !a->moving) {
            if (a && a->size > max_size) found_size = a->size, a = NULL;
            else if (a) table_unlink_locked(link);
            break;
        }
        /* Its mover holds no lock of ours and never waits: it settles. */
        pthread_cond_wait(&table_settled, &table_lock);
    }
    unlock_table();
    if (found_size)
        return tms_fail(err, TMS_E_ARG, 0, "0x%llx: unmap of %zu bytes covers part of an adopted allocation of %zu",
                        (unsigned long long)va, max_size, found_size);
    if (!a) return tms_fail(err, TMS_E_NOT_FOUND, 0, "0x%llx: no adopted allocation starts there", (unsigned long long)va);
    *handle = a->state == TMS_ACTIVE ? a->one_handle : 0;
    *owner_handle = a->owner_handle;
    *size = a->size;
    TMS_DEBUG("disown 0x%llx size %zu tag '%s' (%s)", (unsigned long long)va, a->size, tms_core_tag_name(a->tag_id),
              a->state == TMS_ACTIVE ? "active" : "paused: nothing mapped, backup dropped");
    alloc_destroy(a);
    return TMS_OK;
}

int tms_core_adopted_at(uint64_t ptr, uint64_t *owner_handle, tms_phys *handle)
{
    if (__atomic_load_n(&alloc_count, __ATOMIC_RELAXED) == 0) return TMS_E_NOT_FOUND;
    int rc = TMS_E_NOT_FOUND;
    lock_table();
    const struct tms_alloc *owner = owner_of_locked(ptr);
    if (owner && owner->adopted) {
        *owner_handle = owner->owner_handle;
        *handle = owner->state == TMS_ACTIVE && !owner->moving ? owner->one_handle : 0;
        rc = TMS_OK;
    }
    unlock_table();
    return rc;
}

/* ---- queries and settings ------------------------------------------------ */

int tms_core_backup_of(uint64_t ptr, size_t n, struct tms_backup **out, size_t *offset, struct tms_err *err)
{
    int rc = TMS_OK;
    *out = NULL;
    lock_table();
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
    unlock_table();
    return rc;
}

static struct tms_alloc_info info_of_locked(const struct tms_alloc *a)
{
    int state = a->state;
    if (a->moving) state = a->state == TMS_ACTIVE ? TMS_PAUSING : TMS_RESUMING;
    return (struct tms_alloc_info){
        .ptr = a->va, .size = a->size, .reserved = a->reserved, .device = a->device,
        .tag_id = a->tag_id, .state = state, .backup = a->backup, .backup_kind = a->backup_kind,
        .has_host_copy = a->host_copy != NULL, .n_chunks = a->n_chunks, .adopted = a->adopted,
        .host_copy_pinned = a->host_copy && tms_backup_pinned(a->host_copy),
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
        lock_table();
        if (alloc_count <= n) break;
        n = alloc_count + 16;
        unlock_table();
    }
    FOR_EACH_ALLOC(a) {
        out[i++] = info_of_locked(a);
    }
    unlock_table();
    *rows = out;
    *count = i;
    return TMS_OK;
}

uint64_t tms_core_sorted_lookups(void)
{
    lock_table();
    uint64_t n = sorted_lookups;
    unlock_table();
    return n;
}

int tms_core_find(uint64_t ptr, struct tms_alloc_info *row)
{
    if (__atomic_load_n(&alloc_count, __ATOMIC_RELAXED) == 0) return TMS_E_NOT_FOUND;
    lock_table();
    const struct tms_alloc *owner = owner_of_locked(ptr);
    if (owner) *row = info_of_locked(owner);
    unlock_table();
    return owner ? TMS_OK : TMS_E_NOT_FOUND;
}

void tms_core_set_margin(size_t bytes) { __atomic_store_n(&margin_bytes, bytes, __ATOMIC_RELAXED); }
size_t tms_core_margin(void) { return __atomic_load_n(&margin_bytes, __ATOMIC_RELAXED); }
void tms_core_set_retain(int retain) { __atomic_store_n(&retain_override, retain ? 1 : 0, __ATOMIC_RELAXED); }

int tms_core_retain(void)
{
    int v = __atomic_load_n(&retain_override, __ATOMIC_RELAXED);
    return v >= 0 ? v : tms_defaults()->retain_backup;
}
