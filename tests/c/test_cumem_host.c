/* The expandable-segments translation layer (src/hooks/cumem.c) on the host backend: PyTorch's call shapes, then a random walk checked against a model.
 *
 * The "real" cuMem* functions here stand in for the driver's over the host
 * backend (a handle is a memfd), and check that every handle they are given
 * is a live one: a token, or a handle the layer already released, reaching
 * them is a failure. Last, a thread pausing and resuming a tag races the
 * owner growing and shrinking it. Usage: test_cumem_host [--steps N]
 * [--walks W] [--seed S] [--race-rounds N] [--shapes 0|1]: W walks of N/W
 * steps each, seeds S to S+W-1. */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "platform/config.h"
#include "backup/backup.h"
#include "core/core.h"
#include "core/core_internal.h"
#include "platform/cuda_abi.h"
#include "hooks/cumem.h"
#include "platform/driver.h"
#include "seeded_bytes.h"
#include "check.h"

#define MiB ((size_t)1 << 20)
#define PAGE (2 * MiB)
#define TOKEN_TAG_MASK 0xffff000000000000ull
#define TOKEN_TAG 0x7e5a000000000000ull

static const struct tms_driver *drv;
static int stale_handles;  /* atomic: a handle that is not a live memfd reached a "driver" call */

static int live_handle(tms_CUmemHandle h)
{
    if ((h & TOKEN_TAG_MASK) == TOKEN_TAG) return 0;
    char path[64], target[128];
    snprintf(path, sizeof path, "/proc/self/fd/%d", (int)(h & 0xffffffffu));
    ssize_t n = readlink(path, target, sizeof target - 1);
    if (n < 0) return 0;
    target[n] = '\0';
    return strstr(target, "memfd:tms-host-device") != NULL;
}

/* ---- the driver's functions, as PyTorch would find them ---------------------- */

static tms_CUresult real_create(tms_CUmemHandle *h, size_t size, const tms_CUmemAllocationProp *prop,
                                unsigned long long flags)
{
    (void)flags;
    tms_phys p;
    if (drv->create(prop->location.id, size, &p)) return TMS_CUDA_ERROR_OUT_OF_MEMORY;
    *h = p;
    return TMS_CUDA_SUCCESS;
}

static tms_CUresult real_map(tms_CUdeviceptr va, size_t size, size_t offset, tms_CUmemHandle h,
                             unsigned long long flags)
{
    (void)flags;
    if (!live_handle(h) || offset) return __atomic_add_fetch(&stale_handles, 1, __ATOMIC_RELAXED), TMS_CUDA_ERROR_INVALID_VALUE;
    return drv->map(0, va, size, h) ? TMS_CUDA_ERROR_INVALID_VALUE : TMS_CUDA_SUCCESS;
}

static tms_CUresult real_set_access(tms_CUdeviceptr va, size_t size, const tms_CUmemAccessDesc *desc, size_t n)
{
    (void)va, (void)size, (void)desc, (void)n;
    return TMS_CUDA_SUCCESS;  /* the host backend maps read-write */
}

static tms_CUresult real_unmap(tms_CUdeviceptr va, size_t size)
{
    return drv->unmap(va, size) ? TMS_CUDA_ERROR_INVALID_VALUE : TMS_CUDA_SUCCESS;
}

static tms_CUresult real_release(tms_CUmemHandle h)
{
    if (!live_handle(h)) return __atomic_add_fetch(&stale_handles, 1, __ATOMIC_RELAXED), TMS_CUDA_ERROR_INVALID_VALUE;
    return drv->release(h) ? TMS_CUDA_ERROR_INVALID_VALUE : TMS_CUDA_SUCCESS;
}

static tms_CUresult real_props(tms_CUmemAllocationProp *prop, tms_CUmemHandle h)
{
    if (!live_handle(h)) return __atomic_add_fetch(&stale_handles, 1, __ATOMIC_RELAXED), TMS_CUDA_ERROR_INVALID_VALUE;
    memset(prop, 0, sizeof *prop);
    prop->location.type = TMS_CU_MEM_LOCATION_TYPE_DEVICE;
    return TMS_CUDA_SUCCESS;
}

static tms_CUresult real_retain(tms_CUmemHandle *h, void *addr)
{
    (void)h, (void)addr;
    return TMS_CUDA_ERROR_NOT_SUPPORTED;  /* the walk retains region memory only */
}

