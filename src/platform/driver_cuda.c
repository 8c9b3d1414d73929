/* CUDA backend: driver entry points resolved at run time from libcuda.so.1. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "platform/cuda_abi.h"
#include "platform/driver.h"
#include "platform/fingerprint_ptx.h"
#include "platform/fork.h"
#include "platform/topology.h"

/* Every entry is requested at the ABI of CUDA 12.0, which CUDA 12 and 13
 * drivers both serve, so one build runs on either. */
#define CUDA_ABI_VERSION 12000
#define CUDA_MAX_DEVICES 64

#define CUDA_DECLARE_FIELD(name, params, presence) tms_##name##_fn name;
struct cuda_api {
    TMS_CUDA_ENTRIES(CUDA_DECLARE_FIELD)
};

/* Written once by cuda_load (under driver.c's lock), read-only afterwards. */
static struct cuda_api cu;

struct cuda_device {
    int ready;                /* atomic: 1 once the fields below are set */
    tms_CUcontext ctx;        /* primary context, retained for the process's life */
    size_t granularity;
    int numa_node;            /* of the host memory nearest it, -1 unknown */
    int share_types;          /* handle types its allocations are made with: a POSIX fd where it can export one */
};

static pthread_mutex_t devices_lock = PTHREAD_MUTEX_INITIALIZER;
static struct cuda_device devices[CUDA_MAX_DEVICES];  /* guarded by devices_lock until ready */
static pthread_once_t fork_handlers_once = PTHREAD_ONCE_INIT;

/* Every lock of the library is free in a forked child (CUDA itself is not
 * usable there, but the child must not hang on a lock on its way to that error). */
static void fork_prepare(void) { pthread_mutex_lock(&devices_lock); }
static void fork_release(void) { pthread_mutex_unlock(&devices_lock); }
static void register_fork_handlers(void)
{
    static const struct tms_fork_handlers handlers = {fork_prepare, fork_release, fork_release};
    tms_fork_register(TMS_FORK_DEVICES, &handlers);
}

typedef tms_CUresult (*get_proc_v2_fn)(const char *, void **, int, unsigned long long, int *);
typedef tms_CUresult (*get_proc_v1_fn)(const char *, void **, int, unsigned long long);

static int cuda_load(struct tms_err *err)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        return tms_fail(err, TMS_E_NO_DRIVER, 0,
                        "CUDA driver not found: dlopen(\"libcuda.so.1\") failed: %s (no GPU here? TMS_BACKEND=host "
                        "runs the library on host memory, for tests and demos)", why ? why : "?");
    }
    /* _v2 (CUDA 12+) reports per-symbol status; plain is the 11.3 form. */
    get_proc_v2_fn get_v2 = (get_proc_v2_fn)dlsym(lib, "cuGetProcAddress_v2");
    get_proc_v1_fn get_v1 = (get_proc_v1_fn)dlsym(lib, "cuGetProcAddress");
    if (!get_v2 && !get_v1)
        return tms_fail(err, TMS_E_NO_DRIVER, 0,
                        "CUDA driver too old: libcuda.so.1 has no cuGetProcAddress (need CUDA 12 or newer)");
    struct cuda_api api;
    memset(&api, 0, sizeof api);
#define CUDA_RESOLVE(name, params, presence)                                                    \
    {                                                                                           \
        void *fn = NULL;                                                                        \
        int symbol_status = 0;                                                                  \
        tms_CUresult rc = get_v2 ? get_v2(#name, &fn, CUDA_ABI_VERSION,                         \
                                          TMS_CU_GET_PROC_ADDRESS_DEFAULT, &symbol_status)      \
                                 : get_v1(#name, &fn, CUDA_ABI_VERSION,                         \
                                          TMS_CU_GET_PROC_ADDRESS_DEFAULT);                     \
        if ((rc != TMS_CUDA_SUCCESS || !fn) && TMS_CUDA_##presence)                             \
            return tms_fail(err, TMS_E_NO_DRIVER, rc,                                           \
                            "CUDA driver lacks " #name " (cuGetProcAddress code %d, status %d)", \
                            rc, symbol_status);                                                 \
        if (rc == TMS_CUDA_SUCCESS) memcpy(&api.name, &fn, sizeof fn);                          \
    }
    TMS_CUDA_ENTRIES(CUDA_RESOLVE)
#undef CUDA_RESOLVE
    tms_CUresult rc = api.cuInit(0);
    if (rc != TMS_CUDA_SUCCESS) {
        const char *name = "?";
        api.cuGetErrorName(rc, &name);
        return tms_fail(err, TMS_E_NO_DRIVER, rc, "cuInit failed: %s (%d): no usable GPU", name, rc);
    }
    cu = api;
    return TMS_OK;
}

