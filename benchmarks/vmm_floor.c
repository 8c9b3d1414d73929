/*
 * vmm_floor: the raw CUDA driver floor of pause and resume, with no library in between:
 * pause = cuMemUnmap + cuMemRelease, resume = cuMemCreate + cuMemMap + cuMemSetAccess,
 * per allocation, the calls torch_memory_saver makes for an allocation of one chunk
 * (src/core/chunks.c), each allocation with its own virtual range kept across cycles.
 *
 * Usage: vmm_floor [--cycles N] [--warmup W] [--margin BYTES] [--shuffle] [--touch]
 *                  [--idle-us U] [SHAPE ...]
 *   --shuffle: visit the allocations in one fixed random order (the cost of the order).
 *   --touch: between cycles (untimed) write the first and last 4 KiB, as the library
 *   benchmarks do to check the memory works: an unmap of used memory costs more.
 *   --idle-us: spin U microseconds with the device idle before the timed loops.
 *   SHAPE = COUNTxSIZE, SIZE in bytes or with a K/M/G/T suffix (binary); default
 *   1x8G 64x128M 2048x4M. Prints one JSON document on stdout, progress on stderr;
 *   exit status 0 if the driver loaded (a shape may carry an "error"), 2 if not.
 * -DVMM_FLOOR_LIBRARY -shared -fPIC builds a library instead, for a floor cycled
 * inside another process (the end of this file). The driver is opened at run time
 * (dlopen + cuGetProcAddress): building needs only cuda.h (benchmarks/floor.py).
 */
#define _GNU_SOURCE
#include <cuda.h>
#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAX_SHAPES 64
#define MAX_CYCLES 1000
#define ABI_VERSION 12000

/* cuGetProcAddress_v2 (CUDA 12+) and the 11.3 form, declared here so the
 * program builds against any cuda.h >= 11.3 and runs on any driver >= 12. */
typedef int (*getproc_v2_fn)(const char *, void **, int, unsigned long long, int *);
typedef int (*getproc_v1_fn)(const char *, void **, int, unsigned long long);

static struct {
    CUresult (*init)(unsigned int);
    CUresult (*driver_version)(int *);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*device_name)(char *, int, CUdevice);
    CUresult (*primary_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_set)(CUcontext);
    CUresult (*ctx_sync)(void);
    CUresult (*mem_info)(size_t *, size_t *);
    CUresult (*granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
    CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*address_free)(CUdeviceptr, size_t);
    CUresult (*create)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *, unsigned long long);
    CUresult (*release)(CUmemGenericAllocationHandle);
    CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*unmap)(CUdeviceptr, size_t);
    CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*error_name)(CUresult, const char **);
    CUresult (*memset8)(CUdeviceptr, unsigned char, size_t);
} cu;

static char load_error[512];

static const char *err_name(CUresult rc)
{
    const char *name = NULL;
    if (cu.error_name && cu.error_name(rc, &name) == CUDA_SUCCESS && name) return name;
    return "CUDA_ERROR_UNKNOWN";
}

static int resolve(getproc_v2_fn v2, getproc_v1_fn v1, const char *name, void *slot)
{
    void *fn = NULL;
    int status = 0, rc;
    rc = v2 ? v2(name, &fn, ABI_VERSION, 0 /* CU_GET_PROC_ADDRESS_DEFAULT */, &status)
            : v1(name, &fn, ABI_VERSION, 0);
    if (rc != 0 || !fn) {
        snprintf(load_error, sizeof load_error, "driver lacks %s (cuGetProcAddress code %d, status %d)", name, rc,
                 status);
        return -1;
    }
    memcpy(slot, &fn, sizeof fn);
    return 0;
}

static int load_driver(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *why = dlerror();
        snprintf(load_error, sizeof load_error, "dlopen(\"libcuda.so.1\") failed: %s", why ? why : "?");
        return -1;
    }
    getproc_v2_fn v2 = NULL;
    getproc_v1_fn v1 = NULL;
    void *p = dlsym(lib, "cuGetProcAddress_v2");
    memcpy(&v2, &p, sizeof p);
    p = dlsym(lib, "cuGetProcAddress");
    memcpy(&v1, &p, sizeof p);
    if (!v2 && !v1) {
        snprintf(load_error, sizeof load_error, "libcuda.so.1 has no cuGetProcAddress (driver older than CUDA 11.3)");
        return -1;
    }
