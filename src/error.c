/* Error records: formatting a failure into the caller's struct tms_err. */
#include "error.h"

#include <stdarg.h>
#include <stdio.h>

int tms_fail(struct tms_err *err, int status, int driver_code, const char *fmt, ...)
{
    if (err) {
        err->status = status;
        err->driver_code = driver_code;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(err->msg, sizeof err->msg, fmt, ap);
        va_end(ap);
    }
    return status;
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
    }
    return "unrecognised status";
}
