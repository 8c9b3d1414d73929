/* The process's settings: every TMS_* variable parsed once (malformed ones reported, safe defaults kept). */
#include "platform/config.h"

#include "platform/parse.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

static pthread_once_t defaults_once = PTHREAD_ONCE_INIT;
static struct tms_defaults defaults;  /* written once under defaults_once */
static struct tms_host_env host_env;  /* written once under defaults_once */


static void env_bool(const char *var, int *out)
{
    const char *s = getenv(var);
    if (s && tms_parse_bool(s, out) != TMS_OK && !defaults.parse_error.status)
        tms_fail(&defaults.parse_error, TMS_E_ARG, 0,
                 "%s='%s' is not a boolean (use 1, true, TRUE, yes, YES or 0, false, FALSE, no, NO)", var, s);
}

static void env_threads(void)
{
    const char *s = getenv("TMS_BACKUP_THREADS");
    if (!s || !*s) return;
    unsigned long long n;
    if (tms_parse_uint(s, 32, &n) || n < 1) {
        if (!defaults.parse_error.status)
            tms_fail(&defaults.parse_error, TMS_E_ARG, 0, "TMS_BACKUP_THREADS='%s' is not a number from 1 to 32", s);
        return;
    }
    defaults.backup_threads = (int)n;
}

/* A size with units, or a whole percentage of the host's memory ("40%"). */
static void env_host_limit(void)
{
    const char *s = getenv("TMS_HOST_BACKUP_LIMIT");
    if (s && *s) {
        size_t len = strlen(s);
        unsigned long long pct;
        char digits[8];
        if (s[len - 1] == '%' && len >= 2 && len - 1 < sizeof digits) {
            memcpy(digits, s, len - 1);
            digits[len - 1] = 0;
            if (tms_parse_uint(digits, 100, &pct) == TMS_OK && pct >= 1) defaults.host_limit_percent = (unsigned)pct;
        } else if (tms_parse_bytes(s, &defaults.host_limit_bytes) != TMS_OK) {
            defaults.host_limit_bytes = 0;
        }
        if (!defaults.host_limit_percent && !defaults.host_limit_bytes && !defaults.parse_error.status)
            tms_fail(&defaults.parse_error, TMS_E_ARG, 0,
                     "TMS_HOST_BACKUP_LIMIT='%s' is not a positive size (e.g. 64GiB) or a percentage from 1%% to 100%%", s);
    }
    const char *name = getenv("TMS_HOST_BACKUP_LIMIT_NAME");
    strcpy(defaults.host_limit_name, "host");
    if (!name || !*name) return;
    size_t n = strlen(name);
    int ok = n <= 64 && name[0] != '.';
    for (size_t i = 0; ok && i < n; i++)
        ok = (name[i] >= 'a' && name[i] <= 'z') || (name[i] >= 'A' && name[i] <= 'Z') ||
             (name[i] >= '0' && name[i] <= '9') || name[i] == '_' || name[i] == '-' || name[i] == '.';
    if (ok) memcpy(defaults.host_limit_name, name, n + 1);
    else if (!defaults.parse_error.status)
        tms_fail(&defaults.parse_error, TMS_E_ARG, 0,
                 "TMS_HOST_BACKUP_LIMIT_NAME='%s' is not a name of 1 to 64 letters, digits, '_', '-' or '.' "
                 "(not starting with '.')", name);
}

int tms_job_name_ok(const char *name)
{
    size_t n = strlen(name);
    int ok = n >= 1 && n <= TMS_JOB_NAME_MAX;
    for (size_t i = 0; ok && i < n; i++)
        ok = (name[i] >= 'a' && name[i] <= 'z') || (name[i] >= 'A' && name[i] <= 'Z') ||
             (name[i] >= '0' && name[i] <= '9') || name[i] == '_' || name[i] == '-' || name[i] == '.';
    return ok;
}

/* A bound in whole milliseconds, 0 to TMS_JOB_MS_MAX. */
static void env_ms(const char *var, unsigned fallback, unsigned *out)
{
    *out = fallback;
    const char *s = getenv(var);
    unsigned long long n;
    if (!s || !*s) return;
    if (tms_parse_uint(s, TMS_JOB_MS_MAX, &n) == TMS_OK) *out = (unsigned)n;
    else if (!defaults.parse_error.status)
        tms_fail(&defaults.parse_error, TMS_E_ARG, 0, "%s='%s' is not a whole number of milliseconds from 0 to %d", var,
                 s, TMS_JOB_MS_MAX);
}