static int cuda_is_oom(int code) { return code == TMS_CUDA_ERROR_OUT_OF_MEMORY; }

static int cuda_is_shutdown(int code)
{
    return code == TMS_CUDA_ERROR_DEINITIALIZED || code == TMS_CUDA_ERROR_NOT_INITIALIZED;
}

static const char *cuda_code_name(int code)
{
    const char *name = NULL;
    if (cu.cuGetErrorName && cu.cuGetErrorName(code, &name) == TMS_CUDA_SUCCESS && name)
        return name;
    return "CUDA_ERROR_UNRECOGNISED";
}

static int cuda_device_count(int *count) { return cu.cuDeviceGetCount(count); }

static int cuda_current_device(int *device)
{
    tms_CUcontext ctx = NULL;
    int rc = cu.cuCtxGetCurrent(&ctx);
    if (rc) return rc;
    if (!ctx) {  /* the runtime has not touched a device yet: it would use 0 */
        *device = 0;
        return 0;
    }
    tms_CUdevice dev = 0;
    rc = cu.cuCtxGetDevice(&dev);
    if (rc == 0) *device = dev;
    return rc;
}

static tms_CUmemAllocationProp device_prop(int device)
{
    tms_CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = TMS_CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = TMS_CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = device;
    return prop;
}

/* Retains the primary context (the one the runtime and PyTorch use) on
 * first use of a device. */
static int device_get(int device, struct cuda_device **out)
{
    if (device < 0 || device >= CUDA_MAX_DEVICES) return TMS_CUDA_ERROR_INVALID_DEVICE;
    struct cuda_device *d = &devices[device];
    if (__atomic_load_n(&d->ready, __ATOMIC_ACQUIRE)) {
        *out = d;
        return 0;
    }
    int rc = 0;
    pthread_once(&fork_handlers_once, register_fork_handlers);
    pthread_mutex_lock(&devices_lock);
    if (!d->ready) {
        tms_CUdevice dev = 0;
        tms_CUcontext ctx = NULL;
        size_t gran = 0;
        tms_CUmemAllocationProp prop = device_prop(device);
        rc = cu.cuDeviceGet(&dev, device);
        if (!rc) rc = cu.cuDevicePrimaryCtxRetain(&ctx, dev);
        if (!rc) rc = cu.cuMemGetAllocationGranularity(&gran, &prop, TMS_CU_MEM_ALLOC_GRANULARITY_MINIMUM);
        if (!rc) {
            char bus_id[32];
            d->numa_node = cu.cuDeviceGetPCIBusId(bus_id, (int)sizeof bus_id, dev) == TMS_CUDA_SUCCESS
                               ? tms_topology_pci_numa_node(TMS_SYSFS, bus_id)
                               : -1;
            int fd_ok = 0;
            if (cu.cuDeviceGetAttribute && cu.cuMemExportToShareableHandle && cu.cuMemImportFromShareableHandle &&
                cu.cuDeviceGetAttribute(&fd_ok, TMS_CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev))
                fd_ok = 0;
            d->share_types = fd_ok ? TMS_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : 0;
            d->ctx = ctx;
            d->granularity = gran;
            __atomic_store_n(&d->ready, 1, __ATOMIC_RELEASE);
        }
    }
    pthread_mutex_unlock(&devices_lock);
    if (!rc) *out = d;
    return rc;
}

static int cuda_granularity(int device, size_t *bytes)
{
    struct cuda_device *d;
    int rc = device_get(device, &d);
    if (!rc) *bytes = d->granularity;
    return rc;
}

/* Runs the body with device's primary context current, restoring the
 * caller's context after: hooks run on PyTorch's threads. */
#define WITH_DEVICE_CONTEXT(device, d, body)                 \
    do {                                                     \
        int rc_ = device_get((device), &(d));                \
        if (rc_) return rc_;                                 \
        rc_ = cu.cuCtxPushCurrent((d)->ctx);                 \
        if (rc_) return rc_;                                 \
        int body_rc_ = (body);                               \
        tms_CUcontext popped_;                               \
        rc_ = cu.cuCtxPopCurrent(&popped_);                  \
        return body_rc_ ? body_rc_ : rc_;                    \
    } while (0)