static tms_CUresult real_export(void *out, tms_CUmemHandle h, int type, unsigned long long flags)
{
    (void)flags;
    if (!live_handle(h)) return __atomic_add_fetch(&stale_handles, 1, __ATOMIC_RELAXED), TMS_CUDA_ERROR_INVALID_VALUE;
    if (type != 1) return TMS_CUDA_ERROR_INVALID_VALUE;  /* POSIX file descriptors only */
    return drv->export_fd(h, (int *)out) ? TMS_CUDA_ERROR_INVALID_VALUE : TMS_CUDA_SUCCESS;
}

static struct tms_cumem_entry_points cu;  /* the wrappers, as PyTorch would hold them */

static void *wrapped(const char *name, void *real)
{
    void *fn = real;
    tms_cumem_wrap(name, &fn);
    CHECK(fn != real);
    return fn;
}

static void look_up_entry_points(void)
{
    cu.create = (tms_cuMemCreate_fn)wrapped("cuMemCreate", (void *)real_create);
    cu.map = (tms_cuMemMap_fn)wrapped("cuMemMap", (void *)real_map);
    cu.set_access = (tms_cuMemSetAccess_fn)wrapped("cuMemSetAccess", (void *)real_set_access);
    cu.unmap = (tms_cuMemUnmap_fn)wrapped("cuMemUnmap", (void *)real_unmap);
    cu.release = (tms_cuMemRelease_fn)wrapped("cuMemRelease", (void *)real_release);
    cu.props = (tms_cuMemGetAllocationPropertiesFromHandle_fn)wrapped("cuMemGetAllocationPropertiesFromHandle", (void *)real_props);
    cu.retain = (tms_cuMemRetainAllocationHandle_fn)wrapped("cuMemRetainAllocationHandle", (void *)real_retain);
    cu.export_handle = (tms_cuMemExportToShareableHandle_fn)wrapped("cuMemExportToShareableHandle", (void *)real_export);
    void *other = (void *)real_create;
    tms_cumem_wrap("cuMemAddressReserve", &other);  /* not wrapped: left as it is */
    CHECK(other == (void *)real_create);
}

/* ---- helpers ------------------------------------------------------------------ */

static void *at(uint64_t va) { return (void *)(uintptr_t)va; }

static int is_token(tms_CUmemHandle h) { return (h & TOKEN_TAG_MASK) == TOKEN_TAG; }

static void enter_region(int tag_id, int backup)
{
    struct tms_region *r = tms_region_current();
    r->active = 1;
    r->tag_id = tag_id;
    r->backup = backup;
    r->backup_kind = TMS_BACKUP_MMAP;
}

static void leave_region(void) { tms_region_current()->active = 0; }

static tms_CUmemAllocationProp device_prop(void)
{
    tms_CUmemAllocationProp prop = {.type = TMS_CU_MEM_ALLOCATION_TYPE_PINNED};
    prop.location.type = TMS_CU_MEM_LOCATION_TYPE_DEVICE;
    prop.requestedHandleTypes = 1;  /* PyTorch asks for POSIX file descriptors */
    return prop;
}

static const tms_CUmemAccessDesc access_rw = {.location = {TMS_CU_MEM_LOCATION_TYPE_DEVICE, 0},
                                              .flags = TMS_CU_MEM_ACCESS_FLAGS_PROT_READWRITE};

/* PyTorch's ExpandableSegment::map: create every handle, map each, then one access call. */
static void grow(uint64_t va, int n, size_t page, tms_CUmemHandle *handles)
{
    tms_CUmemAllocationProp prop = device_prop();
    for (int i = 0; i < n; i++) CHECK(cu.create(&handles[i], page, &prop, 0) == TMS_CUDA_SUCCESS);
    for (int i = 0; i < n; i++) CHECK(cu.map(va + (uint64_t)i * page, page, 0, handles[i], 0) == TMS_CUDA_SUCCESS);
    CHECK(cu.set_access(va, (size_t)n * page, &access_rw, 1) == TMS_CUDA_SUCCESS);
}

/* PyTorch's ExpandableSegment::unmapHandles: unmap, then release. */
static void shrink(uint64_t va, size_t page, tms_CUmemHandle h)
{
    CHECK(cu.unmap(va, page) == TMS_CUDA_SUCCESS);
    CHECK(cu.release(h) == TMS_CUDA_SUCCESS);
}

