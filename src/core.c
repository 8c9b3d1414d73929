/* The VMM core: the process's one allocation table and its pause/resume state machine. */
#include "core.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "driver.h"
#include "log.h"
#include "stats.h"
#include "transfer.h"

struct tms_alloc {
    tms_va va;
    size_t size;
    size_t reserved;
    size_t chunk;            /* bytes per physical handle; the last may be shorter */
    int n_chunks;
    int device;
    int tag_id;
    int state;
    int backup;
    int backup_kind;
    tms_phys *handles;       /* n_chunks entries; points at one_handle when n_chunks == 1 */
    tms_phys one_handle;
    struct tms_backup *host_copy;  /* paused with backup, or retained after resume */
    struct tms_alloc *next;        /* hash chain */
};

/* Hooks run on arbitrary threads, so every table access takes core_lock.
 * pause/resume hold it throughout: a free racing a pause must not unmap
 * memory the pause is copying. The GIL is never held by a caller (module.c
 * releases it), so the two locks are never taken in opposite orders. */
static pthread_mutex_t core_lock = PTHREAD_MUTEX_INITIALIZER;
static struct tms_alloc **buckets;   /* guarded by core_lock */
static size_t bucket_count;          /* power of two */
static size_t alloc_count;           /* atomic reads allowed (tms_core_owns fast path) */
struct tag_entry {
    char *name;                                  /* immutable once set */
    struct tms_stats per_device[TMS_STATS_DEVICES];
};
static struct tag_entry **tags;      /* guarded by core_lock */
static int tag_count;
static int tag_capacity;
static size_t margin_bytes;          /* atomic */
static int retain_override = -1;     /* atomic; -1: TMS_RETAIN_CPU_BACKUP decides */

/* ---- tags ---------------------------------------------------------------- */

static int tag_intern_locked(const char *tag, int *id, struct tms_err *err);

/* "default" is tag 0 from the start: threads begin with it (TMS_INIT_ENABLE)
 * before any region names a tag. */
static void default_tag_locked(void)
{
    int id;
    if (tag_count == 0) (void)tag_intern_locked("default", &id, NULL);
}

static int tag_find_locked(const char *tag)
{
    default_tag_locked();
    for (int i = 0; i < tag_count; i++)
        if (strcmp(tags[i]->name, tag) == 0) return i;
    return -1;
}

static int tag_intern_locked(const char *tag, int *id, struct tms_err *err)
{
    if (tag_count == 0 && strcmp(tag, "default") != 0) {
        int ignored;
        int rc = tag_intern_locked("default", &ignored, err);  /* keeps TMS_TAG_DEFAULT_ID == 0 */
        if (rc) return rc;
    }
    int found = -1;
    for (int i = 0; i < tag_count; i++)
        if (strcmp(tags[i]->name, tag) == 0) found = i;
    if (found >= 0) return *id = found, TMS_OK;
    if (tag_count == tag_capacity) {
        int cap = tag_capacity ? tag_capacity * 2 : 16;
        struct tag_entry **grown = realloc(tags, (size_t)cap * sizeof *grown);
        if (!grown) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory interning tag '%s'", tag);
        tags = grown;
        tag_capacity = cap;
    }
    struct tag_entry *entry = calloc(1, sizeof *entry);
    char *copy = strdup(tag);
    if (!entry || !copy) {
        free(entry);
        free(copy);
        return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory interning tag '%s'", tag);
    }
    entry->name = copy;
    tags[tag_count] = entry;
    *id = tag_count++;
    return TMS_OK;
}

int tms_core_tag_id(const char *tag, int *id, struct tms_err *err)
{
    if (!tag || !*tag) return tms_fail(err, TMS_E_ARG, 0, "tag must be a non-empty string");
    pthread_mutex_lock(&core_lock);
    int rc = tag_intern_locked(tag, id, err);
    pthread_mutex_unlock(&core_lock);
    return rc;
}

static const char *tag_name_locked(int id)
{
    if (id >= 0 && id < tag_count) return tags[id]->name;
    return id == TMS_TAG_DEFAULT_ID ? "default" : "?";
}

