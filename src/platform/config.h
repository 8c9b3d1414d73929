/* Every setting of the library in one table: its name, type, bounds, default, environment
 * variable, whether it changes at run time (and the core's setter and getter), and what it
 * does. The environment's parser and the list of known variables (config.c), the core's
 * run-time accessors (core/settings.c), the CPython get/set methods (face/module_process.c)
 * and the description the Python layer builds its settings from (_tms_env.settings()) are
 * all made from it. Any layer may include this header: it is the process's configuration. */
#ifndef TMS_CONFIG_H
#define TMS_CONFIG_H

#include <stddef.h>
#include <stdint.h>

#include "platform/error.h"

#define TMS_CHUNK_BYTES_MAX ((size_t)1 << 40)
#define TMS_HOST_MAX_DEVICES 8

/* The operations TMS_FAULT can make fail: the host backend's, and disk.c's under every
 * backend (a write or read failing with EIO, a write moving half its bytes, a file created
 * without O_DIRECT as on a filesystem that has none, a write-back failing with EIO). */
#define TMS_FAULT_LIST(X)                                                                                      \
    X(TMS_FAULT_CREATE, "create") X(TMS_FAULT_MAP, "map") X(TMS_FAULT_UNMAP, "unmap")                          \
    X(TMS_FAULT_TO_HOST, "copy_to_host") X(TMS_FAULT_TO_DEVICE, "copy_to_device")                              \
    X(TMS_FAULT_HOST_ALLOC, "host_alloc") X(TMS_FAULT_DISK_WRITE, "disk_write")                                \
    X(TMS_FAULT_DISK_READ, "disk_read") X(TMS_FAULT_DISK_SHORT_WRITE, "disk_short_write")                      \
    X(TMS_FAULT_DISK_NO_DIRECT, "disk_no_direct") X(TMS_FAULT_DISK_SYNC, "disk_sync")                          \
    X(TMS_FAULT_FINGERPRINT, "fingerprint") X(TMS_FAULT_FILL, "fill")
#define TMS_FAULT_ENUM(op, name) op,
enum tms_fault_op { TMS_FAULT_LIST(TMS_FAULT_ENUM) TMS_FAULT_OPS };
#undef TMS_FAULT_ENUM

/* ---- the table -------------------------------------------------------------------------
 * X(name, type, env, default, range, accepts, when, doc)
 *   name     the field of struct tms_defaults; for a run-time setting also its Python name
 *            (TorchMemorySaver.<name>, the native modules' get_<name> / set_<name>)
 *   type     how a value is read (below)
 *   env      its environment variable (NULL: none; the setting is set at run time only)
 *   default  the value while the variable is unset, empty or malformed
 *   range    bounds in the type's form: (lo, hi) numbers, (lo, hi, multiple) sizes,
 *            ("a", "b", ...) choices, (longest) texts (0: any length); () none
 *   accepts  what a value must be: a malformed variable is told "<VAR>='<value>' is not
 *            <accepts>" (NULL: the type says it)
 *   when     RUN(setter, getter): the value also changes while the process runs; the core
 *            keeps it and makes the setter and getter named (core/settings.c), the faces
 *            set and read it. ENV: the environment gives it once; a malformed variable
 *            keeps the default (a hook cannot raise) and is what importing the package
 *            raises. HOST: as ENV, the host backend's (platform/driver_host.c): a malformed
 *            one keeps that backend from loading. OUTSIDE: another program's variable,
 *            read as glibc reads it (secure_getenv: not in a setuid process), never
 *            malformed and not named among the library's. CALL(setter, getter): a text
 *            that also changes while the process runs, kept by the layer that uses it,
 *            which may refuse a change (int tms_<setter>(const char *text or NULL, struct
 *            tms_err *), void tms_<getter>(char *buf, size_t size), "" for none: the names
 *            are pasted, so the table names no function of a layer above); the faces set
 *            and read it as a RUN one.
 *   doc      what it does (the Python property's and the native methods' docstrings); a
 *            variable only tests or benchmarks set says so first ("tests...")
 * Types: boolean (1, true, TRUE, yes, YES / 0, false, FALSE, no, NO; empty is malformed),
 *   count (an int in range), size (bytes, with K/KiB/KB.. units, in range and a multiple),
 *   mib (a count of MiB in range, kept in bytes), choice / choice_anycase (one of the range's
 *   words, kept as the table spells it), name (1 to longest letters, digits, '_', '-', '.',
 *   not starting with '.'), path (any text of at most longest bytes), limit (a size, or a
 *   whole percentage in range: two fields, <name>_bytes and <name>_percent), faults (op:n,...
 *   of TMS_FAULT_LIST), device (a device of the host backend, below host_devices, which
 *   comes first). An empty variable is unset, but for a boolean. A RUN setting is a boolean,
 *   count or size. */
