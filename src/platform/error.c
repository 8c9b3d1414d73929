/* Error records: formatting a failure into the caller's struct tms_err. */
#include "platform/error.h"

#include <ctype.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static int word_char(char c) { return isalnum((unsigned char)c) || c == '_' || c == '.'; }

/* Where " (<x> GiB" already follows: the message gives the GiB itself. */
static int gib_follows(const char *s)
{
    if (s[0] != ' ' || s[1] != '(' || !isdigit((unsigned char)s[2])) return 0;
    s += 2;
    while (isdigit((unsigned char)*s) || *s == '.') s++;
    return strncmp(s, " GiB", 4) == 0;
}

/* A byte count of 1 GiB or more is hard to read in digits: "<n> bytes",
 * "<n> free bytes" and "..._bytes=<n>" get " (<x> GiB)" beside them, in every
 * message, once (a message that gives the GiB already is left as it is). */
static void add_gib(char *msg, size_t cap)
{
    char out[sizeof ((struct tms_err *)0)->msg];
    size_t o = 0;
    const char *p = msg;
    while (*p && o + 1 < sizeof out) {
        if (isdigit((unsigned char)*p) && (p == msg || !word_char(p[-1]))) {
            const char *end = p;
            unsigned long long n = 0;
            int big = 0;
            for (; isdigit((unsigned char)*end); end++) {
                if (n > (~0ull - 9) / 10) big = 1;  /* past 2**64: no figure to give */
                n = n * 10 + (unsigned long long)(*end - '0');
            }
            const char *after = NULL;
            if (!word_char(*end) && !big && n >= (1ull << 30)) {
                if (!strncmp(end, " bytes", 6) && !word_char(end[6])) after = end + 6;
                else if (!strncmp(end, " free bytes", 11) && !word_char(end[11])) after = end + 11;
                else if (p - msg >= 6 && !strncmp(p - 6, "bytes=", 6)) after = end;
            }
            if (after && !gib_follows(after)) {
                int w = snprintf(out + o, sizeof out - o, "%.*s (%.2f GiB)", (int)(after - p), p,
                                 (double)n / (double)(1ull << 30));
                o = w < 0 ? o : o + (size_t)w < sizeof out ? o + (size_t)w : sizeof out - 1;
                p = after;
                continue;
            }
            while (p < end && o + 1 < sizeof out) out[o++] = *p++;
            continue;
        }
        out[o++] = *p++;
    }
    out[o] = '\0';
    snprintf(msg, cap, "%s", out);
}

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
        add_gib(err->msg, sizeof err->msg);
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
    add_gib(err->msg, sizeof err->msg);
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