#define R(field, sym) \
    if (resolve(v2, v1, sym, &cu.field)) return -1;
    R(init, "cuInit")
    R(driver_version, "cuDriverGetVersion")
    R(device_get, "cuDeviceGet")
    R(device_name, "cuDeviceGetName")
    R(primary_retain, "cuDevicePrimaryCtxRetain")
    R(ctx_set, "cuCtxSetCurrent")
    R(ctx_sync, "cuCtxSynchronize")
    R(mem_info, "cuMemGetInfo")
    R(granularity, "cuMemGetAllocationGranularity")
    R(reserve, "cuMemAddressReserve")
    R(address_free, "cuMemAddressFree")
    R(create, "cuMemCreate")
    R(release, "cuMemRelease")
    R(map, "cuMemMap")
    R(unmap, "cuMemUnmap")
    R(set_access, "cuMemSetAccess")
    R(error_name, "cuGetErrorName")
    R(memset8, "cuMemsetD8")
#undef R
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

struct shape {
    const char *text;
    long count;
    unsigned long long size;
};

static int shuffle_order; /* --shuffle */

/* The order a cycle visits the allocations in: reserved order, or a fixed
 * permutation (xorshift, Fisher-Yates) with --shuffle. */
static long *visit_order(long count)
{
    long *order = malloc((size_t)count * sizeof *order);
    if (!order) return NULL;
    for (long i = 0; i < count; i++) order[i] = i;
    unsigned long long x = 88172645463325252ull;
    for (long i = count - 1; shuffle_order && i > 0; i--) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        long j = (long)(x % (unsigned long long)(i + 1)), t = order[i];
        order[i] = order[j], order[j] = t;
    }
    return order;
}

/* One shape's allocations: reserved once, mapped, then cycled. */
struct held {
    long count;
    size_t rsize;
    CUmemAllocationProp prop;
    CUmemAccessDesc access;
    CUdeviceptr *va;
    CUmemGenericAllocationHandle *h;
    char *mapped;
    long *order;
    long reserved;
    int ascending; /* does the driver hand out addresses upwards? */
    double first_map_s;
};

static int hold_resume(struct held *h, double *seconds, char *error, size_t cap);

/* Reserves and maps sh; 0, or -1 with the reason in error. The caller
 * closes h whatever the result. */
static int hold_open(struct held *h, const struct shape *sh, CUdevice dev, size_t gran, unsigned long long margin,
                     char *error, size_t cap)
{
    CUresult rc;
    memset(h, 0, sizeof *h);
    h->count = sh->count;
    h->rsize = (size_t)((sh->size + gran - 1) / gran * gran);
    h->ascending = -1;
    h->first_map_s = -1.0;
    h->prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    h->prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    h->prop.location.id = (int)dev;
    h->access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    h->access.location.id = (int)dev;
    h->access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    h->va = calloc((size_t)sh->count, sizeof *h->va);
    h->h = calloc((size_t)sh->count, sizeof *h->h);
    h->mapped = calloc((size_t)sh->count, 1);
    h->order = visit_order(sh->count);
    size_t total = h->rsize * (size_t)sh->count, free_bytes = 0, total_bytes = 0;
    if (!h->va || !h->h || !h->mapped || !h->order) {
        snprintf(error, cap, "out of host memory for %ld handles", sh->count);
        return -1;
    }
    if ((rc = cu.mem_info(&free_bytes, &total_bytes))) {
        snprintf(error, cap, "cuMemGetInfo failed: %s (%d)", err_name(rc), rc);
        return -1;
    }
    if ((unsigned long long)total + margin > (unsigned long long)free_bytes) {
        snprintf(error, cap, "skipped: needs %zu bytes + %llu margin, %zu free", total, margin, free_bytes);
        return -1;
    }
    for (; h->reserved < sh->count; h->reserved++) {
        if ((rc = cu.reserve(&h->va[h->reserved], h->rsize, gran, 0, 0))) {
            snprintf(error, cap, "cuMemAddressReserve(%zu) #%ld failed: %s (%d)", h->rsize, h->reserved,
                     err_name(rc), rc);
            return -1;
        }
    }
    if (h->reserved >= 2) h->ascending = h->va[1] > h->va[0];
    /* Initial mapping (not a cycle). */
    return hold_resume(h, &h->first_map_s, error, cap);
}