#define TMS_SETTINGS(X)                                                                                        \
    /* regions and backups */                                                                                  \
    X(init_enable, boolean, "TMS_INIT_ENABLE", 0, (), NULL, ENV, "threads start inside a region (tag 'default')") \
    X(init_backup, boolean, "TMS_INIT_ENABLE_CPU_BACKUP", 0, (), NULL, ENV, "threads start with CPU backup")   \
    X(init_backup_backend, choice, "TMS_INIT_CPU_BACKUP_BACKEND", "mmap", ("pinned", "mmap"),                  \
      "a backup backend (use 'pinned' or 'mmap')", ENV, "the CPU backup backend regions get by default")       \
    X(init_disk_backup, boolean, "TMS_INIT_ENABLE_DISK_BACKUP", 0, (), NULL, ENV,                              \
      "threads start with disk backup (wins over CPU backup)")                                                 \
    X(retain_cpu_backup, boolean, "TMS_RETAIN_CPU_BACKUP", 0, (), NULL, RUN(tms_core_set_retain, tms_core_retain), \
      "Keep host backups across resume: the next pause copies into them instead of allocating (faster), "      \
      "at the cost of the host memory. TMS_RETAIN_CPU_BACKUP gives the default.")                              \
    X(backup_live_only, boolean, "TMS_BACKUP_LIVE_ONLY", 1, (), NULL,                                          \
      RUN(tms_core_set_backup_live_only, tms_core_backup_live_only),                                           \
      "Backed-up pauses called from Python copy only the bytes of blocks PyTorch's caching allocator "         \
      "holds live (allocated, or freed but pending on a stream); free blocks come back with undefined "        \
      "contents, as newly allocated memory. Memory PyTorch did not hand out is copied whole. On by "           \
      "default; TMS_BACKUP_LIVE_ONLY=0 turns it off.")                                                         \
    X(progress, boolean, "TMS_PROGRESS", 0, (), NULL, RUN(tms_core_set_progress, tms_core_progress),           \
      "Log progress lines (INFO, logger \"torch_memory_saver\") for backed-up pauses/resumes that take "       \
      "more than a second. Off by default; TMS_PROGRESS=1.")                                                   \
    X(memory_margin_bytes, size, NULL, 0, (0, SIZE_MAX, 1), "a number of bytes", RUN(tms_core_set_margin,      \
      tms_core_margin),                                                                                        \
      "Allocations inside regions fail with OutOfMemoryError (PyTorch then frees its cache and retries) "      \
      "if they would leave fewer than this many bytes free on the device. 0 (the default) turns the "          \
      "check off.")                                                                                            \
    /* the host budget and the disk */                                                                         \
    X(host_limit, limit, "TMS_HOST_BACKUP_LIMIT", 0, (1, 100),                                                 \
      "a positive size (e.g. 64GiB) or a percentage from 1% to 100%", ENV,                                     \
      "the host backup budget, in bytes or in percent of the host's memory (0: none)")                         \
    X(host_limit_name, name, "TMS_HOST_BACKUP_LIMIT_NAME", "host", (64),                                       \
      "a name of 1 to 64 letters, digits, '_', '-' or '.' (not starting with '.')", ENV,                       \
      "the ledger the processes sharing a budget name")                                                        \
    X(host_memory_safety, boolean, "TMS_HOST_MEMORY_SAFETY", 1, (), NULL, ENV,                                 \
      "without a budget, pauses keep 5 % of the host's memory available")                                      \
    X(skip_unchanged, boolean, "TMS_SKIP_UNCHANGED", 0, (), NULL,                                              \
      RUN(tms_core_set_skip_unchanged, tms_core_skip_unchanged),                                               \
      "Backed-up pauses copy only the 2 MiB chunks that changed since the backup was written (found by "       \
      "fingerprints on the GPU), keeping each backup between cycles; a region's skip_unchanged overrides it. "  \
      "Off by default; TMS_SKIP_UNCHANGED=1.")                                                                 \
    X(verify_restore, boolean, "TMS_VERIFY_RESTORE", 1, (), NULL,                                              \
      RUN(tms_core_set_verify_restore, tms_core_verify_restore),                                               \
      "Every backed-up pause records a keyed fingerprint of each 2 MiB chunk it copied (on the GPU), and "     \
      "every resume fingerprints what it restored and compares: a mismatch raises IntegrityError and the "     \
      "allocation stays paused with its backup. On by default; TMS_VERIFY_RESTORE=0 turns it off.")           \
    X(restore, choice, "TMS_RESTORE", "none", ("none", "zero", "poison"), "one of: none, zero, poison", ENV,   \
      "what memory paused without backup holds after resume, for regions that do not say: none (undefined), " \
      "zero (every byte 0), poison (every byte 0xFF)")                                                         \
    /* lending within a job */                                                                                 \
    X(job, name, "TMS_JOB", "", (64), "a job name of 1 to 64 letters, digits, '_', '-' or '.' (not starting "  \
      "with '.')", CALL(job_set_name, job_get_name),                                                   \
      "The job this process lends memory in (None: none, the default; TMS_JOB): processes of one user that "  \
      "name the same job and use the same GPU pass each other the physical memory a pause releases, so a "     \
      "resume right after another member's pause need not wait for the driver to clean it. Set it before "     \
      "the process's first pause or resume in the job.")                                                       \
    X(job_hold_ms, count, "TMS_JOB_HOLD_MS", 2000, (0, 60000), "a whole number of milliseconds from 0 to 60000", \
      ENV, "how long memory a pause keeps for the job's members waits before it goes back to the driver")      \
    X(job_wait_ms, count, "TMS_JOB_WAIT_MS", 20, (0, 60000), "a whole number of milliseconds from 0 to 60000", \
      ENV, "how long a pause or resume waits for the members' answers, all together, before it goes on without them") \
    X(spill_to_disk, boolean, "TMS_SPILL_TO_DISK", 0, (), NULL, RUN(tms_core_set_spill, tms_core_spill),       \
      "When a backed-up pause would exceed the host backup budget (TMS_HOST_BACKUP_LIMIT, or 5 % of the "      \
      "host's memory kept available), the largest allocations that do not fit are backed up to disk (the "     \
      "disk backup directory) instead of raising. TMS_SPILL_TO_DISK gives the default.")                       \
    X(host_meminfo, path, "TMS_HOST_MEMINFO", "", (255), "a path of at most 255 bytes", ENV,                   \
      "tests: a file read instead of /proc/meminfo")                                                           \
    X(disk_dir, path, "TMS_DISK_BACKUP_DIR", "", (0), NULL, ENV,                                               \
      "the disk backup directory (default $TMPDIR, else /tmp)")                                                \
    X(disk_trust_dir, boolean, "TMS_DISK_BACKUP_TRUST_DIR", 0, (), NULL, ENV,                                  \
      "the user vouches for the disk backup directory (used though it fails the safety check)")                \
    X(disk_block_bytes, mib, "TMS_DISK_BACKUP_CHUNK_MB", (size_t)256 << 20, (1, 4096),                         \
      "a whole number of MiB from 1 to 4096", ENV, "the largest file I/O of a disk backup")                    \
    /* copies and allocations */                                                                               \
    X(backup_threads, count, "TMS_BACKUP_THREADS", 0, (1, 32), "a number from 1 to 32", ENV,                   \
      "copy workers (0: one per CPU, at most 16)")                                                             \
    X(backup_block_bytes, size, "TMS_BACKUP_BLOCK_BYTES", 0, (64 << 10, 256 << 20, 4096),                      \
      "a size from 64KiB to 256MiB in whole 4 KiB pages", ENV, "the copy block both ways (0: per direction)")  \
    X(chunk_bytes, size, "TMS_CHUNK_BYTES", 0, (0, TMS_CHUNK_BYTES_MAX, 1),                                    \
      "a size from 0 to 1TiB (e.g. 67108864, 64MiB, 1GiB)", ENV,                                               \
      "the physical chunk of an allocation (0: one handle; unset: the backend's)")                             \
    /* hooks, sharing, the backend, the log */                                                                 \
    X(reloc_hooks, boolean, "TMS_RELOC_HOOKS", 1, (), NULL, ENV, "preload mode may patch GOT entries (relocation)") \
    X(shareable, boolean, "TMS_SHAREABLE", 1, (), NULL, ENV, "allocations are made exportable to other processes") \
    X(log, choice, "TMS_LOG", "", ("debug", "off", "0"), "one of: debug, off, 0", ENV,                         \
      "C-side debug lines on stderr; off (or 0): not even warnings")                                           \
    X(platform, choice_anycase, "TMS_PLATFORM", "", ("cuda", "rocm", "hip"), "one of: cuda, rocm, hip", ENV,   \
      "the platform whose backend to use when TMS_BACKEND says nothing")                                       \
    X(backend, choice_anycase, "TMS_BACKEND", "", ("cuda", "hip", "host"), "one of: cuda, hip, host", ENV,     \
      "the backend")                                                                                           \
    X(hip_library, path, "TMS_HIP_LIBRARY", "", (0), NULL, ENV,                                                \
      "tests: the HIP runtime to load instead of libamdhip64")                                                 \
    /* the host backend */                                                                                     \
    X(host_device_bytes, size, "TMS_HOST_DEVICE_BYTES", (size_t)16 << 30, (1, SIZE_MAX, 1),                    \
      "a positive size (e.g. 8, 64MiB, 16GiB)", HOST, "the capacity of each emulated device")                  \
    X(host_devices, count, "TMS_HOST_DEVICES", 2, (1, TMS_HOST_MAX_DEVICES), "a device count from 1 to 8",     \
      HOST, "the emulated devices")                                                                            \
    X(host_numa_node, count, "TMS_HOST_NUMA_NODE", -1, (0, 1023), "a NUMA node from 0 to 1023", HOST,          \
      "the NUMA node the devices sit on (-1: unknown)")                                                        \
    X(host_current_device, device, "TMS_HOST_CURRENT_DEVICE", 0, (), NULL, HOST,                               \
      "tests and benchmarks: the device allocations go to by default")                                         \
    X(fault_at, faults, "TMS_FAULT", 0, (), NULL, HOST, "tests: op:n,... the n-th call of op fails once")      \
    X(host_copy_gate, path, "TMS_HOST_COPY_GATE", "", (255), "a path of at most 255 bytes", HOST,              \
      "tests: a regular file the first device->host copy waits on")                                            \
    /* other programs' */                                                                                      \
    X(tmpdir, path, "TMPDIR", "", (0), NULL, OUTSIDE, "where disk backups go without TMS_DISK_BACKUP_DIR")     \
    X(xdg_runtime_dir, path, "XDG_RUNTIME_DIR", "", (0), NULL, OUTSIDE, "where the host budget's ledger lives") \
    X(ld_library_path, path, "LD_LIBRARY_PATH", "", (0), NULL, OUTSIDE,                                        \
      "the directories the relocation hooks' dlopen searches, as the dynamic loader does")