/* The job lending happens in, and its two bounds. */
static void env_job(void)
{
    const char *name = getenv("TMS_JOB");
    if (name && *name) {
        if (tms_job_name_ok(name)) strcpy(defaults.job, name);
        else if (!defaults.parse_error.status)
            tms_fail(&defaults.parse_error, TMS_E_ARG, 0,
                     "TMS_JOB='%.80s' is not a job name of 1 to %d letters, digits, '_', '-' or '.'", name,
                     TMS_JOB_NAME_MAX);
    }
    env_ms("TMS_JOB_HOLD_MS", TMS_JOB_HOLD_MS_DEFAULT, &defaults.job_hold_ms);
    env_ms("TMS_JOB_WAIT_MS", TMS_JOB_WAIT_MS_DEFAULT, &defaults.job_wait_ms);
}

/* Upstream's spelling: whole MiB. */
static void env_disk_block(void)
{
    defaults.disk_block_bytes = (size_t)256 << 20;
    const char *s = getenv("TMS_DISK_BACKUP_CHUNK_MB");
    if (!s || !*s) return;
    unsigned long long n;
    if (tms_parse_uint(s, 4096, &n) || n < 1) {
        if (!defaults.parse_error.status)
            tms_fail(&defaults.parse_error, TMS_E_ARG, 0,
                     "TMS_DISK_BACKUP_CHUNK_MB='%s' is not a whole number of MiB from 1 to 4096", s);
        return;
    }
    defaults.disk_block_bytes = (size_t)n << 20;
}

/* A path for a test hook, checked for length only: its reader opens it as a
 * regular file and bounds what it reads. */
static void env_path(const char *var, char *out, size_t size)
{
    const char *s = getenv(var);
    if (!s || !*s) return;
    if (strlen(s) < size) strcpy(out, s);
    else if (!defaults.parse_error.status)
        tms_fail(&defaults.parse_error, TMS_E_ARG, 0, "%s is longer than %zu bytes", var, size - 1);
}

static void load_defaults(void)
{
    env_bool("TMS_INIT_ENABLE", &defaults.init_enable);
    env_bool("TMS_INIT_ENABLE_CPU_BACKUP", &defaults.init_backup);
    env_bool("TMS_RETAIN_CPU_BACKUP", &defaults.retain_backup);
    env_bool("TMS_INIT_ENABLE_DISK_BACKUP", &defaults.init_disk_backup);
    defaults.reloc_hooks = 1;
    env_bool("TMS_RELOC_HOOKS", &defaults.reloc_hooks);
    defaults.shareable = 1;
    env_bool("TMS_SHAREABLE", &defaults.shareable);
    env_bool("TMS_DISK_BACKUP_TRUST_DIR", &defaults.disk_trust_dir);
    env_bool("TMS_PROGRESS", &defaults.progress);
    defaults.backup_live_only = 1;
    env_bool("TMS_BACKUP_LIVE_ONLY", &defaults.backup_live_only);
    env_bool("TMS_SPILL_TO_DISK", &defaults.spill_to_disk);
    defaults.host_memory_safety = 1;
    env_bool("TMS_HOST_MEMORY_SAFETY", &defaults.host_memory_safety);
    env_host_limit();
    env_path("TMS_HOST_MEMINFO", defaults.host_meminfo, sizeof defaults.host_meminfo);
    env_disk_block();
    env_job();
    /* The names of the CPU backup kinds (backup/backup.h turns one into its kind). */
    const char *kind = getenv("TMS_INIT_CPU_BACKUP_BACKEND");
    if (kind && (!strcmp(kind, "pinned") || !strcmp(kind, "mmap")))
        strcpy(defaults.init_backup_backend, kind);
    else if (kind && *kind && !defaults.parse_error.status)
        tms_fail(&defaults.parse_error, TMS_E_ARG, 0,
                 "TMS_INIT_CPU_BACKUP_BACKEND='%s' is not a backup backend (use 'pinned' or 'mmap')", kind);
    env_threads();
    /* The backend and platform names are read in any letter case (platform/driver.c
     * chooses with the same comparison); the log level exactly. */
    static const struct { const char *var; int any_case; const char *allowed[4]; } choices[] = {
        {"TMS_LOG", 0, {"debug", "off", "0", NULL}},
        {"TMS_PLATFORM", 1, {"cuda", "rocm", "hip", NULL}},
        {"TMS_BACKEND", 1, {"cuda", "hip", "host", NULL}},
    };
    for (size_t i = 0; i < sizeof choices / sizeof *choices; i++) {
        const char *v = getenv(choices[i].var);
        int ok = !v || !*v;
        for (int k = 0; !ok && choices[i].allowed[k]; k++)
            ok = choices[i].any_case ? tms_ascii_case_equal(v, choices[i].allowed[k]) : !strcmp(v, choices[i].allowed[k]);
        if (!ok && !defaults.parse_error.status)
            tms_fail(&defaults.parse_error, TMS_E_ARG, 0, "%s='%s' is not one of: %s, %s, %s", choices[i].var, v,
                     choices[i].allowed[0], choices[i].allowed[1], choices[i].allowed[2]);
    }
    const char *block = getenv("TMS_BACKUP_BLOCK_BYTES");
    size_t block_bytes = 0;
    if (block && *block) {
        if (tms_parse_bytes(block, &block_bytes) == TMS_OK && block_bytes >= (64u << 10) &&
            block_bytes <= ((size_t)256 << 20) && block_bytes % 4096 == 0)
            defaults.backup_block_bytes = block_bytes;
        else if (!defaults.parse_error.status)
            tms_fail(&defaults.parse_error, TMS_E_ARG, 0,
                     "TMS_BACKUP_BLOCK_BYTES='%s' is not a size from 64KiB to 256MiB in whole 4 KiB pages", block);
    }
    /* Bounded so that rounding it up to the granularity cannot wrap to 0 (a
     * division by zero at the first allocation, in every preloaded child). */
    const char *chunk = getenv("TMS_CHUNK_BYTES");
    size_t chunk_bytes = 0;
    if (chunk && *chunk) {
        if (tms_parse_bytes(chunk, &chunk_bytes) == TMS_OK && chunk_bytes <= TMS_CHUNK_BYTES_MAX) {
            defaults.chunk_bytes = chunk_bytes;
            defaults.chunk_bytes_set = 1;
        } else if (!defaults.parse_error.status) {
            tms_fail(&defaults.parse_error, TMS_E_ARG, 0,
                     "TMS_CHUNK_BYTES='%s' is not a size from 0 to 1TiB (e.g. 67108864, 64MiB, 1GiB)", chunk);
        }
    }
}

