/* PyTorch's expandable segments: tokens for the handles its allocator creates in a region, translated to the core's handles. */
#include "hooks/cumem.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/core.h"
#include "hooks/hook.h"
#include "platform/cuda_abi.h"
#include "platform/fork.h"
#include "platform/log.h"

/* The owner's own entry points, kept by tms_cumem_wrap (atomic: set once). */
static struct tms_cumem_entry_points real;

#define REAL(field) __atomic_load_n(&real.field, __ATOMIC_ACQUIRE)

/* A token: TOKEN_TAG | generation << 32 | index. Bits 48..62 set is no
 * user-space address (the driver's handles are heap addresses), and the
 * generation makes a stale copy of a reused slot unknown, not another's. */
#define TOKEN_TAG 0x7e5a000000000000ull
#define TOKEN_TAG_MASK 0xffff000000000000ull

struct token {
    int live;
    int adopted;        /* the core holds its memory (tms_core_adopt) */
    int mapped;         /* mapped by the owner at va, not adopted */
    int refs;           /* the owner's references: create 1, retain +1, release -1 */
    uint64_t handle;    /* while not adopted: its physical handle; 0 if none (it was paused when disowned) */
    uint64_t va;
    size_t size;
    int device;
    int handle_types;
    uint16_t generation;
    uint32_t next_free; /* index + 1 of the next free slot; 0: none */
    struct tms_region region;
};

/* Guards the tokens. Never held across a driver call of the owner's; held
 * across tms_core_adopt / tms_core_adopted_at (table lock inside: that
 * order only), never across tms_core_disown, which may wait for a pause. */
static pthread_mutex_t cumem_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t fork_handlers_once = PTHREAD_ONCE_INIT;
static struct token *tokens;
static uint32_t token_cap;
static uint32_t free_head;
static unsigned long live_tokens;    /* atomic reads: the pass-through fast path */
static unsigned long mapped_tokens;  /* tokens with mapped set */

static void fork_prepare(void) { pthread_mutex_lock(&cumem_lock); }
static void fork_release(void) { pthread_mutex_unlock(&cumem_lock); }
static void register_fork_handlers(void)
{
    static const struct tms_fork_handlers handlers = {fork_prepare, fork_release, fork_release};
    tms_fork_register(TMS_FORK_CUMEM, &handlers);
}

static void lock_tokens(void)
{
    pthread_once(&fork_handlers_once, register_fork_handlers);
    pthread_mutex_lock(&cumem_lock);
}

static void unlock_tokens(void) { pthread_mutex_unlock(&cumem_lock); }

static int is_token(tms_CUmemHandle h) { return (h & TOKEN_TAG_MASK) == TOKEN_TAG; }

static uint64_t token_value(const struct token *t)
{
    return TOKEN_TAG | (uint64_t)t->generation << 32 | (uint64_t)(t - tokens);
}

static struct token *token_find_locked(uint64_t value)
{
    uint32_t index = (uint32_t)value;
    if (!is_token(value) || index >= token_cap) return NULL;
    struct token *t = &tokens[index];
    return t->live && t->generation == (uint16_t)(value >> 32) ? t : NULL;
}

static struct token *token_new_locked(void)
{
    if (!free_head) {
        uint32_t cap = token_cap ? token_cap * 2 : 256;
        if (cap <= token_cap || cap > UINT32_MAX / 2) return NULL;
        struct token *grown = realloc(tokens, cap * sizeof *grown);
        if (!grown) return NULL;
        memset(grown + token_cap, 0, (cap - token_cap) * sizeof *grown);
        for (uint32_t i = cap; i > token_cap; i--) grown[i - 1].next_free = i == cap ? free_head : i + 1;
        free_head = token_cap + 1;
        tokens = grown;
        token_cap = cap;
    }
    struct token *t = &tokens[free_head - 1];
    free_head = t->next_free;
    uint16_t generation = (uint16_t)(t->generation + 1);
    *t = (struct token){.live = 1, .refs = 1, .generation = generation};
    __atomic_store_n(&live_tokens, live_tokens + 1, __ATOMIC_RELAXED);
    return t;
}

static void token_free_locked(struct token *t)
{
    tms_core_tag_unref(t->region.tag_id);
    if (t->mapped) mapped_tokens--;
    t->live = 0;
    t->next_free = free_head;
    free_head = (uint32_t)(t - tokens) + 1;
    __atomic_store_n(&live_tokens, live_tokens - 1, __ATOMIC_RELAXED);
}

static struct token *mapped_at_locked(uint64_t va)
{
    for (uint32_t i = 0, seen = 0; i < token_cap && seen < mapped_tokens; i++) {
        if (!tokens[i].live || !tokens[i].mapped) continue;
        if (tokens[i].va == va) return &tokens[i];
        seen++;
    }
    return NULL;
}