/* TMS_* variables the library's command line and build read, not the library: X(env, doc). */
#define TMS_ENV_ELSEWHERE(X)                                                                                   \
    X("TMS_DEMO_REEXEC", "the demo re-executed itself with the preload library")                               \
    X("TMS_WERROR", "the build: warnings are errors")                                                          \
    X("TMS_EXTRA_CFLAGS", "the build: more compiler flags (sanitizers)")

/* ---- the types ------------------------------------------------------------------------ */

enum tms_setting_type {
    TMS_SETTING_TYPE_boolean, TMS_SETTING_TYPE_count, TMS_SETTING_TYPE_size, TMS_SETTING_TYPE_mib,
    TMS_SETTING_TYPE_choice, TMS_SETTING_TYPE_choice_anycase, TMS_SETTING_TYPE_name, TMS_SETTING_TYPE_path,
    TMS_SETTING_TYPE_limit, TMS_SETTING_TYPE_faults, TMS_SETTING_TYPE_device,
};

/* The C type of a value (a run-time setting's setter takes it, its getter returns it). */
#define TMS_SETTING_CTYPE(type) TMS_SETTING_CTYPE_##type
#define TMS_SETTING_CTYPE_boolean int
#define TMS_SETTING_CTYPE_count int
#define TMS_SETTING_CTYPE_size size_t
#define TMS_SETTING_CTYPE_mib size_t
#define TMS_SETTING_CTYPE_device int
#define TMS_SETTING_CTYPE_choice const char *
#define TMS_SETTING_CTYPE_choice_anycase const char *
#define TMS_SETTING_CTYPE_name const char *
#define TMS_SETTING_CTYPE_path const char *