/* Between cycles, untimed: with write, the first 4 KiB of the first and the
 * last 4 KiB of the last allocation get value; then the device is idle. */
static int hold_touch(struct held *h, int write, int value, char *error, size_t cap)
{
    size_t edge = h->rsize < 4096 ? h->rsize : 4096;
    CUresult rc;
    if (write && ((rc = cu.memset8(h->va[0], (unsigned char)value, edge)) ||
                  (rc = cu.memset8(h->va[h->count - 1] + h->rsize - edge, (unsigned char)value, edge)))) {
        snprintf(error, cap, "cuMemsetD8 failed: %s (%d)", err_name(rc), rc);
        return -1;
    }
    if ((rc = cu.ctx_sync())) {
        snprintf(error, cap, "cuCtxSynchronize failed: %s (%d)", err_name(rc), rc);
        return -1;
    }
    return 0;
}

/* The pause floor: cuMemUnmap + cuMemRelease of every allocation. */
static int hold_pause(struct held *h, double *seconds, char *error, size_t cap)
{
    CUresult rc;
    double a = now_s();
    for (long k = 0; k < h->count; k++) {
        long i = h->order[k];
        if ((rc = cu.unmap(h->va[i], h->rsize))) {
            snprintf(error, cap, "cuMemUnmap #%ld failed: %s (%d)", i, err_name(rc), rc);
            return -1;
        }
        h->mapped[i] = 0;
        if ((rc = cu.release(h->h[i]))) {
            snprintf(error, cap, "cuMemRelease #%ld failed: %s (%d)", i, err_name(rc), rc);
            return -1;
        }
        h->h[i] = 0;
    }
    *seconds = now_s() - a;
    return 0;
}

/* The resume floor: cuMemCreate + cuMemMap + cuMemSetAccess of every allocation. */
static int hold_resume(struct held *h, double *seconds, char *error, size_t cap)
{
    CUresult rc;
    double a = now_s();
    for (long k = 0; k < h->count; k++) {
        long i = h->order[k];
        if ((rc = cu.create(&h->h[i], h->rsize, &h->prop, 0))) {
            h->h[i] = 0;
            snprintf(error, cap, "cuMemCreate(%zu) #%ld failed: %s (%d)", h->rsize, i, err_name(rc), rc);
            return -1;
        }
        if ((rc = cu.map(h->va[i], h->rsize, 0, h->h[i], 0))) {
            snprintf(error, cap, "cuMemMap #%ld failed: %s (%d)", i, err_name(rc), rc);
            return -1;
        }
        h->mapped[i] = 1;
        if ((rc = cu.set_access(h->va[i], h->rsize, &h->access, 1))) {
            snprintf(error, cap, "cuMemSetAccess #%ld failed: %s (%d)", i, err_name(rc), rc);
            return -1;
        }
    }
    *seconds = now_s() - a;
    return 0;
}

static void hold_close(struct held *h)
{
    if (h->va && h->h && h->mapped) {
        (void)cu.ctx_sync();
        for (long i = 0; i < h->count; i++) {
            if (h->mapped[i]) cu.unmap(h->va[i], h->rsize);
            if (h->h[i]) cu.release(h->h[i]);
        }
        for (long i = 0; i < h->reserved; i++) cu.address_free(h->va[i], h->rsize);
    }
    free(h->va);
    free(h->h);
    free(h->mapped);
    free(h->order);
    memset(h, 0, sizeof *h);
}

/* Device 0's primary context, current on this thread, and its granularity;
 * on failure *step names the call that failed. */
