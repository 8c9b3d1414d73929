/* Chooses and loads the process's one VMM backend. */
#include "platform/driver.h"

#include "platform/config.h"
#include "platform/fork.h"
#include "platform/parse.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static pthread_mutex_t driver_lock = PTHREAD_MUTEX_INITIALIZER;
static const struct tms_driver *driver_chosen;  /* guarded by driver_lock */
static const struct tms_driver *driver_ready;   /* loaded; written once under the lock */
static const struct tms_driver *platform_hint;  /* guarded by driver_lock */
static pthread_once_t fork_handlers_once = PTHREAD_ONCE_INIT;

/* A fork while another thread loads the backend waits for the load, so the
 * child sees the lock free and the backend either loaded or not. */
static void fork_prepare(void) { pthread_mutex_lock(&driver_lock); }
static void fork_release(void) { pthread_mutex_unlock(&driver_lock); }
static void register_fork_handlers(void)
{
    static const struct tms_fork_handlers handlers = {fork_prepare, fork_release, fork_release};
    tms_fork_register(TMS_FORK_DRIVER, &handlers);
}

static void lock_driver(void)
{
    pthread_once(&fork_handlers_once, register_fork_handlers);
    pthread_mutex_lock(&driver_lock);
}

static const struct tms_driver *driver_by_name(const char *name)
{
    if (tms_ascii_case_equal(name, "cuda")) return &tms_driver_cuda;
    if (tms_ascii_case_equal(name, "hip")) return &tms_driver_hip;
    if (tms_ascii_case_equal(name, "host")) return &tms_driver_host;
    return NULL;
}

int tms_driver_select(const char *name, struct tms_err *err)
{
    const struct tms_driver *want = driver_by_name(name);
    if (!want)
        return tms_fail(err, TMS_E_ARG, 0, "unknown backend '%s' (expected 'cuda', 'hip' or 'host')", name);
    int rc = TMS_OK;
    lock_driver();
    const struct tms_driver *have = driver_ready ? driver_ready : driver_chosen;
    if (have && have != want)
        rc = tms_fail(err, TMS_E_STATE, 0, "backend '%s' is already in use; cannot switch to '%s'",
                      have->name, name);
    else
        driver_chosen = want;
    pthread_mutex_unlock(&driver_lock);
    return rc;
}

int tms_driver_get(const struct tms_driver **out, struct tms_err *err)
{
    const struct tms_driver *ready = __atomic_load_n(&driver_ready, __ATOMIC_ACQUIRE);
    if (ready) {
        *out = ready;
        return TMS_OK;
    }
    int rc = TMS_OK;
    lock_driver();
    if (!driver_ready) {
        const struct tms_driver *d = driver_chosen;
        if (!d) {
            /* Both words as config.h's table spells them; a malformed TMS_BACKEND is
             * an error here too, for a process that never imported the package. */
            const char *env = tms_defaults()->backend, *platform = tms_defaults()->platform;
            rc = tms_setting_error(TMS_SETTING_backend, err);
            if (*env) d = driver_by_name(env);
            else if (!strcmp(platform, "rocm") || !strcmp(platform, "hip")) d = &tms_driver_hip;
            else if (!strcmp(platform, "cuda")) d = &tms_driver_cuda;
            else d = platform_hint ? platform_hint : &tms_driver_cuda;
        }
        /* A failed load is not cached: a later call may succeed (driver
         * installed, env fixed) and each caller gets the message. */
        if (rc == TMS_OK)
            rc = d->load(err);
        if (rc == TMS_OK) {
            driver_chosen = d;
            __atomic_store_n(&driver_ready, d, __ATOMIC_RELEASE);
        }
    }
    if (rc == TMS_OK)
        *out = driver_ready;
    pthread_mutex_unlock(&driver_lock);
    return rc;
}

void tms_driver_set_platform_hint(const char *platform)
{
    lock_driver();
    platform_hint = platform && !strcmp(platform, "hip") ? &tms_driver_hip : platform && !strcmp(platform, "cuda") ? &tms_driver_cuda : NULL;
    pthread_mutex_unlock(&driver_lock);
}

const char *tms_driver_loaded_name(void)
{
    const struct tms_driver *d = __atomic_load_n(&driver_ready, __ATOMIC_ACQUIRE);
    return d ? d->name : NULL;
}

int tms_driver_fail(struct tms_err *err, int status, const struct tms_driver *drv, int rc, const char *fmt, ...)
{
    if (!err) return status;
    char what[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return tms_fail(err, status, rc, "%s: %s (%d)", what, drv->code_name(rc), rc);
}

void tms_driver_fail_append(struct tms_err *err, const struct tms_driver *drv, int rc, const char *fmt, ...)
{
    if (!err) return;
    char what[sizeof err->msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    tms_err_append(err, "%s: %s (%d)", what, drv->code_name(rc), rc);
}

int tms_driver_status(const struct tms_driver *drv, int rc)
{
    return drv->is_oom(rc) ? TMS_E_OOM : TMS_E_DRIVER;
}
