/* ROCm backend: HIP runtime entry points resolved at run time from libamdhip64. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "platform/config.h"
#include "platform/driver.h"
#include "platform/hip_abi.h"

#define HIP_ENTRIES(X) \
    X(hipGetDeviceCount, (int *count)) \
    X(hipGetDevice, (int *device)) \
    X(hipSetDevice, (int device)) \
    X(hipRuntimeGetVersion, (int *version)) \
    X(hipDeviceSynchronize, (void)) \
    X(hipMemGetInfo, (size_t *free_bytes, size_t *total_bytes)) \
    X(hipMemGetAllocationGranularity, (size_t *g, const tms_hipMemAllocationProp *prop, int option)) \
    X(hipMemAddressReserve, (void **va, size_t size, size_t align, void *addr, unsigned long long flags)) \
    X(hipMemAddressFree, (void *va, size_t size)) \
    X(hipMemCreate, (tms_hipMemGenericAllocationHandle_t *h, size_t size, const tms_hipMemAllocationProp *prop, \
                     unsigned long long flags)) \
    X(hipMemRelease, (tms_hipMemGenericAllocationHandle_t h)) \
    X(hipMemMap, (void *va, size_t size, size_t offset, tms_hipMemGenericAllocationHandle_t h, \
                  unsigned long long flags)) \
    X(hipMemUnmap, (void *va, size_t size)) \
    X(hipMemSetAccess, (void *va, size_t size, const tms_hipMemAccessDesc *desc, size_t count)) \
    X(hipStreamCreateWithFlags, (tms_hipStream_t *stream, unsigned flags)) \
    X(hipStreamSynchronize, (tms_hipStream_t stream)) \
    X(hipMemcpyAsync, (void *dst, const void *src, size_t n, int kind, tms_hipStream_t stream)) \
    X(hipHostMalloc, (void **p, size_t size, unsigned flags)) \
    X(hipHostFree, (void *p))

typedef const char *(*hip_error_name_fn)(tms_hipError_t);
typedef tms_hipError_t (*hip_register_fn)(void *, size_t, unsigned);
typedef tms_hipError_t (*hip_unregister_fn)(void *);
typedef tms_hipError_t (*hip_ctx_state_fn)(int, unsigned *, int *);

#define HIP_DECLARE_FIELD(name, params) tms_hipError_t (*name) params;
struct hip_api {
    HIP_ENTRIES(HIP_DECLARE_FIELD)
    hip_error_name_fn hipGetErrorName;      /* optional entries: NULL if absent */
    hip_register_fn hipHostRegister;
    hip_unregister_fn hipHostUnregister;
    hip_ctx_state_fn hipDevicePrimaryCtxGetState;
};

/* Written once by hip_load (under driver.c's lock), read-only afterwards. */
static struct hip_api hip;
static size_t hip_chunk_bytes;

static size_t chunk_bytes_for(const struct hip_api *api);

