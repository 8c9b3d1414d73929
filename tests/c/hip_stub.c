/* A stand-in for libamdhip64: every HIP entry point driver_hip.c
 * resolves, with the real signatures (hip_abi.h), over host memory the way
 * driver_host.c emulates VMM. Loaded through TMS_HIP_LIBRARY by the tests.
 *
 *   reserve  = mmap PROT_NONE, aligned       create  = memfd of the size
 *   map      = mmap MAP_SHARED|MAP_FIXED, PROT_NONE until hipMemSetAccess
 *   unmap    = back to an anonymous PROT_NONE reservation
 *   release  = close (deferred while mapped, as in HIP/CUDA)
 *   hipHostMalloc = mmap; hipHostRegister only records the range
 *   copies   = queued on their stream and run by hipStreamSynchronize /
 *              hipDeviceSynchronize, like a GPU's asynchronous DMA
 *
 * Arguments are checked as the real runtime does (sizes against the
 * granularity and the handle, mapped ranges, devices, directions, handles),
 * so a wrong call in driver_hip.c returns an error here. Work left queued on
 * memory being unmapped, or a copy touching memory that is not mapped and
 * accessible when it runs, would fault a GPU: the stub aborts with a message.
 *
 * Environment: HIP_STUB_VERSION (hipRuntimeGetVersion, default 60342131 =
 * ROCm 6.3), HIP_STUB_DEVICES (default 2), HIP_STUB_DEVICE_BYTES (capacity
 * per device, default 16 GiB), HIP_STUB_NO_REGISTER (hipHostRegister
 * unsupported). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../../src/platform/hip_abi.h"

#define API __attribute__((visibility("default")))
#define GRANULARITY ((size_t)2 << 20)
#define MAX_DEVICES 8

enum {
    hipErrorInvalidValue = 1,
    hipErrorInvalidMemcpyDirection = 21,
    hipErrorNoDevice = 100,
    hipErrorInvalidHandle = 400,
    hipErrorNotMapped = 211,
    hipErrorHostMemoryAlreadyRegistered = 712,
    hipErrorHostMemoryNotRegistered = 713,
    hipErrorNotSupported = 801,
};

struct reservation { uintptr_t va; size_t size; struct reservation *next; };
struct handle { uintptr_t id; int fd, device, maps, released; size_t size; struct handle *next; };
struct mapping { uintptr_t va; size_t size; int prot; struct handle *h; struct mapping *next; };
struct copy { void *dst; const void *src; size_t n; uintptr_t dev; struct copy *next; };
struct stream { uintptr_t id; int device; struct copy *head, **tail; struct stream *next; };
struct host_block { void *p; size_t size; struct host_block *next; };

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;  /* guards everything below */
static struct reservation *reservations;
static struct handle *handles;
static struct mapping *mappings;
static struct stream *streams;
static struct host_block *host_blocks;   /* hipHostMalloc */
static struct host_block *registered;    /* hipHostRegister */
static uintptr_t next_id = 0x1000;  /* handle and stream tokens: never NULL, never reused */
static size_t used[MAX_DEVICES];

/* The calling thread's device (0 until hipSetDevice). A pthread key, not
 * _Thread_local: LeakSanitizer crashes scanning the dynamic TLS of a
 * dlopen'ed library in threads (seen with the lent toolchain). */
static pthread_once_t device_key_once = PTHREAD_ONCE_INIT;
static pthread_key_t device_key;
static void make_device_key(void) { (void)pthread_key_create(&device_key, NULL); }

static int current_device(void)
{
    pthread_once(&device_key_once, make_device_key);
    return (int)(intptr_t)pthread_getspecific(device_key);
}

#define STUB_MAX_DEVICES 64
static int device_used[STUB_MAX_DEVICES];  /* atomic: made current by some thread */

static void set_current_device(int device)
{
    if (device >= 0 && device < STUB_MAX_DEVICES) __atomic_store_n(&device_used[device], 1, __ATOMIC_RELAXED);
    pthread_once(&device_key_once, make_device_key);
    (void)pthread_setspecific(device_key, (void *)(intptr_t)device);
}

