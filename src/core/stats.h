/* Per-(tag, device) statistics: one list of fields, kept up to date by the table (stats.c). */
#ifndef TMS_STATS_H
#define TMS_STATS_H

#include <stdint.h>

#define TMS_STATS_DEVICES 64  /* devices beyond are counted under the last slot */

/* Gauges describe the table now; counters only grow. X(name, kind, doc). */
#define TMS_STAT_FIELDS(X)                                                          \
    X(allocations, gauge, "allocations held")                                       \
    X(bytes_requested, gauge, "bytes asked for")                                    \
    X(bytes_reserved, gauge, "virtual bytes reserved (rounded to the granularity)") \
    X(bytes_mapped, gauge, "bytes backed by device memory now")                     \
    X(bytes_paused, gauge, "reserved bytes whose device memory is released")        \
    /* the three backup gauges in the order of enum tms_backup_kind */           \
    X(bytes_backup_pinned, gauge, "host bytes held in pinned-backend backups")      \
    X(bytes_backup_mmap, gauge, "host bytes held in mmap-backend backups")          \
    X(bytes_backup_disk, gauge, "bytes held in backup files on disk")               \
    X(pauses, counter, "pause calls that released memory of this tag")              \
    X(resumes, counter, "resume calls that mapped memory of this tag back")         \
    X(pause_ns, counter, "time spent in those pause calls")                         \
    X(resume_ns, counter, "time spent in those resume calls")                       \
    X(bytes_to_host, counter, "bytes copied to host backups")                       \
    X(bytes_to_device, counter, "bytes restored from host backups")                 \
    X(bytes_skipped, counter, "bytes of backed-up allocations left out as free in PyTorch's cache")  \
    X(bytes_unchanged, counter, "bytes of backed-up allocations not copied: unchanged since their backup") \
    X(bytes_verified, counter, "restored bytes found as they were paused")

struct tms_stats {
#define TMS_STAT_DECLARE(name, kind, doc) uint64_t name;
    TMS_STAT_FIELDS(TMS_STAT_DECLARE)
#undef TMS_STAT_DECLARE
};

/* One row of tms_core_stats(). */
struct tms_stats_row {
    int tag_id;
    int device;
    struct tms_stats stats;
};

#endif
