/* The platform contract: one table of function pointers per VMM backend. */
#ifndef TMS_DRIVER_H
#define TMS_DRIVER_H

#include <stddef.h>
#include <stdint.h>

#include "platform/error.h"
#include "platform/fingerprint.h"

/*
 * Conventions every backend keeps:
 *  - Each operation returns int: 0 on success, otherwise the backend's own
 *    code (CUresult, hipError_t, errno). The layers above report a failure
 *    with tms_driver_fail: the operation, the address and size, the code
 *    and its code_name().
 *  - Out-parameters are never NULL.
 *  - Sizes and addresses handed to reserve/create/map/unmap are already
 *    multiples of granularity(device).
 *  - Device ordinals are valid for the backend (the core checks them with
 *    device_count first).
 *  - No operation calls back into the core or into Python, and none holds a
 *    lock of its own across a call into another backend function.
 */

typedef uint64_t tms_va;     /* device virtual address */
typedef uint64_t tms_phys;   /* physical memory handle */
typedef struct tms_stream_opaque *tms_stream;  /* an ordered queue of copies on one device */

struct tms_driver {
    const char *name;

    /* Resolve entry points and initialise; called once by driver.c.
     * On failure fills err (TMS_E_NO_DRIVER or TMS_E_DRIVER). */
    int (*load)(struct tms_err *err);

    int (*is_oom)(int code);                 /* does code mean "out of memory"? */
    int (*is_shutdown)(int code);            /* driver already torn down (process exit)? */
    const char *(*code_name)(int code);
    /* Physical chunk size the core should use when TMS_CHUNK_BYTES is unset
     * (0: one handle per allocation). pre: loaded. */
    size_t (*default_chunk_bytes)(void);

    int (*device_count)(int *count);
    /* The device the calling thread's runtime would allocate on. */
    int (*current_device)(int *device);
    int (*granularity)(int device, size_t *bytes);
    int (*mem_get_info)(int device, size_t *free_bytes, size_t *total_bytes);

    /* pre: size multiple of alignment. */
    int (*reserve)(size_t size, size_t alignment, tms_va *va);
    /* pre: nothing mapped in [va, va+size). */
    int (*unreserve)(tms_va va, size_t size);
    int (*create)(int device, size_t size, tms_phys *handle);
    /* create, exportable as handle_types (CUmemAllocationHandleType bits), as
     * an adopted allocation's owner made it (cumem.c). NULL: create is used. */
    int (*create_shareable)(int device, size_t size, int handle_types, tms_phys *handle);
    /* pre: handle not mapped anywhere. */
    int (*release)(tms_phys handle);
    /* Sharing with another process (NULL where the backend cannot): the
     * handle types a new allocation on device is made with so that its
     * handles can be exported (0: none can); a file descriptor of handle, the
     * caller's to close; and a handle of another process's memory from such
     * a descriptor (which stays the caller's), released with release. */
    int (*share_types)(int device);
    int (*export_fd)(tms_phys handle, int *fd);
    int (*import_fd)(int device, int fd, tms_phys *handle);
    /* What names the physical device behind ordinal device the same way in
     * every process of the host (a GPU's UUID), into buf (NUL-terminated);
     * NULL where the backend cannot share memory. */
    int (*device_identity)(int device, char *buf, size_t size);
    /* Maps the first size bytes of handle at va and grants device read-write
     * access. pre: [va, va+size) reserved and unmapped; size <= the handle's
     * size (all of it but for memory another process of a job lent). */
    int (*map)(int device, tms_va va, size_t size, tms_phys handle);
    /* pre: [va, va+size) mapped; no work in flight touches it. */
    int (*unmap)(tms_va va, size_t size);

    /* Waits for all work queued on device (every stream). */
    int (*synchronize)(int device);
    /* A copy queue of its own on device, independent of the user's streams.
     * Streams live for the process. */
    int (*stream_create)(int device, tms_stream *stream);
    /* Queues a copy of n bytes between host and the device range at dev.
     * pre: the range is mapped; host stays valid until stream_wait returns.
     * host may be pageable (the copy is then synchronous). */
    int (*copy_async)(int device, int to_host, void *host, tms_va dev, size_t n, tms_stream stream);
    /* Waits for every copy queued on stream. */
    int (*stream_wait)(int device, tms_stream stream);

    /* Page-locked host memory (plain memory on the host backend), made and
     * freed in device's context: the device whose copies it serves, so that a
     * process never touches a device it does not use. Portable: any device the
     * process uses may copy to and from it. */
    int (*host_alloc_pinned)(int device, size_t size, void **ptr);
    int (*host_free_pinned)(int device, void *ptr, size_t size);
    /* Page-locks memory the caller mapped and faulted in (faster than
     * host_alloc_pinned for large sizes: fault in on many threads, then lock),
     * in device's context as above. */
    int (*host_register)(int device, void *ptr, size_t size);
    int (*host_unregister)(int device, void *ptr);
    /* *active: 1 if the process already uses device (its primary context is
     * active), else 0; asking creates nothing on the device. */
    int (*device_active)(int device, int *active);
    /* NUMA node of the host memory nearest the device (its backups go
     * there), -1 where unknown; NULL where the backend cannot tell. */
    int (*numa_node)(int device);
    /* Fingerprints (platform/fingerprint.h, the process's key) of the n
     * chunks of TMS_FP_CHUNK bytes at chunks[] on device, into out[]. NULL
     * where the backend has no way to compute them on the device; a backend
     * whose kernel cannot be loaded here returns that code every time.
     * pre: the chunks are mapped and nothing writes them. */
    int (*fingerprint)(int device, const tms_va *chunks, size_t n, struct tms_fp *out);
    /* Sets the n ranges [va[i], va[i] + len[i]) on device to byte, and waits
     * until they are: queued on a stream of its own, so one wait serves them
     * all (a resume that zeroes or poisons many allocations). pre: mapped,
     * and nothing else writes them. */
    int (*fill)(int device, const tms_va *va, const size_t *len, size_t n, unsigned char byte);
};

extern const struct tms_driver tms_driver_cuda;
extern const struct tms_driver tms_driver_hip;
extern const struct tms_driver tms_driver_host;

/* The process's backend, loaded on first use: the one selected, else
 * TMS_BACKEND (cuda, hip, host), else TMS_PLATFORM (rocm or hip -> hip,
 * cuda), else the platform hint, else cuda. Returns TMS_OK and sets *out, or
 * fills err. Thread-safe. */
int tms_driver_get(const struct tms_driver **out, struct tms_err *err);

/* Chooses the backend before first use; TMS_E_STATE if another is loaded. */
int tms_driver_select(const char *name, struct tms_err *err);

/* The platform the process's PyTorch was built for ("cuda" or "hip"; NULL or
 * another: none), the default when the environment names no backend. */
void tms_driver_set_platform_hint(const char *platform);

/* Name of the loaded backend, or NULL if none is loaded yet. */
const char *tms_driver_loaded_name(void);

/* ---- reporting a failed call --------------------------------------------------
 * The caller's words say what failed: the operation, and the pointer and size
 * (or device) it was given; the helper adds the code and its name, as
 * "<words>: <code name> (<code>)". */
int tms_driver_fail(struct tms_err *err, int status, const struct tms_driver *drv, int rc, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* As tms_err_append: a driver call that failed while undoing after another failure. */
void tms_driver_fail_append(struct tms_err *err, const struct tms_driver *drv, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* TMS_E_OOM if rc means out of memory (a caller may free and retry), else TMS_E_DRIVER. */
int tms_driver_status(const struct tms_driver *drv, int rc);

#endif