static long env_long(const char *name, long fallback)
{
    const char *s = getenv(name);
    return s && *s ? strtol(s, NULL, 10) : fallback;
}

static int device_count(void)
{
    long n = env_long("HIP_STUB_DEVICES", 2);
    return n < 0 ? 0 : n > MAX_DEVICES ? MAX_DEVICES : (int)n;
}

static size_t capacity(void) { return (size_t)env_long("HIP_STUB_DEVICE_BYTES", 16L << 30); }
static int valid_device(int d) { return d >= 0 && d < device_count(); }

static _Noreturn void gpu_fault(const char *what, uintptr_t va, size_t n)
{
    fprintf(stderr, "hip_stub: %s [0x%llx, +%zu): a GPU would fault or corrupt memory here\n", what,
            (unsigned long long)va, n);
    abort();
}

/* ---- lookups (under lock) ----------------------------------------------- */

static struct reservation *reservation_of(uintptr_t va, size_t n)
{
    for (struct reservation *r = reservations; r; r = r->next)
        if (va >= r->va && n <= r->size && va - r->va <= r->size - n) return r;
    return NULL;
}

static struct mapping *mapping_at(uintptr_t va)
{
    for (struct mapping *m = mappings; m; m = m->next)
        if (va >= m->va && va - m->va < m->size) return m;
    return NULL;
}

static struct handle *handle_of(tms_hipMemGenericAllocationHandle_t token)
{
    for (struct handle *h = handles; h; h = h->next)
        if (h->id == (uintptr_t)token && !h->released) return h;
    return NULL;
}

static struct stream *stream_of(tms_hipStream_t token)
{
    for (struct stream *s = streams; s; s = s->next)
        if (s->id == (uintptr_t)token) return s;
    return NULL;
}

/* Is [va, va+n) inside device memory at all (any reservation)? */
static int is_device(uintptr_t va, size_t n) { return n && reservation_of(va, 1) && reservation_of(va + n - 1, 1); }

/* Is every byte of [va, va+n) mapped (and, if prot, with at least prot)? */
static int covered(uintptr_t va, size_t n, int prot)
{
    for (uintptr_t end = va + n; va < end;) {
        struct mapping *m = mapping_at(va);
        if (!m || (m->prot & prot) != prot) return 0;
        va = m->va + m->size;
    }
    return 1;
}

/* Is [va, va+n) exactly a run of whole mappings (what unmap and set-access take)? */
static int whole_mappings(uintptr_t va, size_t n)
{
    if (n == 0) return 0;
    for (uintptr_t end = va + n; va < end;) {
        struct mapping *m = mapping_at(va);
        if (!m || m->va != va || m->size > end - va) return 0;
        va += m->size;
    }
    return 1;
}

/* Does queued work still touch [va, va+n)? */
static int in_flight(uintptr_t va, size_t n)
{
    for (struct stream *s = streams; s; s = s->next)
        for (struct copy *c = s->head; c; c = c->next)
            if (c->dev < va + n && va < c->dev + c->n) return 1;
    return 0;
}

static void handle_drop_if_done(struct handle *h)
{
    if (!h->released || h->maps) return;
    close(h->fd);
    used[h->device] -= h->size;
    for (struct handle **p = &handles; *p; p = &(*p)->next)
        if (*p == h) {
            *p = h->next;
            break;
        }
    free(h);
}

static void run_queue(struct stream *s)
{
    while (s->head) {
        struct copy *c = s->head;
        if (!covered(c->dev, c->n, PROT_READ | PROT_WRITE)) gpu_fault("queued copy on memory no longer mapped", c->dev, c->n);
        memcpy(c->dst, c->src, c->n);
        s->head = c->next;
        free(c);
    }
    s->tail = &s->head;
}

/* ---- devices -------------------------------------------------------------- */

API tms_hipError_t hipGetDeviceCount(int *count)
{
    if (!count) return hipErrorInvalidValue;
    *count = device_count();
    return *count ? TMS_hipSuccess : hipErrorNoDevice;
}

