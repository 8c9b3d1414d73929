/* C tests of the core on the host backend: state machine, backups, retain, margin, chunks, devices, threads, faults.
 * TMS_BACKEND=hip with TMS_HIP_LIBRARY naming tests/c/hip_stub.c's build runs
 * the same scenarios (all but the fault plans) on the hip backend. */
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "backup/backup.h"
#include "backup/host.h"
#include "platform/config.h"
#include "core/core.h"
#include "core/core_internal.h"
#include "platform/driver.h"
#include "platform/parse.h"
#include "seeded_bytes.h"
#include "check.h"
#include "core/span_index.h"
#include "platform/topology.h"
#include "backup/transfer.h"

/* The TMS_FAULT plans the fault scenarios are written for: driver_host.c
 * counts calls per op from process start, and each scenario's comments give
 * every call's number. CMakeLists.txt's core_host_faults* tests set them. */
#define FAULT_PLAN "map:2,host_alloc:1,create:12,unmap:8,copy_to_host:11,copy_to_device:13"
#define FAULT_PLAN_CHUNKED "create:3,map:5,unmap:3"  /* with TMS_CHUNK_BYTES=2MiB */
#define FAULT_PLAN_EARLY "copy_to_host:7,map:9,create:19" /* with TMS_BACKUP_THREADS=1 */

/* ---- helpers ------------------------------------------------------------------ */

static const struct tms_driver *drv;
static const char *backend;  /* TMS_BACKEND, else "host" */
static size_t gran;

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

static struct tms_region region(const char *tag, int backup, int kind)
{
    struct tms_err err;
    struct tms_region r = {.active = 1, .tag_id = -1, .backup = backup, .backup_kind = kind};
    CHECK_RC(tms_core_tag_id(tag, &r.tag_id, &err), TMS_OK);
    return r;
}

static void *alloc_ok(size_t size, int device, const struct tms_region *r)
{
    struct tms_err err;
    void *p = NULL;
    CHECK_RC(tms_core_alloc(size, device, r, &p, &err), TMS_OK);
    CHECK(size == 0 || p != NULL);
    return p;
}

static void free_ok(void *p)
{
    struct tms_err err;
    CHECK_RC(tms_core_free(p, &err), TMS_OK);
}

/* The table row of p; .ptr == 0 if the core does not hold p. */
static struct tms_alloc_info info_of(const void *p)
{
    struct tms_err err;
    struct tms_alloc_info *rows = NULL, found = {0};
    size_t n = 0;
    CHECK_RC(tms_core_list(&rows, &n, &err), TMS_OK);
    for (size_t i = 0; i < n; i++)
        if (rows[i].ptr == (uint64_t)(uintptr_t)p) found = rows[i];
    free(rows);
    return found;
}

static size_t count_rows(int tag_id, int state)
{
    struct tms_err err;
    struct tms_alloc_info *rows = NULL;
    size_t n = 0, hits = 0;
    CHECK_RC(tms_core_list(&rows, &n, &err), TMS_OK);
    for (size_t i = 0; i < n; i++)
        hits += (tag_id < 0 || rows[i].tag_id == tag_id) && (state < 0 || rows[i].state == state);
    free(rows);
    return hits;
}

/* The statistics row of (tag, device); all zero if the core reports none. */
static struct tms_stats stats_of(int tag_id, int device)
{
    struct tms_err err;
    struct tms_stats_row *rows = NULL;
    struct tms_stats found = {0};
    size_t n = 0;
    CHECK_RC(tms_core_stats(&rows, &n, &err), TMS_OK);
    for (size_t i = 0; i < n; i++)
        if (rows[i].tag_id == tag_id && rows[i].device == device) found = rows[i].stats;
    free(rows);
    return found;
}

static size_t free_bytes(int device)
{
    size_t free_b = 0, total = 0;
    CHECK(drv->mem_get_info(device, &free_b, &total) == 0);
    return free_b;
}

static int device_count(void)
{
    int n = 0;
    CHECK(drv->device_count(&n) == 0);
    return n;
}

/* Chunks the core should cut an allocation of size into under TMS_CHUNK_BYTES. */
static int expected_chunks(size_t size)
{
    const struct tms_defaults *d = tms_defaults();
    size_t reserved = round_up(size, gran), chunk = d->chunk_bytes_set ? d->chunk_bytes : drv->default_chunk_bytes();
    chunk = chunk ? round_up(chunk, gran) : reserved;
    if (chunk > reserved) chunk = reserved;
    return (int)((reserved + chunk - 1) / chunk);
}

/* ---- tests ---------------------------------------------------------------------- */

static void test_config(void)
{
    size_t v = 0;
    int kind = -1;
    CHECK(tms_parse_bytes("1048576", &v) == TMS_OK && v == 1048576);
    CHECK(tms_parse_bytes("4MiB", &v) == TMS_OK && v == (size_t)4 << 20);
    CHECK(tms_parse_bytes("2g", &v) == TMS_OK && v == (size_t)2 << 30);
    CHECK(tms_parse_bytes("64K", &v) == TMS_OK && v == (size_t)64 << 10);
    CHECK(tms_parse_bytes("", &v) == TMS_E_ARG);
    CHECK(tms_parse_bytes("-1", &v) == TMS_E_ARG);
    CHECK(tms_parse_bytes("12 MiB", &v) == TMS_E_ARG);
    CHECK(tms_parse_bytes("99999999999999999999", &v) == TMS_E_ARG);
    CHECK(tms_parse_bytes("17179869184G", &v) == TMS_E_ARG);
    CHECK(tms_parse_bytes("+1", &v) == TMS_E_ARG && tms_parse_bytes(" 1", &v) == TMS_E_ARG);
    unsigned long long u = 0;
    CHECK(tms_parse_uint("32", 32, &u) == TMS_OK && u == 32);
    CHECK(tms_parse_uint("33", 32, &u) == TMS_E_ARG && tms_parse_uint("9", 8, &u) == TMS_E_ARG);
    CHECK(tms_parse_uint(" 1", 32, &u) == TMS_E_ARG && tms_parse_uint("+1", 32, &u) == TMS_E_ARG);
    CHECK(tms_parse_uint("\n1", 32, &u) == TMS_E_ARG && tms_parse_uint("1 ", 32, &u) == TMS_E_ARG);
    CHECK(tms_parse_uint("", 32, &u) == TMS_E_ARG && tms_parse_uint("0x1", 32, &u) == TMS_E_ARG);
    CHECK(tms_parse_uint("18446744073709551615", ~0ull, &u) == TMS_OK && u == ~0ull);
    CHECK(tms_parse_uint("18446744073709551616", ~0ull, &u) == TMS_E_ARG);
    CHECK(tms_parse_uint("99999999999999999999", ~0ull, &u) == TMS_E_ARG);
    int b = -1;
    CHECK(tms_parse_bool("YES", &b) == TMS_OK && b == 1 && tms_parse_bool(" 1", &b) == TMS_E_ARG);
    size_t bad = 0;
    CHECK(tms_utf8_valid("kv_cache", &bad) && tms_utf8_valid("\xc3\xa9t\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", &bad));
    CHECK(!tms_utf8_valid("ab\xff", &bad) && bad == 2);
    CHECK(!tms_utf8_valid("\xc0\xaf", &bad) && bad == 0);           /* overlong '/' */
    CHECK(!tms_utf8_valid("x\xed\xa0\x80", &bad) && bad == 1);     /* a surrogate */
    CHECK(!tms_utf8_valid("\xf4\x90\x80\x80", &bad) && bad == 0); /* past U+10FFFF */
    CHECK(!tms_utf8_valid("\xe2\x82", &bad) && bad == 0);           /* cut short */
    CHECK(tms_backup_kind_parse("pinned", &kind) == TMS_OK && kind == TMS_BACKUP_PINNED);
    CHECK(tms_backup_kind_parse("mmap", &kind) == TMS_OK && kind == TMS_BACKUP_MMAP);
    CHECK(tms_backup_kind_parse("cuda", &kind) == TMS_E_ARG);
    CHECK(strcmp(tms_backup_kind_name(TMS_BACKUP_PINNED), "pinned") == 0);
    CHECK(strcmp(tms_backup_kind_name(TMS_BACKUP_MMAP), "mmap") == 0);
    CHECK(tms_defaults()->parse_error.status == TMS_OK);
    CHECK(tms_region_current()->tag_id == TMS_TAG_DEFAULT_ID);
    /* The thread's settings persist between calls (threads scenario: and stay its own). */
    struct tms_region saved = *tms_region_current();
    tms_region_current()->tag_id = 7;
    tms_region_current()->active = !saved.active;
    CHECK(tms_region_current()->tag_id == 7 && tms_region_current()->active == !saved.active);
    *tms_region_current() = saved;
}

static void test_driver(void)
{
    struct tms_err err;
    CHECK(strcmp(tms_driver_loaded_name(), backend) == 0);
    CHECK_RC(tms_driver_select(backend, &err), TMS_OK);
    CHECK_RC(tms_driver_select("cuda", &err), TMS_E_STATE);
    CHECK_MSG("already in use");
    CHECK_RC(tms_driver_select("vulkan", &err), TMS_E_ARG);
    CHECK_MSG("vulkan");
    CHECK(gran == (size_t)2 << 20);
    CHECK(device_count() >= 1);
}

static void test_basics(void)
{
    struct tms_err err;
    int id = -1, id2 = -1;
    CHECK_RC(tms_core_tag_id("", &id, &err), TMS_E_ARG);
    CHECK_RC(tms_core_tag_id("default", &id, &err), TMS_OK);
    CHECK(id == TMS_TAG_DEFAULT_ID);
    CHECK_RC(tms_core_tag_id("basics", &id, &err), TMS_OK);
    CHECK_RC(tms_core_tag_id("basics", &id2, &err), TMS_OK);
    CHECK(id == id2 && id != TMS_TAG_DEFAULT_ID);
    CHECK(strcmp(tms_core_tag_name(id), "basics") == 0);

    struct tms_region r = region("basics", 0, TMS_BACKUP_MMAP);
    void *p = (void *)1;
    CHECK_RC(tms_core_alloc(0, 0, &r, &p, &err), TMS_OK);
    CHECK(p == NULL);
    CHECK_RC(tms_core_alloc(1, device_count(), &r, &p, &err), TMS_E_ARG);
    CHECK_MSG("does not exist");

    size_t before = free_bytes(0);
    p = alloc_ok(1000, -1, &r);  /* -1: the current device, 0 here */
    struct tms_alloc_info row = info_of(p);
    CHECK(row.ptr == (uint64_t)(uintptr_t)p);
    CHECK(row.size == 1000 && row.reserved == gran && row.device == 0 && row.tag_id == id);
    CHECK(row.state == TMS_ACTIVE && !row.backup && !row.has_host_copy);
    CHECK((uintptr_t)p % gran == 0);
    CHECK(free_bytes(0) == before - gran);
    CHECK(tms_core_owns(p));
    CHECK(!tms_core_owns((char *)p + 1));
    CHECK(!tms_core_owns(NULL));
    fill(p, 1000, 1);
    CHECK(matches(p, 1000, 1));

    int on_stack = 0;
    CHECK_RC(tms_core_free(&on_stack, &err), TMS_E_NOT_FOUND);
    CHECK_MSG("not an allocation");
    free_ok(p);
    CHECK(!tms_core_owns(p));
    CHECK_RC(tms_core_free(p, &err), TMS_E_NOT_FOUND);
    CHECK(free_bytes(0) == before);
}

/* Pause copies to host and releases the device memory; resume restores it
 * at the same address. */
