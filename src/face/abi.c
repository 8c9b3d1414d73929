/* The upstream library's C ABI (include/torch_memory_saver.h): thin forwards into the core's region settings and operations. */
#include "torch_memory_saver.h"

#include <stdint.h>

#include "core/core.h"

_Static_assert(TMS_STATUS_OK == TMS_OK && TMS_STATUS_OOM == TMS_E_OOM && TMS_STATUS_HOST_OOM == TMS_E_HOST_OOM &&
                   TMS_STATUS_DRIVER == TMS_E_DRIVER && TMS_STATUS_NO_DRIVER == TMS_E_NO_DRIVER &&
                   TMS_STATUS_STATE == TMS_E_STATE && TMS_STATUS_ARG == TMS_E_ARG &&
                   TMS_STATUS_NOT_FOUND == TMS_E_NOT_FOUND && TMS_STATUS_UNSUPPORTED == TMS_E_UNSUPPORTED &&
                   TMS_STATUS_IO == TMS_E_IO,
               "the public status codes are the core's");

#define TMS_EXPORT_ABI __attribute__((visibility("default")))

/* Returns rc, keeping err's message for tms_get_last_error on failure. */
static int answer(int rc, const struct tms_err *err)
{
    if (rc != TMS_OK) tms_core_keep_error(err);
    return rc;
}

TMS_EXPORT_ABI int tms_set_interesting_region(bool is_interesting)
{
    tms_core_region_set_active(is_interesting);
    return TMS_OK;
}

TMS_EXPORT_ABI bool tms_get_interesting_region(void) { return tms_core_region()->active; }

TMS_EXPORT_ABI int tms_set_current_tag(const char *tag)
{
    struct tms_err err = {0};
    return answer(tms_core_set_region_tag(tag, &err), &err);  /* rejects NULL, "" and what is not UTF-8 */
}

TMS_EXPORT_ABI const char *tms_get_current_tag(void) { return tms_core_tag_name(tms_core_region()->tag_id); }

TMS_EXPORT_ABI int tms_set_enable_cpu_backup(bool enable)
{
    tms_core_region_set_backup(enable);
    return TMS_OK;
}

TMS_EXPORT_ABI bool tms_get_enable_cpu_backup(void) { return tms_core_region()->backup; }

TMS_EXPORT_ABI int tms_set_cpu_backup_backend(const char *backend)
{
    int kind;
    if (!backend || tms_core_backup_kind_parse(backend, &kind) != TMS_OK) {
        struct tms_err err;
        return answer(tms_fail(&err, TMS_E_ARG, 0, "tms_set_cpu_backup_backend: '%s' is not a backup backend "
                               "(use 'pinned' or 'mmap')", backend ? backend : "NULL"), &err);
    }
    tms_core_region_set_backup_kind(kind);
    return TMS_OK;
}

TMS_EXPORT_ABI const char *tms_get_cpu_backup_backend(void)
{
    return tms_core_backup_kind_name(tms_core_region()->backup_kind);
}

TMS_EXPORT_ABI int tms_set_enable_disk_backup(bool enable)
{
    tms_core_region_set_disk_backup(enable);
    return TMS_OK;
}

TMS_EXPORT_ABI bool tms_get_enable_disk_backup(void) { return tms_core_region()->disk_backup; }

TMS_EXPORT_ABI int tms_set_disk_backup_dir(const char *dir)
{
    struct tms_err err = {0};
    return answer(tms_core_set_disk_dir(dir, &err), &err);
}

TMS_EXPORT_ABI int set_memory_margin_bytes(uint64_t bytes)
{
    tms_core_set_margin(bytes > SIZE_MAX ? SIZE_MAX : (size_t)bytes);
    return TMS_OK;
}

TMS_EXPORT_ABI int tms_set_retain_cpu_backup(bool retain)
{
    tms_core_set_retain(retain);
    return TMS_OK;
}

TMS_EXPORT_ABI bool tms_get_retain_cpu_backup(void) { return tms_core_retain(); }

/* Upstream passes "" for every tag. */
static const char *tag_or_all(const char *tag) { return tag && *tag ? tag : NULL; }

TMS_EXPORT_ABI int tms_pause(const char *tag)
{
    struct tms_err err = {0};
    return answer(tms_core_pause(tag_or_all(tag), &err), &err);
}

TMS_EXPORT_ABI int tms_resume(const char *tag)
{
    struct tms_err err = {0};
    return answer(tms_core_resume(tag_or_all(tag), &err), &err);
}

TMS_EXPORT_ABI uint8_t *tms_get_cpu_backup_pointer(const uint8_t *ptr, uint64_t size)
{
    struct tms_err err = {0};
    if (size > SIZE_MAX) {
        answer(tms_fail(&err, TMS_E_ARG, 0, "tms_get_cpu_backup_pointer: size %llu does not fit in size_t",
                        (unsigned long long)size), &err);
        return NULL;
    }
    struct tms_backup *b = NULL;
    size_t offset = 0;
    if (answer(tms_core_backup_of((uint64_t)(uintptr_t)ptr, (size_t)size, 1, &b, &offset, &err), &err)) return NULL;
    if (!b) return NULL;
    uint8_t *host = (uint8_t *)tms_core_backup_bytes(b) + offset;
    tms_core_backup_release(b);  /* the allocation keeps its own reference */
    return host;
}

TMS_EXPORT_ABI const char *tms_get_last_error(void) { return tms_core_last_error(); }
