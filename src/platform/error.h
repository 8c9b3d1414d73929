/* Status codes and the error record every core operation fills on failure. */
#ifndef TMS_ERROR_H
#define TMS_ERROR_H

#include <stddef.h>

/* Library status: 0 = success. The Python face maps each to one exception; the C ABI
 * returns them as they are (include/torch_memory_saver.h, TMS_STATUS_*). */
enum tms_status {
    TMS_OK = 0,
    TMS_E_OOM,        /* device memory exhausted (or margin hit): recoverable */
    TMS_E_HOST_OOM,   /* host memory for a backup could not be had */
    TMS_E_DRIVER,     /* a driver call failed; driver_code says which code */
    TMS_E_NO_DRIVER,  /* the backend's library could not be loaded */
    TMS_E_STATE,      /* operation not allowed in the current state (double pause…) */
    TMS_E_ARG,        /* bad argument */
    TMS_E_NOT_FOUND,  /* pointer not owned by the core */
    TMS_E_UNSUPPORTED, /* a feature this build does not have */
    TMS_E_IO,         /* a disk backup file could not be made, written or read (disk full, I/O error) */
};

/* Filled by the failing call, owned by the caller (on its stack): no error
 * state is shared between calls or threads. */
struct tms_err {
    int status;
    int driver_code;
    unsigned flags;  /* TMS_ERR_*: what the status alone does not say; tms_fail clears them */
    char msg[384];
};

/* The disk backup directory itself cannot be used (made, opened, trusted or
 * locked), whichever path named it: the Python face raises DiskBackupDirError. */
#define TMS_ERR_DISK_DIR 1u
/* A resume restored bytes other than those its pause backed up (their
 * fingerprints differ): the Python face raises IntegrityError. */
#define TMS_ERR_CORRUPT 2u

/* Records status + formatted message; returns status so callers can
 * `return tms_fail(err, ...)`. err may be NULL (hooks that only need the code). */
int tms_fail(struct tms_err *err, int status, int driver_code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Adds "; <formatted>" to err's message (as much as fits), for what went
 * wrong while cleaning up after the failure err already records. */
void tms_err_append(struct tms_err *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

const char *tms_status_name(int status);

#endif