static size_t adopted_rows(int tag_id, int state)
{
    struct tms_alloc_info *rows;
    size_t n, count = 0;
    struct tms_err err = {0};
    if (tms_core_list(&rows, &n, &err)) return (size_t)-1;
    for (size_t i = 0; i < n; i++)
        if (rows[i].adopted && (tag_id < 0 || rows[i].tag_id == tag_id) && (state < 0 || rows[i].state == state))
            count++;
    free(rows);
    return count;
}

static size_t device_used(void)
{
    size_t free_bytes, total;
    drv->mem_get_info(0, &free_bytes, &total);
    return total - free_bytes;
}

static int tag(const char *name)
{
    int id;
    struct tms_err err = {0};
    if (tms_core_tag_id(name, &id, &err)) abort();
    return id;
}

/* ---- PyTorch's call shapes -------------------------------------------------------- */

static void test_segment_lifecycle(void)
{
    struct tms_err err = {0};
    tms_va base;
    CHECK(drv->reserve(16 * PAGE, PAGE, &base) == 0);
    int weights = tag("cm_weights");
    size_t used_before = device_used();

    /* Outside a region: the driver's handles, untouched, not adopted. */
    tms_CUmemHandle outside[2];
    grow(base, 2, PAGE, outside);
    CHECK(!is_token(outside[0]) && !is_token(outside[1]) && live_handle(outside[0]));
    CHECK(adopted_rows(-1, -1) == 0);

    /* In a region: tokens, adopted once accessible. */
    enter_region(weights, 1);
    tms_CUmemHandle in[3];
    grow(base + 2 * PAGE, 3, PAGE, in);
    leave_region();
    CHECK(is_token(in[0]) && is_token(in[1]) && is_token(in[2]) && in[0] != in[1]);
    CHECK(adopted_rows(weights, TMS_ACTIVE) == 3);
    CHECK(tms_cumem_tokens() == 3);
    for (int i = 0; i < 5; i++) fill(at(base + (uint64_t)i * PAGE), PAGE, 100 + (uint64_t)i);

    tms_CUmemAllocationProp prop;
    CHECK(cu.props(&prop, in[1]) == TMS_CUDA_SUCCESS);
    CHECK(cu.map(base + 8 * PAGE, PAGE, 0, in[0], 0) == TMS_CUDA_ERROR_NOT_SUPPORTED);  /* one mapping per token */

    /* Pause gives the memory back; the owner's tokens stay valid. */
    CHECK(tms_core_pause("cm_weights", &err) == TMS_OK);
    CHECK(adopted_rows(weights, TMS_PAUSED) == 3);
    CHECK(device_used() == used_before + 2 * PAGE);
    CHECK(cu.props(&prop, in[1]) == TMS_CUDA_ERROR_ILLEGAL_STATE);  /* no memory behind it while paused */

    /* Resume maps new memory at the same addresses, contents restored. */
    CHECK(tms_core_resume("cm_weights", &err) == TMS_OK);
    CHECK(device_used() == used_before + 5 * PAGE);
    for (int i = 0; i < 5; i++) CHECK(matches(at(base + (uint64_t)i * PAGE), PAGE, 100 + (uint64_t)i));

    /* PyTorch shrinks with the tokens it was given: translated to the new handles. */
    shrink(base + 4 * PAGE, PAGE, in[2]);
    CHECK(adopted_rows(weights, -1) == 2);
    CHECK(device_used() == used_before + 4 * PAGE);

    /* A release while paused, then the unmap: both succeed without touching the driver. */
    CHECK(tms_core_pause("cm_weights", &err) == TMS_OK);
    CHECK(cu.release(in[1]) == TMS_CUDA_SUCCESS);
    CHECK(adopted_rows(weights, TMS_PAUSED) == 2);  /* mapped still, as far as its owner knows */
    CHECK(cu.unmap(base + 3 * PAGE, PAGE) == TMS_CUDA_SUCCESS);
    CHECK(adopted_rows(weights, TMS_PAUSED) == 1);
    CHECK(cu.release(in[1]) == TMS_CUDA_ERROR_INVALID_VALUE);  /* twice: the driver's answer to a stale handle */
    shrink(base + 2 * PAGE, PAGE, in[0]);                      /* unmap + release while paused */
    CHECK(adopted_rows(-1, -1) == 0);
    CHECK(tms_cumem_tokens() == 0);
    CHECK(tms_core_resume("cm_weights", &err) == TMS_OK);      /* nothing left: a no-op */

    /* Memory grown after a resume joins the same tag and pauses with it. */
    enter_region(weights, 1);
    grow(base + 2 * PAGE, 2, PAGE, in);
    leave_region();
    fill(at(base + 2 * PAGE), 2 * PAGE, 7);
    CHECK(tms_core_pause("cm_weights", &err) == TMS_OK);
    CHECK(adopted_rows(weights, TMS_PAUSED) == 2);
    CHECK(tms_core_resume("cm_weights", &err) == TMS_OK);
    CHECK(matches(at(base + 2 * PAGE), 2 * PAGE, 7));

    /* The outside pages never moved. */
    CHECK(matches(at(base), PAGE, 100) && matches(at(base + PAGE), PAGE, 101));

    /* An unmap covering part of an adopted allocation changes nothing. */
    enter_region(weights, 0);
    tms_CUmemHandle big;
    tms_CUmemAllocationProp p = device_prop();
    CHECK(cu.create(&big, 2 * PAGE, &p, 0) == TMS_CUDA_SUCCESS);
    leave_region();
    CHECK(cu.map(base + 6 * PAGE, 2 * PAGE, 0, big, 0) == TMS_CUDA_SUCCESS);
    CHECK(cu.set_access(base + 6 * PAGE, 2 * PAGE, &access_rw, 1) == TMS_CUDA_SUCCESS);
    CHECK(cu.unmap(base + 6 * PAGE, PAGE) == TMS_CUDA_ERROR_INVALID_VALUE);
    CHECK(adopted_rows(weights, TMS_ACTIVE) == 3);
    /* One unmap over several adopted allocations (legal for the driver). */
    CHECK(cu.unmap(base + 2 * PAGE, 2 * PAGE) == TMS_CUDA_SUCCESS);
    CHECK(cu.release(in[0]) == TMS_CUDA_SUCCESS && cu.release(in[1]) == TMS_CUDA_SUCCESS);
    /* Retained from an address: the token again, one more reference. */
    tms_CUmemHandle again = 0;
    CHECK(cu.retain(&again, (void *)(uintptr_t)(base + 7 * PAGE)) == TMS_CUDA_SUCCESS && again == big);
    CHECK(cu.release(again) == TMS_CUDA_SUCCESS);
    shrink(base + 6 * PAGE, 2 * PAGE, big);

    /* Mapped but never made accessible (not adopted), released, then
     * unmapped: the unmap is what gives its memory back. */
    enter_region(weights, 0);
    tms_CUmemHandle pending;
    CHECK(cu.create(&pending, PAGE, &p, 0) == TMS_CUDA_SUCCESS);
    leave_region();
    CHECK(cu.map(base + 9 * PAGE, PAGE, 0, pending, 0) == TMS_CUDA_SUCCESS);
    CHECK(cu.release(pending) == TMS_CUDA_SUCCESS);
    CHECK(tms_cumem_tokens() == 1 && device_used() == used_before + 3 * PAGE);
    CHECK(cu.unmap(base + 9 * PAGE, PAGE) == TMS_CUDA_SUCCESS);
    CHECK(tms_cumem_tokens() == 0 && device_used() == used_before + 2 * PAGE);

    shrink(base, PAGE, outside[0]);
    shrink(base + PAGE, PAGE, outside[1]);
    CHECK(adopted_rows(-1, -1) == 0 && tms_cumem_tokens() == 0);
    CHECK(device_used() == used_before);
    CHECK(drv->unreserve(base, 16 * PAGE) == 0);
}

