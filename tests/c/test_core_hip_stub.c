/* The hip backend against tests/c/hip_stub.c (TMS_HIP_LIBRARY): what the
 * shared scenarios of test_core_host.c (run with TMS_BACKEND=hip) do not
 * cover. The default chunking of the backend (ROCm 6.x: 256 MiB chunks,
 * ROCm 7: none) on a 600 MiB allocation, the calling thread's current device,
 * application work still queued when pause and free come, OOM messages, and
 * the stub's own argument checks (without them the other tests prove little).
 *
 *   test_core_hip_stub <default chunk in MiB the stub's HIP_STUB_VERSION implies>
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "platform/config.h"
#include "backup/backup.h"
#include "core/core.h"
#include "platform/driver.h"
#include "platform/hip_abi.h"
#include "check.h"

#define MiB ((size_t)1 << 20)

static const struct tms_driver *drv;
static size_t gran, want_chunk;

/* The stub's entry points, called directly (same library handle as the backend's). */
static struct {
    int (*GetDevice)(int *);
    int (*SetDevice)(int);
    int (*MemAddressReserve)(void **, size_t, size_t, void *, unsigned long long);
    int (*MemAddressFree)(void *, size_t);
    int (*MemCreate)(tms_hipMemGenericAllocationHandle_t *, size_t, const tms_hipMemAllocationProp *,
                     unsigned long long);
    int (*MemRelease)(tms_hipMemGenericAllocationHandle_t);
    int (*MemMap)(void *, size_t, size_t, tms_hipMemGenericAllocationHandle_t, unsigned long long);
    int (*MemUnmap)(void *, size_t);
    int (*MemSetAccess)(void *, size_t, const tms_hipMemAccessDesc *, size_t);
    int (*StreamCreateWithFlags)(tms_hipStream_t *, unsigned);
    int (*MemcpyAsync)(void *, const void *, size_t, int, tms_hipStream_t);
    int (*HostRegister)(void *, size_t, unsigned);
    int (*HostUnregister)(void *);
} hip;

