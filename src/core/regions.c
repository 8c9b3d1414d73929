/* Regions: the one policy for what a thread's allocations get, whichever face asks. */
#include <string.h>

#include "core/core.h"
#include "core/core_internal.h"

int tms_core_check_region(const struct tms_region_request *req, int *kind, struct tms_err *err)
{
    int rc = tms_tag_check(req->tag, err);
    if (rc) return rc;
    if (req->cpu_backup && req->disk_backup)
        return tms_fail(err, TMS_E_ARG, 0, "enable_cpu_backup and enable_disk_backup are mutually exclusive (a region "
                        "backs up to host memory or to disk)");
    if (!req->backend) {
        *kind = tms_defaults()->init_backup_kind;
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