/* PyTorch shares an expandable segment by exporting its handles itself: the
 * importer then keeps that memory alive whatever this process does, so a
 * pause of it is refused (naming it) until it is freed; a failed export, or
 * one of paused memory, leaves nothing held. */
static void test_exported_segment_is_held_until_freed(void)
{
    struct tms_err err = {0};
    tms_va base;
    CHECK(drv->reserve(4 * PAGE, PAGE, &base) == 0);
    int t = tag("cm_exported");
    size_t used_before = device_used();
    enter_region(t, 1);
    tms_CUmemHandle h[2];
    grow(base, 2, PAGE, h);
    leave_region();
    fill(at(base), PAGE, 31);
    fill(at(base + PAGE), PAGE, 32);

    int fd = -1;
    CHECK(cu.export_handle(&fd, h[0], 2, 0) == TMS_CUDA_ERROR_INVALID_VALUE);  /* refused by the driver */
    CHECK(tms_core_pause("cm_exported", &err) == TMS_OK);                      /* so nothing was held */
    CHECK(cu.export_handle(&fd, h[0], 1, 0) == TMS_CUDA_ERROR_ILLEGAL_STATE);  /* paused: no memory to export */
    CHECK(tms_core_resume("cm_exported", &err) == TMS_OK);
    CHECK(matches(at(base), PAGE, 31) && matches(at(base + PAGE), PAGE, 32));

    CHECK(cu.export_handle(&fd, h[0], 1, 0) == TMS_CUDA_SUCCESS && fd >= 0);
    CHECK(close(fd) == 0);
    CHECK(tms_core_pause("cm_exported", &err) == TMS_E_STATE);
    CHECK(strstr(err.msg, "pause of tag 'cm_exported'") && strstr(err.msg, "cuMemExportToShareableHandle") &&
          strstr(err.msg, "nothing was paused"));
    CHECK(adopted_rows(t, TMS_ACTIVE) == 2 && device_used() == used_before + 2 * PAGE);

    shrink(base, PAGE, h[0]);  /* freed: the other allocation pauses again */
    CHECK(tms_core_pause("cm_exported", &err) == TMS_OK);
    CHECK(adopted_rows(t, TMS_PAUSED) == 1 && device_used() == used_before);
    CHECK(tms_core_resume("cm_exported", &err) == TMS_OK);
    CHECK(matches(at(base + PAGE), PAGE, 32));
    shrink(base + PAGE, PAGE, h[1]);
    CHECK(adopted_rows(-1, -1) == 0 && tms_cumem_tokens() == 0 && device_used() == used_before);
    CHECK(drv->unreserve(base, 4 * PAGE) == 0);
}

