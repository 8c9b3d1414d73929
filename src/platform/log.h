/* Debug lines to stderr when TMS_LOG=debug: for preload processes without Python logging. */
#ifndef TMS_LOG_H
#define TMS_LOG_H

int tms_log_enabled(void);
void tms_log_write(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* A failure nobody can be told about through a return value (a cleanup
 * after the operation already succeeded or failed for another reason, a free
 * finished by another thread): one line on stderr unless TMS_LOG=off or 0. */
void tms_log_warn(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Arguments are not evaluated unless logging is on. */
#define TMS_DEBUG(...)                              \
    do {                                            \
        if (tms_log_enabled()) tms_log_write(__VA_ARGS__); \
    } while (0)

#endif