static int hip_load(struct tms_err *err)
{
    /* TMS_HIP_LIBRARY names another build (tests load a stub through it). */
    const char *override = tms_defaults()->hip_library;
    const char *names[] = {override, "libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6"};
    void *lib = NULL;
    const char *why = "?";
    char first_why[256] = "";
    for (size_t i = 0; i < sizeof names / sizeof *names && !lib; i++) {
        if (!names[i] || !*names[i]) continue;
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (!lib && !first_why[0]) {  /* the first name tried says the most */
            why = dlerror();
            snprintf(first_why, sizeof first_why, "%s", why ? why : "?");
        }
        if (*override) break;  /* an explicit choice is not second-guessed */
    }
    why = first_why;
    if (!lib) return tms_fail(err, TMS_E_NO_DRIVER, 0, "HIP runtime not found: dlopen(libamdhip64) failed: %s", why);
    struct hip_api api;
    memset(&api, 0, sizeof api);
#define HIP_RESOLVE(name, params)                                                                   \
    {                                                                                               \
        void *fn = dlsym(lib, #name);                                                               \
        if (!fn) return tms_fail(err, TMS_E_NO_DRIVER, 0, "HIP runtime lacks " #name " (ROCm 6 or newer needed)"); \
        memcpy(&api.name, &fn, sizeof fn);                                                          \
    }
    HIP_ENTRIES(HIP_RESOLVE)
#undef HIP_RESOLVE
    const char *optional[] = {"hipGetErrorName", "hipHostRegister", "hipHostUnregister", "hipDevicePrimaryCtxGetState"};
    void **slots[] = {(void **)&api.hipGetErrorName, (void **)&api.hipHostRegister, (void **)&api.hipHostUnregister,
                      (void **)&api.hipDevicePrimaryCtxGetState};
    for (size_t i = 0; i < sizeof optional / sizeof *optional; i++) {
        void *fn = dlsym(lib, optional[i]);
        memcpy(slots[i], &fn, sizeof fn);
    }
    int count = 0;
    int rc = api.hipGetDeviceCount(&count);
    if (rc || count <= 0)
        return tms_fail(err, TMS_E_NO_DRIVER, rc, "hipGetDeviceCount failed (code %d, %d devices): no usable GPU", rc,
                        count);
    hip = api;
    hip_chunk_bytes = chunk_bytes_for(&api);
    return TMS_OK;
}

static int hip_is_oom(int code) { return code == TMS_hipErrorOutOfMemory; }
static int hip_is_shutdown(int code) { return code == TMS_hipErrorDeinitialized || code == TMS_hipErrorNotInitialized; }

static const char *hip_code_name(int code)
{
    const char *name = hip.hipGetErrorName ? hip.hipGetErrorName(code) : NULL;
    return name ? name : "hipErrorUnrecognised";
}

static int hip_device_count(int *count) { return hip.hipGetDeviceCount(count); }
static int hip_current_device(int *device) { return hip.hipGetDevice(device); }

/* HIP works on the calling thread's current device: switch, run, switch back. */
#define WITH_DEVICE(device, body)                         \
    do {                                                  \
        int previous_ = 0;                                \
        int rc_ = hip.hipGetDevice(&previous_);           \
        if (!rc_ && previous_ != (device)) rc_ = hip.hipSetDevice(device); \
        if (rc_) return rc_;                              \
        int body_rc_ = (body);                            \
        if (previous_ != (device)) rc_ = hip.hipSetDevice(previous_); \
        return body_rc_ ? body_rc_ : rc_;                 \
    } while (0)

static tms_hipMemAllocationProp device_prop(int device)
{
    tms_hipMemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = TMS_hipMemAllocationTypePinned;
    prop.location.type = TMS_hipMemLocationTypeDevice;
    prop.location.id = device;
    return prop;
}

static int hip_granularity(int device, size_t *bytes)
{
    tms_hipMemAllocationProp prop = device_prop(device);
    return hip.hipMemGetAllocationGranularity(bytes, &prop, TMS_hipMemAllocationGranularityMinimum);
}

static int hip_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes)
{
    WITH_DEVICE(device, hip.hipMemGetInfo(free_bytes, total_bytes));
}

/* Large single physical allocations misbehave on ROCm 6.x: there the
 * core backs each allocation with chunks of this size unless told otherwise. */
static size_t hip_default_chunk_bytes(void) { return hip_chunk_bytes; }

static size_t chunk_bytes_for(const struct hip_api *api)
{
    int version = 0;
    if (api->hipRuntimeGetVersion(&version) != TMS_hipSuccess) return 0;
    return version >= 60000000 && version < 70000000 ? (size_t)256 << 20 : 0;
}

static int hip_reserve(size_t size, size_t alignment, tms_va *va)
{
    void *p = NULL;
    int rc = hip.hipMemAddressReserve(&p, size, alignment, NULL, 0);
    if (!rc) *va = (tms_va)(uintptr_t)p;
    return rc;
}

static int hip_unreserve(tms_va va, size_t size) { return hip.hipMemAddressFree((void *)(uintptr_t)va, size); }

static int hip_create(int device, size_t size, tms_phys *handle)
{
    tms_hipMemAllocationProp prop = device_prop(device);
    tms_hipMemGenericAllocationHandle_t h = NULL;
    int rc = hip.hipMemCreate(&h, size, &prop, 0);
    if (!rc) *handle = (tms_phys)(uintptr_t)h;
    return rc;
}

static int hip_release(tms_phys handle)
{
    return hip.hipMemRelease((tms_hipMemGenericAllocationHandle_t)(uintptr_t)handle);
}

static int hip_map(int device, tms_va va, size_t size, tms_phys handle)
{
    void *p = (void *)(uintptr_t)va;
    int rc = hip.hipMemMap(p, size, 0, (tms_hipMemGenericAllocationHandle_t)(uintptr_t)handle, 0);
    if (rc) return rc;
    tms_hipMemAccessDesc access = {
        .location = {.type = TMS_hipMemLocationTypeDevice, .id = device},
        .flags = TMS_hipMemAccessFlagsProtReadWrite,
    };
    rc = hip.hipMemSetAccess(p, size, &access, 1);
    if (rc) hip.hipMemUnmap(p, size);  /* leave it unmapped, as before the call */
    return rc;
}

static int hip_unmap(tms_va va, size_t size) { return hip.hipMemUnmap((void *)(uintptr_t)va, size); }

static int hip_synchronize(int device) { WITH_DEVICE(device, hip.hipDeviceSynchronize()); }

static int create_stream(tms_stream *stream)
{
    tms_hipStream_t s = NULL;
    int rc = hip.hipStreamCreateWithFlags(&s, TMS_hipStreamNonBlocking);
    if (!rc) *stream = (tms_stream)s;
    return rc;
}

static int hip_stream_create(int device, tms_stream *stream) { WITH_DEVICE(device, create_stream(stream)); }

static int hip_copy_async(int device, int to_host, void *host, tms_va dev, size_t n, tms_stream stream)
{
    (void)device;  /* a stream carries its device */
    void *d = (void *)(uintptr_t)dev;
    return to_host ? hip.hipMemcpyAsync(host, d, n, TMS_hipMemcpyDeviceToHost, (tms_hipStream_t)stream)
                   : hip.hipMemcpyAsync(d, host, n, TMS_hipMemcpyHostToDevice, (tms_hipStream_t)stream);
}

static int hip_stream_wait(int device, tms_stream stream)
{
    (void)device;
    return hip.hipStreamSynchronize((tms_hipStream_t)stream);
}

/* Host memory calls run on the device they serve, as the CUDA backend's: a
 * copy worker's thread would otherwise use device 0. */
static int hip_host_alloc_pinned(int device, size_t size, void **ptr)
{
    WITH_DEVICE(device, hip.hipHostMalloc(ptr, size, TMS_hipHostMallocPortable));
}

static int hip_host_free_pinned(int device, void *ptr, size_t size)
{
    (void)size;
    WITH_DEVICE(device, hip.hipHostFree(ptr));
}

#define HIP_ERROR_NOT_SUPPORTED 801  /* a pinned backup then stays pageable (transfer.c lock_piece) */

static int hip_host_register(int device, void *ptr, size_t size)
{
    if (!hip.hipHostRegister) return HIP_ERROR_NOT_SUPPORTED;
    WITH_DEVICE(device, hip.hipHostRegister(ptr, size, TMS_hipHostMallocPortable));
}

static int hip_host_unregister(int device, void *ptr)
{
    if (!hip.hipHostUnregister) return HIP_ERROR_NOT_SUPPORTED;
    WITH_DEVICE(device, hip.hipHostUnregister(ptr));
}

/* Without hipDevicePrimaryCtxGetState only the thread's current device counts as used. */
static int hip_device_active(int device, int *active)
{
    unsigned flags = 0;
    if (hip.hipDevicePrimaryCtxGetState) return hip.hipDevicePrimaryCtxGetState(device, &flags, active);
    int current = 0, rc = hip.hipGetDevice(&current);
    if (!rc) *active = current == device;
    return rc;
}

const struct tms_driver tms_driver_hip = {
    .name = "hip",
    .load = hip_load,
    .is_oom = hip_is_oom,
    .is_shutdown = hip_is_shutdown,
    .code_name = hip_code_name,
    .default_chunk_bytes = hip_default_chunk_bytes,
    .device_count = hip_device_count,
    .current_device = hip_current_device,
    .granularity = hip_granularity,
    .mem_get_info = hip_mem_get_info,
    .reserve = hip_reserve,
    .unreserve = hip_unreserve,
    .create = hip_create,
    .release = hip_release,
    .map = hip_map,
    .unmap = hip_unmap,
    .synchronize = hip_synchronize,
    .stream_create = hip_stream_create,
    .copy_async = hip_copy_async,
    .stream_wait = hip_stream_wait,
    .host_alloc_pinned = hip_host_alloc_pinned,
    .host_free_pinned = hip_host_free_pinned,
    .host_register = hip_host_register,
    .host_unregister = hip_host_unregister,
    .device_active = hip_device_active,
};