/* The field(s) a setting has in struct tms_defaults, and <name>_set: 1 if the environment gave it. */
#define TMS_SETTING_FIELD(name, type) TMS_SETTING_FIELD_##type(name) int name##_set;
#define TMS_SETTING_FIELD_boolean(name) int name;
#define TMS_SETTING_FIELD_count(name) int name;
#define TMS_SETTING_FIELD_size(name) size_t name;
#define TMS_SETTING_FIELD_mib(name) size_t name;
#define TMS_SETTING_FIELD_device(name) int name;
#define TMS_SETTING_FIELD_choice(name) const char *name;
#define TMS_SETTING_FIELD_choice_anycase(name) const char *name;
#define TMS_SETTING_FIELD_name(name) const char *name;
#define TMS_SETTING_FIELD_path(name) const char *name;
#define TMS_SETTING_FIELD_limit(name) size_t name##_bytes; unsigned name##_percent;
#define TMS_SETTING_FIELD_faults(name) long name[TMS_FAULT_OPS];  /* per op: 0 = never */

#define TMS_SETTING_FIELDS(name, type, env, dflt, range, accepts, when, doc) TMS_SETTING_FIELD(name, type)

/* The values the process started with: every row's default, or what its variable says. */
struct tms_defaults {
    TMS_SETTINGS(TMS_SETTING_FIELDS)
    struct tms_err parse_error;  /* status != 0: the first malformed variable of a RUN or ENV row */
    struct tms_err host_error;   /* status != 0: the first malformed one of a HOST row; the host backend does not load */
};