/* A token is handed out only once every call that can take it back is ours. */
static int wrapped_all(void)
{
    return REAL(map) && REAL(set_access) && REAL(unmap) && REAL(release);
}

unsigned long tms_cumem_tokens(void) { return __atomic_load_n(&live_tokens, __ATOMIC_RELAXED); }

/* ---- the wrappers --------------------------------------------------------- */

static tms_CUresult wrap_create(tms_CUmemHandle *h, size_t size, const tms_CUmemAllocationProp *prop,
                                unsigned long long flags)
{
    tms_cuMemCreate_fn create = REAL(create);
    const struct tms_region *r = tms_core_region();
    if (!r->active || !h || !prop || prop->location.type != TMS_CU_MEM_LOCATION_TYPE_DEVICE || !wrapped_all())
        return create(h, size, prop, flags);
    struct tms_err err = {0};
    int margin = tms_core_check_margin(prop->location.id, size, r->tag_id, &err);
    if (margin == TMS_E_OOM) {
        tms_core_keep_error(&err);
        return TMS_CUDA_ERROR_OUT_OF_MEMORY;  /* PyTorch frees its cache and retries, as for cudaMalloc */
    }
    if (margin) tms_log_warn("expandable segments: memory margin not checked: %s", err.msg);
    tms_CUmemHandle phys = 0;
    tms_CUresult rc = create(&phys, size, prop, flags);
    if (rc) return rc;
    lock_tokens();
    struct token *t = token_new_locked();
    if (t) {
        t->handle = phys;
        t->size = size;
        t->device = prop->location.id;
        t->handle_types = prop->requestedHandleTypes;
        t->region = *r;
        tms_core_tag_ref(r->tag_id);  /* the tag stays while the token may still be adopted into it */
        *h = token_value(t);
    }
    unlock_tokens();
    if (t) return TMS_CUDA_SUCCESS;
    REAL(release)(phys);
    tms_log_warn("expandable segments: out of host memory for a token of %zu bytes", size);
    return TMS_CUDA_ERROR_OUT_OF_MEMORY;
}

static tms_CUresult wrap_map(tms_CUdeviceptr va, size_t size, size_t offset, tms_CUmemHandle h,
                             unsigned long long flags)
{
    tms_cuMemMap_fn map = REAL(map);
    if (!is_token(h)) return map(va, size, offset, h, flags);
    uint64_t phys = 0;
    tms_CUresult rc = TMS_CUDA_SUCCESS;
    lock_tokens();
    struct token *t = token_find_locked(h);
    if (!t) rc = TMS_CUDA_ERROR_INVALID_VALUE;
    else if (t->adopted || t->mapped || !t->handle || offset || size != t->size) rc = TMS_CUDA_ERROR_NOT_SUPPORTED;
    else phys = t->handle;  /* one whole mapping per token: what the core can pause */
    unlock_tokens();
    if (rc) return rc;
    if ((rc = map(va, size, 0, phys, flags))) return rc;
    lock_tokens();
    if ((t = token_find_locked(h)) && t->handle == phys && !t->mapped) {
        t->mapped = 1;
        t->va = va;
        mapped_tokens++;
    }
    unlock_tokens();
    return TMS_CUDA_SUCCESS;
}

