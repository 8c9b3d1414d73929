/* Debug lines to stderr when TMS_LOG=debug: for preload processes without Python logging. */
#include "platform/log.h"

#include "platform/config.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static pthread_once_t log_once = PTHREAD_ONCE_INIT;
static int log_debug;  /* written once under log_once */
static int log_quiet;  /* TMS_LOG=off or 0: not even warnings */

static void log_init(void)
{
    const char *v = tms_defaults()->log;  /* "", or the word of TMS_LOG */
    log_debug = strcmp(v, "debug") == 0;
    log_quiet = strcmp(v, "off") == 0 || strcmp(v, "0") == 0;
}

int tms_log_enabled(void)
{
    pthread_once(&log_once, log_init);
    return log_debug;
}

static void log_line(const char *level, const char *fmt, va_list ap)
{
    char line[512];
    int n = snprintf(line, sizeof line, "[torch_memory_saver %d] %s", (int)getpid(), level);
    if (n > 0 && (size_t)n < sizeof line) n += vsnprintf(line + n, sizeof line - (size_t)n, fmt, ap);
    if (n < 0) return;
    if ((size_t)n >= sizeof line - 1) n = (int)sizeof line - 2;
    line[n++] = '\n';
    /* One write per line: lines of several threads do not interleave. */
    (void)!write(STDERR_FILENO, line, (size_t)n);
}

void tms_log_write(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    log_line("", fmt, ap);
    va_end(ap);
}

void tms_log_warn(const char *fmt, ...)
{
    pthread_once(&log_once, log_init);
    if (log_quiet) return;
    va_list ap;
    va_start(ap, fmt);
    log_line("warning: ", fmt, ap);
    va_end(ap);
}