/* Parsed once per process, at the first call (from any thread). */
const struct tms_defaults *tms_defaults(void);

/* ---- the rows, for the faces and checks ------------------------------------------------ */

#define TMS_SETTING_ID(name, type, env, dflt, range, accepts, when, doc) TMS_SETTING_##name,
enum tms_setting_id { TMS_SETTINGS(TMS_SETTING_ID) TMS_SETTING_COUNT };

/* The when column, read by token pasting (RUN, ENV, HOST and OUTSIDE are no macros):
 * TMS_SETTING_GROUP(when) its enum tms_setting_group; TMS_SETTING_IF_RUN(when, ...) the
 * rest for a RUN row, nothing for another; TMS_SETTING_SETTER(when) and
 * TMS_SETTING_GETTER(when) the names a RUN row gives. */
enum tms_setting_group {
    TMS_SETTING_GROUP_RUN, TMS_SETTING_GROUP_ENV, TMS_SETTING_GROUP_HOST, TMS_SETTING_GROUP_OUTSIDE, TMS_SETTING_GROUP_CALL
};
#define TMS_SETTING_GROUP(when) TMS_SETTING_GROUP_OF_##when
#define TMS_SETTING_GROUP_OF_RUN(set, get) TMS_SETTING_GROUP_RUN
#define TMS_SETTING_GROUP_OF_ENV TMS_SETTING_GROUP_ENV
#define TMS_SETTING_GROUP_OF_HOST TMS_SETTING_GROUP_HOST
#define TMS_SETTING_GROUP_OF_OUTSIDE TMS_SETTING_GROUP_OUTSIDE
#define TMS_SETTING_GROUP_OF_CALL(set, get) TMS_SETTING_GROUP_CALL
#define TMS_SETTING_IF_RUN(when, ...) TMS_SETTING_IF_RUN_##when(__VA_ARGS__)
#define TMS_SETTING_IF_RUN_RUN(set, get) TMS_SETTING_KEEP
#define TMS_SETTING_IF_RUN_ENV(...)
#define TMS_SETTING_IF_RUN_HOST(...)
#define TMS_SETTING_IF_RUN_OUTSIDE(...)
#define TMS_SETTING_IF_RUN_CALL(set, get) TMS_SETTING_DROP
#define TMS_SETTING_IF_CALL(when, ...) TMS_SETTING_IF_CALL_##when(__VA_ARGS__)
#define TMS_SETTING_IF_CALL_CALL(set, get) TMS_SETTING_KEEP
#define TMS_SETTING_IF_CALL_RUN(set, get) TMS_SETTING_DROP
#define TMS_SETTING_IF_CALL_ENV(...)
#define TMS_SETTING_IF_CALL_HOST(...)
#define TMS_SETTING_IF_CALL_OUTSIDE(...)
#define TMS_SETTING_KEEP(...) __VA_ARGS__
#define TMS_SETTING_DROP(...)
#define TMS_SETTING_SETTER(when) TMS_SETTING_SETTER_##when
#define TMS_SETTING_SETTER_RUN(set, get) set
#define TMS_SETTING_SETTER_ENV
#define TMS_SETTING_SETTER_HOST
#define TMS_SETTING_SETTER_OUTSIDE
#define TMS_SETTING_SETTER_CALL(set, get) set
#define TMS_SETTING_GETTER(when) TMS_SETTING_GETTER_##when
#define TMS_SETTING_GETTER_RUN(set, get) get
#define TMS_SETTING_GETTER_ENV
#define TMS_SETTING_GETTER_HOST
#define TMS_SETTING_GETTER_OUTSIDE
#define TMS_SETTING_GETTER_CALL(set, get) get