static CUresult open_device(CUdevice *dev, CUcontext *ctx, size_t *gran, const char **step)
{
    CUresult rc;
    *step = "cuInit";
    if ((rc = cu.init(0))) return rc;
    *step = "cuDeviceGet";
    if ((rc = cu.device_get(dev, 0))) return rc;
    *step = "cuDevicePrimaryCtxRetain";
    if ((rc = cu.primary_retain(ctx, *dev))) return rc;
    *step = "cuCtxSetCurrent";
    if ((rc = cu.ctx_set(*ctx))) return rc;
    CUmemAllocationProp prop;
    memset(&prop, 0, sizeof prop);
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop.location.id = (int)*dev;
    *step = "cuMemGetAllocationGranularity";
    return cu.granularity(gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
}

#ifndef VMM_FLOOR_LIBRARY
/* ---- the program ---- */

static void json_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; s && *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
    fputc('"', f);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(const double *v, int n)
{
    if (n <= 0) return -1.0;
    double tmp[MAX_CYCLES];
    memcpy(tmp, v, (size_t)n * sizeof *v);
    qsort(tmp, (size_t)n, sizeof *tmp, cmp_double);
    return n % 2 ? tmp[n / 2] : 0.5 * (tmp[n / 2 - 1] + tmp[n / 2]);
}

static int parse_size(const char *s, unsigned long long *out)
{
    char *end = NULL;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s) return -1;
    unsigned long long mul = 1;
    switch (*end) {
    case '\0': break;
    case 'k': case 'K': mul = 1ull << 10; end++; break;
    case 'm': case 'M': mul = 1ull << 20; end++; break;
    case 'g': case 'G': mul = 1ull << 30; end++; break;
    case 't': case 'T': mul = 1ull << 40; end++; break;
    default: return -1;
    }
    if (*end == 'i' || *end == 'I') end++;        /* accept MiB, GiB */
    if (*end == 'b' || *end == 'B') end++;
    if (*end != '\0') return -1;
    *out = v * mul;
    return 0;
}

static int parse_shape(const char *s, struct shape *out)
{
    const char *x = strpbrk(s, "xX*:");
    char *end = NULL;
    long count = x ? strtol(s, &end, 10) : 0; /* the count must run up to the x */
    if (!x || end != x || count <= 0 || count > (1L << 22)) return -1;
    unsigned long long size = 0;
    if (parse_size(x + 1, &size) || size == 0) return -1;
    out->text = s;
    out->count = count;
    out->size = size;
    return 0;
}

static int touch_memory;    /* --touch */
static double idle_seconds; /* --idle-us */