static void test_margin(void)
{
    int t = tag("cm_margin");
    size_t free_bytes, total;
    drv->mem_get_info(0, &free_bytes, &total);
    tms_core_set_margin(free_bytes);  /* any region allocation would cross it */
    tms_CUmemAllocationProp prop = device_prop();
    tms_CUmemHandle h = 0;
    enter_region(t, 0);
    CHECK(cu.create(&h, PAGE, &prop, 0) == TMS_CUDA_ERROR_OUT_OF_MEMORY);
    leave_region();
    CHECK(cu.create(&h, PAGE, &prop, 0) == TMS_CUDA_SUCCESS && !is_token(h));  /* outside: not ours to refuse */
    CHECK(cu.release(h) == TMS_CUDA_SUCCESS);
    tms_core_set_margin(0);
    CHECK(tms_cumem_tokens() == 0);
}

/* ---- random walk against a model ---------------------------------------------------- */

#define PAGES 24
#define TAGS 2  /* tag 0 backed up, tag 1 not */

struct page {
    int mapped;
    int tag;        /* -1: outside any region */
    int paused;
    int valid;      /* contents known (seed) */
    uint64_t seed;
    tms_CUmemHandle handle;
    int released;   /* the owner released it before unmapping */
};

/* Rows against the model after every step. Contents: in full for the pages
 * the step wrote or restored (changed[i]), sampled every 4 KiB for the rest,
 * which catches a page lost, zeroed or mapped elsewhere by the step. */
static void check_model(const struct page *pages, uint64_t base, const int *tag_ids, const int *changed)
{
    for (int t = 0; t < TAGS; t++) {
        size_t active = 0, paused = 0;
        for (int i = 0; i < PAGES; i++) {
            if (!pages[i].mapped || pages[i].tag != t) continue;
            if (pages[i].paused) paused++;
            else active++;
        }
        CHECK(adopted_rows(tag_ids[t], TMS_ACTIVE) == active);
        CHECK(adopted_rows(tag_ids[t], TMS_PAUSED) == paused);
    }
    for (int i = 0; i < PAGES; i++) {
        if (!pages[i].mapped || pages[i].paused || !pages[i].valid) continue;
        const void *p = at(base + (uint64_t)i * PAGE);
        CHECK(changed[i] ? matches(p, PAGE, pages[i].seed) : matches_sampled(p, PAGE, pages[i].seed, 4096));
    }
}