static int cuda_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes)
{
    struct cuda_device *d;
    WITH_DEVICE_CONTEXT(device, d, cu.cuMemGetInfo(free_bytes, total_bytes));
}

static int cuda_reserve(size_t size, size_t alignment, tms_va *va)
{
    tms_CUdeviceptr p = 0;
    int rc = cu.cuMemAddressReserve(&p, size, alignment, 0, 0);
    if (!rc) *va = p;
    return rc;
}

static int cuda_unreserve(tms_va va, size_t size) { return cu.cuMemAddressFree(va, size); }

static int cuda_create_shareable(int device, size_t size, int handle_types, tms_phys *handle)
{
    tms_CUmemAllocationProp prop = device_prop(device);
    prop.requestedHandleTypes = handle_types;
    tms_CUmemHandle h = 0;
    int rc = cu.cuMemCreate(&h, size, &prop, 0);
    if (!rc) *handle = h;
    return rc;
}

static int cuda_create(int device, size_t size, tms_phys *handle)
{
    return cuda_create_shareable(device, size, 0, handle);
}

static int cuda_release(tms_phys handle) { return cu.cuMemRelease(handle); }

static int cuda_share_types(int device)
{
    struct cuda_device *d;
    return device_get(device, &d) ? 0 : d->share_types;
}