/* One row of the table, as the code reads it. */
struct tms_setting_row {
    const char *name;
    const char *env;             /* NULL: none */
    int type;                    /* enum tms_setting_type */
    int group;                   /* enum tms_setting_group */
    unsigned long long lo, hi;   /* numbers: the bounds; name, path: hi = the longest (0: any) */
    unsigned long long multiple; /* size: a value is a multiple of it (1: any) */
    const char *const *choices;  /* choice types: the words, NULL-terminated */
    long long number;            /* the default of a bool or number */
    const char *text;            /* the default of a text */
    const char *accepts;         /* what a value must be */
    const char *doc;
    size_t offset, offset_percent, offset_set;  /* its field(s) in struct tms_defaults */
};

/* The rows in table order, indexed by enum tms_setting_id. */
extern const struct tms_setting_row tms_setting_rows[TMS_SETTING_COUNT];
/* The row called name, or NULL. */
const struct tms_setting_row *tms_setting_find(const char *name);

/* What a value of row r must be: its accepts column, or its type's words. */
const char *tms_setting_accepts(const struct tms_setting_row *r);

/* A value asked for a run-time number setting (row r) while the process runs, checked
 * against the row's bounds: the face converts it, this decides. sign: 0 if it fits an
 * unsigned 64-bit value (value), -1 if it is negative, 1 if it is 2**64 or more; text: the
 * number as the caller wrote it, for the message. TMS_E_ARG "<name> must be ..., got <text>". */
int tms_setting_check(const struct tms_setting_row *r, int sign, unsigned long long value, const char *text,
                      struct tms_err *err);
/* A text asked for a run-time text setting (row r, a name): TMS_E_ARG "<name> '<text>' is not
 * <accepts>" where its variable would be malformed. */
int tms_setting_check_text(const struct tms_setting_row *r, const char *text, struct tms_err *err);

/* TMS_E_ARG and the message of row id's malformed variable, if it was; else TMS_OK. For a
 * reader that must not go on with the default (the backend TMS_BACKEND names). */
int tms_setting_error(int id, struct tms_err *err);

/* A choice row's value as its variable says now (not as the process read it at first use):
 * the table's spelling of it, or its default where it is unset or malformed; "" for a row
 * that is no choice. For a layer that must ask before the library reads its settings. */
const char *tms_setting_text_now(int id);

/* ---- the environment as a whole -------------------------------------------------------- */

/* The first malformed variable of the process, for `import torch_memory_saver` to raise
 * (face/module_env.c, face/module.c): TMS_OK if none. */
int tms_env_check(struct tms_err *err);

/* 1 if the library, its command line or its build reads the variable `name` (a TMS_* name;
 * the TMS_BENCH_, TMS_TEST_ and TMS_FUZZ_ families belong to the project's benchmarks and
 * tests), else 0: what a misspelt variable is told by. */
int tms_env_known(const char *name);
/* The i-th of the variables tms_env_known names one by one, NULL past the last. */
const char *tms_env_name(size_t i);

#endif