API tms_hipError_t hipGetDevice(int *device)
{
    if (!device) return hipErrorInvalidValue;
    *device = current_device();
    return TMS_hipSuccess;
}

API tms_hipError_t hipSetDevice(int device)
{
    if (!valid_device(device)) return TMS_hipErrorInvalidDevice;
    set_current_device(device);
    return TMS_hipSuccess;
}

/* A device's context is active once the thread made it current (set_current_device records it). */
API tms_hipError_t hipDevicePrimaryCtxGetState(int device, unsigned *flags, int *active)
{
    if (!flags || !active) return hipErrorInvalidValue;
    if (!valid_device(device) || device >= STUB_MAX_DEVICES) return TMS_hipErrorInvalidDevice;
    *flags = 0;
    *active = __atomic_load_n(&device_used[device], __ATOMIC_RELAXED) || device == current_device();
    return TMS_hipSuccess;
}

API tms_hipError_t hipRuntimeGetVersion(int *version)
{
    if (!version) return hipErrorInvalidValue;
    *version = (int)env_long("HIP_STUB_VERSION", 60342131);
    return TMS_hipSuccess;
}

API tms_hipError_t hipDeviceSynchronize(void)
{
    pthread_mutex_lock(&lock);
    for (struct stream *s = streams; s; s = s->next)
        if (s->device == current_device()) run_queue(s);
    pthread_mutex_unlock(&lock);
    return TMS_hipSuccess;
}

API tms_hipError_t hipMemGetInfo(size_t *free_bytes, size_t *total_bytes)
{
    if (!free_bytes || !total_bytes) return hipErrorInvalidValue;
    pthread_mutex_lock(&lock);
    size_t u = used[current_device()], total = capacity();
    pthread_mutex_unlock(&lock);
    *total_bytes = total;
    *free_bytes = u < total ? total - u : 0;
    return TMS_hipSuccess;
}

/* ---- virtual memory ------------------------------------------------------- */

static int valid_prop(const tms_hipMemAllocationProp *prop)
{
    return prop && prop->type == TMS_hipMemAllocationTypePinned && prop->location.type == TMS_hipMemLocationTypeDevice &&
           valid_device(prop->location.id);
}

API tms_hipError_t hipMemGetAllocationGranularity(size_t *g, const tms_hipMemAllocationProp *prop, int option)
{
    if (!g || !valid_prop(prop) || (option != 0 && option != 1)) return hipErrorInvalidValue;
    *g = GRANULARITY;
    return TMS_hipSuccess;
}

API tms_hipError_t hipMemAddressReserve(void **va, size_t size, size_t align, void *addr, unsigned long long flags)
{
    (void)addr;  /* a hint only */
    if (!va || size == 0 || size % GRANULARITY || flags || (align & (align - 1))) return hipErrorInvalidValue;
    if (align < GRANULARITY) align = GRANULARITY;
    size_t span = size + align;
    char *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return TMS_hipErrorOutOfMemory;
    uintptr_t start = ((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1);
    size_t head = start - (uintptr_t)p, tail = span - head - size;
    if (head) munmap(p, head);
    if (tail) munmap((char *)start + size, tail);
    struct reservation *r = malloc(sizeof *r);
    if (!r) return munmap((void *)start, size), TMS_hipErrorOutOfMemory;
    *r = (struct reservation){.va = start, .size = size};
    pthread_mutex_lock(&lock);
    r->next = reservations;
    reservations = r;
    pthread_mutex_unlock(&lock);
    *va = (void *)start;
    return TMS_hipSuccess;
}

/* The whole reservation, with nothing mapped in it any more. */
API tms_hipError_t hipMemAddressFree(void *va, size_t size)
{
    int rc = hipErrorInvalidValue;
    pthread_mutex_lock(&lock);
    for (struct reservation **p = &reservations; *p; p = &(*p)->next) {
        struct reservation *r = *p;
        if (r->va != (uintptr_t)va || r->size != size) continue;
        for (struct mapping *m = mappings; m; m = m->next)
            if (m->va >= r->va && m->va - r->va < r->size) goto out;
        if (in_flight(r->va, r->size)) gpu_fault("address free with work in flight", r->va, r->size);
        munmap(va, size);
        *p = r->next;
        free(r);
        rc = TMS_hipSuccess;
        break;
    }
out:
    pthread_mutex_unlock(&lock);
    return rc;
}

API tms_hipError_t hipMemCreate(tms_hipMemGenericAllocationHandle_t *out, size_t size,
                                const tms_hipMemAllocationProp *prop, unsigned long long flags)
{
    if (!out || !valid_prop(prop) || size == 0 || size % GRANULARITY || flags) return hipErrorInvalidValue;
    int device = prop->location.id;
    struct handle *h = calloc(1, sizeof *h);
    if (!h) return TMS_hipErrorOutOfMemory;
    pthread_mutex_lock(&lock);
    if (size > capacity() - used[device]) {
        pthread_mutex_unlock(&lock);
        free(h);
        return TMS_hipErrorOutOfMemory;
    }
    int fd = memfd_create("hip-stub-device", MFD_CLOEXEC);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0) {
        if (fd >= 0) close(fd);
        pthread_mutex_unlock(&lock);
        free(h);
        return TMS_hipErrorOutOfMemory;
    }
    used[device] += size;
    *h = (struct handle){.id = next_id++, .fd = fd, .device = device, .size = size, .next = handles};
    handles = h;
    pthread_mutex_unlock(&lock);
    *out = (tms_hipMemGenericAllocationHandle_t)h->id;
    return TMS_hipSuccess;
}