/* Cycles one shape; writes its JSON object (without a trailing comma). */
static void run_shape(FILE *out, const struct shape *sh, CUdevice dev, size_t gran, int cycles, int warmup,
                      unsigned long long margin)
{
    double pause_s[MAX_CYCLES], resume_s[MAX_CYCLES];
    int done = 0;
    char error[512] = "";
    struct held h;

    fprintf(stderr, "vmm_floor: %ld x %llu bytes ...\n", sh->count, sh->size);
    if (hold_open(&h, sh, dev, gran, margin, error, sizeof error) == 0) {
        for (int c = 0; c < warmup + cycles; c++) {
            double p, r;
            if (hold_touch(&h, touch_memory, c, error, sizeof error)) break;
            for (double until = now_s() + idle_seconds; now_s() < until;) {
            }
            if (hold_pause(&h, &p, error, sizeof error) || hold_resume(&h, &r, error, sizeof error)) break;
            if (c >= warmup && done < MAX_CYCLES) {
                pause_s[done] = p;
                resume_s[done] = r;
                done++;
            }
        }
    }
    size_t rsize = h.rsize, total = rsize * (size_t)sh->count;
    int ascending = h.ascending;
    double first_map_s = h.first_map_s;
    hold_close(&h);

    fprintf(out, "    {\"shape\": ");
    json_string(out, sh->text);
    fprintf(out, ", \"count\": %ld, \"size\": %llu, \"reserved_size\": %zu, \"total_bytes\": %zu,\n", sh->count,
            sh->size, rsize, total);
    fprintf(out, "     \"shuffled\": %d, \"touched\": %d, \"idle_us\": %g, \"reserved_ascending\": %d,\n",
            shuffle_order, touch_memory, idle_seconds * 1e6, ascending);
    fprintf(out, "     \"cycles\": %d, \"warmup\": %d, \"first_map_s\": ", done, warmup);
    if (first_map_s >= 0) fprintf(out, "%.9f,\n", first_map_s);
    else fprintf(out, "null,\n");
    fprintf(out, "     \"pause_s\": [");
    for (int i = 0; i < done; i++) fprintf(out, "%s%.9f", i ? ", " : "", pause_s[i]);
    fprintf(out, "],\n     \"resume_s\": [");
    for (int i = 0; i < done; i++) fprintf(out, "%s%.9f", i ? ", " : "", resume_s[i]);
    fprintf(out, "],\n");
    if (done > 0)
        fprintf(out, "     \"pause_median_s\": %.9f, \"resume_median_s\": %.9f,\n", median(pause_s, done),
                median(resume_s, done));
    else
        fprintf(out, "     \"pause_median_s\": null, \"resume_median_s\": null,\n");
    fprintf(out, "     \"error\": ");
    if (error[0]) json_string(out, error);
    else fprintf(out, "null");
    fprintf(out, "}");
    fprintf(stderr, "vmm_floor: %ld x %llu bytes: %s\n", sh->count, sh->size, error[0] ? error : "ok");
}

/* The document of a run that measured nothing; the exit status. */
static int fail_json(const char *msg)
{
    printf("{\"ok\": false, \"error\": ");
    json_string(stdout, msg);
    printf("}\n");
    return 2;
}

static void usage_error(const char *msg, const char *arg)
{
    char buf[512];
    snprintf(buf, sizeof buf, "%s: %s", msg, arg ? arg : "");
    exit(fail_json(buf));
}

int main(int argc, char **argv)
{
    static const char *defaults[] = {"1x8G", "64x128M", "2048x4M"};
    struct shape shapes[MAX_SHAPES];
    int n_shapes = 0, cycles = 7, warmup = 1;
    unsigned long long margin = 1ull << 30;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--cycles") && i + 1 < argc) {
            cycles = atoi(argv[++i]);
            if (cycles < 1 || cycles > MAX_CYCLES) usage_error("bad --cycles", argv[i]);
        } else if (!strcmp(argv[i], "--warmup") && i + 1 < argc) {
            warmup = atoi(argv[++i]);
            if (warmup < 0 || warmup > 100) usage_error("bad --warmup", argv[i]);
        } else if (!strcmp(argv[i], "--shuffle")) {
            shuffle_order = 1;
        } else if (!strcmp(argv[i], "--touch")) {
            touch_memory = 1;
        } else if (!strcmp(argv[i], "--idle-us") && i + 1 < argc) {
            char *end = NULL;
            idle_seconds = strtod(argv[++i], &end) * 1e-6;
            if (!end || *end || idle_seconds < 0 || idle_seconds > 1.0) usage_error("bad --idle-us", argv[i]);
        } else if (!strcmp(argv[i], "--margin") && i + 1 < argc) {
            if (parse_size(argv[++i], &margin)) usage_error("bad --margin", argv[i]);
        } else if (n_shapes < MAX_SHAPES) {
            if (parse_shape(argv[i], &shapes[n_shapes])) usage_error("bad shape (want COUNTxSIZE)", argv[i]);
            n_shapes++;
        } else {
            usage_error("too many shapes", argv[i]);
        }
    }
    if (n_shapes == 0)
        for (int i = 0; i < 3; i++) parse_shape(defaults[i], &shapes[n_shapes++]);

    CUresult rc;
    CUdevice dev = 0;
    CUcontext ctx = NULL;
    char name[256] = "?";
    int version = 0;
    size_t gran = 0, free_bytes = 0, total_bytes = 0;
    if (load_driver()) return fail_json(load_error);
    const char *step;
    if ((rc = open_device(&dev, &ctx, &gran, &step))) goto fail;
    cu.driver_version(&version);
    cu.device_name(name, (int)sizeof name, dev);
    step = "cuMemGetInfo";
    if ((rc = cu.mem_info(&free_bytes, &total_bytes))) goto fail;

    /* What one cuCtxSynchronize costs on an idle device: the library's pause
     * adds one per device (cuMemUnmap does not wait for queued work). */
    double sync_s[101];
    for (int i = 0; i < 101; i++) {
        double a = now_s();
        cu.ctx_sync();
        sync_s[i] = now_s() - a;
    }

    printf("{\"ok\": true, \"device\": ");
    json_string(stdout, name);
    printf(", \"driver_version\": %d, \"granularity\": %zu, \"free_bytes\": %zu, \"total_bytes\": %zu,\n", version,
           gran, free_bytes, total_bytes);
    printf("  \"ctx_synchronize_median_s\": %.9f,\n  \"shapes\": [\n", median(sync_s, 101));
    for (int i = 0; i < n_shapes; i++) {
        run_shape(stdout, &shapes[i], dev, gran, cycles, warmup, margin);
        printf(i + 1 < n_shapes ? ",\n" : "\n");
        fflush(stdout);
    }
    printf("  ]\n}\n");
    return 0;