static void test_backup_roundtrip(int kind)
{
    struct tms_err err;
    const char *tag = kind == TMS_BACKUP_PINNED ? "bk-pinned" : "bk-mmap";
    struct tms_region r = region(tag, 1, kind);
    /* The last spans two of the copy pool's 8 MiB blocks. */
    const size_t sizes[] = {1, 4093, gran, gran + 1, 3 * gran + 5, 5 * gran + 7};
    enum { N = sizeof sizes / sizeof *sizes };
    void *p[N];
    size_t before = free_bytes(0);
    for (int i = 0; i < N; i++) {
        p[i] = alloc_ok(sizes[i], 0, &r);
        fill(p[i], sizes[i], 100 + i);
    }
    size_t active_free = free_bytes(0), requested = 0, reserved = 0;
    for (int i = 0; i < N; i++) requested += sizes[i], reserved += round_up(sizes[i], gran);
    CHECK_RC(tms_core_pause(tag, &err), TMS_OK);
    CHECK(free_bytes(0) == before);  /* physical memory really released */
    struct tms_stats st = stats_of(r.tag_id, 0);
    CHECK(st.allocations == N && st.bytes_requested == requested && st.bytes_reserved == reserved);
    CHECK(st.bytes_mapped == 0 && st.bytes_paused == reserved);
    CHECK((kind == TMS_BACKUP_PINNED ? st.bytes_backup_pinned : st.bytes_backup_mmap) == requested);
    CHECK(st.pauses == 1 && st.bytes_to_host == requested && st.resumes == 0);
    struct tms_backup *view = NULL;  /* a zero-copy view of the last backup, held across the resume */
    for (int i = 0; i < N; i++) {
        struct tms_alloc_info row = info_of(p[i]);
        CHECK(row.state == TMS_PAUSED && row.backup && row.backup_kind == kind && row.has_host_copy);
        /* The pause that filled a pinned backup page-locked it, where the driver can. */
        CHECK(row.host_copy_pinned == (kind == TMS_BACKUP_PINNED && !getenv("HIP_STUB_NO_REGISTER")));
        CHECK(tms_core_owns(p[i]));
        struct tms_backup *b = NULL;
        size_t offset = 99;
        CHECK_RC(tms_core_backup_of((uintptr_t)p[i], sizes[i], 0, &b, &offset, &err), TMS_OK);
        CHECK(b && offset == 0 && b->kind == kind && b->size >= sizes[i]);
        if (b) CHECK(matches(b->host, sizes[i], 100 + i));  /* the host copy holds the bytes */
        if (i == N - 1) view = b;
        else tms_backup_unref(b);
    }
    CHECK_RC(tms_core_resume(tag, &err), TMS_OK);
    /* The resume drops the backups, giving their memory back on the copy
     * workers, but not one a view still holds. */
    if (view) CHECK(view->host && matches(view->host, sizes[N - 1], 100 + N - 1));
    tms_backup_unref(view);
    CHECK(free_bytes(0) == active_free);
    st = stats_of(r.tag_id, 0);
    CHECK(st.bytes_mapped == reserved && st.bytes_paused == 0);
    CHECK(st.bytes_backup_pinned == 0 && st.bytes_backup_mmap == 0);
    CHECK(st.resumes == 1 && st.bytes_to_device == requested);
    for (int i = 0; i < N; i++) {
        struct tms_alloc_info row = info_of(p[i]);
        CHECK(row.state == TMS_ACTIVE && !row.has_host_copy);  /* not retained */
        CHECK(matches(p[i], sizes[i], 100 + i));
        fill(p[i], sizes[i], 200 + i);  /* writable again */
    }
    /* A second cycle makes new backups and restores the new bytes. */
    CHECK_RC(tms_core_pause(tag, &err), TMS_OK);
    CHECK_RC(tms_core_resume(tag, &err), TMS_OK);
    for (int i = 0; i < N; i++) CHECK(matches(p[i], sizes[i], 200 + i));
    for (int i = 0; i < N; i++) free_ok(p[i]);
    CHECK(free_bytes(0) == before);
}

static void test_backup_pinned(void) { test_backup_roundtrip(TMS_BACKUP_PINNED); }
static void test_backup_mmap(void) { test_backup_roundtrip(TMS_BACKUP_MMAP); }

static void test_discard(void)
{
    struct tms_err err;
    struct tms_region r = region("discard", 0, TMS_BACKUP_MMAP);
    size_t size = 2 * gran + 17;
    void *p = alloc_ok(size, 0, &r);
    fill(p, size, 7);
    CHECK_RC(tms_core_pause("discard", &err), TMS_OK);
    struct tms_alloc_info row = info_of(p);
    CHECK(row.state == TMS_PAUSED && !row.backup && !row.has_host_copy);
    struct tms_backup *b = (struct tms_backup *)1;
    size_t offset = 0;
    CHECK_RC(tms_core_backup_of((uintptr_t)p, size, 0, &b, &offset, &err), TMS_OK);
    CHECK(b == NULL);
    CHECK_RC(tms_core_resume("discard", &err), TMS_OK);
    CHECK(info_of(p).state == TMS_ACTIVE);
    /* Contents are undefined after a discard; the memory must be usable. */
    fill(p, size, 8);
    CHECK(matches(p, size, 8));
    free_ok(p);
}

static void test_state_errors(void)
{
    struct tms_err err;
    struct tms_region r = region("twice", 0, TMS_BACKUP_MMAP);
    void *p = alloc_ok(10, 0, &r);
    CHECK_RC(tms_core_resume("twice", &err), TMS_E_STATE);
    CHECK_MSG("'twice'");
    CHECK_MSG("not paused");
    CHECK_RC(tms_core_pause("twice", &err), TMS_OK);
    CHECK_RC(tms_core_pause("twice", &err), TMS_E_STATE);
    CHECK_MSG("'twice'");
    CHECK_MSG("already paused");
    CHECK(info_of(p).state == TMS_PAUSED);  /* the failed call changed nothing */
    CHECK_RC(tms_core_pause(NULL, &err), TMS_E_STATE);  /* every allocation is paused */
    CHECK_MSG("all tags");
    CHECK_RC(tms_core_resume("twice", &err), TMS_OK);
    CHECK_RC(tms_core_resume("twice", &err), TMS_E_STATE);
    CHECK_MSG("'twice'");
    CHECK_RC(tms_core_resume(NULL, &err), TMS_E_STATE);
    CHECK(info_of(p).state == TMS_ACTIVE);

    /* A tag never seen, or one without allocations, is a no-op. */
    CHECK_RC(tms_core_pause("never-used-tag", &err), TMS_OK);
    CHECK_RC(tms_core_resume("never-used-tag", &err), TMS_OK);
    (void)region("empty-tag", 0, TMS_BACKUP_MMAP);
    CHECK_RC(tms_core_pause("empty-tag", &err), TMS_OK);
    CHECK_RC(tms_core_resume("empty-tag", &err), TMS_OK);
    CHECK(info_of(p).state == TMS_ACTIVE);
    free_ok(p);
    CHECK_RC(tms_core_pause(NULL, &err), TMS_OK);  /* nothing at all: no-op */
    CHECK_RC(tms_core_resume(NULL, &err), TMS_OK);
}

static void test_free_paused(void)
{
    struct tms_err err;
    struct tms_region with = region("free-paused", 1, TMS_BACKUP_MMAP);
    struct tms_region without = region("free-paused", 0, TMS_BACKUP_MMAP);
    size_t before = free_bytes(0);
    void *a = alloc_ok(gran + 3, 0, &with), *b = alloc_ok(5, 0, &without), *c = alloc_ok(77, 0, &with);
    fill(a, gran + 3, 1);
    fill(c, 77, 3);
    CHECK_RC(tms_core_pause("free-paused", &err), TMS_OK);
    /* A reference to a's backup (a zero-copy view) outlives the free. */
    struct tms_backup *view = NULL;
    size_t offset = 0;
    CHECK_RC(tms_core_backup_of((uintptr_t)a, gran + 3, 0, &view, &offset, &err), TMS_OK);
    free_ok(a);
    if (view) CHECK(matches(view->host, gran + 3, 1));
    tms_backup_unref(view);
    free_ok(b);
    CHECK(!tms_core_owns(a) && !tms_core_owns(b) && tms_core_owns(c));
    CHECK_RC(tms_core_free(a, &err), TMS_E_NOT_FOUND);
    CHECK_RC(tms_core_resume("free-paused", &err), TMS_OK);  /* only c is left */
    CHECK(matches(c, 77, 3));
    free_ok(c);
    CHECK(free_bytes(0) == before);
}

static void test_retain(void)
{
    struct tms_err err;
    struct tms_region r = region("retain", 1, TMS_BACKUP_PINNED);
    size_t size = gran + 100;
    void *p = alloc_ok(size, 0, &r);
    fill(p, size, 11);

    tms_core_set_retain(1);
    CHECK(tms_core_retain() == 1);
    CHECK_RC(tms_core_pause("retain", &err), TMS_OK);
    struct tms_backup *first = NULL, *again = NULL;
    size_t offset = 0;
    CHECK_RC(tms_core_backup_of((uintptr_t)p, size, 0, &first, &offset, &err), TMS_OK);
    CHECK_RC(tms_core_resume("retain", &err), TMS_OK);
    CHECK(matches(p, size, 11));
    struct tms_alloc_info row = info_of(p);
    CHECK(row.state == TMS_ACTIVE && row.has_host_copy);  /* kept across resume */
    CHECK_RC(tms_core_backup_of((uintptr_t)p + 100, 50, 0, &again, &offset, &err), TMS_OK);
    CHECK(again != NULL && again == first && offset == 100);
    tms_backup_unref(again);
    again = NULL;

    /* Re-pause reuses the retained buffer and refreshes its bytes. */
    fill(p, size, 12);
    CHECK_RC(tms_core_pause("retain", &err), TMS_OK);
    CHECK_RC(tms_core_backup_of((uintptr_t)p, size, 0, &again, &offset, &err), TMS_OK);
    CHECK(again == first);
    if (again) CHECK(matches(again->host, size, 12));
    tms_backup_unref(again);
    tms_backup_unref(first);

    /* Without retain, resume drops the core's copy; a reference taken while
     * paused (a zero-copy view) keeps the bytes alive. */
    tms_core_set_retain(0);
    struct tms_backup *view = NULL;
    CHECK_RC(tms_core_backup_of((uintptr_t)p, size, 0, &view, &offset, &err), TMS_OK);
    CHECK_RC(tms_core_resume("retain", &err), TMS_OK);
    CHECK(matches(p, size, 12));
    CHECK(!info_of(p).has_host_copy);
    struct tms_backup *none = (struct tms_backup *)1;
    CHECK_RC(tms_core_backup_of((uintptr_t)p, size, 0, &none, &offset, &err), TMS_OK);
    CHECK(none == NULL);
    if (view) CHECK(matches(view->host, size, 12));
    tms_backup_unref(view);

    /* Ranges outside the allocation. */
    CHECK_RC(tms_core_backup_of((uintptr_t)p + size - 10, 20, 0, &none, &offset, &err), TMS_E_ARG);
    none = (struct tms_backup *)1;  /* foreign memory: no backup, no error (as upstream) */
    CHECK_RC(tms_core_backup_of((uintptr_t)&err, 1, 0, &none, &offset, &err), TMS_OK);
    CHECK(none == NULL);
    free_ok(p);
}

static void test_margin_and_oom(void)
{
    struct tms_err err;
    struct tms_region r = region("margin", 0, TMS_BACKUP_MMAP);
    size_t free0 = free_bytes(0), total = 0, ignored = 0;
    CHECK(drv->mem_get_info(0, &ignored, &total) == 0);

    /* Leaving exactly the margin free is allowed; one byte less is OOM. */
    tms_core_set_margin(free0 - gran);
    CHECK(tms_core_margin() == free0 - gran);
    void *p = alloc_ok(1, 0, &r);
    void *q = (void *)1;
    CHECK_RC(tms_core_alloc(1, 0, &r, &q, &err), TMS_E_OOM);
    CHECK_MSG("memory_margin_bytes");
    CHECK_MSG("'margin'");
    free_ok(p);
    CHECK_RC(tms_core_alloc(gran + 1, 0, &r, &q, &err), TMS_E_OOM);
    tms_core_set_margin(0);

    /* Past the emulated capacity: recoverable OOM, nothing left behind. */
    size_t rows = count_rows(-1, -1);
    CHECK_RC(tms_core_alloc(total + 1, 0, &r, &q, &err), TMS_E_OOM);
    CHECK(count_rows(-1, -1) == rows);
    CHECK(free_bytes(0) == free0);
    CHECK_RC(tms_core_alloc(SIZE_MAX - 5, 0, &r, &q, &err), TMS_E_OOM);
    p = alloc_ok(gran, 0, &r);  /* and the device still allocates */
    free_ok(p);
    CHECK(free_bytes(0) == free0);
}

/* Sizes around the granularity and across chunks (TMS_CHUNK_BYTES runs). */
static void test_sizes(void)
{
    struct tms_err err;
    struct tms_region bk = region("sizes-bk", 1, TMS_BACKUP_MMAP);
    struct tms_region discard = region("sizes-discard", 0, TMS_BACKUP_MMAP);
    const size_t sizes[] = {1, 2, gran - 1, gran, gran + 1, 3 * gran + 5, 5 * gran + 7, 9 * gran};
    enum { N = sizeof sizes / sizeof *sizes };
    void *p[N], *d[N];
    for (int i = 0; i < N; i++) {
        p[i] = alloc_ok(sizes[i], 0, &bk);
        d[i] = alloc_ok(sizes[i], 0, &discard);
        struct tms_alloc_info row = info_of(p[i]);
        CHECK(row.size == sizes[i] && row.reserved == round_up(sizes[i], gran));
        CHECK(row.n_chunks == expected_chunks(sizes[i]));
        fill(p[i], sizes[i], 300 + i);
    }
    CHECK_RC(tms_core_pause("sizes-bk", &err), TMS_OK);
    CHECK_RC(tms_core_pause("sizes-discard", &err), TMS_OK);
    CHECK_RC(tms_core_resume("sizes-discard", &err), TMS_OK);
    CHECK_RC(tms_core_resume("sizes-bk", &err), TMS_OK);
    for (int i = 0; i < N; i++) {
        CHECK(matches(p[i], sizes[i], 300 + i));
        /* Every chunk of the reservation is mapped again, to its last byte. */
        size_t reserved = round_up(sizes[i], gran);
        fill(d[i], reserved, 400 + i);
        CHECK(matches(d[i], reserved, 400 + i));
    }
    for (int i = 0; i < N; i++) {
        free_ok(p[i]);
        free_ok(d[i]);
    }
}

