/* The process's settings: every TMS_* variable parsed once, nothing more. */
#ifndef TMS_CONFIG_H
#define TMS_CONFIG_H

#include <stddef.h>

#include "platform/error.h"

#define TMS_CHUNK_BYTES_MAX ((size_t)1 << 40)
#define TMS_JOB_NAME_MAX 64
#define TMS_JOB_HOLD_MS_DEFAULT 2000
#define TMS_JOB_WAIT_MS_DEFAULT 20
#define TMS_JOB_MS_MAX 60000

/* 1 if name is a job's name: 1 to TMS_JOB_NAME_MAX letters, digits, '_', '-' or '.'. */
int tms_job_name_ok(const char *name);

struct tms_defaults {
    int init_enable;             /* TMS_INIT_ENABLE */
    int init_backup;             /* TMS_INIT_ENABLE_CPU_BACKUP */
    char init_backup_backend[8]; /* TMS_INIT_CPU_BACKUP_BACKEND: "pinned", "mmap", or "" (the backups' default) */
    int init_disk_backup;        /* TMS_INIT_ENABLE_DISK_BACKUP */
    size_t disk_block_bytes;     /* TMS_DISK_BACKUP_CHUNK_MB: largest file I/O (default 256 MiB) */
    int reloc_hooks;             /* TMS_RELOC_HOOKS (default 1): preload mode may patch GOT entries */
    int shareable;               /* TMS_SHAREABLE (default 1): allocations are made exportable to other processes */
    int disk_trust_dir;          /* TMS_DISK_BACKUP_TRUST_DIR: the user vouches for the disk backup directory */
    int progress;                /* TMS_PROGRESS: the Python layer logs progress lines for long copies */
    int backup_live_only;        /* TMS_BACKUP_LIVE_ONLY (default 1): the Python layer skips blocks free in PyTorch's cache */
    size_t host_limit_bytes;     /* TMS_HOST_BACKUP_LIMIT in bytes (0: none) ... */
    unsigned host_limit_percent; /* ... or as a percentage of the host's memory (0: given in bytes) */
    char host_limit_name[65];    /* TMS_HOST_BACKUP_LIMIT_NAME: the ledger processes share (default "host") */
    int spill_to_disk;           /* TMS_SPILL_TO_DISK: what does not fit the budget goes to disk */
    int host_memory_safety;      /* TMS_HOST_MEMORY_SAFETY (default 1): no limit, yet keep 5 % of the host available */
    int retain_backup;           /* TMS_RETAIN_CPU_BACKUP */
    size_t chunk_bytes;          /* TMS_CHUNK_BYTES (<= TMS_CHUNK_BYTES_MAX); 0 = one handle per allocation */
    int chunk_bytes_set;         /* else the backend's default applies */
    int backup_threads;          /* TMS_BACKUP_THREADS; 0 = one per core, at most 16 */
    size_t backup_block_bytes;   /* TMS_BACKUP_BLOCK_BYTES: copy block size both ways; 0 = per direction */
    char host_meminfo[256];      /* TMS_HOST_MEMINFO (tests): a file read instead of /proc/meminfo; "" = none */
    char job[TMS_JOB_NAME_MAX + 1];  /* TMS_JOB: the job whose members lend each other memory; "" = none */
    unsigned job_hold_ms;        /* TMS_JOB_HOLD_MS: how long memory kept for the job waits for a borrower */
    unsigned job_wait_ms;        /* TMS_JOB_WAIT_MS: how long a pause or resume waits for one member's answer */
    struct tms_err parse_error;  /* status != 0 if a variable was malformed */
};

/* Parsed once per process. A malformed variable leaves the safe default in
 * place (hooks cannot raise) and is reported through parse_error, which the
 * Python module raises at import. */
const struct tms_defaults *tms_defaults(void);

/* The host backend's emulated devices and injected faults (driver_host.c):
 * TMS_HOST_DEVICE_BYTES, TMS_HOST_DEVICES, TMS_HOST_NUMA_NODE (the NUMA node
 * the devices sit on), TMS_FAULT="op:n[,op:n...]", the n-th call of op
 * failing once, and TMS_HOST_COPY_GATE (driver_host.c). Parsed with the
 * defaults; no other backend reads them. */
#define TMS_HOST_MAX_DEVICES 8
enum tms_fault_op {
    TMS_FAULT_CREATE, TMS_FAULT_MAP, TMS_FAULT_UNMAP, TMS_FAULT_TO_HOST, TMS_FAULT_TO_DEVICE, TMS_FAULT_HOST_ALLOC,
    /* disk.c's, under every backend: a write or read failing with EIO, a write moving half its bytes,
     * a file created without O_DIRECT (as on a filesystem that has none), a write-back failing with EIO */
    TMS_FAULT_DISK_WRITE, TMS_FAULT_DISK_READ, TMS_FAULT_DISK_SHORT_WRITE, TMS_FAULT_DISK_NO_DIRECT,
    TMS_FAULT_DISK_SYNC,
    TMS_FAULT_OPS
};
struct tms_host_env {
    size_t device_bytes;
    int devices;
    int numa_node;                 /* -1: unknown */
    int current_device;            /* TMS_HOST_CURRENT_DEVICE: the device allocations go to by default */
    long fault_at[TMS_FAULT_OPS];  /* 0 = never */
    char copy_gate[256];           /* TMS_HOST_COPY_GATE: a regular file the first device->host copy waits on; "" = none */
    struct tms_err error;          /* status != 0: one was malformed, the host backend does not load */
};
const struct tms_host_env *tms_host_env(void);

/* The first malformed TMS_* variable of the process, for `import
 * torch_memory_saver` to raise (module_env.c): TMS_OK if none. */
int tms_env_check(struct tms_err *err);

/* 1 if the library, its command line or its build reads the variable `name`
 * (a TMS_* name; the TMS_BENCH_, TMS_TEST_ and TMS_FUZZ_ families belong to the
 * project's benchmarks and tests), else 0: what a misspelt variable is told by. */
int tms_env_known(const char *name);
/* The i-th of the variables tms_env_known names one by one, NULL past the last. */
const char *tms_env_name(size_t i);

#endif