fail:;
    char buf[256];
    snprintf(buf, sizeof buf, "%s failed: %s (%d)", step, err_name(rc), (int)rc);
    return fail_json(buf);
}

#else
/* Built with -DVMM_FLOOR_LIBRARY -shared, the floor runs inside another
 * process, on its primary context (benchmarks/floor.py Paired): one shape held
 * across calls and cycled one cycle at a time, each right beside a cycle of
 * the library, so that both see the same driver state and the same idle time
 * before the call (the driver's unmap of one allocation takes twice as long
 * after 1 ms of idle). One caller at a time. */
static struct held paired; /* one shape per loaded library */
static char paired_error[512];

const char *vmm_floor_error(void) { return paired_error; }

/* Holds count allocations of size bytes (rounded up to the granularity) on
 * device 0's primary context, which it makes current on the calling thread and
 * keeps retained: the context PyTorch uses for cuda:0, where the library's
 * allocations being compared live. */
int vmm_floor_hold(long count, unsigned long long size)
{
    CUdevice dev;
    CUcontext ctx;
    size_t gran = 0;
    const char *step;
    CUresult rc;
    paired_error[0] = '\0';
    hold_close(&paired);
    if (count <= 0 || size == 0) {
        snprintf(paired_error, sizeof paired_error, "bad shape %ld x %llu", count, size);
        return -1;
    }
    if (load_driver()) {
        snprintf(paired_error, sizeof paired_error, "%s", load_error);
        return -1;
    }
    if ((rc = open_device(&dev, &ctx, &gran, &step))) {
        snprintf(paired_error, sizeof paired_error, "%s failed: %s (%d)", step, err_name(rc), (int)rc);
        return -1;
    }
    struct shape sh = {.text = "paired", .count = count, .size = size};
    if (hold_open(&paired, &sh, dev, gran, 0, paired_error, sizeof paired_error)) {
        hold_close(&paired);
        return -1;
    }
    return 0;
}

/* One cycle: write value at both ends, synchronize and spin idle_s with the
 * device idle (untimed), then the timed pause and resume loops. */
int vmm_floor_cycle(int value, double idle_s, double *pause_s, double *resume_s)
{
    if (!paired.va) {
        snprintf(paired_error, sizeof paired_error, "vmm_floor_cycle before vmm_floor_hold");
        return -1;
    }
    if (hold_touch(&paired, 1, value, paired_error, sizeof paired_error)) return -1;
    for (double until = now_s() + idle_s; now_s() < until;) {
    }
    if (hold_pause(&paired, pause_s, paired_error, sizeof paired_error) ||
        hold_resume(&paired, resume_s, paired_error, sizeof paired_error))
        return -1;
    return 0;
}

void vmm_floor_drop(void) { hold_close(&paired); }
#endif
