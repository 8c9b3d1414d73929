/* torch_memory_saver's C ABI: the functions the upstream library exports, under its names and signatures. */
#ifndef TORCH_MEMORY_SAVER_H
#define TORCH_MEMORY_SAVER_H

/*
 * Both builds (the preload library, on LD_PRELOAD or as
 * torch_memory_saver_hook_mode_preload*.abi3.so, and the torch-mode library)
 * export these functions. A C or C++ engine started with the preload library
 * on LD_PRELOAD can drive pause/resume itself: every cudaMalloc a thread
 * makes while its region is on (tms_set_interesting_region(true), or
 * TMS_INIT_ENABLE=1) is pauseable under the thread's current tag.
 *
 * Conventions:
 *  - Region settings (interesting region, tag, CPU backup, backend) belong to
 *    the calling thread; threads start from the TMS_INIT_* environment.
 *  - Setters and pause/resume return 0 on success, else one of the
 *    TMS_STATUS_* codes below; the message of the calling thread's last
 *    failure is tms_get_last_error(). No function exits or aborts the
 *    process. (Upstream declares the setters void: a caller that ignores
 *    the result is unaffected.)
 *  - Strings returned stay valid for the life of the process.
 */

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TMS_STATUS_OK 0
#define TMS_STATUS_OOM 1            /* device memory exhausted (or the margin reached) */
#define TMS_STATUS_HOST_OOM 2       /* host memory for a backup could not be had */
#define TMS_STATUS_DRIVER 3         /* a driver call failed */
#define TMS_STATUS_NO_DRIVER 4      /* no driver library (libcuda.so.1, libamdhip64.so) */
#define TMS_STATUS_STATE 5          /* not allowed now: pause of a paused tag, resume of an active one */
#define TMS_STATUS_ARG 6            /* bad argument: empty tag, unknown backend name */
#define TMS_STATUS_NOT_FOUND 7      /* pointer not owned by torch_memory_saver */
#define TMS_STATUS_UNSUPPORTED 8    /* asked for a feature this build does not have */
#define TMS_STATUS_IO 9             /* a disk backup file could not be made, written or read (disk full, I/O error) */

/* Allocations this thread makes are pauseable while true. */
int tms_set_interesting_region(bool is_interesting);
bool tms_get_interesting_region(void);

/* Tag of this thread's next allocations (a non-empty string). */
int tms_set_current_tag(const char *tag);
const char *tms_get_current_tag(void);

/* Keep a host copy of this thread's next allocations across pause. */
int tms_set_enable_cpu_backup(bool enable);
bool tms_get_enable_cpu_backup(void);

/* "pinned" (page-locked) or "mmap" (pageable, returned to the OS on resume). */
int tms_set_cpu_backup_backend(const char *backend);
const char *tms_get_cpu_backup_backend(void);

/* Back this thread's next allocations up to a file each across pause
 * (instead of host memory; if CPU backup is enabled too, disk wins). */
int tms_set_enable_disk_backup(bool enable);
bool tms_get_enable_disk_backup(void);
/* Process-wide directory of the backup files, created (mode 0700) if
 * missing; files left there by dead processes are removed. Default:
 * TMS_DISK_BACKUP_DIR, else $TMPDIR, else /tmp. */
int tms_set_disk_backup_dir(const char *dir);

/* Process-wide: allocations fail with out-of-memory if they would leave
 * fewer than bytes free on the device. */
int set_memory_margin_bytes(uint64_t bytes);

/* Process-wide: keep host backups across resume. */
int tms_set_retain_cpu_backup(bool retain);
bool tms_get_retain_cpu_backup(void);

/* Pause or resume one tag, or every tag when tag is NULL or "". Pausing a
 * tag with nothing active, or resuming one with nothing paused, is
 * TMS_STATUS_STATE; a tag without allocations is a no-op. */
int tms_pause(const char *tag);
int tms_resume(const char *tag);

/* Host address of the backup of [ptr, ptr + size) while its allocation is
 * paused with a CPU backup (or has a retained one); NULL otherwise. Valid
 * until that backup is dropped (resume without retain, free). */
uint8_t *tms_get_cpu_backup_pointer(const uint8_t *ptr, uint64_t size);

/* Message of the calling thread's last failed call ("" if none). */
const char *tms_get_last_error(void);

#ifdef __cplusplus
}
#endif

#endif