static int parse_size_env(const char *var, size_t fallback, size_t *out, struct tms_err *err)
{
    const char *s = getenv(var);
    if (!s || !*s) {
        *out = fallback;
        return TMS_OK;
    }
    if (tms_parse_bytes(s, out) != TMS_OK || *out == 0)
        return tms_fail(err, TMS_E_ARG, 0, "%s='%s' is not a positive size (e.g. 8, 64MiB, 16GiB)", var, s);
    return TMS_OK;
}

/* A count, not a size: "8MiB" devices is a typo, not 8 Mi devices. */
static int parse_device_count(int *out, struct tms_err *err)
{
    const char *s = getenv("TMS_HOST_DEVICES");
    *out = 2;
    if (!s || !*s) return TMS_OK;
    unsigned long long n;
    if (tms_parse_uint(s, TMS_HOST_MAX_DEVICES, &n) || n < 1)
        return tms_fail(err, TMS_E_ARG, 0, "TMS_HOST_DEVICES='%s' is not a device count from 1 to %d", s,
                        TMS_HOST_MAX_DEVICES);
    *out = (int)n;
    return TMS_OK;
}

static int parse_numa_node(int *out, struct tms_err *err)
{
    const char *s = getenv("TMS_HOST_NUMA_NODE");
    *out = -1;
    if (!s || !*s) return TMS_OK;
    unsigned long long n;
    if (tms_parse_uint(s, 1023, &n))
        return tms_fail(err, TMS_E_ARG, 0, "TMS_HOST_NUMA_NODE='%s' is not a NUMA node from 0 to 1023", s);
    *out = (int)n;
    return TMS_OK;
}

static int parse_current_device(int devices, int *out, struct tms_err *err)
{
    const char *s = getenv("TMS_HOST_CURRENT_DEVICE");
    *out = 0;
    if (!s || !*s) return TMS_OK;
    unsigned long long n;
    if (tms_parse_uint(s, (unsigned long long)devices - 1, &n))
        return tms_fail(err, TMS_E_ARG, 0, "TMS_HOST_CURRENT_DEVICE='%s' is not a device from 0 to %d", s, devices - 1);
    *out = (int)n;
    return TMS_OK;
}