/* Releasing a mapped handle is legal: the memory goes with the last unmap. */
API tms_hipError_t hipMemRelease(tms_hipMemGenericAllocationHandle_t token)
{
    pthread_mutex_lock(&lock);
    struct handle *h = handle_of(token);
    if (h) {
        h->released = 1;
        handle_drop_if_done(h);
    }
    pthread_mutex_unlock(&lock);
    return h ? TMS_hipSuccess : hipErrorInvalidHandle;
}

/* The whole handle (offset 0, size == its size) into an unmapped, reserved range. */
API tms_hipError_t hipMemMap(void *va, size_t size, size_t offset, tms_hipMemGenericAllocationHandle_t token,
                             unsigned long long flags)
{
    uintptr_t start = (uintptr_t)va;
    int rc = hipErrorInvalidValue;
    struct mapping *m = malloc(sizeof *m);
    if (!m) return TMS_hipErrorOutOfMemory;
    pthread_mutex_lock(&lock);
    struct handle *h = handle_of(token);
    if (!h) rc = hipErrorInvalidHandle;
    else if (offset || flags || size != h->size || start % GRANULARITY || !reservation_of(start, size)) rc = hipErrorInvalidValue;
    else {
        int overlaps = 0;
        for (struct mapping *o = mappings; o; o = o->next) overlaps |= o->va < start + size && start < o->va + o->size;
        if (!overlaps && mmap(va, size, PROT_NONE, MAP_SHARED | MAP_FIXED, h->fd, 0) != MAP_FAILED) {
            *m = (struct mapping){.va = start, .size = size, .prot = PROT_NONE, .h = h, .next = mappings};
            mappings = m;
            h->maps++;
            rc = TMS_hipSuccess;
        }
    }
    pthread_mutex_unlock(&lock);
    if (rc) free(m);
    return rc;
}

API tms_hipError_t hipMemUnmap(void *va, size_t size)
{
    uintptr_t start = (uintptr_t)va;
    pthread_mutex_lock(&lock);
    if (!whole_mappings(start, size)) {
        pthread_mutex_unlock(&lock);
        return hipErrorInvalidValue;
    }
    if (in_flight(start, size)) gpu_fault("unmap with queued copies (no synchronize before it)", start, size);
    for (struct mapping **p = &mappings; *p;) {
        struct mapping *m = *p;
        if (m->va < start || m->va - start >= size) {
            p = &m->next;
            continue;
        }
        if (mmap((void *)m->va, m->size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0) ==
            MAP_FAILED)
            gpu_fault("remapping as reservation failed", m->va, m->size);
        *p = m->next;
        m->h->maps--;
        handle_drop_if_done(m->h);
        free(m);
    }
    pthread_mutex_unlock(&lock);
    return TMS_hipSuccess;
}

