/* Backup files in the disk backup directory: the directory checked and held, files created, checked, written, read and swept. */
#ifndef TMS_FILES_H
#define TMS_FILES_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "platform/error.h"

/* O_DIRECT wants offsets, lengths and buffers in whole logical blocks; 4 KiB
 * covers every block size Linux filesystems use for it. */
#define TMS_DISK_ALIGN ((size_t)4096)

/* Each file starts with a header of this many bytes (magic, size, the
 * process's key), checked before a resume reads the data after it. */
#define TMS_DISK_HEADER_BYTES TMS_DISK_ALIGN

/* A process with thousands of disk-backed allocations must not hold a
 * descriptor for each (RLIMIT_NOFILE is often 1024): a file is open only
 * while a pause or resume moves it, at most this many at once. */
#define TMS_DISK_FILES_OPEN_AT_ONCE 64

struct tms_disk_dir;  /* a prepared directory (files_dir.c): its descriptor is held for the process's life */

struct tms_disk_file {
    int fd;                    /* -1 between pauses and resumes (tms_disk_open) */
    int direct;                /* O_DIRECT: no page cache */
    int drop_cache;            /* buffered on a real disk: written back and dropped after each block */
    pid_t owner;               /* the process that made it; only that one removes it */
    unsigned long generation;  /* forks the process had made when it made the file */
    struct tms_disk_dir *dir;  /* where it lives: every open is relative to the held directory */
    char name[64];             /* its name in dir */
    uint64_t dev;              /* what was created (major << 32 | minor): a reopen must find this very file */
    uint64_t ino;
    uint32_t uid;              /* its owner as the filesystem made it: a reopen must find the same */
    uint64_t key;              /* the header's key */
    size_t size;               /* data bytes after the header */
};

/* Makes dir the directory of the backup files created from now on (a
 * relative path is resolved against the working directory now, once), and
 * removes the files there whose owner died (see files_dir.c). Missing directories
 * are made, mode 0700. Refused unless the directory is safe (files_dir.c):
 * TMS_E_ARG naming it, its owner and mode; TMS_E_IO naming it and errno if
 * it cannot be made or opened. */
int tms_disk_set_dir(const char *dir, struct tms_err *err);

/* The directory in use: what tms_disk_set_dir set, else TMS_DISK_BACKUP_DIR,
 * else $TMPDIR, else /tmp (resolved once). Copied into buf (truncated to n). */
void tms_disk_get_dir(char *buf, size_t n);

/* A new file for size bytes of the allocation at va, created exclusively
 * under an unpredictable name, its header written and its blocks reserved
 * where the filesystem can (so a full disk fails here, before any copy).
 * TMS_E_IO naming the path and errno on failure; TMS_E_ARG if the directory
 * is not safe. */
int tms_disk_create(uint64_t va, size_t size, struct tms_disk_file *f, struct tms_err *err);

/* Opens a file made earlier again, for a pause to rewrite or a resume to
 * read: TMS_E_IO naming the path if it is gone, is not the file created
 * (another inode, owner or type: replaced meanwhile), or its header is not
 * the one written. */
int tms_disk_open(struct tms_disk_file *f, struct tms_err *err);
void tms_disk_close(struct tms_disk_file *f);

/* After a pause's writes: where the file is buffered, its write-back is
 * complete and succeeded (TMS_E_IO naming the path and errno if not). */
int tms_disk_flush(struct tms_disk_file *f, struct tms_err *err);

/* A pause may rewrite f in place: this process made it and has not forked
 * since (a child may still read it to resume its copy of the allocation). */
int tms_disk_rewritable(const struct tms_disk_file *f);

/* Closes the file and, in its owner process, removes it. */
void tms_disk_remove(struct tms_disk_file *f);

/* Writes or reads len bytes of data at offset (a multiple of TMS_DISK_ALIGN),
 * whole: short transfers are continued. buf is TMS_DISK_ALIGN-aligned with
 * room for len rounded up to TMS_DISK_ALIGN, which is what moves. A read
 * that ends early is an error: never bytes the file did not hold. TMS_E_IO
 * naming the path, offset and errno on failure. */
int tms_disk_write(const struct tms_disk_file *f, const void *buf, size_t len, size_t offset, struct tms_err *err);
int tms_disk_read(const struct tms_disk_file *f, void *buf, size_t len, size_t offset, struct tms_err *err);

/* Where a message names f: its directory and name. */
void tms_disk_path(const struct tms_disk_file *f, char *buf, size_t n);

#endif
