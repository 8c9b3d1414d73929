/* Host backend: VMM emulated on memfd + mmap, so every core path runs without a GPU. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/inotify.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "platform/config.h"
#include "platform/driver.h"
#include "platform/log.h"

/* 2 MiB, the granularity of current NVIDIA GPUs, so rounding behaves as on one. */
#define HOST_GRANULARITY ((size_t)2 << 20)
#define HOST_MAX_DEVICES TMS_HOST_MAX_DEVICES

/* An emulated device of TMS_HOST_DEVICE_BYTES (default 16 GiB) capacity:
 * create fails with ENOMEM past it, which is how OOM paths run in CI. */
static size_t host_capacity;                     /* set once in load */
static int host_device_count;                    /* set once in load */
static size_t host_used[HOST_MAX_DEVICES];       /* atomic */
/* A device's "context": made by the first operation that names the device,
 * as the CUDA backend retains a primary context on its first use, so a test
 * can tell which devices a process touched. */
static int host_context[HOST_MAX_DEVICES];       /* atomic */

static void touch(int device)
{
    if (device >= 0 && device < HOST_MAX_DEVICES) __atomic_store_n(&host_context[device], 1, __ATOMIC_RELAXED);
}

/* TMS_FAULT (config.c): the n-th call (1-based) of op fails once. */
static long fault_at[TMS_FAULT_OPS];             /* set once in load; 0 = never */
static long fault_calls[TMS_FAULT_OPS];          /* atomic */

static int fault_hit(int op)
{
    long n = __atomic_add_fetch(&fault_calls[op], 1, __ATOMIC_RELAXED);
    return fault_at[op] != 0 && n == fault_at[op];
}

/* TMS_HOST_COPY_GATE names a regular file: the first device->host copy waits
 * until it holds a byte, so a test holds a pause in the middle of its copies
 * for as long as it needs, whatever the machine's speed. No file, a FIFO or a
 * device is no gate, and no wait outlasts GATE_MAX_S: no environment value
 * holds a pause for good. inotify wakes the wait; without it there is none. */
#define GATE_MAX_S 60
static pthread_once_t gate_once = PTHREAD_ONCE_INIT;

/* Whether the gate (open as fd) is still shut: empty and still linked. */
static int gate_shut(int fd)
{
    struct statx st;
    return statx(fd, "", AT_EMPTY_PATH, STATX_SIZE | STATX_NLINK, &st) == 0 && st.stx_size == 0 && st.stx_nlink > 0;
}

static void pass_gate(void)
{
    const char *path = tms_defaults()->host_copy_gate;
    if (!path[0]) return;
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return;
    struct statx st;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_TYPE, &st) != 0 || !S_ISREG(st.stx_mode)) {
        tms_log_warn("TMS_HOST_COPY_GATE=%s is not a regular file: the copies do not wait", path);
        close(fd);
        return;
    }
    /* Watched before the first look: a byte written in between still wakes the wait. */
    int watch = inotify_init1(IN_CLOEXEC | IN_NONBLOCK);
    if (watch >= 0 && inotify_add_watch(watch, path, IN_MODIFY | IN_ATTRIB | IN_CLOSE_WRITE | IN_DONT_FOLLOW) < 0) {
        close(watch);
        watch = -1;
    }
    struct timespec now, end;
    clock_gettime(CLOCK_MONOTONIC, &end);
    end.tv_sec += GATE_MAX_S;
    while (watch >= 0 && gate_shut(fd)) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        long long ms = (long long)(end.tv_sec - now.tv_sec) * 1000 + (end.tv_nsec - now.tv_nsec) / 1000000;
        if (ms <= 0) {
            tms_log_warn("TMS_HOST_COPY_GATE=%s stayed empty for %d s: the copies go on", path, GATE_MAX_S);
            break;
        }
        struct pollfd p = {.fd = watch, .events = POLLIN};
        if (poll(&p, 1, (int)ms) < 0 && errno != EINTR) break;
        char events[4096];
        while (read(watch, events, sizeof events) > 0) {}  /* what happened does not matter: the file says */
    }
    if (watch >= 0) close(watch);
    close(fd);
}