static void test_tags(void)
{
    struct tms_err err;
    struct tms_region a = region("tag-a", 1, TMS_BACKUP_MMAP);
    struct tms_region b = region("tag-b", 1, TMS_BACKUP_PINNED);
    struct tms_region c = region("tag-c", 0, TMS_BACKUP_MMAP);
    enum { N = 3 };
    void *pa[N], *pb[N], *pc[N];
    for (int i = 0; i < N; i++) {
        pa[i] = alloc_ok(1000 * (i + 1), 0, &a);
        pb[i] = alloc_ok(gran * (i + 1) + 1, 0, &b);
        pc[i] = alloc_ok(99, 0, &c);
        fill(pa[i], 1000 * (i + 1), 10 + i);
        fill(pb[i], gran * (i + 1) + 1, 20 + i);
        fill(pc[i], 99, 30 + i);
    }
    CHECK_RC(tms_core_pause("tag-a", &err), TMS_OK);
    CHECK(count_rows(a.tag_id, TMS_PAUSED) == N);
    CHECK(count_rows(b.tag_id, TMS_ACTIVE) == N && count_rows(c.tag_id, TMS_ACTIVE) == N);
    for (int i = 0; i < N; i++) CHECK(matches(pb[i], gran * (i + 1) + 1, 20 + i) && matches(pc[i], 99, 30 + i));
    CHECK_RC(tms_core_pause("tag-b", &err), TMS_OK);
    CHECK_RC(tms_core_resume("tag-a", &err), TMS_OK);
    CHECK(count_rows(a.tag_id, TMS_ACTIVE) == N && count_rows(b.tag_id, TMS_PAUSED) == N);
    for (int i = 0; i < N; i++) CHECK(matches(pa[i], 1000 * (i + 1), 10 + i));

    /* All tags: pauses whatever is active, resumes whatever is paused. */
    CHECK_RC(tms_core_pause(NULL, &err), TMS_OK);
    CHECK(count_rows(-1, TMS_ACTIVE) == 0);
    CHECK_RC(tms_core_pause(NULL, &err), TMS_E_STATE);
    CHECK_RC(tms_core_resume("tag-c", &err), TMS_OK);
    CHECK_RC(tms_core_resume(NULL, &err), TMS_OK);
    CHECK(count_rows(-1, TMS_PAUSED) == 0);
    for (int i = 0; i < N; i++)
        CHECK(matches(pa[i], 1000 * (i + 1), 10 + i) && matches(pb[i], gran * (i + 1) + 1, 20 + i));
    for (int i = 0; i < N; i++) {
        free_ok(pa[i]);
        free_ok(pb[i]);
        free_ok(pc[i]);
    }
}

/* Tags nobody references any more are reclaimed once many exist: more
 * distinct tags than the table could ever hold at once all work, a tag with
 * an allocation or a thread's region on it keeps its name and statistics,
 * and names that are not UTF-8 never enter. */
static void test_tag_reclaim(void)
{
    struct tms_err err;
    struct tms_region keep = region("kept-tag", 0, TMS_BACKUP_MMAP);
    void *kept = alloc_ok(4096, 0, &keep);
    CHECK_RC(tms_core_set_region_tag("region-tag", &err), TMS_OK);
    int region_tag = tms_region_current()->tag_id;
    char name[32];
    for (int i = 0; i < 70000; i++) {
        snprintf(name, sizeof name, "churn-%d", i);
        struct tms_region r = region(name, 0, TMS_BACKUP_MMAP);
        if (i % 1000 == 0) free_ok(alloc_ok(1, 0, &r));
    }
    CHECK(strcmp(tms_core_tag_name(keep.tag_id), "kept-tag") == 0 && info_of(kept).tag_id == keep.tag_id);
    CHECK(strcmp(tms_core_tag_name(region_tag), "region-tag") == 0);
    int again = -1;
    CHECK_RC(tms_core_tag_id("kept-tag", &again, &err), TMS_OK);
    CHECK(again == keep.tag_id);
    CHECK_RC(tms_core_pause("kept-tag", &err), TMS_OK);
    CHECK_RC(tms_core_resume("kept-tag", &err), TMS_OK);
    free_ok(kept);
    CHECK_RC(tms_core_set_region_tag("default", &err), TMS_OK);
    CHECK_RC(tms_core_tag_id("bad\xff", &again, &err), TMS_E_ARG);
    CHECK(strstr(err.msg, "not valid UTF-8") != NULL);
    CHECK_RC(tms_core_set_region_tag("", &err), TMS_E_ARG);
    CHECK(tms_region_current()->tag_id == TMS_TAG_DEFAULT_ID);
}

/* A pause of a tag walks that tag's own list of allocations: frees at its
 * head, middle and end, a free while paused and a late allocation keep the
 * list exactly the tag's live allocations. */
static void test_tag_lists(void)
{
    struct tms_err err;
    struct tms_region x = region("list-x", 1, TMS_BACKUP_MMAP);
    struct tms_region y = region("list-y", 1, TMS_BACKUP_MMAP);
    enum { N = 5 };
    void *px[N + 1], *py[N];
    for (int i = 0; i < N; i++) {
        px[i] = alloc_ok(4096, 0, &x);
        py[i] = alloc_ok(4096, 0, &y);
        fill(px[i], 4096, 40 + i);
        fill(py[i], 4096, 50 + i);
    }
    free_ok(px[0]);  /* the first allocated, last in the list */
    free_ok(px[4]);  /* the last allocated, first in the list */
    free_ok(px[2]);
    CHECK_RC(tms_core_pause("list-x", &err), TMS_OK);
    CHECK(count_rows(x.tag_id, TMS_PAUSED) == 2 && count_rows(x.tag_id, TMS_ACTIVE) == 0);
    CHECK(info_of(px[1]).state == TMS_PAUSED && info_of(px[3]).state == TMS_PAUSED);
    CHECK(count_rows(y.tag_id, TMS_ACTIVE) == N);
    free_ok(px[1]);  /* while paused */
    CHECK_RC(tms_core_resume("list-x", &err), TMS_OK);
    CHECK(count_rows(x.tag_id, -1) == 1 && info_of(px[3]).state == TMS_ACTIVE && matches(px[3], 4096, 43));
    px[N] = alloc_ok(4096, 0, &x);
    fill(px[N], 4096, 45);
    CHECK_RC(tms_core_pause("list-x", &err), TMS_OK);
    CHECK(count_rows(x.tag_id, TMS_PAUSED) == 2 && info_of(px[N]).state == TMS_PAUSED);
    CHECK_RC(tms_core_resume("list-x", &err), TMS_OK);
    CHECK(matches(px[3], 4096, 43) && matches(px[N], 4096, 45));
    for (int i = 0; i < N; i++) CHECK(matches(py[i], 4096, 50 + i));
    CHECK_RC(tms_core_pause("list-y", &err), TMS_OK);
    CHECK(count_rows(y.tag_id, TMS_PAUSED) == N && count_rows(x.tag_id, TMS_ACTIVE) == 2);
    CHECK_RC(tms_core_resume("list-y", &err), TMS_OK);
    free_ok(px[3]);
    free_ok(px[N]);
    for (int i = 0; i < N; i++) free_ok(py[i]);
    CHECK_RC(tms_core_pause("list-x", &err), TMS_OK);  /* an emptied tag: nothing to do */
    CHECK(count_rows(-1, -1) == 0);
}

/* Interior pointers are found by a walk while the table changes, by binary
 * search once it holds still (core/table.c, WALKS_BEFORE_SORT): both must agree
 * with the table after every insert and free. */
static uint64_t owner_start(uint64_t ptr)
{
    struct tms_alloc_info row;
    return tms_core_find(ptr, &row) == TMS_OK ? row.ptr : 0;
}

static void test_span_index(void)
{
    static const int owners[3];
    struct tms_span_index ix = {0};
    CHECK(tms_span_index_find(&ix, 5) == NULL);
    CHECK(tms_span_index_add(&ix, 1, 2, &owners[0]) == -1);  /* no room made */
    CHECK(tms_span_index_clear(&ix, 3) == 0);
    CHECK(tms_span_index_add(&ix, 40, 50, &owners[2]) == 0);  /* out of order: the sort puts it last */
    CHECK(tms_span_index_add(&ix, 10, 20, &owners[0]) == 0);
    CHECK(tms_span_index_add(&ix, 20, 30, &owners[1]) == 0);
    tms_span_index_sort(&ix);
    static const struct { uint64_t addr; const void *owner; } probes[] = {
        {9, NULL}, {10, &owners[0]}, {19, &owners[0]}, {20, &owners[1]}, {29, &owners[1]},
        {30, NULL}, {39, NULL}, {40, &owners[2]}, {49, &owners[2]}, {50, NULL}, {UINT64_MAX, NULL},
    };
    for (size_t i = 0; i < sizeof probes / sizeof probes[0]; i++)
        CHECK(tms_span_index_find(&ix, probes[i].addr) == probes[i].owner);
    CHECK(tms_span_index_clear(&ix, 1) == 0 && tms_span_index_find(&ix, 15) == NULL);
    enum { MANY = 100 };  /* growing an index that held spans */
    CHECK(tms_span_index_clear(&ix, MANY) == 0 && ix.cap >= MANY);
    for (uint64_t k = MANY; k-- > 0;) CHECK(tms_span_index_add(&ix, 100 * k, 100 * k + 50, &owners[k % 3]) == 0);
    tms_span_index_sort(&ix);
    for (uint64_t k = 0; k < MANY; k++) {
        CHECK(tms_span_index_find(&ix, 100 * k + 49) == &owners[k % 3]);
        CHECK(tms_span_index_find(&ix, 100 * k + 50) == NULL);
    }
    tms_span_index_free(&ix);
}

static void test_interior_lookup(void)
{
    struct tms_region r = region("interior", 0, TMS_BACKUP_MMAP);
    enum { N = 48, ROUNDS = 3 };
    uint64_t va[N];
    for (int i = 0; i < N; i++) va[i] = (uint64_t)(uintptr_t)alloc_ok(2 * gran + 1, 0, &r);
    uint64_t sorted = tms_core_sorted_lookups();
    CHECK(owner_start(va[0] + gran) == va[0]);
    CHECK(tms_core_sorted_lookups() == sorted);  /* the table just changed: a walk */
    for (int round = 0; round < ROUNDS; round++)  /* walks, then a sort, then searches */
        for (int i = 0; i < N; i++) {
            CHECK(owner_start(va[i] + gran + 4096 * (uint64_t)round) == va[i]);
            CHECK(owner_start(va[i] + 3 * gran - 1) == va[i]);  /* the last reserved byte */
            CHECK(owner_start(va[i] + 3 * gran) != va[i]);
        }
    CHECK(owner_start(1) == 0);
    CHECK(tms_core_sorted_lookups() > sorted + N);  /* the runs of lookups searched */
    for (int i = 0; i < N; i += 2) free_ok((void *)(uintptr_t)va[i]);
    sorted = tms_core_sorted_lookups();
    CHECK(owner_start(va[1] + gran) == va[1]);
    CHECK(tms_core_sorted_lookups() == sorted);  /* a free makes the sorted copy stale */
    for (int round = 0; round < ROUNDS; round++)
        for (int i = 0; i < N; i++) CHECK(owner_start(va[i] + gran) == (i % 2 ? va[i] : 0));
    CHECK(tms_core_sorted_lookups() > sorted);
    for (int i = 0; i < N; i += 2) va[i] = (uint64_t)(uintptr_t)alloc_ok(gran + 1, 0, &r);
    for (int i = 0; i < N; i++)  /* so does an insert, found before the next sort */
        CHECK(owner_start(va[i] + gran) == va[i]);
    for (int i = 1; i < N; i++) free_ok((void *)(uintptr_t)va[i]);
    for (int round = 0; round < ROUNDS; round++)  /* one left: lookups still reach the table */
        for (int i = 1; i < N; i++) CHECK(owner_start(va[i] + gran) == 0);
    CHECK(owner_start(va[0] + gran) == va[0]);
    free_ok((void *)(uintptr_t)va[0]);
}

