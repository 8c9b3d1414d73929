/* Fork safety in one place: every lock of the library taken in one order before a fork, released after it in parent and child. */
#ifndef TMS_FORK_H
#define TMS_FORK_H

/*
 * A fork copies one thread. For the child to find the library usable, each
 * lock must be free and its data consistent there: the subsystem that owns a
 * lock takes it before the fork and releases it (or makes it anew) after, in
 * handlers it registers here. One atfork registration (fork.c) runs them all:
 * prepare handlers by rank, the lock held while another is taken first;
 * parent and child handlers in the reverse order. The ranks follow the layers
 * top down, and docs/design.md's lock table states the same order.
 */
enum tms_fork_rank {
    TMS_FORK_CUMEM,     /* hooks/cumem.c: cumem_lock, held while the wrappers call the core */
    TMS_FORK_IPC_LATER, /* hooks/ipc_later.c: later_lock, held while the IPC hooks' install is joined */
    TMS_FORK_RELOC,     /* hooks/reloc.c: its locks made anew in the child */
    TMS_FORK_SHARE_OPEN,   /* share/open.c: open_lock; the child lets go of what its parent opened */
    TMS_FORK_SHARE_JOB,    /* share/job.c: job_lock; the child is in no job and borrows nothing */
    TMS_FORK_SHARE_SERVE,  /* share/serve.c: serve_lock */
    TMS_FORK_TABLE,     /* core/table.c: table_lock */
    TMS_FORK_POOL,      /* share/job_pool.c: kept_lock; the child keeps no memory for the job and no lent descriptor */
    TMS_FORK_TRANSFER,  /* backup/transfer.c: the copy workers forgotten in the child */
    TMS_FORK_RETAINED,  /* backup/retained.c: pin_lock */
    TMS_FORK_LEDGER,    /* backup/ledger.c: ledger_lock */
    TMS_FORK_FILES,     /* backup/files_dir.c: disk_lock */
    TMS_FORK_DRIVER,    /* platform/driver.c: driver_lock, held while a backend loads */
    TMS_FORK_FP_RUN,    /* platform/driver_cuda.c: fp_lock, held while a fingerprint kernel runs */
    TMS_FORK_FILL,      /* platform/driver_cuda.c: fill_lock, held while memory is filled */
    TMS_FORK_DEVICES,   /* platform/driver_cuda.c: devices_lock */
    TMS_FORK_FINGERPRINT,  /* platform/fingerprint.c: key_lock; the child keys anew */
    TMS_FORK_RANKS
};

struct tms_fork_handlers {
    void (*prepare)(void);  /* each may be NULL */
    void (*parent)(void);
    void (*child)(void);
};

/* Registers the handlers of rank, which live for the process; a rank is
 * registered once, later calls are ignored. Call before the lock is first
 * taken (a subsystem's one-time setup). Thread-safe. */
void tms_fork_register(enum tms_fork_rank rank, const struct tms_fork_handlers *handlers);

#endif