/* The variables were parsed (and checked at import) with the defaults. */
static int host_load(struct tms_err *err)
{
    const struct tms_defaults *env = tms_defaults();
    if (env->host_error.status) {
        if (err) *err = env->host_error;
        return env->host_error.status;
    }
    host_capacity = env->host_device_bytes;
    host_device_count = env->host_devices;
    memcpy(fault_at, env->fault_at, sizeof fault_at);
    return TMS_OK;
}

static int host_is_oom(int code) { return code == ENOMEM; }
static int host_is_shutdown(int code) { (void)code; return 0; }
static const char *host_code_name(int code) { return strerror(code); }

static int host_device_count_fn(int *count)
{
    *count = host_device_count;
    return 0;
}

/* TMS_HOST_CURRENT_DEVICE: the device the emulated runtime allocates on, as
 * if the process had called cudaSetDevice. */
static int host_current_device(int *device)
{
    *device = tms_defaults()->host_current_device;
    return 0;
}

static int host_device_active(int device, int *active)
{
    *active = device >= 0 && device < HOST_MAX_DEVICES && __atomic_load_n(&host_context[device], __ATOMIC_RELAXED);
    return 0;
}

static int host_granularity(int device, size_t *bytes)
{
    touch(device);
    *bytes = HOST_GRANULARITY;
    return 0;
}

static int host_mem_get_info(int device, size_t *free_bytes, size_t *total_bytes)
{
    touch(device);
    size_t used = __atomic_load_n(&host_used[device], __ATOMIC_RELAXED);
    *total_bytes = host_capacity;
    *free_bytes = used < host_capacity ? host_capacity - used : 0;
    return 0;
}

static int host_reserve(size_t size, size_t alignment, tms_va *va)
{
    /* Over-reserve and trim so the range starts on the alignment. */
    if (size > SIZE_MAX - alignment) return ENOMEM;
    size_t span = size + alignment;
    char *p = mmap(NULL, span, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return errno;
    uintptr_t start = ((uintptr_t)p + alignment - 1) & ~(uintptr_t)(alignment - 1);
    size_t head = start - (uintptr_t)p;
    if (head) munmap(p, head);
    size_t tail = span - head - size;
    if (tail) munmap((char *)start + size, tail);
    *va = start;
    return 0;
}

static int host_unreserve(tms_va va, size_t size)
{
    return munmap((void *)(uintptr_t)va, size) ? errno : 0;
}

/* Another process's memory: its bytes count on the exporter's device, not here. */
#define HOST_IMPORTED ((tms_phys)1 << 63)

/* A handle is a memfd; its size is what was created (fstat gives it back). */
static int host_create(int device, size_t size, tms_phys *handle)
{
    touch(device);
    if (fault_hit(TMS_FAULT_CREATE)) return ENOMEM;
    size_t used = __atomic_add_fetch(&host_used[device], size, __ATOMIC_RELAXED);
    if (used > host_capacity) {
        __atomic_sub_fetch(&host_used[device], size, __ATOMIC_RELAXED);
        return ENOMEM;
    }
    /* Sealed at its size: a process it is shared with may rely on every byte
     * staying there (a shrunk file would fault its reads). */
    int fd = memfd_create("tms-host-device", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0 || ftruncate(fd, (off_t)size) != 0 ||
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        int e = errno;
        if (fd >= 0) close(fd);
        __atomic_sub_fetch(&host_used[device], size, __ATOMIC_RELAXED);
        return e;
    }
    /* Encode the device in the high bits: release must give its bytes back. */
    *handle = ((tms_phys)device << 32) | (tms_phys)(unsigned)fd;
    return 0;
}

static int host_release(tms_phys handle)
{
    int fd = (int)(handle & 0xffffffffu);
    if (handle & HOST_IMPORTED) return close(fd) ? errno : 0;
    int device = (int)(handle >> 32);
    off_t size = lseek(fd, 0, SEEK_END);
    if (size < 0) return errno;
    if (close(fd) != 0) return errno;
    __atomic_sub_fetch(&host_used[device], (size_t)size, __ATOMIC_RELAXED);
    return 0;
}

/* A memfd is shareable as it is: no handle type to ask for (1 says "can export"). */
static int host_share_types(int device)
{
    touch(device);
    return 1;
}

/* As the CUDA driver does, an imported handle is not exported again. */
static int host_export_fd(tms_phys handle, int *fd)
{
    if (handle & HOST_IMPORTED) return EINVAL;
    int copy = fcntl((int)(handle & 0xffffffffu), F_DUPFD_CLOEXEC, 0);
    if (copy < 0) return errno;
    *fd = copy;
    return 0;
}

static int host_import_fd(int device, int fd, tms_phys *handle)
{
    touch(device);
    struct statx st;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_TYPE, &st) != 0) return errno;
    if (!S_ISREG(st.stx_mode)) return EBADF;  /* a memfd is a regular file; anything else is not memory */
    int copy = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (copy < 0) return errno;
    *handle = HOST_IMPORTED | (tms_phys)(unsigned)copy;
    return 0;
}