static void test_devices(void)
{
    struct tms_err err;
    if (device_count() < 2) {
        printf("   (one device: TMS_HOST_DEVICES or HIP_STUB_DEVICES < 2, skipped)\n");
        return;
    }
    struct tms_region r = region("devices", 1, TMS_BACKUP_MMAP);
    size_t free0 = free_bytes(0), free1 = free_bytes(1);
    void *p0 = alloc_ok(gran + 1, 0, &r), *p1 = alloc_ok(3 * gran, 1, &r);
    CHECK(info_of(p0).device == 0 && info_of(p1).device == 1);
    CHECK(free_bytes(0) == free0 - 2 * gran && free_bytes(1) == free1 - 3 * gran);
    fill(p0, gran + 1, 50);
    fill(p1, 3 * gran, 51);
    CHECK_RC(tms_core_pause("devices", &err), TMS_OK);
    CHECK(free_bytes(0) == free0 && free_bytes(1) == free1);
    CHECK_RC(tms_core_resume("devices", &err), TMS_OK);
    CHECK(matches(p0, gran + 1, 50) && matches(p1, 3 * gran, 51));
    CHECK(free_bytes(1) == free1 - 3 * gran);
    free_ok(p0);
    free_ok(p1);
    CHECK(free_bytes(0) == free0 && free_bytes(1) == free1);
}

/* Workers allocate, free, pause and resume their own tags through their own
 * thread-local region while the main thread cycles another tag with backups:
 * threads_rounds cycles of the main thread, three times as many iterations of
 * each worker (--threads-rounds N; 40 unless told). */
enum { WORKERS = 4, LIVE = 3 };
static int threads_rounds = 40;

struct worker {
    int index;
    pthread_t thread;
};

static void *worker_main(void *arg)
{
    struct worker *w = arg;
    struct tms_err err;
    char tag[32];
    snprintf(tag, sizeof tag, "worker-%d", w->index);
    int tag_id = -1;
    CHECK_RC(tms_core_tag_id(tag, &tag_id, &err), TMS_OK);
    struct tms_region *r = tms_region_current();
    r->active = 1;
    r->tag_id = tag_id;
    r->backup = 1;
    r->backup_kind = w->index % 2 ? TMS_BACKUP_PINNED : TMS_BACKUP_MMAP;

    void *live[LIVE] = {0};
    size_t sizes[LIVE] = {0};
    uint64_t seeds[LIVE] = {0}, rng = 0x1234567ull + (uint64_t)w->index;
    for (int it = 0; it < 3 * threads_rounds; it++) {
        int slot = it % LIVE;
        if (live[slot]) {
            CHECK(matches(live[slot], sizes[slot], seeds[slot]));
            free_ok(live[slot]);
        }
        sizes[slot] = 1 + next_rand(&rng) % (256 << 10);
        seeds[slot] = next_rand(&rng);
        live[slot] = alloc_ok(sizes[slot], -1, tms_region_current());
        if (live[slot]) fill(live[slot], sizes[slot], seeds[slot]);
        if (it % 4 == 3) {
            CHECK_RC(tms_core_pause(tag, &err), TMS_OK);
            CHECK_RC(tms_core_resume(tag, &err), TMS_OK);
            for (int i = 0; i < LIVE; i++)
                if (live[i]) CHECK(matches(live[i], sizes[i], seeds[i]));
        }
    }
    for (int i = 0; i < LIVE; i++)
        if (live[i]) free_ok(live[i]);
    CHECK(tms_region_current()->tag_id == tag_id);  /* no other thread's settings leaked in */
    return NULL;
}

static void test_threads(void)
{
    struct tms_err err;
    struct tms_region before = *tms_region_current();
    struct tms_region r = region("main-bk", 1, TMS_BACKUP_MMAP);
    const size_t sizes[] = {1, 4096 + 3, 100000, gran + 1};
    enum { N = sizeof sizes / sizeof *sizes };
    /* No allocation here reserves more than two granules: under a TMS_CHUNK_BYTES of
     * that or more each is one chunk of its own size, as without the setting, and the
     * run would repeat the unchunked one's work. */
    if (tms_defaults()->chunk_bytes_set && tms_defaults()->chunk_bytes >= 2 * gran) {
        printf("   (every allocation is one chunk, as without TMS_CHUNK_BYTES: skipped)\n");
        return;
    }
    void *p[N];
    for (int i = 0; i < N; i++) {
        p[i] = alloc_ok(sizes[i], 0, &r);
        fill(p[i], sizes[i], 500 + i);
    }
    struct worker workers[WORKERS];
    for (int i = 0; i < WORKERS; i++) {
        workers[i].index = i;
        CHECK(pthread_create(&workers[i].thread, NULL, worker_main, &workers[i]) == 0);
    }
    for (int cycle = 0; cycle < threads_rounds; cycle++) {
        CHECK_RC(tms_core_pause("main-bk", &err), TMS_OK);
        CHECK(count_rows(r.tag_id, TMS_PAUSED) == N);
        CHECK_RC(tms_core_resume("main-bk", &err), TMS_OK);
        for (int i = 0; i < N; i++) {
            CHECK(matches(p[i], sizes[i], 500 + cycle * N + i));
            fill(p[i], sizes[i], 500 + (cycle + 1) * N + i);
        }
    }
    for (int i = 0; i < WORKERS; i++) CHECK(pthread_join(workers[i].thread, NULL) == 0);
    for (int i = 0; i < N; i++) free_ok(p[i]);
    struct tms_region after = *tms_region_current();
    CHECK(after.active == before.active && after.tag_id == before.tag_id && after.backup == before.backup);
}

/* ---- nothing waits for a pause in progress ---------------------------------------- */

struct pause_call {
    pthread_t thread;
    const char *tag;
    void *ptr;  /* backup_main: the allocation whose backup to read */
    int rc;
    struct tms_err err;
};

static void *pause_main(void *arg)
{
    struct pause_call *c = arg;
    c->rc = tms_core_pause(c->tag, &c->err);
    return NULL;
}

static void *backup_main(void *arg)
{
    struct pause_call *c = arg;
    struct tms_backup *b = NULL;
    size_t offset = 0;
    c->rc = tms_core_backup_of((uint64_t)(uintptr_t)c->ptr, 1 << 20, 0, &b, &offset, &c->err);
    if (b) {
        c->rc = matches((char *)b->host + offset, 1 << 20, 77) ? c->rc : -1;
        tms_backup_unref(b);
    } else {
        c->rc = -2;
    }
    return NULL;
}

/* While one thread pauses a large backed-up allocation, every other call
 * completes while that allocation is still moving: the checks run first and
 * the state is read after them. Calls on the moving allocation get their
 * defined outcomes: free returns at once and the pause frees it; a second
 * pause of the tag waits and then finds it paused; get_cpu_backup waits and
 * gets the whole backup. */
static size_t nowait_mib = 256;  /* --nowait-mib N: the size of the allocation that moves */

static void test_nowait(void)
{
    struct tms_err err;
    const size_t big = nowait_mib << 20;
    struct tms_region rb = region("nowait-big", 1, TMS_BACKUP_MMAP);
    struct tms_region ro = region("nowait-other", 0, TMS_BACKUP_MMAP);
    void *p = alloc_ok(big, 0, &rb);
    void *doomed = alloc_ok(gran, 0, &rb);
    void *other = alloc_ok(gran, 0, &ro);
    fill(p, 1 << 20, 77);  /* a sample: filling all of it would be the slow part under the sanitizers */
    fill((char *)p + big - (1 << 20), 1 << 20, 78);
    struct pause_call first = {.tag = "nowait-big"}, second = {.tag = "nowait-big"}, reader = {.ptr = p};
    CHECK(pthread_create(&first.thread, NULL, pause_main, &first) == 0);
    while (info_of(p).state == TMS_ACTIVE) sched_yield();  /* claimed: the pause is under way */
    CHECK(pthread_create(&second.thread, NULL, pause_main, &second) == 0);
    CHECK(pthread_create(&reader.thread, NULL, backup_main, &reader) == 0);

    int foreign;
    CHECK(!tms_core_owns(&foreign));
    CHECK_RC(tms_core_free(&foreign, &err), TMS_E_NOT_FOUND);
    void *x = alloc_ok(3 * gran, 0, &ro);
    fill(x, 3 * gran, 5);
    free_ok(x);
    free_ok(other);
    struct tms_stats_row *rows = NULL;
    size_t n = 0;
    CHECK_RC(tms_core_stats(&rows, &n, &err), TMS_OK);
    free(rows);
    free_ok(doomed);                                   /* moving: left to the pause */
    CHECK_RC(tms_core_free(doomed, &err), TMS_E_NOT_FOUND);
    void *newcomer = alloc_ok(gran, 0, &rb);           /* into the tag being paused: not part of that pause */
    struct tms_alloc_info during = info_of(p);
    CHECK(during.state == TMS_PAUSING);                /* everything above finished while it was moving */
    CHECK(info_of(doomed).state == TMS_PAUSING);

    CHECK(pthread_join(first.thread, NULL) == 0 && pthread_join(second.thread, NULL) == 0);
    CHECK(pthread_join(reader.thread, NULL) == 0);
    CHECK(first.rc == TMS_OK);
    /* The second pause waited for the first, then paused what was still active: the newcomer. */
    CHECK(second.rc == TMS_OK);
    CHECK(reader.rc == TMS_OK);
    CHECK(info_of(doomed).ptr == 0);
    CHECK(info_of(p).state == TMS_PAUSED && info_of(newcomer).state == TMS_PAUSED);
    CHECK_RC(tms_core_pause("nowait-big", &err), TMS_E_STATE);
    CHECK_RC(tms_core_resume("nowait-big", &err), TMS_OK);
    CHECK(matches(p, 1 << 20, 77) && matches((char *)p + big - (1 << 20), 1 << 20, 78));
    free_ok(newcomer);
    free_ok(p);
}

/* Bytes of device 0 mapped now, summed over the table. */
static size_t mapped_bytes(void)
{
    struct tms_err err;
    struct tms_alloc_info *rows = NULL;
    size_t n = 0, sum = 0;
    CHECK_RC(tms_core_list(&rows, &n, &err), TMS_OK);
    for (size_t i = 0; i < n; i++)
        if (rows[i].device == 0 && rows[i].state == TMS_ACTIVE) sum += rows[i].reserved;
    free(rows);
    return sum;
}

/* After a failed call: active allocations hold their bytes, paused ones keep
 * their backups, and exactly the active ones hold device memory. */
static void check_after_failure(void *const *p, const size_t *sizes, int n, uint64_t seed, size_t total)
{
    for (int i = 0; i < n; i++) {
        struct tms_alloc_info row = info_of(p[i]);
        if (row.state == TMS_ACTIVE) CHECK(matches(p[i], sizes[i], seed + i));
        else CHECK(row.backup && row.has_host_copy);
    }
    CHECK(free_bytes(0) == total - mapped_bytes());
}

/* Runs under TMS_FAULT=FAULT_PLAN. Every allocation here is at most one
 * granule and one copy block, so it costs one create/map/unmap per cycle and
 * one copy per backup; [op n] gives driver_host.c's per-op call count. Copies
 * run on a worker pool, and after a failed copy the pool may skip the copies
 * not started yet: so each op's fault comes before any count of that op
 * could vary, and checks after a failed copy hold for any subset copied. */
