/* The C tests' checks: a failed check is counted and printed with its file and line, and the test goes on. */
#ifndef TMS_TEST_CHECK_H
#define TMS_TEST_CHECK_H

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* Atomic: threads of a test check at once. Each process after a fork counts its own. */
static int passed, failed;

static inline void check_at(int ok, const char *file, int line, const char *what, const char *detail)
{
    if (ok) {
        __atomic_add_fetch(&passed, 1, __ATOMIC_RELAXED);
        return;
    }
    __atomic_add_fetch(&failed, 1, __ATOMIC_RELAXED);
    fprintf(stderr, "%s:%d: FAILED: %s%s%s\n", file, line, what, detail ? " -- " : "", detail ? detail : "");
}

__attribute__((format(printf, 5, 6))) static inline void check_at_f(int ok, const char *file, int line,
                                                                   const char *what, const char *fmt, ...)
{
    char detail[512] = "";
    if (!ok) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(detail, sizeof detail, fmt, ap);
        va_end(ap);
    }
    check_at(ok, file, line, what, ok ? NULL : detail);
}

#define CHECK(cond) check_at(!!(cond), __FILE__, __LINE__, #cond, NULL)
/* CHECK with a printf-formatted detail shown when it fails. */
#define CHECKF(cond, ...) check_at_f(!!(cond), __FILE__, __LINE__, #cond, __VA_ARGS__)

#ifdef TMS_ERROR_H
static inline void check_rc_at(int rc, int want, const struct tms_err *err, const char *file, int line,
                               const char *what)
{
    char detail[512];
    snprintf(detail, sizeof detail, "got %s (%d), want %s (%d); err.msg: %s", tms_status_name(rc), rc,
             tms_status_name(want), want, rc ? err->msg : "");
    check_at(rc == want, file, line, what, rc == want ? NULL : detail);
}

/* Clears err, runs expr, and checks its status; the caller has a local struct tms_err err. */
#define CHECK_RC(expr, want) \
    (memset(&err, 0, sizeof err), check_rc_at((expr), (want), &err, __FILE__, __LINE__, #expr))
#define CHECK_MSG(needle) \
    check_at(strstr(err.msg, (needle)) != NULL, __FILE__, __LINE__, "err.msg contains \"" needle "\"", err.msg)
#endif

/* Prints the counts; the exit status of a test that checked with these. */
static inline int check_summary(void)
{
    printf("%d passed, %d failed\n", passed, failed);
    return failed ? 1 : 0;
}

#endif