static int grants_device(const tms_CUmemAccessDesc *desc, size_t count, int device)
{
    for (size_t i = 0; i < count; i++)
        if (desc[i].location.type == TMS_CU_MEM_LOCATION_TYPE_DEVICE && desc[i].location.id == device &&
            desc[i].flags == TMS_CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
            return 1;
    return 0;
}

/* Access is what makes mapped memory usable (and copyable by a backup):
 * the tokens mapped inside the range are adopted now. */
static tms_CUresult wrap_set_access(tms_CUdeviceptr va, size_t size, const tms_CUmemAccessDesc *desc, size_t count)
{
    tms_CUresult rc = REAL(set_access)(va, size, desc, count);
    if (rc || !desc || !__atomic_load_n(&live_tokens, __ATOMIC_RELAXED)) return rc;
    lock_tokens();
    for (uint32_t i = 0; i < token_cap && mapped_tokens; i++) {
        struct token *t = &tokens[i];
        if (!t->live || !t->mapped || t->va < va || t->va - va > size || t->size > size - (t->va - va)) continue;
        if (!grants_device(desc, count, t->device)) continue;
        struct tms_err err = {0};
        if (tms_core_adopt(t->va, t->size, t->device, t->handle, token_value(t), t->handle_types, &t->region, &err)) {
            tms_log_warn("expandable segments: 0x%llx (%zu bytes, tag '%s') cannot be paused: %s",
                         (unsigned long long)t->va, t->size, tms_core_tag_name(t->region.tag_id), err.msg);
            continue;
        }
        t->adopted = 1;
        t->mapped = 0;
        t->handle = 0;  /* the core's now: pause and resume replace it */
        mapped_tokens--;
    }
    unlock_tokens();
    return TMS_CUDA_SUCCESS;
}

/* The core let go of t's page: its handle and address are the owner's again. */
static void token_back_to_owner_locked(struct token *t, uint64_t handle, uint64_t va)
{
    t->adopted = 0;
    t->handle = handle;
    t->va = va;
}

/* The owner unmapped the memory of token `value` (handle: still mapped
 * if nonzero, unmapped by the caller next). */
static void after_disown(uint64_t value, uint64_t va, uint64_t handle)
{
    uint64_t orphan = 0;
    lock_tokens();
    struct token *t = token_find_locked(value);
    if (t) {
        token_back_to_owner_locked(t, handle, va);
        if (!t->refs) {
            orphan = handle;  /* released already: the unmap was all that kept it */
            token_free_locked(t);
        }
    }
    unlock_tokens();
    if (orphan) REAL(release)(orphan);
}

static tms_CUresult unmap_pending(tms_cuMemUnmap_fn unmap, tms_CUdeviceptr va, size_t size, int *found)
{
    lock_tokens();
    struct token *t = mapped_tokens ? mapped_at_locked(va) : NULL;
    uint64_t value = t ? token_value(t) : 0;
    int whole = t && t->size == size;
    if (whole) {
        t->mapped = 0;
        mapped_tokens--;
    }
    unlock_tokens();
    *found = value != 0;
    if (!value) return TMS_CUDA_SUCCESS;
    if (!whole) return TMS_CUDA_ERROR_NOT_SUPPORTED;
    tms_CUresult rc = unmap(va, size);
    uint64_t orphan = 0;
    lock_tokens();
    if ((t = token_find_locked(value))) {
        if (rc) {
            t->mapped = 1;
            mapped_tokens++;
        } else if (!t->refs) {
            orphan = t->handle;
            token_free_locked(t);
        }
    }
    unlock_tokens();
    if (orphan) REAL(release)(orphan);
    return rc;
}

static tms_CUresult wrap_unmap(tms_CUdeviceptr va, size_t size)
{
    tms_cuMemUnmap_fn unmap = REAL(unmap);
    if (!__atomic_load_n(&live_tokens, __ATOMIC_RELAXED)) return unmap(va, size);
    int pending;
    tms_CUresult rc = unmap_pending(unmap, va, size, &pending);
    if (pending) return rc;
    /* Adopted memory, one allocation after the other over the range
     * (PyTorch unmaps one handle per call). */
    for (uint64_t at = va; at < va + size;) {
        uint64_t handle = 0;
        uint64_t value = 0;
        size_t adopted_size = 0;
        struct tms_err err = {0};
        int found = tms_core_disown(at, va + size - at, &handle, &value, &adopted_size, &err);
        if (found == TMS_E_NOT_FOUND) return at == va ? unmap(va, size) : unmap(at, va + size - at);
        if (found) {
            tms_log_warn("expandable segments: unmap of 0x%llx + %zu: %s", (unsigned long long)va, size, err.msg);
            return TMS_CUDA_ERROR_INVALID_VALUE;
        }
        if (handle && (rc = unmap(at, adopted_size))) {
            /* Still mapped: the owner's again, unmapped by its next try. */
            lock_tokens();
            struct token *t = token_find_locked(value);
            if (t) {
                token_back_to_owner_locked(t, handle, at);
                t->mapped = 1;
                mapped_tokens++;
            }
            unlock_tokens();
            return rc;
        }
        after_disown(value, at, handle);
        at += adopted_size;
    }
    return TMS_CUDA_SUCCESS;
}

static tms_CUresult wrap_release(tms_CUmemHandle h)
{
    if (!is_token(h)) return REAL(release)(h);
    uint64_t handle = 0;
    lock_tokens();
    struct token *t = token_find_locked(h);
    if (!t) {
        unlock_tokens();
        return TMS_CUDA_ERROR_INVALID_VALUE;  /* released twice: the driver's answer to a stale handle */
    }
    if (--t->refs == 0 && !t->adopted && !t->mapped) {  /* else the memory goes when its owner unmaps it */
        handle = t->handle;
        token_free_locked(t);
    }
    unlock_tokens();
    return handle ? REAL(release)(handle) : TMS_CUDA_SUCCESS;
}

/* The physical handle a token stands for now; 0 while its memory is paused. */
static uint64_t current_handle(tms_CUmemHandle h, int *known)
{
    uint64_t handle = 0;
    lock_tokens();
    struct token *t = token_find_locked(h);
    *known = t != NULL;
    if (t && t->adopted) {
        uint64_t owner;
        if (tms_core_adopted_at(t->va, &owner, &handle) || owner != h) handle = 0;
    } else if (t) {
        handle = t->handle;
    }
    unlock_tokens();
    return handle;
}

/* The address of the allocation the core adopted for token h; 0 if none. */
static uint64_t adopted_va(tms_CUmemHandle h)
{
    lock_tokens();
    struct token *t = token_find_locked(h);
    uint64_t va = t && t->adopted ? t->va : 0;
    unlock_tokens();
    return va;
}

/* An exported handle of the core's memory keeps that memory alive in the
 * importer: marked held first, so a pause cannot pretend to free it. */
static tms_CUresult wrap_export(void *out, tms_CUmemHandle h, int type, unsigned long long flags)
{
    if (!is_token(h)) return REAL(export_handle)(out, h, type, flags);
    uint64_t va = adopted_va(h);
    struct tms_err err = {0};
    uint64_t handle = 0;
    int rc = va ? tms_core_mark_exported(va, h, 1, &handle, &err) : TMS_E_NOT_FOUND;
    if (rc == TMS_OK) {
        tms_CUresult crc = REAL(export_handle)(out, handle, type, flags);
        if (crc != TMS_CUDA_SUCCESS) (void)tms_core_mark_exported(va, h, -1, &handle, &err);
        return crc;
    }
    if (rc != TMS_E_NOT_FOUND) {
        tms_core_keep_error(&err);
        return TMS_CUDA_ERROR_ILLEGAL_STATE;
    }
    /* Not (or no longer) the core's: the owner's own handle, as before adoption. */
    int known;
    handle = current_handle(h, &known);
    return handle ? REAL(export_handle)(out, handle, type, flags)
                  : known ? TMS_CUDA_ERROR_ILLEGAL_STATE : TMS_CUDA_ERROR_INVALID_VALUE;
}

static tms_CUresult wrap_props(tms_CUmemAllocationProp *prop, tms_CUmemHandle h)
{
    if (!is_token(h)) return REAL(props)(prop, h);
    int known;
    uint64_t handle = current_handle(h, &known);
    if (!handle) return known ? TMS_CUDA_ERROR_ILLEGAL_STATE : TMS_CUDA_ERROR_INVALID_VALUE;
    return REAL(props)(prop, handle);
}

/* A handle retained from an address in adopted memory is its token (one
 * more reference), so the owner never holds a physical handle a pause
 * would have to leave alive. */
static tms_CUresult wrap_retain(tms_CUmemHandle *h, void *addr)
{
    if (h && __atomic_load_n(&live_tokens, __ATOMIC_RELAXED)) {
        uint64_t value = 0;
        uint64_t handle;
        lock_tokens();
        struct token *t = NULL;
        if (tms_core_adopted_at((uint64_t)(uintptr_t)addr, &value, &handle) == TMS_OK) t = token_find_locked(value);
        if (t) {
            t->refs++;
            *h = token_value(t);
        }
        unlock_tokens();
        if (t) return TMS_CUDA_SUCCESS;
    }
    return REAL(retain)(h, addr);
}

void tms_cumem_wrap(const char *symbol, void **fn)
{
    static const struct {
        const char *name;
        void **real;
        void *wrapper;
    } wrapped[] = {
        {"cuMemCreate", (void **)&real.create, (void *)wrap_create},
        {"cuMemMap", (void **)&real.map, (void *)wrap_map},
        {"cuMemSetAccess", (void **)&real.set_access, (void *)wrap_set_access},
        {"cuMemUnmap", (void **)&real.unmap, (void *)wrap_unmap},
        {"cuMemRelease", (void **)&real.release, (void *)wrap_release},
        {"cuMemExportToShareableHandle", (void **)&real.export_handle, (void *)wrap_export},
        {"cuMemGetAllocationPropertiesFromHandle", (void **)&real.props, (void *)wrap_props},
        {"cuMemRetainAllocationHandle", (void **)&real.retain, (void *)wrap_retain},
    };
    if (!symbol || !fn || !*fn) return;
    for (size_t i = 0; i < sizeof wrapped / sizeof *wrapped; i++) {
        if (strcmp(symbol, wrapped[i].name) != 0) continue;
        if (*fn == wrapped[i].wrapper) return;
        void *unset = NULL;
        /* The first definition stays: every lookup of one name finds the same function. */
        __atomic_compare_exchange_n(wrapped[i].real, &unset, *fn, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
        *fn = wrapped[i].wrapper;
        return;
    }
}