/* An emulated device is the same device to every process of one boot. */
static int host_device_identity(int device, char *buf, size_t size)
{
    touch(device);
    char boot[64] = "";
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    ssize_t n = fd >= 0 ? read(fd, boot, sizeof boot - 1) : -1;
    if (fd >= 0) close(fd);
    if (n <= 0) return EIO;
    boot[n] = '\0';
    boot[strcspn(boot, "\n")] = '\0';
    snprintf(buf, size, "host-%s-%d", boot, device);
    return 0;
}

/* Another process's memory is mapped only if it holds size bytes and cannot
 * shrink: a short or shrinkable file would fault this process's reads. */
static int sealed_at_least(int fd, size_t size)
{
    struct statx st;  /* not fstat: its symbol needs a newer glibc than the wheel's floor */
    int seals = fcntl(fd, F_GET_SEALS);
    return seals >= 0 && (seals & F_SEAL_SHRINK) && statx(fd, "", AT_EMPTY_PATH, STATX_SIZE, &st) == 0 &&
           (st.stx_mask & STATX_SIZE) && st.stx_size >= size;
}

static int host_map(int device, tms_va va, size_t size, tms_phys handle)
{
    touch(device);
    if (fault_hit(TMS_FAULT_MAP)) return ENOMEM;
    int fd = (int)(handle & 0xffffffffu);
    if ((handle & HOST_IMPORTED) && !sealed_at_least(fd, size)) return EBADF;
    /* As the CUDA driver does, a handle maps whole: a part of one is not supported. */
    struct statx st;  /* statx, not fstat: fstat is a glibc 2.33 symbol */
    if (statx(fd, "", AT_EMPTY_PATH, STATX_SIZE, &st) != 0) return errno;
    if (st.stx_size != size) return ENOTSUP;
    void *p = mmap((void *)(uintptr_t)va, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
    if (p == MAP_FAILED) return errno;
    /* Another process's memory stays out of a fork's child, as a GPU mapping does. */
    if ((handle & HOST_IMPORTED) && madvise(p, size, MADV_DONTFORK) != 0) return errno;
    return 0;
}

/* Back to an inaccessible reservation: touching it now faults, as on a GPU. */
static int host_unmap(tms_va va, size_t size)
{
    if (fault_hit(TMS_FAULT_UNMAP)) return EIO;
    void *p = mmap((void *)(uintptr_t)va, size, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE, -1, 0);
    return p == MAP_FAILED ? errno : 0;
}

static int host_synchronize(int device)
{
    touch(device);
    return 0;
}

static int host_stream_create(int device, tms_stream *stream)
{
    touch(device);
    *stream = (tms_stream)(uintptr_t)1;  /* copies run at once: a stream is only a token */
    return 0;
}

static int host_copy_async(int device, int to_host, void *host, tms_va dev, size_t n, tms_stream stream)
{
    (void)stream;
    touch(device);
    if (fault_hit(to_host ? TMS_FAULT_TO_HOST : TMS_FAULT_TO_DEVICE)) return EIO;
    if (to_host) pthread_once(&gate_once, pass_gate);
    if (to_host) memcpy(host, (const void *)(uintptr_t)dev, n);
    else memcpy((void *)(uintptr_t)dev, host, n);
    return 0;
}

static int host_stream_wait(int device, tms_stream stream)
{
    (void)device, (void)stream;
    return 0;
}

static int host_alloc_pinned(int device, size_t size, void **ptr)
{
    touch(device);
    if (fault_hit(TMS_FAULT_HOST_ALLOC)) return ENOMEM;
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return errno;
    /* Page-locked memory is resident: mimic it so RSS reflects the backup. */
    memset(p, 0, size);
    *ptr = p;
    return 0;
}

static int host_free_pinned(int device, void *ptr, size_t size)
{
    touch(device);
    return munmap(ptr, size) ? errno : 0;
}

/* Nothing to lock on the host backend; counted as a host allocation so
 * TMS_FAULT=host_alloc:n reaches pinned backups too. */
static int host_register(int device, void *ptr, size_t size)
{
    (void)ptr, (void)size;
    touch(device);
    return fault_hit(TMS_FAULT_HOST_ALLOC) ? ENOMEM : 0;
}

static int host_unregister(int device, void *ptr)
{
    (void)ptr;
    touch(device);
    return 0;
}

static size_t host_default_chunk_bytes(void) { return 0; }

/* Every emulated device sits on TMS_HOST_NUMA_NODE, if set. */
static int host_numa_node(int device)
{
    touch(device);
    return tms_defaults()->host_numa_node;
}

/* The CPU computes what the GPU kernel would (platform/fingerprint.c); the
 * n-th call fails as a kernel that cannot load would (TMS_FAULT=fingerprint:n). */
static int host_fingerprint(int device, const tms_va *chunks, size_t n, struct tms_fp *out)
{
    touch(device);
    if (fault_hit(TMS_FAULT_FINGERPRINT)) return ENOEXEC;
    const struct tms_fp_key *key;
    uint64_t generation;
    struct tms_err err = {0};
    if (tms_fp_key(&key, &generation, &err)) return err.driver_code ? err.driver_code : EIO;
    for (size_t i = 0; i < n; i++) tms_fp_compute((const void *)(uintptr_t)chunks[i], TMS_FP_CHUNK, key, &out[i]);
    return 0;
}

/* The host backend's device memory is host memory at the same address. */
static int host_fill(int device, const tms_va *va, const size_t *len, size_t n, unsigned char byte)
{
    touch(device);
    if (fault_hit(TMS_FAULT_FILL)) return EIO;
    for (size_t i = 0; i < n; i++) memset((void *)(uintptr_t)va[i], byte, len[i]);
    return 0;
}

const struct tms_driver tms_driver_host = {
    .name = "host",
    .load = host_load,
    .is_oom = host_is_oom,
    .is_shutdown = host_is_shutdown,
    .code_name = host_code_name,
    .default_chunk_bytes = host_default_chunk_bytes,
    .device_count = host_device_count_fn,
    .current_device = host_current_device,
    .granularity = host_granularity,
    .mem_get_info = host_mem_get_info,
    .reserve = host_reserve,
    .unreserve = host_unreserve,
    .create = host_create,
    .release = host_release,
    .share_types = host_share_types,
    .export_fd = host_export_fd,
    .import_fd = host_import_fd,
    .device_identity = host_device_identity,
    .map = host_map,
    .unmap = host_unmap,
    .synchronize = host_synchronize,
    .stream_create = host_stream_create,
    .copy_async = host_copy_async,
    .stream_wait = host_stream_wait,
    .host_alloc_pinned = host_alloc_pinned,
    .host_free_pinned = host_free_pinned,
    .host_register = host_register,
    .host_unregister = host_unregister,
    .numa_node = host_numa_node,
    .device_active = host_device_active,
    .fingerprint = host_fingerprint,
    .fill = host_fill,
};