const char *tms_core_tag_name(int id)
{
    pthread_mutex_lock(&core_lock);
    const char *name = tag_name_locked(id);
    pthread_mutex_unlock(&core_lock);
    return name;
}

/* ---- statistics ---------------------------------------------------------- */

static struct tms_stats *stats_of_locked(int tag_id, int device)
{
    default_tag_locked();
    if (tag_id < 0 || tag_id >= tag_count) return NULL;
    return &tags[tag_id]->per_device[device < TMS_STATS_DEVICES ? device : TMS_STATS_DEVICES - 1];
}

/* The one place gauges change: an allocation's share is taken out (sign -1)
 * before any change to it and put back (+1) after, so gauges always equal
 * the sum over the table. */
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
    if (a->host_copy && a->host_copy->kind == TMS_BACKUP_PINNED) st->bytes_backup_pinned += s * a->host_copy->size;
    if (a->host_copy && a->host_copy->kind != TMS_BACKUP_PINNED) st->bytes_backup_mmap += s * a->host_copy->size;
}

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Counters of one pause or resume: each (tag, device) it changed counts the
 * call once, with the call's duration, and the bytes it copied. */
static void count_call_locked(struct tms_alloc **list, size_t n, const size_t *changed, int is_pause, uint64_t ns)
{
    for (int t = 0; t < tag_count; t++) {
        uint64_t touched[TMS_STATS_DEVICES / 64] = {0};
        for (size_t i = 0; i < n; i++) {
            const struct tms_alloc *a = list[i];
            if (a->tag_id != t || !changed[i]) continue;
            struct tms_stats *st = stats_of_locked(t, a->device);
            int slot = (int)(st - tags[t]->per_device);
            /* changed[i] is 1 + the bytes copied for list[i], 0 if untouched */
            if (is_pause) st->bytes_to_host += changed[i] - 1;
            else st->bytes_to_device += changed[i] - 1;
            if (touched[slot / 64] >> (slot % 64) & 1) continue;
            touched[slot / 64] |= 1ull << (slot % 64);
            if (is_pause) st->pauses++, st->pause_ns += ns;
            else st->resumes++, st->resume_ns += ns;
        }
    }
}

