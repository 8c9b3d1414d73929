/* Regions: each thread's settings for its allocations, the one policy for them whichever face asks, and the tag references regions hold. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "core/core.h"
#include "core/core_internal.h"
#include "platform/config.h"

static _Thread_local struct tms_region thread_region;
static _Thread_local int thread_region_ready;
static pthread_key_t region_tag_key;  /* a thread's reference to its region's tag, dropped at its exit */
static pthread_once_t region_tag_once = PTHREAD_ONCE_INIT;

struct tms_region *tms_region_current(void)
{
    if (!thread_region_ready) {
        const struct tms_defaults *d = tms_defaults();
        thread_region.active = d->init_enable;
        thread_region.tag_id = TMS_TAG_DEFAULT_ID;
        thread_region.backup = d->init_backup;
        thread_region.backup_kind = tms_backup_default_kind();
        thread_region.disk_backup = d->init_disk_backup;
        thread_region.skip_unchanged = -1;
        thread_region.restore = -1;
        thread_region_ready = 1;
    }
    return &thread_region;
}

const struct tms_region *tms_core_region(void) { return tms_region_current(); }

void tms_core_region_set_active(int active) { tms_region_current()->active = active; }
void tms_core_region_set_backup(int backup) { tms_region_current()->backup = backup; }
void tms_core_region_set_backup_kind(int kind) { tms_region_current()->backup_kind = kind; }
void tms_core_region_set_disk_backup(int disk) { tms_region_current()->disk_backup = disk; }
void tms_core_region_set_skip_unchanged(int skip) { tms_region_current()->skip_unchanged = skip < 0 ? -1 : !!skip; }
void tms_core_region_set_restore(int mode)
{
    tms_region_current()->restore = mode >= TMS_RESTORE_NONE && mode <= TMS_RESTORE_POISON ? mode : -1;
}

static const char *const restore_names[] = {"none", "zero", "poison"};

int tms_core_restore_mode_parse(const char *name, int *mode)
{
    for (int m = TMS_RESTORE_NONE; name && m <= TMS_RESTORE_POISON; m++)
        if (strcmp(name, restore_names[m]) == 0) return *mode = m, TMS_OK;
    return TMS_E_ARG;
}

const char *tms_core_restore_mode_name(int mode)
{
    return mode >= TMS_RESTORE_NONE && mode <= TMS_RESTORE_POISON ? restore_names[mode] : "?";
}

int tms_core_restore_mode_default(void)
{
    int mode = TMS_RESTORE_NONE;
    (void)tms_core_restore_mode_parse(tms_defaults()->restore, &mode);
    return mode;
}

int tms_core_tag_id(const char *tag, int *id, struct tms_err *err)
{
    int rc = tms_core_check_tag(tag, err);
    if (rc) return rc;
    tms_table_lock();
    rc = tms_tags_intern_locked(tag, id, err);
    tms_table_unlock();
    return rc;
}

void tms_core_tag_ref(int id)
{
    tms_table_lock();
    tms_tag_ref_locked(id);
    tms_table_unlock();
}

void tms_core_tag_unref(int id)
{
    tms_table_lock();
    tms_tag_unref_locked(id);
    tms_table_unlock();
}

/* The key holds the thread's region tag id + 1, so its reference goes when the thread ends. */
static void drop_thread_tag(void *value) { tms_core_tag_unref((int)(intptr_t)value - 1); }
static void make_region_tag_key(void) { (void)pthread_key_create(&region_tag_key, drop_thread_tag); }

int tms_core_set_region_tag(const char *tag, struct tms_err *err)
{
    int rc = tms_core_check_tag(tag, err), id = 0;
    if (rc) return rc;
    pthread_once(&region_tag_once, make_region_tag_key);
    struct tms_region *r = tms_region_current();
    tms_table_lock();
    rc = tms_tags_intern_locked(tag, &id, err);
    if (!rc && id != r->tag_id) {
        tms_tag_ref_locked(id);
        tms_tag_unref_locked(r->tag_id);
        r->tag_id = id;
    }
    tms_table_unlock();
    if (!rc) (void)pthread_setspecific(region_tag_key, (void *)(intptr_t)(id + 1));
    return rc;
}

int tms_core_check_region(const struct tms_region_request *req, int *kind, struct tms_err *err)
{
    int rc = tms_core_check_tag(req->tag, err);
    if (rc) return rc;
    if (req->cpu_backup && req->disk_backup)
        return tms_fail(err, TMS_E_ARG, 0, "enable_cpu_backup and enable_disk_backup are mutually exclusive (a region "
                        "backs up to host memory or to disk)");
    if (!req->backend) {
        *kind = tms_backup_default_kind();
        return TMS_OK;
    }
    if (tms_backup_kind_parse(req->backend, kind) != TMS_OK)
        return tms_fail(err, TMS_E_ARG, 0, "cpu_backup_backend must be 'pinned' or 'mmap', got '%.64s'", req->backend);
    if (!req->cpu_backup)
        return tms_fail(err, TMS_E_ARG, 0, "cpu_backup_backend='%s' needs enable_cpu_backup=True", req->backend);
    return TMS_OK;
}

int tms_core_set_region(int active, const char *tag, int backup, int kind, int disk, struct tms_err *err)
{
    if (!tms_backup_kind_is_host(kind))
        return tms_fail(err, TMS_E_ARG, 0, "a region's CPU backup is 'pinned' or 'mmap', not kind %d", kind);
    int rc = tms_core_set_region_tag(tag, err);
    if (rc) return rc;
    struct tms_region *r = tms_region_current();
    r->active = active;
    r->backup = backup;
    r->backup_kind = kind;
    r->disk_backup = disk;
    return TMS_OK;
}

int tms_core_backup_kind_parse(const char *name, int *kind) { return tms_backup_kind_parse(name, kind); }

const char *tms_core_backup_kind_name(int kind) { return tms_backup_kind_name(kind); }