static void walk(uint64_t seed, int steps)
{
    struct tms_err err = {0};
    const char *names[TAGS] = {"cm_walk_backup", "cm_walk_discard"};
    int tag_ids[TAGS] = {tag(names[0]), tag(names[1])};
    struct page pages[PAGES] = {{0}};
    tms_va base;
    CHECK(drv->reserve(PAGES * PAGE, PAGE, &base) == 0);
    size_t used_before = device_used();
    uint64_t rng = seed | 1;
    for (int step = 0; step < steps; step++) {
        int changed[PAGES] = {0};
        int op = (int)(next_rand(&rng) % 6);
        int t = (int)(next_rand(&rng) % TAGS);
        if (op <= 1) {  /* grow: a run of unmapped pages, inside a region or not */
            int start = (int)(next_rand(&rng) % PAGES), n = 0;
            while (start + n < PAGES && n < 4 && !pages[start + n].mapped) n++;
            if (!n) continue;
            int where = (int)(next_rand(&rng) % 3) - 1;  /* -1 outside, else a tag */
            tms_CUmemHandle h[4];
            if (where >= 0) enter_region(tag_ids[where], where == 0);
            grow(base + (uint64_t)start * PAGE, n, PAGE, h);
            leave_region();
            for (int i = 0; i < n; i++) {
                struct page *p = &pages[start + i];
                *p = (struct page){.mapped = 1, .tag = where, .valid = 1, .seed = next_rand(&rng), .handle = h[i]};
                CHECK(is_token(h[i]) == (where >= 0));
                fill(at(base + (uint64_t)(start + i) * PAGE), PAGE, p->seed);
                changed[start + i] = 1;
            }
        } else if (op == 2) {  /* shrink one page, in either order, active or paused */
            int i = (int)(next_rand(&rng) % PAGES);
            struct page *p = &pages[i];
            if (!p->mapped) continue;
            if (!p->released && next_rand(&rng) % 3 == 0) {
                CHECK(cu.release(p->handle) == TMS_CUDA_SUCCESS);  /* before the unmap: memory stays */
                p->released = 1;
                continue;
            }
            CHECK(cu.unmap(base + (uint64_t)i * PAGE, PAGE) == TMS_CUDA_SUCCESS);
            if (!p->released) CHECK(cu.release(p->handle) == TMS_CUDA_SUCCESS);
            *p = (struct page){0};
        } else if (op == 3 || op == 4) {  /* pause or resume a tag */
            int pause = op == 3;
            size_t from = 0, other = 0;
            for (int i = 0; i < PAGES; i++) {
                if (!pages[i].mapped || pages[i].tag != t) continue;
                if (pages[i].paused == !pause) from++;
                else other++;
            }
            int want = !from && other ? TMS_E_STATE : TMS_OK;
            int rc = pause ? tms_core_pause(names[t], &err) : tms_core_resume(names[t], &err);
            CHECK(rc == want);
            for (int i = 0; i < PAGES; i++) {
                struct page *p = &pages[i];
                if (!p->mapped || p->tag != t || p->paused != !pause) continue;
                p->paused = pause;
                changed[i] = 1;
                if (!pause && t != 0) p->valid = 0;  /* no backup: contents undefined */
            }
        } else {  /* retain from an address inside a region page, and give it back */
            int i = (int)(next_rand(&rng) % PAGES);
            if (!pages[i].mapped || pages[i].tag < 0) continue;
            tms_CUmemHandle h = 0;
            CHECK(cu.retain(&h, (void *)(uintptr_t)(base + (uint64_t)i * PAGE + 4096)) == TMS_CUDA_SUCCESS);
            CHECK(h == pages[i].handle);
            CHECK(cu.release(h) == TMS_CUDA_SUCCESS);
        }
        check_model(pages, base, tag_ids, changed);
        if (failed) {
            fprintf(stderr, "walk seed %llu: first failure at step %d (op %d)\n", (unsigned long long)seed, step, op);
            break;
        }
    }
    int all[PAGES];
    for (int i = 0; i < PAGES; i++) all[i] = 1;
    check_model(pages, base, tag_ids, all);
    for (int i = 0; i < PAGES; i++) {
        if (!pages[i].mapped) continue;
        CHECK(cu.unmap(base + (uint64_t)i * PAGE, PAGE) == TMS_CUDA_SUCCESS);
        if (!pages[i].released) CHECK(cu.release(pages[i].handle) == TMS_CUDA_SUCCESS);
    }
    CHECK(adopted_rows(-1, -1) == 0 && tms_cumem_tokens() == 0);
    CHECK(device_used() == used_before);
    CHECK(drv->unreserve(base, PAGES * PAGE) == 0);
}

