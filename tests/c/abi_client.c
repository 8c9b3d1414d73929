/* A C program that drives torch_memory_saver through its C ABI only, as a C/C++ engine would:
 * linked with a CUDA runtime, started with the preload library (any of its names) on LD_PRELOAD,
 * TMS_INIT_ENABLE=1 and TMS_INIT_ENABLE_CPU_BACKUP=1. Prints "OK" and exits 0 when every check holds.
 *   cc -DABI_CLIENT_CUDA -Iinclude -I$CUDA/include abi_client.c -L$CUDA/lib64 -lcudart -ldl   (GPU)
 *   cc -Iinclude abi_client.c -L. -lcudart_stub -ldl   (host backend, tests/c/cudart_stub.c as the runtime)
 * The runtime is a dependency of the executable, so it comes before the preloaded library's own
 * dependencies in the search order: the interposition must still win. The tms_* functions are
 * looked up in the process's global scope (dlsym(RTLD_DEFAULT)), where LD_PRELOAD puts them;
 * their types come from the public header. */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "torch_memory_saver.h"

#ifdef ABI_CLIENT_CUDA
#include <cuda_runtime_api.h>
#define DEVICE_NAME "cuda"
#else
int cudaMalloc(void **ptr, size_t size);  /* tests/c/cudart_stub.c, unless interposed */
int cudaFree(void *ptr);
#define DEVICE_NAME "host backend"
#endif

static int failures;

#define CHECK(cond, ...)                                  \
    do {                                                  \
        if (!(cond)) {                                    \
            printf("FAIL line %d: ", __LINE__);           \
            printf(__VA_ARGS__);                          \
            printf("\n");                                 \
            failures++;                                   \
        }                                                 \
    } while (0)

#define ABI_FUNCTIONS(X)                                                                                 \
    X(tms_set_interesting_region) X(tms_get_interesting_region) X(tms_set_current_tag)                   \
    X(tms_get_current_tag) X(tms_set_enable_cpu_backup) X(tms_get_enable_cpu_backup)                     \
    X(tms_set_cpu_backup_backend) X(tms_get_cpu_backup_backend) X(tms_set_enable_disk_backup)            \
    X(tms_get_enable_disk_backup) X(tms_set_disk_backup_dir) X(set_memory_margin_bytes)                  \
    X(tms_set_retain_cpu_backup) X(tms_get_retain_cpu_backup) X(tms_pause) X(tms_resume)                 \
    X(tms_get_cpu_backup_pointer) X(tms_get_last_error)

#define DECLARE(name) static __typeof__(name) *p_##name;
ABI_FUNCTIONS(DECLARE)