API tms_hipError_t hipMemSetAccess(void *va, size_t size, const tms_hipMemAccessDesc *desc, size_t count)
{
    uintptr_t start = (uintptr_t)va;
    if (!desc || count == 0) return hipErrorInvalidValue;
    int prot = PROT_NONE;
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != TMS_hipMemLocationTypeDevice || !valid_device(desc[i].location.id))
            return hipErrorInvalidValue;
        if (desc[i].flags == TMS_hipMemAccessFlagsProtReadWrite) prot = PROT_READ | PROT_WRITE;
        else if (desc[i].flags == 1 && prot == PROT_NONE) prot = PROT_READ;
        else if (desc[i].flags != 0 && desc[i].flags != 1) return hipErrorInvalidValue;
    }
    pthread_mutex_lock(&lock);
    int rc = whole_mappings(start, size) ? TMS_hipSuccess : hipErrorNotMapped;
    if (!rc && mprotect(va, size, prot) != 0) rc = hipErrorInvalidValue;
    for (struct mapping *m = mappings; !rc && m; m = m->next)
        if (m->va >= start && m->va - start < size) m->prot = prot;
    pthread_mutex_unlock(&lock);
    return rc;
}

/* ---- streams and copies --------------------------------------------------- */

API tms_hipError_t hipStreamCreateWithFlags(tms_hipStream_t *out, unsigned flags)
{
    if (!out || flags > TMS_hipStreamNonBlocking) return hipErrorInvalidValue;
    struct stream *s = calloc(1, sizeof *s);
    if (!s) return TMS_hipErrorOutOfMemory;
    pthread_mutex_lock(&lock);
    s->id = next_id++;
    s->device = current_device();
    s->tail = &s->head;
    s->next = streams;
    streams = s;
    pthread_mutex_unlock(&lock);
    *out = (tms_hipStream_t)s->id;
    return TMS_hipSuccess;
}

API tms_hipError_t hipStreamSynchronize(tms_hipStream_t token)
{
    pthread_mutex_lock(&lock);
    struct stream *s = stream_of(token);
    if (s) run_queue(s);
    pthread_mutex_unlock(&lock);
    return s || !token ? TMS_hipSuccess : hipErrorInvalidHandle;
}

/* Host<->device only (all the backend asks for); the device side must be
 * mapped with read-write access, possibly across several mappings. */
API tms_hipError_t hipMemcpyAsync(void *dst, const void *src, size_t n, int kind, tms_hipStream_t token)
{
    if (n == 0) return TMS_hipSuccess;
    if (!dst || !src) return hipErrorInvalidValue;
    uintptr_t dev, host;
    if (kind == TMS_hipMemcpyHostToDevice) dev = (uintptr_t)dst, host = (uintptr_t)src;
    else if (kind == TMS_hipMemcpyDeviceToHost) dev = (uintptr_t)src, host = (uintptr_t)dst;
    else return hipErrorInvalidMemcpyDirection;
    struct copy *c = malloc(sizeof *c);
    if (!c) return TMS_hipErrorOutOfMemory;
    *c = (struct copy){.dst = dst, .src = src, .n = n, .dev = dev};
    pthread_mutex_lock(&lock);
    int rc = TMS_hipSuccess;
    struct stream *s = stream_of(token);
    if (token && !s) rc = hipErrorInvalidHandle;
    else if (is_device(host, n) || !covered(dev, n, PROT_READ | PROT_WRITE)) rc = hipErrorInvalidValue;
    else if (s) {
        *s->tail = c;
        s->tail = &c->next;
        c = NULL;
    } else {
        memcpy(dst, src, n);  /* the null stream: synchronous here */
    }
    pthread_mutex_unlock(&lock);
    free(c);
    return rc;
}

/* ---- host memory ---------------------------------------------------------- */