static void test_faults(void)
{
    struct tms_err err;
    size_t total = free_bytes(0);
    enum { N = 3 };
    void *x[N], *y[N], *z[N], *w[2];
    const size_t xs[N] = {gran, gran - 1, 12345}, ys[N] = {1000, 1001, 1002}, zs[N] = {gran, gran, gran},
                 ws[2] = {5000, 5001};

    /* map 2: an allocation whose map fails gives back what it created. */
    struct tms_region rx = region("f-resume", 1, TMS_BACKUP_MMAP);
    x[0] = alloc_ok(xs[0], 0, &rx);  /* [create 1, map 1] */
    void *q = (void *)1;
    CHECK_RC(tms_core_alloc(gran, 0, &rx, &q, &err), TMS_E_OOM);  /* [create 2, map 2 fails] */
    CHECK_MSG("map");
    CHECK_MSG("'f-resume'");
    CHECK(count_rows(-1, -1) == 1 && free_bytes(0) == total - gran);
    x[1] = alloc_ok(xs[1], 0, &rx);  /* [create 3, map 3] */
    x[2] = alloc_ok(xs[2], 0, &rx);  /* [create 4, map 4] */
    for (int i = 0; i < N; i++) fill(x[i], xs[i], 600 + i);

    /* host_alloc 1: the process's first pause fails copying to its first
     * pinned backup (the copy workers cannot pin their staging);
     * every allocation stays active with its bytes, none keeps a backup, and
     * a retry works. */
    struct tms_region ry = region("f-pause", 1, TMS_BACKUP_PINNED);
    for (int i = 0; i < N; i++) {
        y[i] = alloc_ok(ys[i], 0, &ry);  /* [create 5-7, map 5-7] */
        fill(y[i], ys[i], 700 + i);
    }
    CHECK_RC(tms_core_pause("f-pause", &err), TMS_E_HOST_OOM);  /* [host_alloc 1 fails] */
    CHECK_MSG("cannot pin");
    for (int i = 0; i < N; i++) {
        struct tms_alloc_info row = info_of(y[i]);
        CHECK(row.state == TMS_ACTIVE && !row.has_host_copy);
        CHECK(matches(y[i], ys[i], 700 + i));
    }
    CHECK(free_bytes(0) == total - mapped_bytes());
    CHECK_RC(tms_core_pause("f-pause", &err), TMS_OK);   /* [to_host 1-3, unmap 1-3] */
    CHECK_RC(tms_core_resume("f-pause", &err), TMS_OK);  /* [create 8-10, to_device 1-3] */
    for (int i = 0; i < N; i++) CHECK(matches(y[i], ys[i], 700 + i));

    /* create 12: a resume that runs out of device memory part-way; the
     * allocations mapped before stay resumed, the rest stay paused with their
     * backups, and a retry resumes them. */
    CHECK_RC(tms_core_pause("f-resume", &err), TMS_OK);  /* [to_host 4-6, unmap 4-6] */
    CHECK_RC(tms_core_resume("f-resume", &err), TMS_E_OOM);  /* [create 11, to_device 4, create 12 fails] */
    CHECK_MSG("create");
    CHECK_MSG("'f-resume'");
    CHECK(count_rows(rx.tag_id, TMS_ACTIVE) == 1 && count_rows(rx.tag_id, TMS_PAUSED) == 2);
    check_after_failure(x, xs, N, 600, total);
    CHECK_RC(tms_core_resume("f-resume", &err), TMS_OK);  /* [create 13-14, to_device 5-6] */
    for (int i = 0; i < N; i++) CHECK(matches(x[i], xs[i], 600 + i));

    /* unmap 8: the allocation whose unmap fails stays active and whole, the
     * others pause, and a second pause takes the one left. */
    struct tms_region rz = region("f-unmap", 0, TMS_BACKUP_MMAP);
    for (int i = 0; i < N; i++) {
        z[i] = alloc_ok(zs[i], 0, &rz);  /* [create 15-17] */
        fill(z[i], zs[i], 800 + i);
    }
    CHECK_RC(tms_core_pause("f-unmap", &err), TMS_E_DRIVER);  /* [unmap 7, 8 fails, 9] */
    CHECK_MSG("unmap");
    CHECK(count_rows(rz.tag_id, TMS_ACTIVE) == 1 && count_rows(rz.tag_id, TMS_PAUSED) == 2);
    for (int i = 0; i < N; i++)
        if (info_of(z[i]).state == TMS_ACTIVE) CHECK(matches(z[i], zs[i], 800 + i));
    CHECK(free_bytes(0) == total - mapped_bytes());
    CHECK_RC(tms_core_pause("f-unmap", &err), TMS_OK);  /* [unmap 10] */
    CHECK(count_rows(rz.tag_id, TMS_PAUSED) == N);
    CHECK_RC(tms_core_resume("f-unmap", &err), TMS_OK);

    /* copy_to_host 11: a backup copy that fails undoes the pause: every
     * allocation of the tag stays active with its bytes and without a
     * backup; another tag's paused allocations keep theirs. */
    CHECK_RC(tms_core_pause("f-resume", &err), TMS_OK);  /* [to_host 7-9] */
    struct tms_region rw = region("f-copy", 1, TMS_BACKUP_MMAP);
    for (int i = 0; i < 2; i++) {
        w[i] = alloc_ok(ws[i], 0, &rw);
        fill(w[i], ws[i], 900 + i);
    }
    CHECK_RC(tms_core_pause("f-copy", &err), TMS_E_DRIVER);  /* [to_host 10, 11 fails] */
    CHECK_MSG("backup copy");
    for (int i = 0; i < 2; i++) {
        struct tms_alloc_info row = info_of(w[i]);
        CHECK(row.state == TMS_ACTIVE && !row.has_host_copy && matches(w[i], ws[i], 900 + i));
    }
    for (int i = 0; i < N; i++) {
        struct tms_alloc_info row = info_of(x[i]);
        CHECK(row.state == TMS_PAUSED && row.has_host_copy);
    }
    CHECK_RC(tms_core_pause("f-copy", &err), TMS_OK);
    CHECK_RC(tms_core_resume(NULL, &err), TMS_OK);  /* [to_device 7-11] */
    for (int i = 0; i < N; i++) CHECK(matches(x[i], xs[i], 600 + i));
    for (int i = 0; i < 2; i++) CHECK(matches(w[i], ws[i], 900 + i));

    /* copy_to_device 13: a restore that fails leaves that allocation paused
     * with its backup (and any whose copy the pool skipped); the ones fully
     * restored are active; a retry restores the rest. */
    CHECK_RC(tms_core_pause("f-resume", &err), TMS_OK);
    CHECK_RC(tms_core_resume("f-resume", &err), TMS_E_DRIVER);  /* [to_device 12, 13 fails, maybe 14] */
    CHECK_MSG("restore copy");
    CHECK(count_rows(rx.tag_id, TMS_PAUSED) >= 1);
    check_after_failure(x, xs, N, 600, total);
    CHECK_RC(tms_core_resume("f-resume", &err), TMS_OK);
    for (int i = 0; i < N; i++) CHECK(matches(x[i], xs[i], 600 + i));
    for (int i = 0; i < N; i++) CHECK(matches(y[i], ys[i], 700 + i));  /* z had no backup: undefined */

    for (int i = 0; i < N; i++) {
        free_ok(x[i]);
        free_ok(y[i]);
        free_ok(z[i]);
    }
    free_ok(w[0]);
    free_ok(w[1]);
    CHECK(free_bytes(0) == total);
}

/* Runs under TMS_FAULT=FAULT_PLAN_EARLY with one copy worker, so the copies
 * run in order. A pause of retained, page-locked backups lets each
 * allocation go once its copy is in; when a later copy fails, those are
 * mapped again and their bytes copied back, and one whose map fails stays
 * paused with its whole backup. */