/* ---- a pause racing PyTorch growing and shrinking the same tag ----------------------- */

#define RACE_PAGES 8
/* The pauser's cycles per round of the owner: left to spin, it can take the locks
 * back as soon as it lets them go and hold the owner off for seconds, its cycles
 * meanwhile racing nothing new. */
#define RACE_CYCLES_PER_ROUND 4
static int race_rounds;
static int race_round;  /* atomic: the owner's round under way */
static int race_done;   /* atomic */

static void *race_pauser(void *arg)
{
    (void)arg;
    int round = -1, cycles = 0;
    while (!__atomic_load_n(&race_done, __ATOMIC_ACQUIRE)) {
        int now = __atomic_load_n(&race_round, __ATOMIC_ACQUIRE);
        if (now != round) {
            round = now;
            cycles = 0;
        }
        if (cycles == RACE_CYCLES_PER_ROUND) {  /* until the owner's next round */
            sched_yield();
            continue;
        }
        cycles++;
        struct tms_err err = {0};
        int rc = tms_core_pause("cm_race", &err);
        CHECK(rc == TMS_OK || rc == TMS_E_STATE);
        rc = tms_core_resume("cm_race", &err);
        CHECK(rc == TMS_OK || rc == TMS_E_STATE);
    }
    return NULL;
}

/* The owner never touches the memory: the other thread may have paused it. */
static void race(void)
{
    int t = tag("cm_race");
    tms_va base;
    CHECK(drv->reserve(RACE_PAGES * PAGE, PAGE, &base) == 0);
    size_t used_before = device_used();
    pthread_t pauser;
    CHECK(pthread_create(&pauser, NULL, race_pauser, NULL) == 0);
    tms_CUmemHandle h[RACE_PAGES];
    for (int round = 0; round < race_rounds; round++) {
        __atomic_store_n(&race_round, round, __ATOMIC_RELEASE);
        enter_region(t, round % 2);
        grow(base, RACE_PAGES, PAGE, h);
        leave_region();
        for (int i = RACE_PAGES - 1; i >= 0; i--) {
            if (i % 3 == 0) {  /* release first, then unmap: the memory goes with the unmap */
                CHECK(cu.release(h[i]) == TMS_CUDA_SUCCESS);
                CHECK(cu.unmap(base + (uint64_t)i * PAGE, PAGE) == TMS_CUDA_SUCCESS);
            } else {
                shrink(base + (uint64_t)i * PAGE, PAGE, h[i]);
            }
        }
    }
    __atomic_store_n(&race_done, 1, __ATOMIC_RELEASE);
    pthread_join(pauser, NULL);
    CHECK(adopted_rows(-1, -1) == 0 && tms_cumem_tokens() == 0);
    CHECK(device_used() == used_before);
    CHECK(drv->unreserve(base, RACE_PAGES * PAGE) == 0);
}

int main(int argc, char **argv)
{
    int steps = 3000, walks = 4, shapes = 1;
    uint64_t seed = 1;
    race_rounds = 60;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--steps")) steps = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--seed")) seed = strtoull(argv[i + 1], NULL, 10);
        else if (!strcmp(argv[i], "--walks")) walks = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--race-rounds")) race_rounds = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--shapes")) shapes = atoi(argv[i + 1]);
    }
    struct tms_err err = {0};
    if (tms_driver_select("host", &err) || tms_driver_get(&drv, &err)) {
        fprintf(stderr, "host backend: %s\n", err.msg);
        return 1;
    }
    look_up_entry_points();
    if (shapes) {
        test_segment_lifecycle();
        test_exported_segment_is_held_until_freed();
        test_margin();
    }
    for (uint64_t s = seed; s < seed + (uint64_t)walks && !failed; s++) walk(s, steps / walks);
    if (race_rounds > 0) race();
    CHECK(stale_handles == 0);
    return check_summary();
}