API tms_hipError_t hipHostMalloc(void **p, size_t size, unsigned flags)
{
    if (!p || size == 0 || flags > 0xf) return hipErrorInvalidValue;
    struct host_block *b = malloc(sizeof *b);
    void *mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (!b || mem == MAP_FAILED) {
        free(b);
        if (mem != MAP_FAILED) munmap(mem, size);
        return TMS_hipErrorOutOfMemory;
    }
    pthread_mutex_lock(&lock);
    *b = (struct host_block){.p = mem, .size = size, .next = host_blocks};
    host_blocks = b;
    pthread_mutex_unlock(&lock);
    *p = mem;
    return TMS_hipSuccess;
}

API tms_hipError_t hipHostFree(void *p)
{
    if (!p) return TMS_hipSuccess;
    pthread_mutex_lock(&lock);
    struct host_block *b = NULL;
    for (struct host_block **q = &host_blocks; *q; q = &(*q)->next)
        if ((*q)->p == p) {
            b = *q;
            *q = b->next;
            break;
        }
    pthread_mutex_unlock(&lock);
    if (!b) return hipErrorInvalidValue;
    munmap(b->p, b->size);
    free(b);
    return TMS_hipSuccess;
}

/* Page-locks memory the caller owns: not device memory, not twice.
 * HIP_STUB_NO_REGISTER=1: unsupported, as on a platform without it. */
API tms_hipError_t hipHostRegister(void *p, size_t size, unsigned flags)
{
    if (env_long("HIP_STUB_NO_REGISTER", 0)) return hipErrorNotSupported;
    if (!p || size == 0 || flags > 0xf) return hipErrorInvalidValue;
    struct host_block *b = malloc(sizeof *b);
    if (!b) return TMS_hipErrorOutOfMemory;
    int rc = TMS_hipSuccess;
    pthread_mutex_lock(&lock);
    if (is_device((uintptr_t)p, size)) rc = hipErrorInvalidValue;
    for (struct host_block *o = registered; o && !rc; o = o->next)
        if ((char *)o->p < (char *)p + size && (char *)p < (char *)o->p + o->size) rc = hipErrorHostMemoryAlreadyRegistered;
    if (!rc) {
        *b = (struct host_block){.p = p, .size = size, .next = registered};
        registered = b;
        b = NULL;
    }
    pthread_mutex_unlock(&lock);
    free(b);
    return rc;
}

API tms_hipError_t hipHostUnregister(void *p)
{
    struct host_block *b = NULL;
    pthread_mutex_lock(&lock);
    for (struct host_block **q = &registered; *q; q = &(*q)->next)
        if ((*q)->p == p) {
            b = *q;
            *q = b->next;
            break;
        }
    pthread_mutex_unlock(&lock);
    int rc = b ? TMS_hipSuccess : hipErrorHostMemoryNotRegistered;
    free(b);
    return rc;
}

API const char *hipGetErrorName(tms_hipError_t code)
{
    switch (code) {
    case TMS_hipSuccess: return "hipSuccess";
    case hipErrorInvalidValue: return "hipErrorInvalidValue";
    case TMS_hipErrorOutOfMemory: return "hipErrorOutOfMemory";
    case TMS_hipErrorNotInitialized: return "hipErrorNotInitialized";
    case TMS_hipErrorDeinitialized: return "hipErrorDeinitialized";
    case hipErrorInvalidMemcpyDirection: return "hipErrorInvalidMemcpyDirection";
    case hipErrorNoDevice: return "hipErrorNoDevice";
    case TMS_hipErrorInvalidDevice: return "hipErrorInvalidDevice";
    case hipErrorNotMapped: return "hipErrorNotMapped";
    case hipErrorInvalidHandle: return "hipErrorInvalidHandle";
    case hipErrorHostMemoryAlreadyRegistered: return "hipErrorHostMemoryAlreadyRegistered";
    case hipErrorHostMemoryNotRegistered: return "hipErrorHostMemoryNotRegistered";
    case hipErrorNotSupported: return "hipErrorNotSupported";
    default: return "hipErrorUnknown";
    }
}
