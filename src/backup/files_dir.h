/* Inside the disk backup files: the directory record files_dir.c keeps and files.c's I/O names, and what the I/O asks of the directory. */
#ifndef TMS_FILES_DIR_H
#define TMS_FILES_DIR_H

#include <stdint.h>
#include <sys/types.h>

#include "backup/files.h"

#define TOKENS_PER_DIR 8
struct tms_disk_dir {
    char *path;      /* resolved, absolute */
    uint64_t dev, ino;  /* the directory held: the path may later name another */
    int dfd;         /* held open while the directory is in use or holds files */
    int memory_fs;   /* tmpfs or ramfs: backups there take RAM */
    int lock_fd;     /* this process's lock file in it, -1 until needed (and after a fork) */
    pid_t lock_pid;  /* the process lock_fd and tokens belong to */
    /* The random part of this process's names here (lock and backups): one
     * per directory, so a token seen in one directory cannot be squatted in
     * another; a new one if a name is taken. All kept, for the exit sweep. */
    unsigned long long tokens[TOKENS_PER_DIR];
    int n_tokens;
    size_t files;    /* this process's backup files in it now */
    int replaced;    /* set_dir chose another while it held files: retired with its last one */
    uint32_t file_uid;  /* the owner the filesystem gives this process's files (its lock's) */
    int retired;     /* no longer used: descriptors closed, the path looked up anew */
};

/* TMS_E_IO naming what failed, where, and errno e. */
int tms_files_fail_errno(struct tms_err *err, int e, const char *what, const char *dir, const char *name);
/* 64 random bits (getrandom; mixed from the clock and pid where it fails). */
unsigned long long tms_files_random(void);

/* The directory a new file goes to: the chosen one, else the default,
 * prepared on first use and holding this process's lock. */
int tms_files_dir_for_new(struct tms_disk_dir **out, struct tms_err *err);
/* d's lock for this process, made now if it has none (first use, a fork,
 * or its file was removed while it lived). */
int tms_files_ensure_lock(struct tms_disk_dir *d, struct tms_err *err);
/* The random part of this process's names in d now. */
unsigned long long tms_files_token(struct tms_disk_dir *d);
/* This process's key (made anew after a fork) and the forks it has made. */
void tms_files_identity(uint64_t *key, unsigned long *generation);
unsigned long tms_files_generation(void);
/* Counts one of this process's files in or out of d; the last one out of a
 * directory set_dir replaced retires it. */
void tms_files_add_file(struct tms_disk_dir *d);
void tms_files_remove_file(struct tms_disk_dir *d);

#endif