static void test_faults_early_release(void)
{
    struct tms_err err;
    size_t total = free_bytes(0);
    enum { N = 4 };
    void *x[N];
    const size_t xs[N] = {gran, gran, gran - 7, gran};
    struct tms_region r = region("early", 1, TMS_BACKUP_MMAP);
    for (int i = 0; i < N; i++) {
        x[i] = alloc_ok(xs[i], 0, &r);  /* [map 1-4] */
        fill(x[i], xs[i], 300 + i);
    }
    tms_core_set_retain(1);
    CHECK_RC(tms_core_pause("early", &err), TMS_OK);   /* [to_host 1-4]: the backups are locked as they are written */
    CHECK_RC(tms_core_resume("early", &err), TMS_OK);  /* [map 5-8] */
    for (int i = 0; i < N; i++) CHECK(matches(x[i], xs[i], 300 + i));

    /* to_host 7 fails: the two allocations copied before it were let go; the
     * first mapped again fails [map 9] and stays paused with its backup, the
     * second comes back [map 10] with its bytes, the rest never left. */
    for (int i = 0; i < N; i++) fill(x[i], xs[i], 310 + i);
    CHECK_RC(tms_core_pause("early", &err), TMS_E_DRIVER);  /* [to_host 5, 6, 7 fails] */
    CHECK_MSG("backup copy");
    CHECK_MSG("was already released and stays paused with its backup");
    CHECK(count_rows(r.tag_id, TMS_PAUSED) == 1 && count_rows(r.tag_id, TMS_ACTIVE) == N - 1);
    check_after_failure(x, xs, N, 310, total);
    CHECK_RC(tms_core_resume("early", &err), TMS_OK);  /* [map 11] */
    for (int i = 0; i < N; i++) CHECK(matches(x[i], xs[i], 310 + i));

    /* Without faults: every allocation is let go as its copy lands. */
    for (int i = 0; i < N; i++) fill(x[i], xs[i], 320 + i);
    CHECK_RC(tms_core_pause("early", &err), TMS_OK);
    CHECK(count_rows(r.tag_id, TMS_PAUSED) == N && free_bytes(0) == total);
    CHECK_RC(tms_core_resume("early", &err), TMS_OK);
    for (int i = 0; i < N; i++) CHECK(matches(x[i], xs[i], 320 + i));
    tms_core_set_retain(0);
    for (int i = 0; i < N; i++) free_ok(x[i]);
    CHECK(free_bytes(0) == total);

    /* create 19: a resume whose first map runs out of memory while a later
     * disk backup cannot be opened reports the out-of-memory map, which is
     * what stopped it (the backups are opened before the maps run). */
    char dir[] = "/tmp/tms-early-disk-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    CHECK_RC(tms_core_set_disk_dir(dir, &err), TMS_OK);
    const size_t ds[3] = {gran, 2 * gran, 3 * gran};  /* told apart by their files' sizes */
    struct tms_region rd = {.active = 1, .tag_id = -1, .disk_backup = 1};
    CHECK_RC(tms_core_tag_id("early-disk", &rd.tag_id, &err), TMS_OK);
    for (int i = 0; i < 3; i++) {
        x[i] = alloc_ok(ds[i], 0, &rd);  /* [create 16-18] */
        fill(x[i], ds[i], 330 + i);
    }
    /* A resume takes them in address order: hide the file of the last one. */
    int hi = 0;
    for (int i = 1; i < 3; i++)
        if ((char *)x[i] > (char *)x[hi]) hi = i;
    CHECK_RC(tms_core_pause("early-disk", &err), TMS_OK);
    char cmd[200], last[400] = "", aside[420];
    snprintf(cmd, sizeof cmd, "ls -S %s/*.bin | sed -n %dp", dir, 3 - hi);  /* largest first */
    FILE *f = popen(cmd, "r");
    if (f && fgets(last, sizeof last, f)) last[strcspn(last, "\n")] = 0;
    if (f) pclose(f);
    snprintf(aside, sizeof aside, "%s.aside", last);
    CHECK(last[0] && rename(last, aside) == 0);
    CHECK_RC(tms_core_resume("early-disk", &err), TMS_E_OOM);  /* [create 19 fails] */
    CHECK_MSG("create");
    CHECK_MSG("opening");
    CHECK(count_rows(rd.tag_id, TMS_PAUSED) == 3);
    CHECK(last[0] && rename(aside, last) == 0);
    CHECK_RC(tms_core_resume("early-disk", &err), TMS_OK);
    for (int i = 0; i < 3; i++) CHECK(matches(x[i], ds[i], 330 + i));
    for (int i = 0; i < 3; i++) free_ok(x[i]);
    CHECK(free_bytes(0) == total);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

/* Runs under TMS_FAULT=FAULT_PLAN_CHUNKED with one physical chunk per
 * granule: failures part-way through one allocation's chunks. */
static void test_faults_chunked(void)
{
    struct tms_err err;
    size_t total = free_bytes(0), size = 3 * gran - 5;
    struct tms_region r = region("f-chunks", 1, TMS_BACKUP_MMAP);
    void *q = (void *)1;

    /* Creating chunk 3 fails: chunks 1-2 are released, nothing is left. */
    CHECK_RC(tms_core_alloc(size, 0, &r, &q, &err), TMS_E_OOM);  /* [create 1, 2, 3 fails] */
    CHECK_MSG("chunk 3 of 3");
    CHECK(count_rows(-1, -1) == 0 && free_bytes(0) == total);
    void *v = alloc_ok(size, 0, &r);  /* [create 4-6, map 1-3] */
    CHECK(info_of(v).n_chunks == 3);
    fill(v, size, 1000);

    /* Mapping chunk 2 fails: chunk 1 is unmapped again, both released. */
    CHECK_RC(tms_core_alloc(2 * gran, 0, &r, &q, &err), TMS_E_OOM);  /* [create 7-8, map 4, 5 fails, unmap 1] */
    CHECK_MSG("map");
    CHECK_MSG("chunk 2 of 2");
    CHECK(count_rows(-1, -1) == 1 && free_bytes(0) == total - 3 * gran);

    /* Unmapping chunk 2 fails: chunk 1 is mapped back, so the allocation is
     * active and whole, and (retain off) it keeps no host copy. */
    CHECK_RC(tms_core_pause("f-chunks", &err), TMS_E_DRIVER);  /* [to_host 1, unmap 2, 3 fails] */
    CHECK_MSG("chunk 2 of 3");
    struct tms_alloc_info row = info_of(v);
    CHECK(row.state == TMS_ACTIVE);
    CHECK(matches(v, size, 1000));
    CHECK(free_bytes(0) == total - 3 * gran);
    check_at(!row.has_host_copy, __FILE__, __LINE__, "!row.has_host_copy",
             "an active allocation keeps the backup of a pause whose unmap failed (retain off)");
    CHECK_RC(tms_core_pause("f-chunks", &err), TMS_OK);  /* [unmap 4-6] */
    CHECK(free_bytes(0) == total);
    CHECK_RC(tms_core_resume("f-chunks", &err), TMS_OK);
    CHECK(matches(v, size, 1000));
    free_ok(v);
}

/* ---- runner ----------------------------------------------------------------------- */

struct test {
    const char *name;
    void (*run)(void);
};

/* The copy workers' default count follows the affinity mask, not the host's cores. */
static void test_affinity(void)
{
    cpu_set_t all, one;
    if (sched_getaffinity(0, sizeof all, &all) != 0) return;
    int allowed = CPU_COUNT(&all);
    CHECK(tms_transfer_allowed_cpus() == allowed);
    CPU_ZERO(&one);
    for (int cpu = 0; cpu < CPU_SETSIZE; cpu++) {
        if (!CPU_ISSET(cpu, &all)) continue;
        CPU_SET(cpu, &one);
        break;
    }
    CHECK(sched_setaffinity(0, sizeof one, &one) == 0);
    CHECK(tms_transfer_allowed_cpus() == 1);
    CHECK(sched_setaffinity(0, sizeof all, &all) == 0);
    CHECK(tms_transfer_allowed_cpus() == allowed);
}

/* A backup page-locked later is registered in pieces that together cover it
 * exactly, each no larger than TMS_PIN_PIECE_BYTES (a copy waits for one piece
 * at most); its last reference unregisters every piece. */
#define PIECES_MAX 8
static struct tms_driver recording_drv;
static pthread_mutex_t pieces_lock = PTHREAD_MUTEX_INITIALIZER;
static char *piece_at[PIECES_MAX], *unregistered_at[PIECES_MAX];
static size_t piece_len[PIECES_MAX];
static int pieces, unregistered, register_failed, fail_piece;  /* fail_piece: 1-based, 0 never */

static char *fail_register_at;  /* a piece whose registration fails with fail_register_code */
static int fail_register_code;

static int record_register(int device, void *p, size_t n)
{
    int rc = fail_piece && pieces + 1 == fail_piece ? 12 /* ENOMEM */
             : fail_register_at == p               ? fail_register_code
                                                   : drv->host_register(device, p, n);
    pthread_mutex_lock(&pieces_lock);
    if (pieces < PIECES_MAX) piece_at[pieces] = p, piece_len[pieces] = n;
    if (rc == 0) pieces++;
    else register_failed++;
    pthread_mutex_unlock(&pieces_lock);
    return rc;
}

static int record_unregister(int device, void *p)
{
    pthread_mutex_lock(&pieces_lock);
    if (unregistered < PIECES_MAX) unregistered_at[unregistered] = p;
    unregistered++;
    pthread_mutex_unlock(&pieces_lock);
    return drv->host_unregister(device, p);
}

/* Waits until b is no longer being locked and the locking thread has let go
 * of it (it marks the state, then drops its reference). */
static void wait_pinning_settled(struct tms_backup *b)
{
    for (int i = 0; i < 10000; i++) {
        if (__atomic_load_n(&b->pinning, __ATOMIC_ACQUIRE) != TMS_PIN_RUNNING &&
            __atomic_load_n(&b->refs, __ATOMIC_ACQUIRE) == 1)
            return;
        usleep(1000);
    }
    CHECK(!"the page-locking thread let go of the backup within 10 s");
}

static struct tms_backup *new_recorded_backup(size_t size, int kind)
{
    recording_drv = *drv;
    recording_drv.host_register = record_register;
    recording_drv.host_unregister = record_unregister;
    pieces = unregistered = register_failed = 0;
    struct tms_err err = {0};
    struct tms_backup *b = NULL;
    CHECK_RC(tms_backup_new(&recording_drv, kind, 0, size, 0, &b, &err), TMS_OK);
    return b;
}

/* Pieces of b its record says are registered now. */
static int locked_pieces(const struct tms_backup *b)
{
    int n = 0;
    for (size_t k = 0; b->locked && k * TMS_PIN_PIECE_BYTES < b->size; k++) n += b->locked[k];
    return n;
}

static void test_pin_pieces(void)
{
    const size_t size = 2 * TMS_PIN_PIECE_BYTES + ((size_t)3 << 20) + 5;
    struct tms_backup *b = new_recorded_backup(size, TMS_BACKUP_MMAP);
    if (!b) return;
    CHECK(!tms_backup_pinned(b));
    tms_backup_pin_later(b);
    wait_pinning_settled(b);
    if (register_failed) {  /* a backend that cannot page-lock (hip stub without it): stays pageable */
        CHECK(!tms_backup_pinned(b) && pieces == 0 && register_failed == 1);
        tms_backup_unref(b);
        CHECK(unregistered == 0);
        return;
    }
    CHECK(tms_backup_pinned(b) && locked_pieces(b) == 3);
    pthread_mutex_lock(&pieces_lock);
    CHECK(pieces == 3);
    for (int i = 0; i < pieces && i < PIECES_MAX; i++) {
        size_t want = i < 2 ? TMS_PIN_PIECE_BYTES : size - 2 * TMS_PIN_PIECE_BYTES;
        CHECK(piece_at[i] == (char *)b->host + (size_t)i * TMS_PIN_PIECE_BYTES && piece_len[i] == want);
    }
    pthread_mutex_unlock(&pieces_lock);
    char *host = b->host;
    tms_backup_unref(b);
    CHECK(unregistered == 3);
    for (int i = 0; i < unregistered && i < PIECES_MAX; i++)
        CHECK(unregistered_at[i] == host + (size_t)i * TMS_PIN_PIECE_BYTES);

    /* The second piece fails: the first is unlocked at once (it would hold
     * memory no copy uses) and the backup stays pageable. */
    fail_piece = 2;
    b = new_recorded_backup(size, TMS_BACKUP_MMAP);
    if (b) {
        host = b->host;
        tms_backup_pin_later(b);
        wait_pinning_settled(b);
        CHECK(!tms_backup_pinned(b) && pieces == 1 && register_failed == 1);
        CHECK(unregistered == 1 && unregistered_at[0] == host && locked_pieces(b) == 0);
        tms_backup_unref(b);
        CHECK(unregistered == 1);
    }
    fail_piece = 0;
}

static int record_copy(int device, int to_host, void *host, tms_va dev, size_t n, tms_stream stream);
#define DMA_MAX 256
static size_t dma_off[DMA_MAX], dma_len[DMA_MAX];
static int dmas;
static char *dma_base;
static size_t dma_span;  /* bytes from dma_base that count as the copy's host memory */

/* Copies the size bytes at dev into b (device->host) through the recording
 * driver, each DMA recorded (dma_off: offset in b, SIZE_MAX for a staging
 * slot); returns the copy's status, the bytes copied in *done. */
static int copy_recorded(struct tms_backup *b, const char *dev, size_t size, size_t *done, struct tms_err *err)
{
    recording_drv.copy_async = record_copy;
    dma_base = b->host;
    dma_span = size;
    dmas = 0;
    struct tms_transfer item = {.device = 0, .dev = (tms_va)(uintptr_t)dev, .backup = b, .n = size};
    int rc = tms_transfer_run(&recording_drv, 1, &item, 1, err);
    *done = item.done;
    return rc;
}

/* Bytes the recorded copy DMA'd straight into the backup's memory. */
static size_t dma_straight(void)
{
    size_t straight = 0;
    for (int i = 0; i < dmas && i < DMA_MAX; i++)
        if (dma_off[i] != SIZE_MAX) straight += dma_len[i];
    return straight;
}

/* Was [p, p + n) registered (or unregistered) as one of the first count pieces? */
static int recorded_piece(char *const *at, const size_t *len, int count, const char *p, size_t n)
{
    for (int i = 0; i < count && i < PIECES_MAX; i++)
        if (at[i] == p && (!len || len[i] == n)) return 1;
    return 0;
}

/* The driver's code for out of memory (ENOMEM on the host backend, hipErrorOutOfMemory on HIP). */
static int oom_code(void)
{
    for (int code = 1; code < 1024; code++)
        if (drv->is_oom(code) && code != EOPNOTSUPP) return code;
    CHECK(!"the driver has an out-of-memory code below 1024");
    return ENOMEM;
}

/* A new pinned backup is page-locked by its first copy, a whole piece per
 * DMA, each piece registered just before the DMA into it; the copy's
 * pieces are unlocked with the backup. A piece the driver cannot lock
 * leaves the backup pageable (its other pieces unlocked at once, the bytes
 * all there); one it lacks the memory to lock fails the copy with a message
 * naming the pinned backup, and the backup's release unlocks exactly the
 * pieces that were locked. */
static void test_lock_on_copy(void)
{
    const size_t size = 2 * TMS_PIN_PIECE_BYTES + ((size_t)3 << 20) + 5;
    struct tms_region r = region("lock_on_copy", 0, TMS_BACKUP_MMAP);
    char *dev = alloc_ok(size, 0, &r);
    if (!dev) return;
    fill(dev, size, 61);
    for (int round = 0; round < 3; round++) {  /* all locked; piece 2 unsupported; piece 2 out of memory */
        struct tms_backup *b = new_recorded_backup(size, TMS_BACKUP_PINNED);
        if (!b) break;
        char *host = b->host;
        CHECK(b->ops->path(b, 1, 0, b->size) == TMS_PATH_PREPARED && b->locked && !tms_backup_pinned(b) && pieces == 0);  /* nothing locked before the copy */
        fail_register_at = round ? host + TMS_PIN_PIECE_BYTES : NULL;
        fail_register_code = round == 1 ? EOPNOTSUPP : oom_code();
        struct tms_err err = {0};
        size_t done = 0;
        CHECK_RC(copy_recorded(b, dev, size, &done, &err), round == 2 ? TMS_E_HOST_OOM : TMS_OK);
        fail_register_at = NULL;
        if (round == 2) {
            CHECK_MSG("cannot pin 67108864 bytes of host memory for a pinned backup");
            int locked = pieces;
            tms_backup_unref(b);
            CHECK(unregistered == locked);  /* each locked piece once, no other */
            for (int i = 0; i < unregistered && i < PIECES_MAX; i++)
                CHECK(recorded_piece(piece_at, NULL, pieces, unregistered_at[i], 0));
            continue;
        }
        CHECK(done == size && matches(host, size, 61));
        /* Locked pieces take one DMA straight into them; an unlocked one goes through a staging slot. */
        size_t straight = 0, staged = 0;
        for (int i = 0; i < dmas && i < DMA_MAX; i++) {
            if (dma_off[i] == SIZE_MAX) {
                staged += dma_len[i];
                continue;
            }
            size_t k = dma_off[i] / TMS_PIN_PIECE_BYTES;
            CHECK(dma_off[i] == k * TMS_PIN_PIECE_BYTES && dma_len[i] == (k < 2 ? TMS_PIN_PIECE_BYTES : size - dma_off[i]));
            CHECK(!(round == 1 && k == 1));
            straight += dma_len[i];
        }
        int unlockable = register_failed && round == 0;  /* a backend that cannot page-lock */
        CHECK(straight == (unlockable ? 0 : round == 1 ? size - TMS_PIN_PIECE_BYTES : size));
        CHECK(straight + staged == size);
        tms_backup_copied(b);
        CHECK(b->ops->path(b, 1, 0, b->size) != TMS_PATH_PREPARED);  /* later copies lock nothing more */
        if (unlockable) {  /* stays pageable */
            CHECK(!tms_backup_pinned(b) && pieces == 0 && unregistered == 0);
            tms_backup_unref(b);
            break;
        }
        if (round == 0) {
            CHECK(tms_backup_pinned(b) && locked_pieces(b) == 3 && pieces == 3 && unregistered == 0);
            for (int k = 0; k < 3; k++)
                CHECK(recorded_piece(piece_at, piece_len, pieces, host + (size_t)k * TMS_PIN_PIECE_BYTES,
                                     k < 2 ? TMS_PIN_PIECE_BYTES : size - 2 * TMS_PIN_PIECE_BYTES));
            tms_backup_unref(b);
            CHECK(unregistered == 3);
            for (int k = 0; k < 3; k++)
                CHECK(recorded_piece(unregistered_at, NULL, unregistered, host + (size_t)k * TMS_PIN_PIECE_BYTES, 0));
        } else {
            CHECK(!tms_backup_pinned(b) && locked_pieces(b) == 0 && pieces == 2 && register_failed == 1);
            CHECK(unregistered == 2 && !recorded_piece(unregistered_at, NULL, 2, host + TMS_PIN_PIECE_BYTES, 0));
            tms_backup_unref(b);
            CHECK(unregistered == 2);
        }
    }
    free_ok(dev);
}

/* A pageable backup a pause keeps across resume is locked by its first
 * copy as a pinned one is, so the pause right after the next resume already
 * goes straight to it; one not kept stays staged and is never locked. If the
 * driver lacks the memory to lock a piece, the copy still succeeds and the
 * backup stays pageable (locking it is only a speed-up), its pieces unlocked. */
static void test_retained_pageable_locked_by_first_copy(void)
{
    const size_t size = 2 * TMS_PIN_PIECE_BYTES + ((size_t)3 << 20) + 5;
    struct tms_region r = region("retained_first_copy", 0, TMS_BACKUP_MMAP);
    char *dev = alloc_ok(size, 0, &r);
    if (!dev) return;
    fill(dev, size, 67);
    for (int kept = 0; kept < 2; kept++) {
        struct tms_backup *b = new_recorded_backup(size, TMS_BACKUP_MMAP);
        if (!b) break;
        if (kept) tms_backup_will_be_kept(b);
        CHECK(b->ops->path(b, 1, 0, b->size) == (kept ? TMS_PATH_PREPARED : TMS_PATH_STAGED));
        struct tms_err err = {0};
        size_t done = 0;
        CHECK_RC(copy_recorded(b, dev, size, &done, &err), TMS_OK);
        CHECK(done == size && matches(b->host, size, 67));
        size_t straight = dma_straight();
        tms_backup_copied(b);
        if (!kept) {  /* staged and unlocked until the background locks it */
            CHECK(straight == 0 && !tms_backup_pinned(b) && pieces == 0 && register_failed == 0);
            tms_backup_pin_later(b);
            wait_pinning_settled(b);
        } else {
            tms_backup_pin_later(b);  /* queued as every kept backup is: nothing left to lock */
        }
        int lockable = !register_failed;  /* a backend that cannot page-lock stays staged */
        if (kept) CHECK(straight == (lockable ? size : 0));
        CHECK(tms_backup_pinned(b) == lockable && locked_pieces(b) == (lockable ? 3 : 0));
        CHECK(pieces == (lockable ? 3 : 0));  /* no piece locked twice */
        tms_backup_unref(b);
        CHECK(unregistered == (lockable ? 3 : 0));
    }
    struct tms_backup *b = new_recorded_backup(size, TMS_BACKUP_MMAP);
    if (b) {
        tms_backup_will_be_kept(b);
        fail_register_at = (char *)b->host + TMS_PIN_PIECE_BYTES;
        fail_register_code = oom_code();
        struct tms_err err = {0};
        size_t done = 0;
        CHECK_RC(copy_recorded(b, dev, size, &done, &err), TMS_OK);
        fail_register_at = NULL;
        CHECK(done == size && matches(b->host, size, 67));
        tms_backup_copied(b);
        CHECK(!tms_backup_pinned(b) && locked_pieces(b) == 0 && unregistered == pieces);
        tms_backup_unref(b);
        CHECK(unregistered == pieces);
    }
    free_ok(dev);
}

/* Copies to page-locked host memory never cross the end of a registered
 * piece, whatever TMS_BACKUP_BLOCK_BYTES says (ctest core_host_block_3mib
 * runs this with 3 MiB blocks), and together cover every byte once. */
static int record_copy(int device, int to_host, void *host, tms_va dev, size_t n, tms_stream stream)
{
    pthread_mutex_lock(&pieces_lock);
    /* Offsets from dma_base; a copy into a staging slot (outside) reads as SIZE_MAX. */
    uintptr_t at = (uintptr_t)host, base = (uintptr_t)dma_base;
    if (dmas < DMA_MAX) dma_off[dmas] = at >= base && at - base < dma_span ? at - base : SIZE_MAX, dma_len[dmas] = n;
    dmas++;
    pthread_mutex_unlock(&pieces_lock);
    return drv->copy_async(device, to_host, host, dev, n, stream);
}

static void test_direct_blocks(void)
{
    const size_t size = 2 * TMS_PIN_PIECE_BYTES + ((size_t)5 << 20) + 7;
    struct tms_region r = region("direct_blocks", 0, TMS_BACKUP_MMAP);
    char *dev = alloc_ok(size, 0, &r);
    struct tms_err err = {0};
    struct tms_backup *b = NULL;
    CHECK_RC(tms_backup_new(drv, TMS_BACKUP_PINNED, 0, size, 0, &b, &err), TMS_OK);
    if (!dev || !b) return;
    fill(dev, size, 16);
    struct tms_transfer item = {.device = 0, .dev = (tms_va)(uintptr_t)dev, .backup = b, .n = size};
    CHECK_RC(tms_transfer_run(drv, 1, &item, 1, &err), TMS_OK);  /* the first copy page-locks it */
    tms_backup_copied(b);
    if (tms_backup_pinned(b)) {  /* else a backend that cannot page-lock: every copy stages */
        struct tms_driver copying = *drv;
        copying.copy_async = record_copy;
        dma_base = b->host;
        dma_span = size;
        for (int to_host = 0; to_host < 2; to_host++) {
            dmas = 0;
            if (!to_host) memset(dev, 0, size);
            CHECK_RC(tms_transfer_run(&copying, to_host, &item, 1, &err), TMS_OK);
            CHECK(item.done == size && dmas <= DMA_MAX);
            size_t covered = 0;
            for (int i = 0; i < dmas && i < DMA_MAX; i++) {
                CHECK(dma_off[i] != SIZE_MAX);  /* straight into the backup */
                CHECK(dma_len[i] > 0 && dma_off[i] / TMS_PIN_PIECE_BYTES == (dma_off[i] + dma_len[i] - 1) / TMS_PIN_PIECE_BYTES);
                covered += dma_len[i];
            }
            CHECK(covered == size);
        }
    }
    CHECK(matches(dev, size, 16) && matches(b->host, size, 16));
    tms_backup_unref(b);
    free_ok(dev);
}

/* A restored callback runs once for each host->device item whose copy
 * completes, on the worker that completes it, with every byte done; never
 * for an item whose copy failed, nor device->host. */
static int restored_calls[3];  /* atomic */
static const struct tms_transfer *restored_items;
static char *failing_dev;

static void count_restored(void *arg)
{
    int i = (int)(intptr_t)arg;
    CHECK(restored_items[i].done == restored_items[i].n);
    __atomic_add_fetch(&restored_calls[i], 1, __ATOMIC_RELAXED);
}

static int copy_failing_one(int device, int to_host, void *host, tms_va dev, size_t n, tms_stream stream)
{
    if (failing_dev && (char *)(uintptr_t)dev <= failing_dev && failing_dev < (char *)(uintptr_t)dev + n) return EIO;
    return drv->copy_async(device, to_host, host, dev, n, stream);
}

static void test_restored_callback(void)
{
    enum { N = 3 };
    const size_t sizes[N] = {4093, 2 * TMS_DIRECT_BLOCK_BYTES + 5, gran};
    struct tms_region r = region("restored", 0, TMS_BACKUP_MMAP);
    char *dev[N] = {0};
    struct tms_backup *backups[N] = {0};
    static struct tms_transfer items[N];  /* restored_items points here */
    struct tms_driver failing = *drv;
    failing.copy_async = copy_failing_one;
    restored_items = items;
    struct tms_err err = {0};
    for (int round = 0; round < 3; round++) {  /* to host, to device, to device with item 1 failing */
        for (int i = 0; i < N; i++) {
            if (round == 0) {
                dev[i] = alloc_ok(sizes[i], 0, &r);
                CHECK_RC(tms_backup_new(drv, TMS_BACKUP_MMAP, 0, sizes[i], 0, &backups[i], &err), TMS_OK);
                if (!dev[i] || !backups[i]) goto out;
                fill(dev[i], sizes[i], 40 + i);
            }
            items[i] = (struct tms_transfer){.device = 0, .dev = (tms_va)(uintptr_t)dev[i], .backup = backups[i],
                                             .n = sizes[i], .restored = count_restored,
                                             .restored_arg = (void *)(intptr_t)i};
            restored_calls[i] = 0;
        }
        failing_dev = round == 2 ? dev[1] + TMS_DIRECT_BLOCK_BYTES : NULL;  /* in one of its later blocks */
        CHECK_RC(tms_transfer_run(&failing, round == 0, items, N, &err), round == 2 ? TMS_E_DRIVER : TMS_OK);
        for (int i = 0; i < N; i++) {
            int whole = items[i].done == items[i].n;
            if (round < 2) CHECK(whole);
            if (round == 2 && i == 1) CHECK(!whole);  /* after it the pool may skip the rest */
            CHECK(restored_calls[i] == (round > 0 && whole));
        }
    }
out:
    for (int i = 0; i < N; i++) {
        if (dev[i]) free_ok(dev[i]);
        tms_backup_unref(backups[i]);
    }
}

/* Prepare hooks (a resume maps each allocation so): called in item order in
 * the caller's thread while the earlier items copy; no block of an item is
 * copied before the hook at or before it has run; a hook that fails leaves
 * its item and the later ones uncopied without failing the run. */
enum { PREP_N = 4 };
static pthread_t prep_caller;
static const int prep_hook[PREP_N] = {0, 0, 2, 3};  /* item 1 has none: it is ready with item 0 */
static struct tms_transfer prep_items[PREP_N];
static int prep_done;       /* atomic: items [0, prep_done) prepared */
static int prep_fail_at;    /* the hook that fails, or -1 */
static int prep_early;      /* atomic: blocks copied before their hook */
static int prep_calls[PREP_N];
static pthread_mutex_t prep_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t prep_cond = PTHREAD_COND_INITIALIZER;

static int prep_first_copied;  /* atomic: a block of item 0 went */

/* The last hook waits (boundedly) for item 0's copy: the hooks run while the copies do. */
static int prepare_item(void *arg)
{
    int i = (int)(intptr_t)arg;
    prep_calls[i]++;
    CHECK(pthread_equal(pthread_self(), prep_caller));
    if (i == prep_fail_at) return TMS_E_OOM;
    pthread_mutex_lock(&prep_lock);
    if (i == PREP_N - 1) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 20;
        while (!__atomic_load_n(&prep_first_copied, __ATOMIC_ACQUIRE) &&
               pthread_cond_timedwait(&prep_cond, &prep_lock, &until) == 0) {
        }
        CHECK(__atomic_load_n(&prep_first_copied, __ATOMIC_ACQUIRE));
    }
    __atomic_store_n(&prep_done, i == 0 ? 2 : i + 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&prep_lock);
    return 0;
}