static int resolve(void)
{
#define RESOLVE(name)                                                                \
    if (!(p_##name = (__typeof__(name) *)dlsym(RTLD_DEFAULT, #name))) {              \
        printf("FAIL: %s is not in the global scope (is the library on LD_PRELOAD?)\n", #name); \
        return 0;                                                                    \
    }
    ABI_FUNCTIONS(RESOLVE)
    return 1;
}

/* Device memory access: cudaMemcpy on a GPU; plain memory on the host backend. */
static void to_device(void *dev, const void *host, size_t n)
{
#ifdef ABI_CLIENT_CUDA
    int rc = cudaMemcpy(dev, host, n, cudaMemcpyHostToDevice);
    CHECK(rc == 0, "cudaMemcpy to device: %d", rc);
#else
    memcpy(dev, host, n);
#endif
}

static void from_device(void *host, const void *dev, size_t n)
{
#ifdef ABI_CLIENT_CUDA
    int rc = cudaMemcpy(host, dev, n, cudaMemcpyDeviceToHost);
    CHECK(rc == 0, "cudaMemcpy from device: %d", rc);
#else
    memcpy(host, dev, n);
#endif
}

static void random_bytes(unsigned char *buf, size_t n)
{
    unsigned long long x = (unsigned long long)time(NULL) * 0x9E3779B97F4A7C15ull ^ (unsigned long long)getpid();
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        buf[i] = (unsigned char)(x >> 24);
    }
}

int main(void)
{
    if (!resolve()) return 1;
    /* Not a multiple of the 2 MiB granularity. */
    const size_t size = 3 * (1u << 20) + 12345;
    unsigned char *data = malloc(size), *back = malloc(size);
    if (!data || !back) return 1;
    random_bytes(data, size);

    CHECK(p_tms_get_interesting_region(), "TMS_INIT_ENABLE=1 but the thread's region is off");
    CHECK(p_tms_get_enable_cpu_backup(), "TMS_INIT_ENABLE_CPU_BACKUP=1 but backup is off");
    CHECK(strcmp(p_tms_get_current_tag(), "default") == 0, "first tag '%s'", p_tms_get_current_tag());
    CHECK(p_tms_set_current_tag("weights") == TMS_STATUS_OK, "set tag: %s", p_tms_get_last_error());
    CHECK(strcmp(p_tms_get_current_tag(), "weights") == 0, "tag '%s'", p_tms_get_current_tag());

    void *weights = NULL, *kv = NULL;
    int rc = cudaMalloc(&weights, size);
    CHECK(rc == 0 && weights, "cudaMalloc in a region: %d (%s)", rc, p_tms_get_last_error());
    if (!weights) return 1;
    to_device(weights, data, size);
    CHECK(p_tms_get_cpu_backup_pointer(weights, size) == NULL, "an active allocation has a backup");

    /* Outside the region: ordinary memory from the runtime, which pause leaves alone. */
    void *plain = NULL;
    CHECK(p_tms_set_interesting_region(false) == TMS_STATUS_OK, "region off");
    CHECK(!p_tms_get_interesting_region(), "region still on");
    rc = cudaMalloc(&plain, 1 << 20);
    CHECK(rc == 0 && plain, "cudaMalloc outside the region: %d", rc);
    if (!plain) return 1;
    to_device(plain, data, 1 << 20);
    CHECK(p_tms_set_interesting_region(true) == TMS_STATUS_OK, "region on");

    CHECK(p_tms_set_enable_cpu_backup(false) == TMS_STATUS_OK, "backup off");
    CHECK(p_tms_set_current_tag("kv") == TMS_STATUS_OK, "tag kv");
    rc = cudaMalloc(&kv, 2u << 20);
    CHECK(rc == 0 && kv, "cudaMalloc kv: %d (%s)", rc, p_tms_get_last_error());

    CHECK(p_tms_pause(NULL) == TMS_STATUS_OK, "pause(NULL): %s", p_tms_get_last_error());
    rc = p_tms_pause("");
    CHECK(rc == TMS_STATUS_STATE, "second pause of every tag returned %d, want %d", rc, TMS_STATUS_STATE);
    CHECK(strstr(p_tms_get_last_error(), "already paused"), "message: '%s'", p_tms_get_last_error());
    const uint8_t *host = p_tms_get_cpu_backup_pointer(weights, size);
    CHECK(host && memcmp(host, data, size) == 0, "backup of the paused allocation differs (%p)", (void *)host);
    host = p_tms_get_cpu_backup_pointer((const uint8_t *)weights + 4096, 100);
    CHECK(host && memcmp(host, data + 4096, 100) == 0, "backup at an offset differs");
    CHECK(p_tms_get_cpu_backup_pointer(kv, 16) == NULL, "an allocation without backup has one");
    int local;
    CHECK(p_tms_get_cpu_backup_pointer((const uint8_t *)&local, 4) == NULL, "foreign memory has a backup");
    memset(back, 0, 1 << 20);
    from_device(back, plain, 1 << 20);
    CHECK(memcmp(back, data, 1 << 20) == 0, "ordinary memory changed by the pause");

    CHECK(p_tms_resume(NULL) == TMS_STATUS_OK, "resume(NULL): %s", p_tms_get_last_error());
    memset(back, 0, size);
    from_device(back, weights, size);
    CHECK(memcmp(back, data, size) == 0, "contents differ after resume");
    rc = p_tms_resume("weights");
    CHECK(rc == TMS_STATUS_STATE && strstr(p_tms_get_last_error(), "weights"),
          "resume of an active tag: %d '%s'", rc, p_tms_get_last_error());
    CHECK(p_tms_pause("kv") == TMS_STATUS_OK && p_tms_resume("kv") == TMS_STATUS_OK, "pause/resume one tag");

    /* Bad input is a status and a message, never an exit. */
    rc = p_tms_set_cpu_backup_backend("disk");
    CHECK(rc == TMS_STATUS_ARG && strstr(p_tms_get_last_error(), "'disk'"), "backend 'disk': %d '%s'", rc,
          p_tms_get_last_error());
    CHECK(p_tms_set_cpu_backup_backend(NULL) == TMS_STATUS_ARG, "backend NULL");
    CHECK(p_tms_set_cpu_backup_backend("pinned") == TMS_STATUS_OK, "backend pinned");
    CHECK(strcmp(p_tms_get_cpu_backup_backend(), "pinned") == 0, "backend '%s'", p_tms_get_cpu_backup_backend());
    CHECK(p_tms_set_current_tag("") == TMS_STATUS_ARG, "empty tag accepted");
    CHECK(p_tms_set_current_tag(NULL) == TMS_STATUS_ARG, "NULL tag accepted");
    CHECK(strcmp(p_tms_get_current_tag(), "kv") == 0, "a rejected tag changed the tag");
    CHECK(p_tms_set_enable_disk_backup(true) == TMS_STATUS_OK && p_tms_get_enable_disk_backup(), "disk on");
    CHECK(p_tms_set_enable_disk_backup(false) == TMS_STATUS_OK && !p_tms_get_enable_disk_backup(), "disk off");
    CHECK(p_tms_set_disk_backup_dir("/tmp") == TMS_STATUS_OK, "disk dir: %s", p_tms_get_last_error());
    CHECK(p_tms_set_disk_backup_dir("") == TMS_STATUS_ARG, "empty disk dir");
    CHECK(p_tms_set_retain_cpu_backup(true) == TMS_STATUS_OK && p_tms_get_retain_cpu_backup(), "retain on");
    CHECK(p_tms_set_retain_cpu_backup(false) == TMS_STATUS_OK && !p_tms_get_retain_cpu_backup(), "retain off");
    CHECK(p_set_memory_margin_bytes(0) == TMS_STATUS_OK, "margin");

    CHECK(cudaFree(weights) == 0 && cudaFree(kv) == 0, "cudaFree");
    CHECK(cudaFree(plain) == 0, "cudaFree of ordinary memory");
    free(data);
    free(back);
    if (failures) return 1;
    printf("OK %s\n", DEVICE_NAME);
    return 0;
}
