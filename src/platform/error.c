/* Error records: formatting a failure into the caller's struct tms_err. */
#include "platform/error.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int tms_fail(struct tms_err *err, int status, int driver_code, const char *fmt, ...)
{
    if (err) {
        err->status = status;
        err->driver_code = driver_code;
        err->flags = 0;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return status;
}

void tms_err_append(struct tms_err *err, const char *fmt, ...)
{
    if (!err) return;
    size_t used = strnlen(err->msg, sizeof err->msg);
    if (used + 3 >= sizeof err->msg) return;
    memcpy(err->msg + used, "; ", 3);
    used += 2;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg + used, sizeof err->msg - used, fmt, ap);
    va_end(ap);
}

const char *tms_status_name(int status)
{
    switch (status) {
    case TMS_OK: return "ok";
    case TMS_E_OOM: return "out of device memory";
    case TMS_E_HOST_OOM: return "out of host memory";
    case TMS_E_DRIVER: return "driver error";
    case TMS_E_NO_DRIVER: return "driver unavailable";
    case TMS_E_STATE: return "invalid state";
    case TMS_E_ARG: return "invalid argument";
    case TMS_E_NOT_FOUND: return "not found";
    case TMS_E_UNSUPPORTED: return "not supported";
    case TMS_E_IO: return "disk backup I/O error";
    }
    return "unrecognised status";
}