static int copy_after_prepare(int device, int to_host, void *host, tms_va dev, size_t n, tms_stream stream)
{
    for (int i = 0; i < PREP_N; i++) {
        const struct tms_transfer *it = &prep_items[i];
        if (dev < it->dev || dev >= it->dev + it->n) continue;
        if (__atomic_load_n(&prep_done, __ATOMIC_ACQUIRE) <= prep_hook[i]) __atomic_add_fetch(&prep_early, 1, __ATOMIC_RELAXED);
        if (i == 0) {
            pthread_mutex_lock(&prep_lock);
            __atomic_store_n(&prep_first_copied, 1, __ATOMIC_RELEASE);
            pthread_cond_broadcast(&prep_cond);
            pthread_mutex_unlock(&prep_lock);
        }
    }
    return drv->copy_async(device, to_host, host, dev, n, stream);
}

static void test_prepare_hooks(void)
{
    const size_t sizes[PREP_N] = {4093, gran, 12345, 5000};
    struct tms_region r = region("prepared", 0, TMS_BACKUP_MMAP);
    char *dev[PREP_N] = {0};
    struct tms_backup *backups[PREP_N] = {0};
    struct tms_driver hooked = *drv;
    hooked.copy_async = copy_after_prepare;
    prep_caller = pthread_self();
    struct tms_err err = {0};
    for (int i = 0; i < PREP_N; i++) {
        dev[i] = alloc_ok(sizes[i], 0, &r);
        CHECK_RC(tms_backup_new(drv, TMS_BACKUP_MMAP, 0, sizes[i], 0, &backups[i], &err), TMS_OK);
        if (!dev[i] || !backups[i]) goto out;
        fill(dev[i], sizes[i], 60 + i);
        prep_items[i] = (struct tms_transfer){.device = 0, .dev = (tms_va)(uintptr_t)dev[i], .backup = backups[i],
                                              .n = sizes[i]};
    }
    CHECK_RC(tms_transfer_run(drv, 1, prep_items, PREP_N, &err), TMS_OK);
    for (int round = 0; round < 2; round++) {  /* every hook succeeds; the third fails */
        prep_fail_at = round == 0 ? -1 : 2;
        prep_done = 0, prep_early = 0, prep_first_copied = 0;
        for (int i = 0; i < PREP_N; i++) {
            memset(dev[i], 0, sizes[i]);
            prep_calls[i] = 0;
            if (prep_hook[i] == i) prep_items[i].prepare = prepare_item, prep_items[i].prepare_arg = (void *)(intptr_t)i;
        }
        CHECK_RC(tms_transfer_run(&hooked, 0, prep_items, PREP_N, &err), TMS_OK);
        CHECK(prep_early == 0);
        for (int i = 0; i < PREP_N; i++) {
            int copied = round == 0 || i < 2;
            CHECK(prep_calls[i] == (prep_hook[i] == i && (round == 0 || i <= 2)));
            CHECK(prep_items[i].done == (copied ? sizes[i] : 0));
            if (copied) CHECK(matches(dev[i], sizes[i], 60 + i));
        }
    }
out:
    for (int i = 0; i < PREP_N; i++) {
        if (dev[i]) free_ok(dev[i]);
        tms_backup_unref(backups[i]);
    }
}