int tms_core_stats(struct tms_stats_row **rows, size_t *count, struct tms_err *err)
{
    pthread_mutex_lock(&core_lock);
    size_t n = 0, cap = 16;
    struct tms_stats_row *out = malloc(cap * sizeof *out);
    static const struct tms_stats zero;
    for (int t = 0; out && t < tag_count; t++) {
        for (int d = 0; d < TMS_STATS_DEVICES; d++) {
            if (!memcmp(&tags[t]->per_device[d], &zero, sizeof zero)) continue;
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
            out[n++] = (struct tms_stats_row){.tag_id = t, .device = d, .stats = tags[t]->per_device[d]};
        }
    }
    pthread_mutex_unlock(&core_lock);
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

static int table_insert_locked(struct tms_alloc *a)
{
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
    __atomic_store_n(&alloc_count, alloc_count + 1, __ATOMIC_RELAXED);
    account_locked(a, +1);
    return TMS_OK;
}

static struct tms_alloc *table_remove_locked(tms_va va)
{
    if (!bucket_count) return NULL;
    for (struct tms_alloc **link = &buckets[bucket_of(va, bucket_count)]; *link; link = &(*link)->next) {
        struct tms_alloc *a = *link;
        if (a->va == va) {
            *link = a->next;
            __atomic_store_n(&alloc_count, alloc_count - 1, __ATOMIC_RELAXED);
            account_locked(a, -1);
            return a;
        }
    }
    return NULL;
}

static struct tms_alloc *table_find_locked(tms_va va)
{
    if (!bucket_count) return NULL;
    for (struct tms_alloc *a = buckets[bucket_of(va, bucket_count)]; a; a = a->next)
        if (a->va == va) return a;
    return NULL;
}

/* Two nested loops: `break` inside leaves only the inner one. */
#define FOR_EACH_ALLOC(a)                               \
    for (size_t bucket_ = 0; bucket_ < bucket_count; bucket_++) \
        for (struct tms_alloc *a = buckets[bucket_]; a; a = a->next)

/* ---- physical memory of one allocation ----------------------------------- */

static size_t chunk_size(const struct tms_alloc *a, int i)
{
    size_t start = (size_t)i * a->chunk;
    return a->reserved - start < a->chunk ? a->reserved - start : a->chunk;
}

/* Creates and maps every chunk; on failure leaves none created or mapped. */
static int map_chunks(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err)
{
    int created = 0, mapped = 0, rc = 0;
    const char *op = "create";
    for (; created < a->n_chunks; created++) {
        rc = drv->create(a->device, chunk_size(a, created), &a->handles[created]);
        if (rc) break;
    }
    if (!rc) {
        op = "map";
        for (; mapped < a->n_chunks; mapped++) {
            rc = drv->map(a->device, a->va + (tms_va)mapped * a->chunk, chunk_size(a, mapped), a->handles[mapped]);
            if (rc) break;
        }
    }
    if (!rc) return TMS_OK;
    int failed = op[0] == 'c' ? created : mapped;
    for (int i = 0; i < mapped; i++) (void)drv->unmap(a->va + (tms_va)i * a->chunk, chunk_size(a, i));
    for (int i = 0; i < created; i++) (void)drv->release(a->handles[i]);
    return tms_fail(err, drv->is_oom(rc) ? TMS_E_OOM : TMS_E_DRIVER, rc,
                    "%s of %zu bytes (chunk %d of %d) for allocation 0x%llx of %zu bytes, tag '%s', device %d "
                    "failed: %s (%d)",
                    op, chunk_size(a, failed), failed + 1, a->n_chunks, (unsigned long long)a->va, a->size, tag,
                    a->device, drv->code_name(rc), rc);
}

/* Unmaps every chunk. If one fails, the chunks already unmapped are mapped
 * back (their handles are still held), so the allocation stays whole and
 * usable. pre: no work in flight touches it. */
static int unmap_chunks(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err)
{
    for (int i = 0; i < a->n_chunks; i++) {
        int rc = drv->unmap(a->va + (tms_va)i * a->chunk, chunk_size(a, i));
        if (rc && drv->is_shutdown(rc)) return TMS_OK;  /* process exit: the driver took it all */
        if (rc) {
            for (int j = 0; j < i; j++)
                (void)drv->map(a->device, a->va + (tms_va)j * a->chunk, chunk_size(a, j), a->handles[j]);
            return tms_fail(err, TMS_E_DRIVER, rc,
                            "unmap of allocation 0x%llx (%zu bytes, chunk %d of %d), tag '%s', device %d failed: %s (%d)",
                            (unsigned long long)a->va, a->size, i + 1, a->n_chunks, tag, a->device,
                            drv->code_name(rc), rc);
        }
    }
    return TMS_OK;
}

/* Releases the physical memory of an unmapped allocation. A failure leaks
 * the handle but changes nothing else, so it is reported, not undone. */
static int release_chunks(const struct tms_driver *drv, struct tms_alloc *a, const char *tag, struct tms_err *err)
{
    int first_rc = 0;
    for (int i = 0; i < a->n_chunks; i++) {
        int rc = drv->release(a->handles[i]);
        if (rc && !first_rc && !drv->is_shutdown(rc)) first_rc = rc;
    }
    if (first_rc)
        return tms_fail(err, TMS_E_DRIVER, first_rc,
                        "release of allocation 0x%llx (%zu bytes), tag '%s', device %d failed: %s (%d)",
                        (unsigned long long)a->va, a->size, tag, a->device, drv->code_name(first_rc), first_rc);
    return TMS_OK;
}

static void alloc_destroy(struct tms_alloc *a)
{
    if (a->handles != &a->one_handle) free(a->handles);
    tms_backup_unref(a->host_copy);
    free(a);
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

int tms_core_alloc(size_t size, int device, const struct tms_region *r, void **ptr, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
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
    if (size > SIZE_MAX - gran)
        return tms_fail(err, TMS_E_OOM, 0, "allocation of %zu bytes (tag '%s', device %d) is larger than any device", size,
                        tag, device);
    size_t reserved = (size + gran - 1) / gran * gran;
    if ((rc = check_margin(drv, device, reserved, size, tag, err))) return rc;

    const struct tms_defaults *defaults = tms_defaults();
    size_t chunk = defaults->chunk_bytes_set ? defaults->chunk_bytes : drv->default_chunk_bytes();
    chunk = chunk ? (chunk + gran - 1) / gran * gran : reserved;
    if (chunk > reserved) chunk = reserved;
    struct tms_alloc *a = calloc(1, sizeof *a);
    if (!a) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory for an allocation record");
    a->size = size;
    a->reserved = reserved;
    a->chunk = chunk;
    a->n_chunks = (int)((reserved + chunk - 1) / chunk);
    a->device = device;
    a->tag_id = r->tag_id;
    a->state = TMS_ACTIVE;
    a->backup = r->backup;
    a->backup_kind = r->backup_kind;
    a->handles = a->n_chunks == 1 ? &a->one_handle : calloc((size_t)a->n_chunks, sizeof *a->handles);
    if (!a->handles) {
        int n_chunks = a->n_chunks;
        free(a);
        return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory for %d chunk handles", n_chunks);
    }
    rc = drv->reserve(reserved, gran, &a->va);
    if (rc) {
        alloc_destroy(a);
        return tms_fail(err, drv->is_oom(rc) ? TMS_E_OOM : TMS_E_DRIVER, rc,
                        "address reserve of %zu bytes (tag '%s', device %d) failed: %s (%d)", reserved, tag, device,
                        drv->code_name(rc), rc);
    }
    if ((rc = map_chunks(drv, a, tag, err))) {
        (void)drv->unreserve(a->va, reserved);
        alloc_destroy(a);
        return rc;
    }
    pthread_mutex_lock(&core_lock);
    rc = table_insert_locked(a);
    pthread_mutex_unlock(&core_lock);
    if (rc) {
        if (unmap_chunks(drv, a, tag, NULL) == TMS_OK) (void)release_chunks(drv, a, tag, NULL);
        (void)drv->unreserve(a->va, reserved);
        alloc_destroy(a);
        return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory growing the allocation table");
    }
    *ptr = (void *)(uintptr_t)a->va;
    TMS_DEBUG("alloc 0x%llx size %zu reserved %zu chunks %d device %d tag '%s' backup %s", (unsigned long long)a->va,
              size, reserved, a->n_chunks, device, tag, a->backup ? tms_backup_kind_name(a->backup_kind) : "none");
    return TMS_OK;
}

int tms_core_owns(const void *ptr)
{
    if (!ptr || __atomic_load_n(&alloc_count, __ATOMIC_RELAXED) == 0) return 0;
    pthread_mutex_lock(&core_lock);
    int owned = table_find_locked((tms_va)(uintptr_t)ptr) != NULL;
    pthread_mutex_unlock(&core_lock);
    return owned;
}

int tms_core_free(void *ptr, struct tms_err *err)
{
    tms_va va = (tms_va)(uintptr_t)ptr;
    pthread_mutex_lock(&core_lock);
    struct tms_alloc *a = table_remove_locked(va);
    pthread_mutex_unlock(&core_lock);
    if (!a) return tms_fail(err, TMS_E_NOT_FOUND, 0, "free of 0x%llx: not an allocation of torch_memory_saver",
                            (unsigned long long)va);
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);  /* loaded already: a owns driver memory */
    if (rc) return rc;
    const char *tag = tms_core_tag_name(a->tag_id);
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
            rc = unmap_chunks(drv, a, tag, err);
        if (rc) {  /* still mapped: keep it in the table rather than leak a live mapping */
            pthread_mutex_lock(&core_lock);
            (void)table_insert_locked(a);
            pthread_mutex_unlock(&core_lock);
            return rc;
        }
        (void)release_chunks(drv, a, tag, NULL);  /* a leaked handle must not fail the free */
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

/* ---- pause / resume ------------------------------------------------------ */

struct selection {
    int tag_id;        /* -1 = all tags */
    size_t active;
    size_t paused;
};

static int selected(const struct tms_alloc *a, const struct selection *s)
{
    return s->tag_id < 0 || a->tag_id == s->tag_id;
}

/* Counts the selected allocations. Returns 0 if there is nothing to do. */
static int select_locked(const char *tag, struct selection *s)
{
    memset(s, 0, sizeof *s);
    s->tag_id = -1;
    if (tag) {
        s->tag_id = tag_find_locked(tag);
        if (s->tag_id < 0) return 0;  /* never used: nothing to pause, as upstream */
    }
    FOR_EACH_ALLOC(a) {
        if (!selected(a, s)) continue;
        if (a->state == TMS_ACTIVE) s->active++;
        else s->paused++;
    }
    return 1;
}

static int synchronize_devices_locked(const struct tms_driver *drv, const struct selection *s, int state,
                                      struct tms_err *err)
{
    uint64_t done = 0;  /* bit per device; devices >= 64 are synchronized every time */
    FOR_EACH_ALLOC(a) {
        if (!selected(a, s) || a->state != state) continue;
        if (a->device < 64 && (done >> a->device & 1)) continue;
        int rc = drv->synchronize(a->device);
        if (rc)
            return tms_fail(err, TMS_E_DRIVER, rc, "synchronize of device %d before pause failed: %s (%d)", a->device,
                            drv->code_name(rc), rc);
        if (a->device < 64) done |= 1ull << a->device;
    }
    return TMS_OK;
}

/* The selected allocations in the given state, as a fresh array. */
static int collect_locked(const struct selection *s, int state, struct tms_alloc ***out, size_t *count,
                          struct tms_err *err)
{
    size_t n = state == TMS_ACTIVE ? s->active : s->paused, i = 0;
    struct tms_alloc **list = calloc(n ? n : 1, sizeof *list);
    if (!list) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory listing %zu allocations", n);
    FOR_EACH_ALLOC(a) {
        if (selected(a, s) && a->state == state) list[i++] = a;
    }
    *out = list;
    *count = i;
    return TMS_OK;
}

static struct tms_transfer transfer_of(const struct tms_alloc *a)
{
    return (struct tms_transfer){
        .device = a->device, .dev = a->va, .host = a->host_copy->host, .n = a->size,
        .host_pinned = a->host_copy->kind == TMS_BACKUP_PINNED,
    };
}

/* Makes (or reuses) the host copies and fills them. On failure every host
 * copy this call touched is dropped: the device still holds the truth, and
 * a half-overwritten retained copy must not be served as a backup. */
static int backup_all(const struct tms_driver *drv, struct tms_alloc **list, size_t n, struct tms_err *err)
{
    struct tms_transfer *copies = calloc(n ? n : 1, sizeof *copies);
    if (!copies) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning %zu backups", n);
    size_t k = 0;
    int rc = TMS_OK;
    for (size_t i = 0; i < n && !rc; i++) {
        struct tms_alloc *a = list[i];
        if (!a->backup) continue;
        if (a->host_copy && a->host_copy->kind != a->backup_kind) {
            tms_backup_unref(a->host_copy);
            a->host_copy = NULL;
        }
        if (!a->host_copy) rc = tms_backup_new(drv, a->backup_kind, a->size, &a->host_copy, err);
        if (!rc) copies[k++] = transfer_of(a);
    }
    if (!rc) rc = tms_transfer_run(drv, 1, copies, k, err);
    free(copies);
    if (rc) {
        for (size_t i = 0; i < n; i++) {
            tms_backup_unref(list[i]->host_copy);
            list[i]->host_copy = NULL;
        }
    }
    return rc;
}

int tms_core_pause(const char *tag, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    struct tms_alloc **list = NULL;
    size_t n = 0;
    uint64_t start = now_ns();
    pthread_mutex_lock(&core_lock);
    struct selection s;
    if (!select_locked(tag, &s) || (s.active == 0 && s.paused == 0)) goto out;
    if (s.active == 0) {
        rc = tms_fail(err, TMS_E_STATE, 0, "pause of %s%s%s: already paused (%zu allocations, none active)",
                      tag ? "tag '" : "all tags", tag ? tag : "", tag ? "'" : "", s.paused);
        goto out;
    }
    if ((rc = collect_locked(&s, TMS_ACTIVE, &list, &n, err))) goto out;
    for (size_t i = 0; i < n; i++) account_locked(list[i], -1);
    /* Queued kernels may still write the memory: copy and unmap only after. */
    if ((rc = synchronize_devices_locked(drv, &s, TMS_ACTIVE, err))) goto out;
    /* All backups first: if one fails, nothing has been unmapped yet. */
    if ((rc = backup_all(drv, list, n, err))) goto out;
    /* Then unmap: an allocation whose unmap fails stays active and whole. */
    for (size_t i = 0; i < n; i++) {
        struct tms_alloc *a = list[i];
        const char *name = tag_name_locked(a->tag_id);
        struct tms_err one_err = {0};
        int one = unmap_chunks(drv, a, name, &one_err);
        if (one == TMS_OK) {
            a->state = TMS_PAUSED;
            one = release_chunks(drv, a, name, &one_err);
        } else if (a->host_copy && !tms_core_retain()) {
            tms_backup_unref(a->host_copy);  /* still active: the device holds the bytes */
            a->host_copy = NULL;
        }
        if (one && !rc) {
            rc = one;
            if (err) *err = one_err;
        }
    }
out:
    if (list) {
        size_t *changed = calloc(n ? n : 1, sizeof *changed);
        for (size_t i = 0; i < n; i++) {
            struct tms_alloc *a = list[i];
            if (changed && a->state == TMS_PAUSED) changed[i] = 1 + (a->host_copy ? a->size : 0);
            account_locked(a, +1);
        }
        if (changed) count_call_locked(list, n, changed, 1, now_ns() - start);
        free(changed);
        TMS_DEBUG("pause %s: %zu allocations, %.3f ms, status %d", tag ? tag : "<all>", n,
                  (double)(now_ns() - start) / 1e6, rc);
    }
    pthread_mutex_unlock(&core_lock);
    free(list);
    return rc;
}

int tms_core_resume(const char *tag, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    struct tms_alloc **list = NULL;
    struct tms_transfer *copies = NULL;
    size_t *changed = NULL;  /* per list entry: 1 + bytes restored once active again */
    size_t n = 0, mapped = 0, k = 0;
    uint64_t start = now_ns();
    pthread_mutex_lock(&core_lock);
    struct selection s;
    if (!select_locked(tag, &s) || (s.active == 0 && s.paused == 0)) goto out;
    if (s.paused == 0) {
        rc = tms_fail(err, TMS_E_STATE, 0, "resume of %s%s%s: not paused (%zu allocations, all active)",
                      tag ? "tag '" : "all tags", tag ? tag : "", tag ? "'" : "", s.active);
        goto out;
    }
    if ((rc = collect_locked(&s, TMS_PAUSED, &list, &n, err))) goto out;
    for (size_t i = 0; i < n; i++) account_locked(list[i], -1);
    copies = calloc(n, sizeof *copies);
    changed = calloc(n, sizeof *changed);
    if (!copies || !changed) {
        rc = tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning %zu restores", n);
        goto out;
    }
    /* Map what fits; on the first failure (typically OOM) stop, so the rest
     * stay paused with their backups and a retry resumes them. */
    for (; mapped < n; mapped++) {
        struct tms_alloc *a = list[mapped];
        if ((rc = map_chunks(drv, a, tag_name_locked(a->tag_id), err))) break;
        if (a->host_copy) copies[k++] = transfer_of(a);
    }
    struct tms_err copy_err = {0};
    int copy_rc = tms_transfer_run(drv, 0, copies, k, &copy_err);
    if (copy_rc && !rc) {
        rc = copy_rc;
        if (err) *err = copy_err;
    }
    /* An allocation is active only once all its bytes are back; one whose
     * restore failed is unmapped again and stays paused with its backup. */
    int retain = tms_core_retain();
    for (size_t i = 0, c = 0; i < mapped; i++) {
        struct tms_alloc *a = list[i];
        int restored = !a->host_copy || copies[c].done == copies[c].n;
        if (a->host_copy) c++;
        if (!restored) {
            const char *name = tag_name_locked(a->tag_id);
            if (unmap_chunks(drv, a, name, NULL) == TMS_OK) (void)release_chunks(drv, a, name, NULL);
            continue;
        }
        a->state = TMS_ACTIVE;
        changed[i] = 1 + (a->host_copy ? a->size : 0);
        if (a->host_copy && !retain) {
            tms_backup_unref(a->host_copy);
            a->host_copy = NULL;
        }
    }
out:
    for (size_t i = 0; list && i < n; i++) account_locked(list[i], +1);
    if (changed) count_call_locked(list, n, changed, 0, now_ns() - start);
    if (list)
        TMS_DEBUG("resume %s: %zu allocations, %.3f ms, status %d", tag ? tag : "<all>", n,
                  (double)(now_ns() - start) / 1e6, rc);
    pthread_mutex_unlock(&core_lock);
    free(list);
    free(copies);
    free(changed);
    return rc;
}

/* ---- queries and settings ------------------------------------------------ */

int tms_core_backup_of(uint64_t ptr, size_t n, struct tms_backup **out, size_t *offset, struct tms_err *err)
{
    int rc = TMS_OK;
    *out = NULL;
    pthread_mutex_lock(&core_lock);
    struct tms_alloc *owner = NULL;
    FOR_EACH_ALLOC(a) {  /* ranges never overlap: at most one matches */
        if (ptr >= a->va && ptr < a->va + a->reserved) owner = a;
    }
    if (!owner) {
        /* memory of someone else: no backup here, as for an active allocation */
    } else if (n > owner->size || ptr - owner->va > owner->size - n) {
        rc = tms_fail(err, TMS_E_ARG, 0, "range 0x%llx + %zu bytes runs past allocation 0x%llx of %zu bytes",
                      (unsigned long long)ptr, n, (unsigned long long)owner->va, owner->size);
    } else if (owner->host_copy) {
        tms_backup_ref(owner->host_copy);
        *out = owner->host_copy;
        *offset = (size_t)(ptr - owner->va);
    }
    pthread_mutex_unlock(&core_lock);
    return rc;
}

int tms_core_list(struct tms_alloc_info **rows, size_t *count, struct tms_err *err)
{
    pthread_mutex_lock(&core_lock);
    size_t n = alloc_count, i = 0;
    struct tms_alloc_info *out = calloc(n ? n : 1, sizeof *out);
    if (out) {
        FOR_EACH_ALLOC(a) {
            out[i++] = (struct tms_alloc_info){
                .ptr = a->va, .size = a->size, .reserved = a->reserved, .device = a->device,
                .tag_id = a->tag_id, .state = a->state, .backup = a->backup, .backup_kind = a->backup_kind,
                .has_host_copy = a->host_copy != NULL, .n_chunks = a->n_chunks,
            };
        }
    }
    pthread_mutex_unlock(&core_lock);
    if (!out) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory listing %zu allocations", n);
    *rows = out;
    *count = i;
    return TMS_OK;
}

void tms_core_set_margin(size_t bytes) { __atomic_store_n(&margin_bytes, bytes, __ATOMIC_RELAXED); }
size_t tms_core_margin(void) { return __atomic_load_n(&margin_bytes, __ATOMIC_RELAXED); }
void tms_core_set_retain(int retain) { __atomic_store_n(&retain_override, retain ? 1 : 0, __ATOMIC_RELAXED); }

int tms_core_retain(void)
{
    int v = __atomic_load_n(&retain_override, __ATOMIC_RELAXED);
    return v >= 0 ? v : tms_defaults()->retain_backup;
}