static int load_stub(void)
{
    const char *path = getenv("TMS_HIP_LIBRARY");
    void *lib = path ? dlopen(path, RTLD_NOW | RTLD_NOLOAD) : NULL;  /* the backend loaded it already */
    if (!lib) return 0;
#define RESOLVE(field)                          \
    {                                           \
        void *fn = dlsym(lib, "hip" #field);    \
        memcpy(&hip.field, &fn, sizeof fn);     \
    }
    RESOLVE(GetDevice);
    RESOLVE(SetDevice);
    RESOLVE(MemAddressReserve);
    RESOLVE(MemAddressFree);
    RESOLVE(MemCreate);
    RESOLVE(MemRelease);
    RESOLVE(MemMap);
    RESOLVE(MemUnmap);
    RESOLVE(MemSetAccess);
    RESOLVE(StreamCreateWithFlags);
    RESOLVE(MemcpyAsync);
    RESOLVE(HostRegister);
    RESOLVE(HostUnregister);
#undef RESOLVE
    return hip.GetDevice && hip.SetDevice && hip.MemAddressReserve && hip.MemAddressFree && hip.MemCreate &&
           hip.MemRelease && hip.MemMap && hip.MemUnmap && hip.MemSetAccess && hip.StreamCreateWithFlags &&
           hip.MemcpyAsync && hip.HostRegister && hip.HostUnregister;
}

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

static size_t free_bytes(int device)
{
    size_t free_b = 0, total = 0;
    CHECK(drv->mem_get_info(device, &free_b, &total) == 0);
    return free_b;
}

static int current_device(void)
{
    int d = -1;
    CHECK(hip.GetDevice(&d) == TMS_hipSuccess);
    return d;
}

static struct tms_region region(const char *tag, int backup, int kind)
{
    struct tms_err err;
    struct tms_region r = {.active = 1, .tag_id = -1, .backup = backup, .backup_kind = kind};
    CHECK_RC(tms_core_tag_id(tag, &r.tag_id, &err), TMS_OK);
    return r;
}

/* A byte pattern at a few offsets only: the big allocations stay untouched. */
static void mark(unsigned char *p, const size_t *offsets, int n, unsigned char salt)
{
    for (int i = 0; i < n; i++) p[offsets[i]] = (unsigned char)(offsets[i] * 131 + salt);
}

static int marked(const unsigned char *p, const size_t *offsets, int n, unsigned char salt)
{
    for (int i = 0; i < n; i++)
        if (p[offsets[i]] != (unsigned char)(offsets[i] * 131 + salt)) return 0;
    return 1;
}

/* ---- tests ------------------------------------------------------------------ */

static void test_loaded(void)
{
    struct tms_err err;
    CHECK(strcmp(tms_driver_loaded_name(), "hip") == 0);
    CHECK_RC(tms_driver_select("host", &err), TMS_E_STATE);
    CHECK(gran == 2 * MiB);
    int n = 0;
    CHECK(drv->device_count(&n) == 0 && n == 2);
    CHECK(strcmp(drv->code_name(TMS_hipErrorOutOfMemory), "hipErrorOutOfMemory") == 0);  /* hipGetErrorName */
    CHECK(drv->is_oom(TMS_hipErrorOutOfMemory) && !drv->is_oom(1));
    CHECK(drv->default_chunk_bytes() == want_chunk);
}

/* 600 MiB: three chunks (256 + 256 + 88 MiB) under ROCm 6.x, one under 7. */
static void test_default_chunking(void)
{
    struct tms_err err;
    CHECK(!tms_defaults()->chunk_bytes_set);
    struct tms_region r = region("big", 0, TMS_BACKUP_MMAP);
    size_t size = 600 * MiB - 3, total = free_bytes(0);
    int want = want_chunk ? (int)((600 * MiB + want_chunk - 1) / want_chunk) : 1;
    unsigned char *p = NULL;
    CHECK_RC(tms_core_alloc(size, 0, &r, (void **)&p, &err), TMS_OK);
    if (!p) return;
    CHECK(info_of(p).n_chunks == want && info_of(p).reserved == 600 * MiB);
    CHECK(free_bytes(0) == total - 600 * MiB);
    const size_t at[] = {0, 256 * MiB - 1, 256 * MiB, 512 * MiB - 1, 512 * MiB, size - 1};
    enum { N = sizeof at / sizeof *at };
    mark(p, at, N, 1);
    CHECK(marked(p, at, N, 1));
    CHECK_RC(tms_core_pause("big", &err), TMS_OK);
    CHECK(free_bytes(0) == total);
    CHECK_RC(tms_core_resume("big", &err), TMS_OK);
    mark(p, at, N, 2);  /* every chunk is mapped and writable again */
    CHECK(marked(p, at, N, 2));
    CHECK_RC(tms_core_free(p, &err), TMS_OK);
    CHECK(free_bytes(0) == total);

    /* With a backup, across the default chunk boundary (partial last chunk). */
    struct tms_region bk = region("big-bk", 1, TMS_BACKUP_MMAP);
    size = 256 * MiB + 3 * MiB + 7;
    CHECK_RC(tms_core_alloc(size, 0, &bk, (void **)&p, &err), TMS_OK);
    if (!p) return;
    CHECK(info_of(p).n_chunks == (want_chunk ? 2 : 1));
    const size_t at2[] = {0, 4096, 256 * MiB - 1, 256 * MiB, size - 1};
    enum { N2 = sizeof at2 / sizeof *at2 };
    mark(p, at2, N2, 3);
    CHECK_RC(tms_core_pause("big-bk", &err), TMS_OK);
    CHECK(free_bytes(0) == total);
    CHECK_RC(tms_core_resume("big-bk", &err), TMS_OK);
    CHECK(marked(p, at2, N2, 3));
    CHECK_RC(tms_core_free(p, &err), TMS_OK);
    CHECK(free_bytes(0) == total);
}

static void *other_thread(void *arg)
{
    (void)arg;
    return (void *)(intptr_t)current_device();
}

/* Device -1 is the thread's current device; operations on another device
 * switch to it and back. */
static void test_current_device(void)
{
    struct tms_err err;
    struct tms_region r = region("dev", 1, TMS_BACKUP_PINNED);
    size_t free0 = free_bytes(0), free1 = free_bytes(1);
    CHECK(current_device() == 0);
    CHECK(hip.SetDevice(1) == TMS_hipSuccess);
    pthread_t t;
    void *theirs = (void *)-1;
    CHECK(pthread_create(&t, NULL, other_thread, NULL) == 0 && pthread_join(t, &theirs) == 0);
    CHECK((intptr_t)theirs == 0);  /* per thread, as in HIP */

    unsigned char *p1 = NULL, *p0 = NULL;
    CHECK_RC(tms_core_alloc(3 * MiB, -1, &r, (void **)&p1, &err), TMS_OK);
    CHECK_RC(tms_core_alloc(MiB, 0, &r, (void **)&p0, &err), TMS_OK);
    if (!p0 || !p1) return;
    CHECK(info_of(p1).device == 1 && info_of(p0).device == 0);
    CHECK(free_bytes(1) == free1 - 4 * MiB && free_bytes(0) == free0 - 2 * MiB);
    CHECK(current_device() == 1);  /* mem_get_info(0) switched and came back */
    memset(p1, 0x11, 3 * MiB);
    memset(p0, 0x22, MiB);
    CHECK_RC(tms_core_pause("dev", &err), TMS_OK);
    CHECK(free_bytes(1) == free1 && free_bytes(0) == free0);
    CHECK_RC(tms_core_resume("dev", &err), TMS_OK);
    CHECK(p1[0] == 0x11 && p1[3 * MiB - 1] == 0x11 && p0[0] == 0x22 && p0[MiB - 1] == 0x22);
    CHECK(current_device() == 1);
    CHECK_RC(tms_core_free(p0, &err), TMS_OK);
    CHECK_RC(tms_core_free(p1, &err), TMS_OK);
    CHECK(current_device() == 1);
    CHECK(hip.SetDevice(0) == TMS_hipSuccess);
    CHECK(free_bytes(1) == free1 && free_bytes(0) == free0);
}

/* The application's work still queued on its own stream (the stub runs a
 * queued copy only at a synchronize) when pause and free come: the core must
 * synchronize the device first. Else the stub aborts on the unmap, or the
 * backup misses the bytes. */
static void test_work_in_flight(void)
{
    struct tms_err err;
    struct tms_region bk = region("flight-bk", 1, TMS_BACKUP_MMAP), discard = region("flight", 0, TMS_BACKUP_MMAP);
    static unsigned char pattern[3 * MiB];
    for (size_t i = 0; i < sizeof pattern; i++) pattern[i] = (unsigned char)(i * 7 + 1);
    tms_hipStream_t user = NULL;
    CHECK(hip.StreamCreateWithFlags(&user, 0) == TMS_hipSuccess);  /* on device 0, the current one */
    unsigned char *p = NULL, *q = NULL;
    CHECK_RC(tms_core_alloc(sizeof pattern, 0, &bk, (void **)&p, &err), TMS_OK);
    CHECK_RC(tms_core_alloc(sizeof pattern, 0, &discard, (void **)&q, &err), TMS_OK);
    if (!p || !q) return;
    memset(p, 0, sizeof pattern);
    CHECK(hip.MemcpyAsync(p, pattern, sizeof pattern, TMS_hipMemcpyHostToDevice, user) == TMS_hipSuccess);
    CHECK(p[0] == 0);  /* still queued */
    CHECK_RC(tms_core_pause("flight-bk", &err), TMS_OK);
    CHECK_RC(tms_core_resume("flight-bk", &err), TMS_OK);
    CHECK(memcmp(p, pattern, sizeof pattern) == 0);  /* the backup saw the finished copy */
    CHECK(hip.MemcpyAsync(q, pattern, sizeof pattern, TMS_hipMemcpyHostToDevice, user) == TMS_hipSuccess);
    CHECK_RC(tms_core_pause("flight", &err), TMS_OK);
    CHECK_RC(tms_core_resume("flight", &err), TMS_OK);
    CHECK(hip.MemcpyAsync(q, pattern, sizeof pattern, TMS_hipMemcpyHostToDevice, user) == TMS_hipSuccess);
    CHECK_RC(tms_core_free(q, &err), TMS_OK);
    CHECK(hip.MemcpyAsync(p, pattern, sizeof pattern, TMS_hipMemcpyHostToDevice, user) == TMS_hipSuccess);
    CHECK_RC(tms_core_pause("flight-bk", &err), TMS_OK);
    CHECK_RC(tms_core_free(p, &err), TMS_OK);  /* paused: nothing to wait for */
}

static void test_oom(void)
{
    struct tms_err err;
    struct tms_region r = region("oom", 0, TMS_BACKUP_MMAP);
    size_t free0 = free_bytes(0), total = 0, ignored = 0;
    CHECK(drv->mem_get_info(0, &ignored, &total) == 0);
    void *p = (void *)1;
    CHECK_RC(tms_core_alloc(total + 1, 0, &r, &p, &err), TMS_E_OOM);
    CHECK_MSG("hipErrorOutOfMemory");
    CHECK(free_bytes(0) == free0 && info_of(p).ptr == 0);
}

/* The stub refuses what the real runtime refuses. */
static void test_stub_checks(void)
{
    tms_hipMemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = TMS_hipMemAllocationTypePinned;
    prop.location.type = TMS_hipMemLocationTypeDevice;
    tms_hipMemAccessDesc rw = {.location = {.type = TMS_hipMemLocationTypeDevice, .id = 0},
                               .flags = TMS_hipMemAccessFlagsProtReadWrite};
    void *va = NULL;
    tms_hipMemGenericAllocationHandle_t h = NULL, h2 = NULL;
    CHECK(hip.SetDevice(2) == TMS_hipErrorInvalidDevice && hip.SetDevice(-1) == TMS_hipErrorInvalidDevice);
    CHECK(current_device() == 0);
    CHECK(hip.MemAddressReserve(&va, 3 * MiB, 0, NULL, 0) != 0);  /* not a granule multiple */
    CHECK(hip.MemAddressReserve(&va, 8 * MiB, 0, NULL, 0) == 0);
    CHECK(hip.MemCreate(&h, 3 * MiB, &prop, 0) != 0);
    prop.location.id = 2;
    CHECK(hip.MemCreate(&h, 2 * MiB, &prop, 0) != 0);  /* no such device */
    prop.location.id = 0;
    CHECK(hip.MemCreate(&h, 4 * MiB, &prop, 0) == 0);
    CHECK(hip.MemCreate(&h2, 2 * MiB, &prop, 0) == 0);
    char *base = va;
    CHECK(hip.MemSetAccess(base, 4 * MiB, &rw, 1) != 0);          /* nothing mapped yet */
    CHECK(hip.MemMap(base, 2 * MiB, 0, h, 0) != 0);               /* size differs from the handle's */
    CHECK(hip.MemMap(base, 4 * MiB, 2 * MiB, h, 0) != 0);         /* offset */
    CHECK(hip.MemMap(base + 6 * MiB, 4 * MiB, 0, h, 0) != 0);     /* runs past the reservation */
    CHECK(hip.MemMap(base, 4 * MiB, 0, h, 0) == 0);
    CHECK(hip.MemMap(base + 2 * MiB, 2 * MiB, 0, h2, 0) != 0);    /* overlaps a mapping */
    CHECK(hip.MemMap(base + 4 * MiB, 2 * MiB, 0, h2, 0) == 0);
    CHECK(hip.MemSetAccess(base, 8 * MiB, &rw, 1) != 0);          /* 2 MiB of it unmapped */
    CHECK(hip.MemSetAccess(base, 6 * MiB, &rw, 1) == 0);          /* two whole mappings */
    base[0] = 1, base[6 * MiB - 1] = 2;
    CHECK(hip.MemUnmap(base, 2 * MiB) != 0);                      /* half a mapping */
    CHECK(hip.MemAddressFree(va, 8 * MiB) != 0);                  /* still mapped */
    CHECK(hip.MemRelease(h) == 0);                                /* legal while mapped: freed on unmap */
    CHECK(hip.MemRelease(h) != 0);                                /* twice */
    CHECK(hip.MemUnmap(base, 6 * MiB) == 0);
    CHECK(hip.MemRelease(h2) == 0);
    CHECK(hip.MemAddressFree(va, 4 * MiB) != 0);                  /* not the whole reservation */
    CHECK(hip.MemAddressFree(va, 8 * MiB) == 0);

    static char host[3 * 4096];
    CHECK(hip.HostUnregister(host) != 0);                         /* never registered */
    CHECK(hip.HostRegister(host, sizeof host, 1) == 0);
    CHECK(hip.HostRegister(host + 4096, 4096, 1) != 0);           /* overlaps a registered range */
    CHECK(hip.HostUnregister(host) == 0);
    CHECK(hip.HostUnregister(host) != 0);                         /* twice */
}

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: %s <default chunk MiB: 256 for ROCm 6.x, 0 for 7>\n", argv[0]);
        return 2;
    }
    want_chunk = (size_t)strtoul(argv[1], NULL, 10) * MiB;
    setenv("HIP_STUB_DEVICE_BYTES", "1073741824", 0);
    struct tms_err err = {0};
    if (tms_driver_select("hip", &err) || tms_driver_get(&drv, &err) || drv->granularity(0, &gran)) {
        fprintf(stderr, "cannot load the hip backend (TMS_HIP_LIBRARY=%s): %s\n", getenv("TMS_HIP_LIBRARY"), err.msg);
        return 2;
    }
    if (!load_stub()) {
        fprintf(stderr, "TMS_HIP_LIBRARY does not name the loaded stub: %s\n", dlerror());
        return 2;
    }
    setvbuf(stdout, NULL, _IOLBF, 0);
    static const struct {
        const char *name;
        void (*run)(void);
    } tests[] = {
        {"loaded", test_loaded},
        {"default_chunking", test_default_chunking},
        {"current_device", test_current_device},
        {"work_in_flight", test_work_in_flight},
        {"oom", test_oom},
        {"stub_checks", test_stub_checks},
    };
    for (size_t i = 0; i < sizeof tests / sizeof *tests; i++) {
        int before = failed;
        tests[i].run();
        printf("%s %s\n", failed == before ? "ok  " : "FAIL", tests[i].name);
    }
    return check_summary();
}