static int cuda_export_fd(tms_phys handle, int *fd)
{
    if (!cu.cuMemExportToShareableHandle) return TMS_CUDA_ERROR_NOT_SUPPORTED;
    int out = -1;
    int rc = cu.cuMemExportToShareableHandle(&out, handle, TMS_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    if (!rc) *fd = out;
    return rc;
}

static int cuda_import_fd(int device, int fd, tms_phys *handle)
{
    (void)device;  /* the memory lives where its exporter made it; map() grants device access */
    if (!cu.cuMemImportFromShareableHandle) return TMS_CUDA_ERROR_NOT_SUPPORTED;
    tms_CUmemHandle h = 0;
    int rc = cu.cuMemImportFromShareableHandle(&h, (void *)(intptr_t)fd, TMS_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
    if (!rc) *handle = h;
    return rc;
}

/* The GPU's UUID (a MIG instance's own), as nvidia-smi prints it; its PCI
 * address where the driver has no UUID entry. */
static int cuda_device_identity(int device, char *buf, size_t size)
{
    tms_CUdevice dev = 0;
    int rc = cu.cuDeviceGet(&dev, device);
    if (rc) return rc;
    if (!cu.cuDeviceGetUuid) {
        char bus_id[32];
        if ((rc = cu.cuDeviceGetPCIBusId(bus_id, (int)sizeof bus_id, dev))) return rc;
        snprintf(buf, size, "pci-%s", bus_id);
        return 0;
    }
    tms_CUuuid uuid;
    if ((rc = cu.cuDeviceGetUuid(&uuid, dev))) return rc;
    const unsigned char *b = (const unsigned char *)uuid.bytes;
    snprintf(buf, size, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1], b[2],
             b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
    return 0;
}

static int cuda_map(int device, tms_va va, size_t size, tms_phys handle)
{
    int rc = cu.cuMemMap(va, size, 0, handle, 0);
    if (rc) return rc;
    tms_CUmemAccessDesc access = {
        .location = {.type = TMS_CU_MEM_LOCATION_TYPE_DEVICE, .id = device},
        .flags = TMS_CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    };
    rc = cu.cuMemSetAccess(va, size, &access, 1);
    if (rc) cu.cuMemUnmap(va, size);  /* leave it unmapped, as before the call */
    return rc;
}

static int cuda_unmap(tms_va va, size_t size) { return cu.cuMemUnmap(va, size); }

static int cuda_synchronize(int device)
{
    struct cuda_device *d;
    WITH_DEVICE_CONTEXT(device, d, cu.cuCtxSynchronize());
}

static int cuda_stream_create(int device, tms_stream *stream)
{
    struct cuda_device *d;
    tms_CUstream created = NULL;
    int rc = device_get(device, &d);
    if (rc) return rc;
    if ((rc = cu.cuCtxPushCurrent(d->ctx))) return rc;
    rc = cu.cuStreamCreate(&created, TMS_CU_STREAM_NON_BLOCKING);
    tms_CUcontext popped;
    int pop_rc = cu.cuCtxPopCurrent(&popped);
    if (!rc) *stream = (tms_stream)created;
    return rc ? rc : pop_rc;
}

static int queue_copy(int to_host, void *host, tms_va dev, size_t n, tms_stream stream)
{
    return to_host ? cu.cuMemcpyDtoHAsync(host, dev, n, (tms_CUstream)stream)
                   : cu.cuMemcpyHtoDAsync(dev, host, n, (tms_CUstream)stream);
}

static int cuda_copy_async(int device, int to_host, void *host, tms_va dev, size_t n, tms_stream stream)
{
    struct cuda_device *d;
    WITH_DEVICE_CONTEXT(device, d, queue_copy(to_host, host, dev, n, stream));
}

static int cuda_stream_wait(int device, tms_stream stream)
{
    (void)device;  /* a stream carries its context */
    return cu.cuStreamSynchronize((tms_CUstream)stream);
}

/* Host memory calls need a context. The thread's current one may belong to
 * no device of the backup (a copy worker has none), so each runs in the
 * context of the device it serves: borrowing another device's would create
 * a context there, in a process that never uses that device. */
static int cuda_host_alloc_pinned(int device, size_t size, void **ptr)
{
    struct cuda_device *d;
    /* Portable: the backup may be restored while another device's context is current. */
    WITH_DEVICE_CONTEXT(device, d, cu.cuMemHostAlloc(ptr, size, 0x01 /* CU_MEMHOSTALLOC_PORTABLE */));
}

static int cuda_host_free_pinned(int device, void *ptr, size_t size)
{
    struct cuda_device *d;
    (void)size;
    WITH_DEVICE_CONTEXT(device, d, cu.cuMemFreeHost(ptr));
}

static int cuda_host_register(int device, void *ptr, size_t size)
{
    struct cuda_device *d;
    WITH_DEVICE_CONTEXT(device, d, cu.cuMemHostRegister(ptr, size, 0x01 /* CU_MEMHOSTREGISTER_PORTABLE */));
}

static int cuda_host_unregister(int device, void *ptr)
{
    struct cuda_device *d;
    WITH_DEVICE_CONTEXT(device, d, cu.cuMemHostUnregister(ptr));
}

static int cuda_device_active(int device, int *active)
{
    tms_CUdevice dev = 0;
    unsigned flags = 0;
    int rc = cu.cuDeviceGet(&dev, device);
    return rc ? rc : cu.cuDevicePrimaryCtxGetState(dev, &flags, active);
}

static size_t cuda_default_chunk_bytes(void) { return 0; }

static int cuda_numa_node(int device)
{
    struct cuda_device *d;
    return device_get(device, &d) ? -1 : d->numa_node;
}

/* ---- fingerprints on the device ---------------------------------------------------
 * The kernel of fingerprint.cu, loaded from its PTX by the driver on a device's
 * first fingerprint: a driver that cannot load it (too old for the PTX, no JIT)
 * says so with its code, kept, so a pause after it copies everything at once.
 * The chunk list and the results live in page-locked host memory the kernel
 * reads and writes through its device address. */
struct cuda_fp {
    int tried;                /* the module was asked for */
    int code;                 /* what the driver said when loading it failed (0: loaded) */
    tms_CUmodule module;
    tms_CUfunction kernel;
    tms_CUstream stream;
    uint64_t key_generation;  /* of the key in the module's constants */
    tms_va *chunks;           /* capacity entries, mapped into the device */
    struct tms_fp *out;
    tms_CUdeviceptr chunks_dev, out_dev;
    size_t capacity;
};

static pthread_mutex_t fp_lock = PTHREAD_MUTEX_INITIALIZER;  /* the fps below; held across a kernel's run */
static struct cuda_fp fps[CUDA_MAX_DEVICES];
static pthread_once_t fp_fork_once = PTHREAD_ONCE_INIT;

static void fp_fork_prepare(void) { pthread_mutex_lock(&fp_lock); }
static void fp_fork_release(void) { pthread_mutex_unlock(&fp_lock); }
static void fp_register_fork(void)
{
    static const struct tms_fork_handlers handlers = {fp_fork_prepare, fp_fork_release, fp_fork_release};
    tms_fork_register(TMS_FORK_FP_RUN, &handlers);
}

static int fp_load(struct cuda_fp *f)
{
    if (!cu.cuModuleLoadData || !cu.cuModuleGetFunction || !cu.cuModuleGetGlobal || !cu.cuLaunchKernel ||
        !cu.cuMemHostGetDevicePointer || !cu.cuMemcpyHtoD)
        return TMS_CUDA_ERROR_NOT_SUPPORTED;
    int rc = cu.cuModuleLoadData(&f->module, tms_fingerprint_ptx);
    if (!rc) rc = cu.cuModuleGetFunction(&f->kernel, f->module, "tms_fingerprint");
    if (!rc) rc = cu.cuStreamCreate(&f->stream, TMS_CU_STREAM_NON_BLOCKING);
    return rc;
}

/* The process's key into the module's constants, once per key. */
static int fp_key(struct cuda_fp *f)
{
    const struct tms_fp_key *key;
    uint64_t generation;
    struct tms_err err = {0};
    if (tms_fp_key(&key, &generation, &err)) return TMS_CUDA_ERROR_NOT_SUPPORTED;
    if (generation == f->key_generation) return 0;
    tms_CUdeviceptr nh, point;
    size_t nh_bytes, point_bytes;
    int rc = cu.cuModuleGetGlobal(&nh, &nh_bytes, f->module, "tms_fp_nh_key");
    if (!rc) rc = cu.cuModuleGetGlobal(&point, &point_bytes, f->module, "tms_fp_point");
    if (!rc && (nh_bytes != sizeof key->nh || point_bytes != sizeof key->point)) rc = TMS_CUDA_ERROR_INVALID_VALUE;
    if (!rc) rc = cu.cuMemcpyHtoD(nh, key->nh, sizeof key->nh);
    if (!rc) rc = cu.cuMemcpyHtoD(point, key->point, sizeof key->point);
    if (!rc) f->key_generation = generation;
    return rc;
}

static int fp_room(struct cuda_fp *f, size_t n)
{
    if (n <= f->capacity) return 0;
    if (f->chunks) cu.cuMemFreeHost(f->chunks);
    if (f->out) cu.cuMemFreeHost(f->out);
    f->chunks = NULL, f->out = NULL, f->capacity = 0;
    size_t want = n < 1024 ? 1024 : n;
    unsigned flags = 0x01 | 0x02; /* CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP */
    void *chunks = NULL, *out = NULL;
    int rc = cu.cuMemHostAlloc(&chunks, want * sizeof *f->chunks, flags);
    if (!rc) rc = cu.cuMemHostAlloc(&out, want * sizeof *f->out, flags);
    if (!rc) rc = cu.cuMemHostGetDevicePointer(&f->chunks_dev, chunks, 0);
    if (!rc) rc = cu.cuMemHostGetDevicePointer(&f->out_dev, out, 0);
    if (rc) {
        if (chunks) cu.cuMemFreeHost(chunks);
        if (out) cu.cuMemFreeHost(out);
        return rc;
    }
    f->chunks = chunks, f->out = out, f->capacity = want;
    return 0;
}

static int fp_run(int device, const tms_va *chunks, size_t n, struct tms_fp *out)
{
    struct cuda_fp *f = &fps[device];
    if (!f->tried) {
        f->tried = 1;
        f->code = fp_load(f);
    }
    if (f->code) return f->code;
    int rc = fp_key(f);
    if (!rc) rc = fp_room(f, n);
    for (size_t done = 0; !rc && done < n;) {
        size_t k = n - done < f->capacity ? n - done : f->capacity;
        memcpy(f->chunks, chunks + done, k * sizeof *chunks);
        unsigned long long chunk_bytes = TMS_FP_CHUNK;
        void *params[] = {&f->chunks_dev, &chunk_bytes, &f->out_dev};
        rc = cu.cuLaunchKernel(f->kernel, (unsigned)k, 1, 1, TMS_FP_THREADS, 1, 1, 0, f->stream, params, NULL);
        if (!rc) rc = cu.cuStreamSynchronize(f->stream);
        if (!rc) memcpy(out + done, f->out, k * sizeof *out);
        done += k;
    }
    return rc;
}

static int cuda_fingerprint(int device, const tms_va *chunks, size_t n, struct tms_fp *out)
{
    struct cuda_device *d;
    if (device < 0 || device >= CUDA_MAX_DEVICES) return TMS_CUDA_ERROR_INVALID_DEVICE;
    pthread_once(&fp_fork_once, fp_register_fork);
    pthread_mutex_lock(&fp_lock);
    int rc = device_get(device, &d);
    if (!rc && !(rc = cu.cuCtxPushCurrent(d->ctx))) {
        rc = fp_run(device, chunks, n, out);
        tms_CUcontext popped;
        int pop_rc = cu.cuCtxPopCurrent(&popped);
        if (!rc) rc = pop_rc;
    }
    pthread_mutex_unlock(&fp_lock);
    return rc;
}

/* ---- filling device memory ------------------------------------------------------------
 * One stream per device, made on first use, on which every range is queued
 * before one wait: a resume that zeroes many allocations waits once. */
static pthread_mutex_t fill_lock = PTHREAD_MUTEX_INITIALIZER;  /* the streams; held across a fill */
static tms_CUstream fill_streams[CUDA_MAX_DEVICES];
static pthread_once_t fill_fork_once = PTHREAD_ONCE_INIT;

static void fill_fork_prepare(void) { pthread_mutex_lock(&fill_lock); }
static void fill_fork_release(void) { pthread_mutex_unlock(&fill_lock); }
static void fill_register_fork(void)
{
    static const struct tms_fork_handlers handlers = {fill_fork_prepare, fill_fork_release, fill_fork_release};
    tms_fork_register(TMS_FORK_FILL, &handlers);
}

static int fill_run(int device, const tms_va *va, const size_t *len, size_t n, unsigned char byte)
{
    tms_CUstream *s = &fill_streams[device];
    int rc = *s ? 0 : cu.cuStreamCreate(s, TMS_CU_STREAM_NON_BLOCKING);
    if (rc) {
        *s = NULL;
        return rc;
    }
    for (size_t i = 0; !rc && i < n; i++) rc = cu.cuMemsetD8Async(va[i], byte, len[i], *s);
    int wait_rc = cu.cuStreamSynchronize(*s);  /* nothing queued stays in flight, also after a failure */
    return rc ? rc : wait_rc;
}

static int cuda_fill(int device, const tms_va *va, const size_t *len, size_t n, unsigned char byte)
{
    struct cuda_device *d;
    if (device < 0 || device >= CUDA_MAX_DEVICES) return TMS_CUDA_ERROR_INVALID_DEVICE;
    if (!cu.cuMemsetD8Async) return TMS_CUDA_ERROR_NOT_SUPPORTED;
    pthread_once(&fill_fork_once, fill_register_fork);
    pthread_mutex_lock(&fill_lock);
    int rc = device_get(device, &d);
    if (!rc && !(rc = cu.cuCtxPushCurrent(d->ctx))) {
        rc = fill_run(device, va, len, n, byte);
        tms_CUcontext popped;
        int pop_rc = cu.cuCtxPopCurrent(&popped);
        if (!rc) rc = pop_rc;
    }
    pthread_mutex_unlock(&fill_lock);
    return rc;
}

const struct tms_driver tms_driver_cuda = {
    .name = "cuda",
    .load = cuda_load,
    .is_oom = cuda_is_oom,
    .is_shutdown = cuda_is_shutdown,
    .code_name = cuda_code_name,
    .default_chunk_bytes = cuda_default_chunk_bytes,
    .device_count = cuda_device_count,
    .current_device = cuda_current_device,
    .granularity = cuda_granularity,
    .mem_get_info = cuda_mem_get_info,
    .reserve = cuda_reserve,
    .unreserve = cuda_unreserve,
    .create = cuda_create,
    .create_shareable = cuda_create_shareable,
    .release = cuda_release,
    .share_types = cuda_share_types,
    .export_fd = cuda_export_fd,
    .import_fd = cuda_import_fd,
    .device_identity = cuda_device_identity,
    .map = cuda_map,
    .unmap = cuda_unmap,
    .synchronize = cuda_synchronize,
    .stream_create = cuda_stream_create,
    .copy_async = cuda_copy_async,
    .stream_wait = cuda_stream_wait,
    .host_alloc_pinned = cuda_host_alloc_pinned,
    .host_free_pinned = cuda_host_free_pinned,
    .host_register = cuda_host_register,
    .host_unregister = cuda_host_unregister,
    .numa_node = cuda_numa_node,
    .device_active = cuda_device_active,
    .fingerprint = cuda_fingerprint,
    .fill = cuda_fill,
};
