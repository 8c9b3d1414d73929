/* Tags: interned names, found by a hash index, their slots reclaimed once unreferenced. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "core/core_internal.h"
#include "platform/parse.h"

/*
 * A tag lives in a slot of pages that never move, found by name through a
 * hash index. Its references are its allocations and the regions (of
 * threads, and of expandable-segment handles not yet adopted) that name it.
 * Once more than TAGS_BEFORE_RECLAIM slots are in use, interning a new tag
 * first reclaims the slots nobody references (their statistics go with
 * them), so a process that makes tags without end keeps a bounded table.
 * Names are never freed, and each is made once (a pool by text): a reader
 * may hold one without the lock (Python building a row, a log line), and a
 * reused slot's old id then names the new tag rather than freed memory. The
 * pool grows with the distinct names a process ever uses, not with reuse.
 */
#define TAG_PAGE_SIZE 64
#define TAG_PAGES 1024
#define TAGS_BEFORE_RECLAIM 1024
static void default_tag_locked(void);
static struct tms_tag *tag_pages[TAG_PAGES];  /* filled under table_lock */
static int tag_slots;     /* slots made so far; stored with release once a slot is complete */
static int tags_in_use;   /* guarded by table_lock */
static uint32_t tag_free_head;
/* Every name ever made, by text: open addressing, NULL empty. Guarded by table_lock. */
static char **name_pool;
static size_t name_pool_cap, name_pool_used;
/* name -> slot, open addressing: -1 empty, -2 removed. Guarded by table_lock. */
static int32_t *tag_index;
static size_t tag_index_cap, tag_index_used;

static struct tms_tag *tag_at(int id) { return &tag_pages[id / TAG_PAGE_SIZE][id % TAG_PAGE_SIZE]; }
static int tags_published(void) { return __atomic_load_n(&tag_slots, __ATOMIC_ACQUIRE); }

struct tms_tag *tms_tag_locked(int id)
{
    default_tag_locked();
    return id >= 0 && id < tags_published() && tag_at(id)->in_use ? tag_at(id) : NULL;
}

int tms_tags_count(void) { return tags_published(); }
struct tms_tag *tms_tag_slot_locked(int id) { return id >= 0 && id < tags_published() ? tag_at(id) : NULL; }

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

int tms_tags_find_locked(const char *tag)
{
    if (!tag_index_cap) return -1;
    int32_t v = *index_slot_locked(tag, 0);
    return v >= 0 ? v : -1;
}

/* Frees the slots nobody references (never "default"). */
static void reclaim_tags_locked(void)
{
    for (int id = 1; id < tags_published(); id++) {
        struct tms_tag *t = tag_at(id);
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

static char **pool_slot_locked(const char *text)
{
    size_t mask = name_pool_cap - 1, i = (size_t)name_hash(text) & mask;
    while (name_pool[i] && strcmp(name_pool[i], text) != 0) i = (i + 1) & mask;
    return &name_pool[i];
}

/* The pooled copy of text, made if new; NULL out of memory. */
static const char *pooled_name_locked(const char *text)
{
    if ((name_pool_used + 1) * 2 > name_pool_cap) {
        size_t cap = name_pool_cap ? 2 * name_pool_cap : 64, old_cap = name_pool_cap;
        char **grown = calloc(cap, sizeof *grown), **old = name_pool;
        if (!grown) return NULL;
        name_pool = grown, name_pool_cap = cap;
        for (size_t i = 0; i < old_cap; i++)
            if (old[i]) *pool_slot_locked(old[i]) = old[i];
        free(old);
    }
    char **at = pool_slot_locked(text);
    if (!*at && (*at = strdup(text))) name_pool_used++;
    return *at;
}

int tms_tags_intern_locked(const char *tag, int *id, struct tms_err *err)
{
    if (tags_published() == 0 && strcmp(tag, "default") != 0) {
        int ignored;
        int rc = tms_tags_intern_locked("default", &ignored, err);  /* keeps TMS_TAG_DEFAULT_ID == 0 */
        if (rc) return rc;
    }
    int found = tms_tags_find_locked(tag);
    if (found >= 0) return *id = found, TMS_OK;
    if (tags_in_use >= TAGS_BEFORE_RECLAIM) reclaim_tags_locked();
    if ((tag_index_used + 1) * 2 > tag_index_cap && index_grow_locked())
        return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory interning tag '%s'", tag);
    int n = tag_free_head ? (int)tag_free_head - 1 : tags_published();
    if (n == TAG_PAGE_SIZE * TAG_PAGES)
        return tms_fail(err, TMS_E_ARG, 0, "too many tags in use (%d, each with allocations or a region): cannot "
                        "add '%.64s'", n, tag);
    struct tms_tag **page = &tag_pages[n / TAG_PAGE_SIZE];
    const char *name = pooled_name_locked(tag);
    if (!name || (!*page && !(*page = calloc(TAG_PAGE_SIZE, sizeof **page))))
        return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory interning tag '%.64s'", tag);
    struct tms_tag *t = tag_at(n);
    if (tag_free_head) tag_free_head = t->next_free;
    t->in_use = 1;
    t->refs = 0;
    t->allocs = NULL;
    __atomic_store_n(&t->name, name, __ATOMIC_RELEASE);
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
    if (tags_published() == 0) (void)tms_tags_intern_locked("default", &id, NULL);
}

int tms_core_check_tag(const char *tag, struct tms_err *err)
{
    size_t bad;
    if (!tag || !*tag) return tms_fail(err, TMS_E_ARG, 0, "tag must be a non-empty string");
    if (!tms_utf8_valid(tag, &bad))
        return tms_fail(err, TMS_E_ARG, 0, "tag is not valid UTF-8 (byte 0x%02x at offset %zu)",
                        (unsigned)(unsigned char)tag[bad], bad);
    return TMS_OK;
}

const char *tms_core_tag_name(int id)
{
    if (id >= 0 && id < tags_published()) return __atomic_load_n(&tag_at(id)->name, __ATOMIC_ACQUIRE);
    return id == TMS_TAG_DEFAULT_ID ? "default" : "?";
}

void tms_tag_ref_locked(int id)
{
    if (id > 0 && id < tags_published()) tag_at(id)->refs++;
}

void tms_tag_unref_locked(int id)
{
    if (id > 0 && id < tags_published() && tag_at(id)->refs) tag_at(id)->refs--;
}

int tms_core_check_tags(const char *op, const char *const *tags, size_t n, struct tms_err *err)
{
    if (!tags || !n) return tms_fail(err, TMS_E_ARG, 0, "%s: the list of tags is empty", op);
    for (size_t i = 0; i < n; i++) {
        int rc = tms_core_check_tag(tags[i], err);
        if (rc) return rc;
        for (size_t j = 0; j < i; j++)
            if (!strcmp(tags[i], tags[j])) return tms_fail(err, TMS_E_ARG, 0, "%s: tag '%s' is listed twice", op, tags[i]);
    }
    return TMS_OK;
}
