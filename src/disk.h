/* Backup files: one per allocation backed up to disk, in the process's disk backup directory. */
#ifndef TMS_DISK_H
#define TMS_DISK_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "error.h"

/* O_DIRECT wants offsets, lengths and buffers in whole logical blocks; 4 KiB
 * covers every block size Linux filesystems use for it. */
#define TMS_DISK_ALIGN ((size_t)4096)

/* A process with thousands of disk-backed allocations must not hold a
 * descriptor for each (RLIMIT_NOFILE is often 1024): a file is open only
 * while a pause or resume moves it, at most this many at once. */
#define TMS_DISK_FILES_OPEN_AT_ONCE 64

struct tms_disk_file {
    int fd;                    /* -1 between pauses and resumes (tms_disk_open) */
    int direct;                /* O_DIRECT: no page cache */
    int drop_cache;            /* buffered on a real disk: its pages are dropped after each block */
    pid_t owner;               /* the process that made it; only that one removes it */
    unsigned long generation;  /* forks the process had made when it made the file */
    char *path;
};

/* Makes dir (and its parents, mode 0700) the directory of the backup files
 * created from now on, and removes the files there whose owner died (see
 * disk.c). TMS_E_ARG naming dir and errno if it cannot be made or used. */
int tms_disk_set_dir(const char *dir, struct tms_err *err);

/* The directory in use: what tms_disk_set_dir set, else TMS_DISK_BACKUP_DIR,
 * else $TMPDIR, else /tmp. Copied into buf (truncated to n). */
void tms_disk_get_dir(char *buf, size_t n);

/* A new file for size bytes of the allocation at va, reserved on the disk
 * where the filesystem can (so a full disk fails here, before any copy).
 * TMS_E_IO naming the path and errno on failure. */
int tms_disk_create(uint64_t va, size_t size, struct tms_disk_file *f, struct tms_err *err);

/* Opens a file made earlier again, for a pause to rewrite or a resume to
 * read. TMS_E_IO naming the path and errno (a file removed meanwhile). */
int tms_disk_open(struct tms_disk_file *f, struct tms_err *err);
void tms_disk_close(struct tms_disk_file *f);

/* A pause may rewrite f in place: this process made it and has not forked
 * since (a child may still read it to resume its copy of the allocation). */
int tms_disk_rewritable(const struct tms_disk_file *f);

/* Closes the file and, in its owner process, removes it. */
void tms_disk_remove(struct tms_disk_file *f);

/* Writes or reads len bytes at offset (a multiple of TMS_DISK_ALIGN), whole:
 * short transfers are continued. buf is TMS_DISK_ALIGN-aligned with room for
 * len rounded up to TMS_DISK_ALIGN, which is what moves. TMS_E_IO naming the
 * path, offset and errno on failure. */
int tms_disk_write(const struct tms_disk_file *f, const void *buf, size_t len, size_t offset, struct tms_err *err);
int tms_disk_read(const struct tms_disk_file *f, void *buf, size_t len, size_t offset, struct tms_err *err);

#endif