/* Released once restored: only while the owner's reference is the last,
 * never a file; the record stays for the owner to drop. */
static void test_release_restored(void)
{
    struct tms_err err = {0};
    for (int kind = TMS_BACKUP_PINNED; kind <= TMS_BACKUP_MMAP; kind++) {
        struct tms_backup *b = NULL;
        CHECK_RC(tms_backup_new(drv, kind, 0, gran, 0, &b, &err), TMS_OK);
        if (!b) continue;
        fill(b->host, gran, 50 + kind);
        tms_backup_ref(b);  /* a view */
        tms_backup_release_restored(b);
        CHECK(b->host && matches(b->host, gran, 50 + kind));
        tms_backup_unref(b);
        tms_backup_release_restored(b);
        CHECK(b->host == NULL);
        tms_backup_unref(b);  /* frees the record, nothing else */
    }
}

/* A sysfs tree of the test's own: which PCI functions count as GPUs, and
 * the NUMA node of a bus id however the driver spells it. */
static void write_file(const char *dir, const char *name, const char *text)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    if (f) fputs(text, f), fclose(f);
}

static void fake_pci(const char *root, const char *id, const char *vendor, const char *class_code, const char *node)
{
    char dir[512];
    snprintf(dir, sizeof dir, "%s/bus/pci/devices/%s", root, id);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", dir);
    CHECK(system(cmd) == 0);
    write_file(dir, "vendor", vendor);
    write_file(dir, "class", class_code);
    write_file(dir, "numa_node", node);
}

static void test_topology(void)
{
    char root[] = "/tmp/tms-sysfs-XXXXXX";
    CHECK(mkdtemp(root) != NULL);
    CHECK(tms_topology_host_gpus(root) == 0);  /* no bus at all */
    fake_pci(root, "0000:3b:00.0", "0x10de\n", "0x030200\n", "1\n");  /* H100: 3D controller */
    fake_pci(root, "0000:86:00.0", "0x10de\n", "0x030200\n", "0\n");
    fake_pci(root, "0000:c1:00.0", "0x1002\n", "0x120000\n", "-1\n");  /* Instinct: accelerator */
    fake_pci(root, "0000:07:00.0", "0x10de\n", "0x068000\n", "0\n");  /* NVSwitch: a bridge */
    fake_pci(root, "0000:00:02.0", "0x8086\n", "0x030000\n", "0\n");  /* another vendor's VGA */
    CHECK(tms_topology_host_gpus(root) == 3);
    CHECK(tms_topology_pci_numa_node(root, "0000:3b:00.0") == 1);
    CHECK(tms_topology_pci_numa_node(root, "00000000:3B:00.0") == 1);  /* nvidia-smi's spelling */
    CHECK(tms_topology_pci_numa_node(root, "0000:86:00.0") == 0);
    CHECK(tms_topology_pci_numa_node(root, "0000:c1:00.0") == -1);     /* the kernel does not know */
    CHECK(tms_topology_pci_numa_node(root, "0000:99:00.0") == -1);     /* no such device */
    CHECK(tms_topology_pci_numa_node(root, "3b:00.0") == -1);
    CHECK(tms_topology_pci_numa_node(root, "0000:3b:00.0 trailing") == -1);
    CHECK(tms_topology_pci_numa_node(root, NULL) == -1);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", root);
    CHECK(system(cmd) == 0);

    /* The copy workers: the affinity mask, or the visible GPUs' share of the host. */
    CHECK(tms_transfer_default_workers(16, 16, 1, 1) == 16);
    CHECK(tms_transfer_default_workers(32, 32, 2, 1) == 16);
    CHECK(tms_transfer_default_workers(16, 16, 2, 1) == 8);    /* two ranks free on 16 cores: 8 each */
    CHECK(tms_transfer_default_workers(32, 32, 8, 8) == 16);   /* one process driving every GPU */
    CHECK(tms_transfer_default_workers(64, 64, 8, 1) == 8);    /* eight ranks, each seeing all: 8 cores each */
    CHECK(tms_transfer_default_workers(32, 32, 8, 2) == 8);
    CHECK(tms_transfer_default_workers(24, 96, 8, 1) == 16);   /* pinned to 24 cores: the mask decides */
    CHECK(tms_transfer_default_workers(6, 96, 8, 1) == 6);
    CHECK(tms_transfer_default_workers(128, 128, 8, 1) == 16);
    CHECK(tms_transfer_default_workers(4, 4, 4, 1) == 2);
    CHECK(tms_transfer_default_workers(1, 1, 0, 0) == 2);
    CHECK(tms_transfer_default_workers(16, 16, 0, 2) == 16);   /* sysfs says nothing: the mask */

    /* Placement: the kernel records the preferred node on the range (where
     * the container lets it set one: Docker's default seccomp says EPERM). */
    size_t size = (size_t)4 << 20;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    CHECK(p != MAP_FAILED);
    int rc = tms_topology_prefer_node(p, size, 0);
    if (rc == EPERM || rc == ENOSYS) {
        printf("   (mbind not permitted here: placement checks skipped)\n");
    } else {
        CHECK(rc == 0);
        int mode = -1;
        unsigned long mask[16] = {0};
        CHECK(syscall(SYS_get_mempolicy, &mode, mask, 1025ul, p, 2ul /* MPOL_F_ADDR */) == 0);
        CHECK(mode == 1 /* MPOL_PREFERRED */ && mask[0] == 1ul);
    }
    CHECK(tms_topology_prefer_node(p, size, 1024) == EINVAL);
    CHECK(tms_topology_prefer_node(p, size, -1) == EINVAL);
    munmap(p, size);
}

static const struct test tests[] = {
    {"config", test_config},
    {"driver", test_driver},
    {"basics", test_basics},
    {"backup_pinned", test_backup_pinned},
    {"backup_mmap", test_backup_mmap},
    {"discard", test_discard},
    {"state_errors", test_state_errors},
    {"free_paused", test_free_paused},
    {"retain", test_retain},
    {"margin_and_oom", test_margin_and_oom},
    {"sizes", test_sizes},
    {"tags", test_tags},
    {"tag_lists", test_tag_lists},
    {"tag_reclaim", test_tag_reclaim},
    {"span_index", test_span_index},
    {"interior_lookup", test_interior_lookup},
    {"devices", test_devices},
    {"threads", test_threads},  /* with nowait, what ThreadSanitizer runs: `test_core_host threads nowait` */
    {"nowait", test_nowait},
    {"affinity", test_affinity},
    {"pin_pieces", test_pin_pieces},
    {"direct_blocks", test_direct_blocks},
    {"lock_on_copy", test_lock_on_copy},
    {"retained_pageable_locked_by_first_copy", test_retained_pageable_locked_by_first_copy},
    {"restored_callback", test_restored_callback},
    {"release_restored", test_release_restored},
    {"prepare_hooks", test_prepare_hooks},
    {"topology", test_topology},
};

/* The scenarios named on the command line (all when none is), past its options. */
static int selected(const char *name, int argc, char **argv)
{
    int named = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--threads-rounds") == 0 || strcmp(argv[i], "--nowait-mib") == 0) {
            i++;
            continue;
        }
        named = 1;
        if (strcmp(argv[i], name) == 0) return 1;
    }
    return !named;
}

/* After every test: nothing left in the table, every emulated byte back. */
static void check_clean(void)
{
    struct tms_err err;
    struct tms_stats_row *rows = NULL;
    size_t n = 0;
    CHECK_RC(tms_core_stats(&rows, &n, &err), TMS_OK);
    for (size_t i = 0; i < n; i++) {
        const struct tms_stats *st = &rows[i].stats;
        CHECK(st->allocations == 0 && st->bytes_requested == 0 && st->bytes_reserved == 0 && st->bytes_mapped == 0 &&
              st->bytes_paused == 0 && st->bytes_backup_pinned == 0 && st->bytes_backup_mmap == 0);
    }
    free(rows);
    CHECK(count_rows(-1, -1) == 0);
    for (int d = 0; d < device_count(); d++) {
        size_t free_b = 0, total = 0;
        CHECK(drv->mem_get_info(d, &free_b, &total) == 0 && free_b == total);
    }
}

static void run(const struct test *t)
{
    int failed_before = __atomic_load_n(&failed, __ATOMIC_RELAXED);
    t->run();
    check_clean();
    int now = __atomic_load_n(&failed, __ATOMIC_RELAXED);
    printf("%s %s\n", now == failed_before ? "ok  " : "FAIL", t->name);
}

int main(int argc, char **argv)
{
    /* 1 GiB emulated devices keep the OOM tests small; an outer setting wins. */
    setenv("TMS_HOST_DEVICE_BYTES", "1073741824", 0);
    setenv("HIP_STUB_DEVICE_BYTES", "1073741824", 0);
    backend = getenv("TMS_BACKEND");
    if (!backend || !*backend) backend = "host";
    struct tms_err err = {0};
    if (tms_driver_select(backend, &err) || tms_driver_get(&drv, &err) || drv->granularity(0, &gran)) {
        fprintf(stderr, "cannot load the %s backend: %s\n", backend, err.msg);
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        int rounds = strcmp(argv[i], "--threads-rounds") == 0, mib = strcmp(argv[i], "--nowait-mib") == 0;
        if (!rounds && !mib) continue;
        int n = i + 1 < argc ? atoi(argv[i + 1]) : 0;
        if (n < 1 + mib) {  /* nowait samples the first and the last MiB */
            fprintf(stderr, "%s wants a number of %d or more\n", argv[i], 1 + mib);
            return 2;
        }
        if (rounds) threads_rounds = n;
        else nowait_mib = (size_t)n;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    tms_core_set_retain(0);
    tms_core_set_margin(0);
    printf("%s backend: %d devices, granularity %zu, TMS_CHUNK_BYTES=%zu, default chunk %zu\n", backend,
           device_count(), gran, tms_defaults()->chunk_bytes, drv->default_chunk_bytes());

    const char *fault = getenv("TMS_FAULT");
    if (fault && *fault) {
        /* Call counts run from process start: a fault scenario runs alone. */
        if (strcmp(backend, "host") != 0)
            check_at(0, __FILE__, __LINE__, "TMS_FAULT runs on the host backend", backend);
        else if (strcmp(fault, FAULT_PLAN) == 0)
            run(&(struct test){"faults", test_faults});
        else if (strcmp(fault, FAULT_PLAN_CHUNKED) == 0 && tms_defaults()->chunk_bytes == gran)
            run(&(struct test){"faults_chunked", test_faults_chunked});
        else if (strcmp(fault, FAULT_PLAN_EARLY) == 0 && tms_defaults()->backup_threads == 1)
            run(&(struct test){"faults_early_release", test_faults_early_release});
        else
            check_at(0, __FILE__, __LINE__, "TMS_FAULT is a plan a scenario is written for",
                     "TMS_FAULT=" FAULT_PLAN ", TMS_FAULT=" FAULT_PLAN_CHUNKED " with TMS_CHUNK_BYTES=2MiB, or "
                     "TMS_FAULT=" FAULT_PLAN_EARLY " with TMS_BACKUP_THREADS=1");
    } else {
        for (size_t i = 0; i < sizeof tests / sizeof *tests; i++)
            if (selected(tests[i].name, argc, argv)) run(&tests[i]);
    }
    return check_summary();
}