static int parse_faults(long at[TMS_FAULT_OPS], struct tms_err *err)
{
    static const char *const names[TMS_FAULT_OPS] = {
        "create", "map", "unmap", "copy_to_host", "copy_to_device", "host_alloc",
        "disk_write", "disk_read", "disk_short_write", "disk_no_direct", "disk_sync",
    };
    const char *s = getenv("TMS_FAULT");
    if (!s || !*s) return TMS_OK;
    char buf[256];
    if (strlen(s) >= sizeof buf) return tms_fail(err, TMS_E_ARG, 0, "TMS_FAULT is too long");
    strcpy(buf, s);
    char *save = NULL;
    for (char *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *colon = strchr(item, ':');
        unsigned long long n = 0;
        int op = -1;
        if (colon) {
            *colon = '\0';
            for (int i = 0; i < TMS_FAULT_OPS; i++)
                if (strcmp(item, names[i]) == 0) op = i;
        }
        if (op < 0 || tms_parse_uint(colon + 1, 1000000000, &n) || n == 0)
            return tms_fail(err, TMS_E_ARG, 0,
                            "TMS_FAULT='%s' is malformed (expected op:n with op one of create, map, "
                            "unmap, copy_to_host, copy_to_device, host_alloc, disk_write, disk_read, "
                            "disk_short_write, disk_no_direct, disk_sync)", s);
        at[op] = (long)n;
    }
    return TMS_OK;
}

static void load_host_env(void)
{
    struct tms_err *err = &host_env.error;
    if (parse_size_env("TMS_HOST_DEVICE_BYTES", (size_t)16 << 30, &host_env.device_bytes, err)) return;
    if (parse_device_count(&host_env.devices, err)) return;
    if (parse_numa_node(&host_env.numa_node, err)) return;
    if (parse_current_device(host_env.devices, &host_env.current_device, err)) return;
    if (parse_faults(host_env.fault_at, err)) return;
    const char *gate = getenv("TMS_HOST_COPY_GATE");
    if (gate && strlen(gate) >= sizeof host_env.copy_gate) {
        tms_fail(err, TMS_E_ARG, 0, "TMS_HOST_COPY_GATE is longer than %zu bytes", sizeof host_env.copy_gate - 1);
        return;
    }
    if (gate) strcpy(host_env.copy_gate, gate);
}

static void load_all(void)
{
    load_defaults();
    load_host_env();
}

const struct tms_host_env *tms_host_env(void)
{
    pthread_once(&defaults_once, load_all);
    return &host_env;
}

int tms_env_check(struct tms_err *err)
{
    pthread_once(&defaults_once, load_all);
    const struct tms_err *first = defaults.parse_error.status ? &defaults.parse_error : &host_env.error;
    if (!first->status) return TMS_OK;
    if (err) *err = *first;
    return first->status;
}

static const char *const env_names[] = {
    /* the process defaults and the host backend, above */
    "TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP", "TMS_INIT_ENABLE_DISK_BACKUP", "TMS_INIT_CPU_BACKUP_BACKEND",
    "TMS_RETAIN_CPU_BACKUP", "TMS_RELOC_HOOKS", "TMS_SHAREABLE", "TMS_DISK_BACKUP_TRUST_DIR", "TMS_DISK_BACKUP_CHUNK_MB",
    "TMS_PROGRESS", "TMS_BACKUP_LIVE_ONLY", "TMS_SPILL_TO_DISK", "TMS_HOST_MEMORY_SAFETY",
    "TMS_HOST_BACKUP_LIMIT", "TMS_HOST_BACKUP_LIMIT_NAME", "TMS_BACKUP_THREADS", "TMS_BACKUP_BLOCK_BYTES",
    "TMS_CHUNK_BYTES", "TMS_LOG", "TMS_PLATFORM", "TMS_BACKEND", "TMS_HOST_DEVICE_BYTES", "TMS_HOST_DEVICES",
    "TMS_HOST_NUMA_NODE", "TMS_HOST_CURRENT_DEVICE", "TMS_FAULT", "TMS_HOST_COPY_GATE", "TMS_JOB", "TMS_JOB_HOLD_MS",
    "TMS_JOB_WAIT_MS",
    /* read where they are used: the disk directory, the ledger's and ROCm's test seams */
    "TMS_DISK_BACKUP_DIR", "TMS_HOST_MEMINFO", "TMS_HIP_LIBRARY",
    /* the command line's and the build's */
    "TMS_DEMO_REEXEC", "TMS_WERROR", "TMS_EXTRA_CFLAGS",
};

const char *tms_env_name(size_t i)
{
    return i < sizeof env_names / sizeof *env_names ? env_names[i] : NULL;
}

int tms_env_known(const char *name)
{
    static const char *const families[] = {"TMS_BENCH_", "TMS_TEST_", "TMS_FUZZ_"};
    for (size_t i = 0; tms_env_name(i); i++)
        if (strcmp(name, env_names[i]) == 0) return 1;
    for (size_t i = 0; i < sizeof families / sizeof *families; i++)
        if (strncmp(name, families[i], strlen(families[i])) == 0) return 1;
    return 0;
}

const struct tms_defaults *tms_defaults(void)
{
    pthread_once(&defaults_once, load_all);
    return &defaults;
}
