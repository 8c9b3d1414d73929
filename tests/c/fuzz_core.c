/* Fuzzing the core on the host backend: random alloc/free/pause/resume/region/retain/margin sequences against a model.
 *
 * Each input is a byte string read as a sequence of operations; after every
 * operation the core is checked against a model of what it must hold:
 *  - every byte of a backed-up allocation survives pause/resume (shadow copies),
 *    and a host copy read through tms_core_backup_of holds what was paused;
 *  - states, backup flags and host copies are the ones the model expects, and
 *    status codes are the documented ones (unknown tag: no-op; double pause or
 *    resume: TMS_E_STATE naming the tag; OOM when the device or margin says so);
 *  - tms_core_stats gauges equal sums over tms_core_list (bytes accounted =
 *    bytes allocated), and the pause/resume counters grow by what moved;
 *  - the emulated device's free bytes (mem_get_info) equal its capacity minus
 *    the reserved bytes of its mapped allocations.
 * Every input ends by freeing everything; then the table, the gauges and the
 * devices must be empty, so inputs are independent.
 *
 * Two builds of this file:
 *  - libFuzzer, with clang -fsanitize=fuzzer,address,undefined -DTMS_FUZZ_LIBFUZZER
 *    (CMake: -DTMS_LIBFUZZER=ON builds fuzz_core_libfuzzer): coverage-guided;
 *  - plain (any C compiler; CMake target fuzz_core, run by ctest): a
 *    deterministic driver that replays input files, or runs random inputs
 *    derived from --seed for --seconds / --runs, so CI always runs something:
 *      fuzz_core [--seconds S] [--runs N] [--seed N] [--max-len N] [--only K] [FILE|DIR ...]
 *    A failing random input is written to fuzz-crash-<seed>-<k> (in
 *    $TMS_FUZZ_ARTIFACT_DIR, else the current directory); either build replays it.
 *
 * TMS_FAULT set (host backend fault injection): driver and host failures may
 * happen anywhere, so failed calls are accepted, and the model is brought back
 * in line with the table after checking that nothing was lost.
 */
#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "platform/config.h"
#include "core/core.h"
#include "core/core_internal.h"
#include "platform/driver.h"

/* ---- failure reporting --------------------------------------------------------- */

static const uint8_t *cur_input;
static size_t cur_len;
static const char *cur_op = "init";
static size_t cur_step;
static void (*save_input)(void);  /* plain driver: writes the failing input */

__attribute__((noreturn, format(printf, 1, 2))) static void fail(const char *fmt, ...)
{
    va_list ap;
    fprintf(stderr, "fuzz_core: FAILED at step %zu (%s): ", cur_step, cur_op);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    if (save_input) save_input();
    abort();
}

#define REQUIRE(cond, fmt, ...)                                                              \
    do {                                                                                     \
        if (!(cond)) fail("%s:%d: %s -- " fmt, __FILE__, __LINE__, #cond, ##__VA_ARGS__); \
    } while (0)

/* ---- the process: backend, tags, counters ------------------------------------------ */

#define N_TAGS 4
#define MAX_LIVE 16
#define MAX_STEPS 256
#define MAX_DEVICES 8

static const struct tms_driver *drv;
static size_t gran, capacity;
static int n_devices;
static int lenient;  /* TMS_FAULT is set: any driver or host call may fail */
static const char *const tag_names[N_TAGS] = {"fz0", "fz1", "fz2", "fz3"};
static int tag_ids[N_TAGS];

/* What the inputs reached (printed by the plain driver; the pytest wrapper
 * checks that the interesting paths ran). */
#define EVENTS(X)                                                                              \
    X(inputs) X(steps) X(alloc_ok) X(alloc_multi_chunk) X(alloc_oom) X(alloc_margin_oom) X(alloc_bad_device) \
    X(alloc_zero) X(frees) X(free_paused) X(bad_free) X(pause_ok) X(pause_all) X(pause_state) X(pause_noop)  \
    X(resume_ok) X(resume_partial_oom) X(resume_state) X(resume_noop) X(restored_bytes) X(retained_copies)   \
    X(backup_reads) X(backup_range_errors) X(faults_seen)
static struct {
#define EVENT_FIELD(name) unsigned long long name;
    EVENTS(EVENT_FIELD)
#undef EVENT_FIELD
} ev;

static void init_once(void)
{
    static int done;
    if (done) return;
    done = 1;
    /* Small emulated devices so OOM (allocation, resume, margin) is common; an
     * outer setting wins. Two copy workers keep the pinned staging small. */
    setenv("TMS_HOST_DEVICE_BYTES", "16MiB", 0);
    setenv("TMS_HOST_DEVICES", "2", 0);
    setenv("TMS_BACKUP_THREADS", "2", 0);
    const char *fault = getenv("TMS_FAULT");
    lenient = fault && *fault;
    struct tms_err err = {0};
    size_t total = 0, free_b = 0;
    if (tms_driver_select("host", &err) || tms_driver_get(&drv, &err)) {
        fprintf(stderr, "fuzz_core: cannot load the host backend: %s\n", err.msg);
        exit(2);
    }
    if (drv->granularity(0, &gran) || drv->device_count(&n_devices) || drv->mem_get_info(0, &free_b, &total)) {
        fprintf(stderr, "fuzz_core: host backend queries failed\n");
        exit(2);
    }
    if (n_devices < 1 || n_devices > MAX_DEVICES) {
        fprintf(stderr, "fuzz_core: %d devices (TMS_HOST_DEVICES 1..%d)\n", n_devices, MAX_DEVICES);
        exit(2);
    }
    capacity = total;
    for (int i = 0; i < N_TAGS; i++)
        if (tms_core_tag_id(tag_names[i], &tag_ids[i], &err)) {
            fprintf(stderr, "fuzz_core: tag: %s\n", err.msg);
            exit(2);
        }
}

/* ---- the model ------------------------------------------------------------------ */

struct m_alloc {
    uint8_t *ptr;
    size_t size, reserved;
    int device, tag, backup, kind, state, has_copy;
    int known;              /* shadow holds the device contents (0 after a discarding resume) */
    uint8_t *shadow;        /* what the allocation must hold while active and known */
    uint8_t *copy;          /* what its host copy must hold, while has_copy */
};

static struct m_alloc live[MAX_LIVE];
static int n_live;
static int retain;
static size_t margin;

static size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

static size_t chunks_of(size_t size)
{
    const struct tms_defaults *d = tms_defaults();
    size_t reserved = round_up(size, gran), chunk = d->chunk_bytes_set ? d->chunk_bytes : drv->default_chunk_bytes();
    chunk = chunk ? round_up(chunk, gran) : reserved;
    if (chunk > reserved) chunk = reserved;
    return (reserved + chunk - 1) / chunk;
}

static size_t mapped_on(int device)
{
    size_t sum = 0;
    for (int i = 0; i < n_live; i++)
        if (live[i].device == device && live[i].state == TMS_ACTIVE) sum += live[i].reserved;
    return sum;
}

static size_t device_free(int device)
{
    size_t free_b = 0, total = 0;
    REQUIRE(drv->mem_get_info(device, &free_b, &total) == 0, "mem_get_info(%d)", device);
    REQUIRE(total == capacity, "device %d total %zu, capacity %zu", device, total, capacity);
    return free_b;
}

/* Random bytes from a per-step generator: content depends on the input only. */
static uint64_t rng_state;

static uint64_t rng(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void random_bytes(uint8_t *out, size_t n)
{
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v = rng();
        memcpy(out + i, &v, n - i < 8 ? n - i : 8);
    }
}

/* Writes [off, off+n) of an active allocation, device and shadow alike. */
static void write_window(struct m_alloc *a, size_t off, size_t n)
{
    random_bytes(a->shadow + off, n);
    memcpy(a->ptr + off, a->shadow + off, n);
}

static void fill_all(struct m_alloc *a)
{
    write_window(a, 0, a->size);
    a->known = 1;
}

static void check_bytes(const struct m_alloc *a, const uint8_t *got, const uint8_t *want, size_t off, size_t n,
                        const char *what)
{
    if (memcmp(got + off, want + off, n) == 0) return;
    size_t at = off;
    while (got[at] == want[at]) at++;
    fail("%s of allocation %p (%zu bytes, tag %s, device %d, %s backup %s) differs at byte %zu: 0x%02x, want 0x%02x",
         what, (void *)a->ptr, a->size, tag_names[a->tag], a->device, a->state == TMS_ACTIVE ? "active" : "paused",
         a->backup ? tms_backup_kind_name(a->kind) : "none", at, got[at], want[at]);
}

/* Full check of an active allocation's bytes. */
static void check_contents(const struct m_alloc *a)
{
    if (a->state == TMS_ACTIVE && a->known) check_bytes(a, a->ptr, a->shadow, 0, a->size, "device contents");
}

/* Cheap check: both ends and one window. */
static void sample_contents(const struct m_alloc *a)
{
    if (a->state != TMS_ACTIVE || !a->known) return;
    size_t edge = a->size < 64 ? a->size : 64;
    check_bytes(a, a->ptr, a->shadow, 0, edge, "device contents (head)");
    check_bytes(a, a->ptr, a->shadow, a->size - edge, edge, "device contents (tail)");
    size_t win = a->size < 4096 ? a->size : 4096, off = (size_t)(rng() % (a->size - win + 1));
    check_bytes(a, a->ptr, a->shadow, off, win, "device contents (window)");
}

/* The host copy the core holds for a, read through tms_core_backup_of. */
static void check_copy(const struct m_alloc *a)
{
    struct tms_err err = {0};
    struct tms_backup *b = NULL;
    size_t offset = 99;
    int rc = tms_core_backup_of((uint64_t)(uintptr_t)a->ptr, a->size, 0, &b, &offset, &err);
    REQUIRE(rc == TMS_OK, "backup_of %p: %s", (void *)a->ptr, err.msg);
    if (!a->has_copy) {
        REQUIRE(b == NULL, "host copy for %p, none expected", (void *)a->ptr);
        return;
    }
    REQUIRE(b != NULL && offset == 0 && tms_backup_size(b) == a->size && tms_backup_kind(b) == a->kind, "host copy of %p", (void *)a->ptr);
    check_bytes(a, tms_backup_host(b), a->copy, 0, a->size, "host copy");
    tms_backup_unref(b);
    ev.backup_reads++;
}

/* ---- whole-state invariants --------------------------------------------------------- */

static struct m_alloc *find(uint64_t ptr)
{
    for (int i = 0; i < n_live; i++)
        if ((uint64_t)(uintptr_t)live[i].ptr == ptr) return &live[i];
    return NULL;
}

static int tag_index(int tag_id)
{
    for (int i = 0; i < N_TAGS; i++)
        if (tag_ids[i] == tag_id) return i;
    return -1;
}

static void stats_now(struct tms_stats out[N_TAGS][MAX_DEVICES], int all_zero_elsewhere)
{
    struct tms_err err = {0};
    struct tms_stats_row *rows = NULL;
    size_t n = 0;
    REQUIRE(tms_core_stats(&rows, &n, &err) == TMS_OK, "stats: %s", err.msg);
    memset(out, 0, sizeof(struct tms_stats) * N_TAGS * MAX_DEVICES);
    for (size_t i = 0; i < n; i++) {
        int t = tag_index(rows[i].tag_id);
        if (t >= 0 && rows[i].device < MAX_DEVICES) {
            out[t][rows[i].device] = rows[i].stats;
        } else if (all_zero_elsewhere) {
            const struct tms_stats *s = &rows[i].stats;
            REQUIRE(s->allocations == 0 && s->bytes_requested == 0 && s->bytes_reserved == 0 && s->bytes_mapped == 0 &&
                        s->bytes_paused == 0 && s->bytes_backup_pinned == 0 && s->bytes_backup_mmap == 0,
                    "gauges of tag %d device %d, which holds nothing", rows[i].tag_id, rows[i].device);
        }
    }
    free(rows);
}

static void check_all(int full_contents)
{
    struct tms_err err = {0};
    struct tms_alloc_info *rows = NULL;
    size_t n = 0;
    REQUIRE(tms_core_list(&rows, &n, &err) == TMS_OK, "list: %s", err.msg);
    REQUIRE(n == (size_t)n_live, "table holds %zu allocations, model %d", n, n_live);
    struct tms_stats want[N_TAGS][MAX_DEVICES], got[N_TAGS][MAX_DEVICES];
    memset(want, 0, sizeof want);
    for (size_t i = 0; i < n; i++) {
        const struct tms_alloc_info *r = &rows[i];
        const struct m_alloc *a = find(r->ptr);
        REQUIRE(a != NULL, "table holds 0x%llx, the model does not", (unsigned long long)r->ptr);
        REQUIRE(r->size == a->size && r->reserved == a->reserved && r->device == a->device &&
                    r->tag_id == tag_ids[a->tag] && r->backup == a->backup && (!a->backup || r->backup_kind == a->kind),
                "row of %p", (void *)a->ptr);
        REQUIRE(r->state == a->state, "%p is %s, model %s", (void *)a->ptr, r->state ? "paused" : "active",
                a->state ? "paused" : "active");
        REQUIRE(r->has_host_copy == a->has_copy, "%p has_host_copy %d, model %d", (void *)a->ptr, r->has_host_copy,
                a->has_copy);
        REQUIRE(r->n_chunks == (int)chunks_of(a->size), "%p has %d chunks, expected %zu", (void *)a->ptr, r->n_chunks,
                chunks_of(a->size));
        /* Sums over the table, as the gauges must be. */
        struct tms_stats *w = &want[tag_index(r->tag_id)][r->device];
        w->allocations++;
        w->bytes_requested += r->size;
        w->bytes_reserved += r->reserved;
        if (r->state == TMS_ACTIVE) w->bytes_mapped += r->reserved;
        else w->bytes_paused += r->reserved;
        if (r->has_host_copy && r->backup_kind == TMS_BACKUP_PINNED) w->bytes_backup_pinned += r->size;
        if (r->has_host_copy && r->backup_kind != TMS_BACKUP_PINNED) w->bytes_backup_mmap += r->size;
    }
    free(rows);
    stats_now(got, 1);
    for (int t = 0; t < N_TAGS; t++)
        for (int d = 0; d < n_devices; d++) {
            const struct tms_stats *g = &got[t][d], *w = &want[t][d];
            REQUIRE(g->allocations == w->allocations && g->bytes_requested == w->bytes_requested &&
                        g->bytes_reserved == w->bytes_reserved && g->bytes_mapped == w->bytes_mapped &&
                        g->bytes_paused == w->bytes_paused && g->bytes_backup_pinned == w->bytes_backup_pinned &&
                        g->bytes_backup_mmap == w->bytes_backup_mmap,
                    "gauges of tag %s device %d: allocations %llu/%llu requested %llu/%llu reserved %llu/%llu mapped "
                    "%llu/%llu paused %llu/%llu pinned %llu/%llu mmap %llu/%llu (stats/table)",
                    tag_names[t], d, (unsigned long long)g->allocations, (unsigned long long)w->allocations,
                    (unsigned long long)g->bytes_requested, (unsigned long long)w->bytes_requested,
                    (unsigned long long)g->bytes_reserved, (unsigned long long)w->bytes_reserved,
                    (unsigned long long)g->bytes_mapped, (unsigned long long)w->bytes_mapped,
                    (unsigned long long)g->bytes_paused, (unsigned long long)w->bytes_paused,
                    (unsigned long long)g->bytes_backup_pinned, (unsigned long long)w->bytes_backup_pinned,
                    (unsigned long long)g->bytes_backup_mmap, (unsigned long long)w->bytes_backup_mmap);
        }
    for (int d = 0; d < n_devices; d++) {
        size_t f = device_free(d);
        REQUIRE(f == capacity - mapped_on(d), "device %d: %zu bytes free, capacity %zu - mapped %zu = %zu", d, f,
                capacity, mapped_on(d), capacity - mapped_on(d));
    }
    for (int i = 0; i < n_live; i++) {
        REQUIRE(tms_core_owns(live[i].ptr), "the core does not own %p", (void *)live[i].ptr);
        if (full_contents) check_contents(&live[i]);
        else sample_contents(&live[i]);
    }
}

/* ---- operations ------------------------------------------------------------------ */

struct reader {
    const uint8_t *p;
    size_t n, i;
};

static unsigned byte(struct reader *r) { return r->i < r->n ? r->p[r->i++] : 0; }
static unsigned word(struct reader *r) { return byte(r) | byte(r) << 8; }

static void expect_rc(int rc, int want, const struct tms_err *err, const char *call)
{
    REQUIRE(rc == want, "%s returned %s (%d), expected %s (%d): %s", call, tms_status_name(rc), rc,
            tms_status_name(want), want, rc ? err->msg : "");
}

/* A call that failed although the model expected success: allowed only under
 * TMS_FAULT, and only with a driver or memory status. */
static int tolerated(int rc, int want, const struct tms_err *err, const char *call)
{
    if (rc == want) return 0;
    if (lenient && want == TMS_OK && (rc == TMS_E_DRIVER || rc == TMS_E_OOM || rc == TMS_E_HOST_OOM)) {
        ev.faults_seen++;
        return 1;
    }
    expect_rc(rc, want, err, call);
    return 0;
}

/* Sizes around the granularity and chunk edges, and ones that cannot fit.
 * free_b: what the target device has left (filling it makes resumes OOM). */
static size_t pick_size(struct reader *r, size_t free_b)
{
    unsigned c = byte(r), w = word(r);
    switch (c % 12) {
    case 0: return 0;
    case 1: return 1;
    case 2: return gran - 1;
    case 3: return gran;
    case 4: return gran + 1;
    case 5: return 2 * gran + w % 4096;
    case 6: return 3 * gran - 1;
    case 7: return 1 + w;                      /* below a granule */
    case 8: return 1 + (size_t)w * 97;         /* up to ~6 MiB, any alignment */
    case 9: return 4 * gran + 1 + w % 4096;    /* several chunks under TMS_CHUNK_BYTES */
    case 10: return free_b > w % gran ? free_b - w % gran : gran;  /* fills the device */
    default:
        switch (w & 3) {
        case 0: case 1: return capacity + 1 + w;        /* never fits */
        case 2: return SIZE_MAX - w % gran;              /* overflows the rounding: the core refuses */
        default: return SIZE_MAX / 2 + w;                /* the backend cannot reserve it */
        }
    }
}

static void op_alloc(struct reader *r)
{
    cur_op = "alloc";
    unsigned d = byte(r) % 16;
    int device = d < 13 ? (int)(d % 2) : d < 15 ? -1 : n_devices;  /* -1: the current one (0); one past the end */
    int eff = device < 0 ? 0 : device, want = TMS_OK;
    size_t size = pick_size(r, eff < n_devices ? capacity - mapped_on(eff) : gran);
    if (n_live == MAX_LIVE && size) return;
    const struct tms_region *reg = tms_region_current();
    size_t reserved = 0;
    if (size == 0) want = TMS_OK;
    else if (eff >= n_devices) want = TMS_E_ARG;
    else if (size > SIZE_MAX - gran) want = TMS_E_OOM;
    else {
        reserved = round_up(size, gran);
        size_t f = capacity - mapped_on(eff);
        if (margin && (f < reserved || f - reserved < margin)) want = TMS_E_OOM, ev.alloc_margin_oom++;
        else if (reserved > f) want = TMS_E_OOM;
    }
    struct tms_err err = {0};
    void *p = (void *)1;
    int rc = tms_core_alloc(size, device, reg, &p, &err);
    /* An address range the backend cannot reserve is its error code's call:
     * ENOMEM from Linux, EINVAL under valgrind. */
    if (want == TMS_E_OOM && rc == TMS_E_DRIVER && size >= SIZE_MAX / 2 && strstr(err.msg, "address reserve"))
        rc = TMS_E_OOM;
    if (tolerated(rc, want, &err, "tms_core_alloc")) return;
    if (rc == TMS_E_OOM) {
        ev.alloc_oom++;
        int named = strstr(err.msg, tag_names[tag_index(reg->tag_id)]) != NULL;
        /* The core's own size guard names neither tag nor device (src/core/alloc.c). */
        if (size > SIZE_MAX - gran) named |= strstr(err.msg, "larger than any device") != NULL;
        REQUIRE(named, "OOM message names the tag: %s", err.msg);
        return;
    }
    if (rc == TMS_E_ARG) {
        ev.alloc_bad_device++;
        REQUIRE(strstr(err.msg, "does not exist"), "%s", err.msg);
        return;
    }
    if (size == 0) {
        REQUIRE(p == NULL, "alloc(0) gave %p", p);
        ev.alloc_zero++;
        return;
    }
    REQUIRE(p && (uintptr_t)p % gran == 0, "alloc gave %p", p);
    REQUIRE(find((uint64_t)(uintptr_t)p) == NULL, "alloc gave %p, which is live", p);
    struct m_alloc *a = &live[n_live++];
    *a = (struct m_alloc){.ptr = p, .size = size, .reserved = reserved, .device = eff,
                          .tag = tag_index(reg->tag_id), .backup = reg->backup, .kind = reg->backup_kind,
                          .state = TMS_ACTIVE};
    a->shadow = malloc(size);
    a->copy = malloc(size);
    REQUIRE(a->shadow && a->copy, "host malloc of %zu for the model", size);
    fill_all(a);
    ev.alloc_ok++;
    if (chunks_of(size) > 1) ev.alloc_multi_chunk++;
}

static void drop(int i)
{
    free(live[i].shadow);
    free(live[i].copy);
    live[i] = live[--n_live];
}

static void op_free(struct reader *r)
{
    cur_op = "free";
    unsigned c = byte(r);
    if (!n_live) return;
    int i = (int)(c % (unsigned)n_live);
    struct m_alloc *a = &live[i];
    uint8_t *p = a->ptr;
    int paused = a->state == TMS_PAUSED;
    check_contents(a);
    struct tms_err err = {0};
    int rc = tms_core_free(p, &err);
    if (tolerated(rc, TMS_OK, &err, "tms_core_free")) {
        /* Still in the table, whole: a failed unmap maps back what it had unmapped. */
        return;
    }
    drop(i);
    ev.frees++;
    ev.free_paused += paused;
    REQUIRE(!tms_core_owns(p), "%p still owned after free", (void *)p);
    if (c & 0x80) {  /* a double free, before anything can reuse the address */
        memset(&err, 0, sizeof err);
        expect_rc(tms_core_free(p, &err), TMS_E_NOT_FOUND, &err, "double tms_core_free");
        REQUIRE(strstr(err.msg, "not an allocation"), "%s", err.msg);
        ev.bad_free++;
    }
}

/* Which allocations a tag operation selects: t < 0 = every tag. */
static int selected(const struct m_alloc *a, int t) { return t < 0 || a->tag == t; }

struct before {
    int state[MAX_LIVE];
    struct tms_stats stats[N_TAGS][MAX_DEVICES];
};

static void snapshot(struct before *b)
{
    for (int i = 0; i < n_live; i++) b->state[i] = live[i].state;
    stats_now(b->stats, 0);
}

/* The pause/resume counters grew by exactly what changed state in this call. */
static void check_counters(const struct before *b, int is_pause)
{
    struct tms_stats now[N_TAGS][MAX_DEVICES];
    stats_now(now, 0);
    for (int t = 0; t < N_TAGS; t++)
        for (int d = 0; d < n_devices; d++) {
            uint64_t calls = 0, bytes = 0;
            for (int i = 0; i < n_live; i++) {
                const struct m_alloc *a = &live[i];
                if (a->tag != t || a->device != d || a->state == b->state[i]) continue;
                calls = 1;
                if (a->backup) bytes += a->size;
            }
            const struct tms_stats *o = &b->stats[t][d], *n = &now[t][d];
            uint64_t dcalls = is_pause ? n->pauses - o->pauses : n->resumes - o->resumes;
            uint64_t dbytes = is_pause ? n->bytes_to_host - o->bytes_to_host : n->bytes_to_device - o->bytes_to_device;
            REQUIRE(dcalls == calls && dbytes == bytes,
                    "tag %s device %d: %s counter +%llu (want +%llu), bytes +%llu (want +%llu)", tag_names[t], d,
                    is_pause ? "pauses" : "resumes", (unsigned long long)dcalls, (unsigned long long)calls,
                    (unsigned long long)dbytes, (unsigned long long)bytes);
            REQUIRE((is_pause ? n->resumes == o->resumes : n->pauses == o->pauses), "the other counter moved");
        }
}

/* After a call that may have done part of its work (OOM in resume, or any
 * injected fault): reads each selected allocation's state back, checks that
 * nothing was lost, and brings the model in line. */
static void resync_after_partial(int t, int is_pause)
{
    struct tms_err err = {0};
    struct tms_alloc_info *rows = NULL;
    size_t n = 0;
    REQUIRE(tms_core_list(&rows, &n, &err) == TMS_OK, "list: %s", err.msg);
    for (size_t k = 0; k < n; k++) {
        struct m_alloc *a = find(rows[k].ptr);
        REQUIRE(a != NULL, "table holds 0x%llx, the model does not", (unsigned long long)rows[k].ptr);
        if (!selected(a, t)) continue;
        int was = a->state, now = rows[k].state, has = rows[k].has_host_copy;
        REQUIRE(a->backup || !has, "%p: a host copy without backup", (void *)a->ptr);
        REQUIRE(is_pause ? !(was == TMS_PAUSED && now == TMS_ACTIVE) : !(was == TMS_ACTIVE && now == TMS_PAUSED),
                "%p moved the wrong way", (void *)a->ptr);
        a->state = now;
        if (now == TMS_PAUSED) {
            /* Paused: a backed-up allocation keeps its copy, byte for byte. */
            REQUIRE(!a->backup || has, "%p paused without its backup", (void *)a->ptr);
            if (was == TMS_ACTIVE && a->backup) memcpy(a->copy, a->shadow, a->size);
            a->has_copy = has;
        } else if (was == TMS_PAUSED) {
            /* Resumed: a backed-up allocation got every byte back (and keeps
             * its copy if retained); a discarding one holds nothing defined. */
            if (a->backup) {
                REQUIRE(has == retain, "%p resumed: has_host_copy %d, retain %d", (void *)a->ptr, has, retain);
            } else {
                a->known = 0;
            }
            a->has_copy = has;
        } else if (is_pause) {
            /* Left active by a failed pause: the device holds the truth; a
             * copy it kept is one this call made, kept only when retained (a
             * stale one must not be served later). */
            REQUIRE(!has || retain, "%p left active with a host copy, retain off", (void *)a->ptr);
            if (has) memcpy(a->copy, a->shadow, a->size);
            a->has_copy = has;
        }
        /* else: untouched by a failed resume (it was active): as before */
        check_contents(a);
        check_copy(a);
        if (a->state == TMS_ACTIVE && !a->known) fill_all(a);
    }
    free(rows);
}

static int pick_tag(struct reader *r, const char **name)
{
    unsigned c = byte(r) % 16;
    if (c < 3 * N_TAGS) return *name = tag_names[c % N_TAGS], (int)(c % N_TAGS);
    if (c < 14) return *name = NULL, -1;       /* every tag */
    *name = c == 14 ? "fz-never-used" : "default";
    return -2;                                  /* a tag that holds nothing */
}

static void op_pause(struct reader *r)
{
    cur_op = "pause";
    const char *name;
    int t = pick_tag(r, &name);
    size_t active = 0, paused = 0;
    for (int i = 0; t != -2 && i < n_live; i++)
        if (selected(&live[i], t)) live[i].state == TMS_ACTIVE ? active++ : paused++;
    for (int i = 0; i < n_live; i++) check_contents(&live[i]);  /* the bytes a backup must capture */
    int want = active ? TMS_OK : paused ? TMS_E_STATE : TMS_OK;
    struct before b;
    snapshot(&b);
    struct tms_err err = {0};
    int rc = tms_core_pause(name, &err);
    if (tolerated(rc, want, &err, "tms_core_pause")) {
        resync_after_partial(t, 1);
        check_counters(&b, 1);
        return;
    }
    if (rc == TMS_E_STATE) {
        ev.pause_state++;
        REQUIRE(strstr(err.msg, name ? name : "all tags") && strstr(err.msg, "already paused"), "%s", err.msg);
        check_counters(&b, 1);
        return;
    }
    if (!active) {
        ev.pause_noop++;
        check_counters(&b, 1);
        return;
    }
    for (int i = 0; i < n_live; i++) {
        struct m_alloc *a = &live[i];
        if (!selected(a, t) || a->state != TMS_ACTIVE) continue;
        a->state = TMS_PAUSED;
        if (a->backup) {
            a->has_copy = 1;
            memcpy(a->copy, a->shadow, a->size);
        } else {
            a->has_copy = 0;
        }
    }
    check_counters(&b, 1);
    for (int i = 0; i < n_live; i++)
        if (selected(&live[i], t) && live[i].backup) check_copy(&live[i]);
    ev.pause_ok++;
    ev.pause_all += t == -1;
}

static void op_resume(struct reader *r)
{
    cur_op = "resume";
    const char *name;
    int t = pick_tag(r, &name);
    size_t active = 0, paused = 0, need[MAX_DEVICES] = {0};
    for (int i = 0; t != -2 && i < n_live; i++) {
        if (!selected(&live[i], t)) continue;
        if (live[i].state == TMS_ACTIVE) active++;
        else paused++, need[live[i].device] += live[i].reserved;
    }
    int fits = 1;
    for (int d = 0; d < n_devices; d++) fits &= need[d] <= capacity - mapped_on(d);
    /* Resume stops at the first allocation that does not fit: OOM. */
    int want = paused ? (fits ? TMS_OK : TMS_E_OOM) : active ? TMS_E_STATE : TMS_OK;
    struct before b;
    snapshot(&b);
    struct tms_err err = {0};
    int rc = tms_core_resume(name, &err);
    if (rc == TMS_E_OOM && want == TMS_E_OOM) {
        ev.resume_partial_oom++;
        REQUIRE(strstr(err.msg, "create of"), "%s", err.msg);
        resync_after_partial(t, 0);
        check_counters(&b, 0);
        return;
    }
    if (tolerated(rc, want, &err, "tms_core_resume")) {
        resync_after_partial(t, 0);
        check_counters(&b, 0);
        return;
    }
    if (rc == TMS_E_STATE) {
        ev.resume_state++;
        REQUIRE(strstr(err.msg, name ? name : "all tags") && strstr(err.msg, "not paused"), "%s", err.msg);
        check_counters(&b, 0);
        return;
    }
    if (!paused) {
        ev.resume_noop++;
        check_counters(&b, 0);
        return;
    }
    for (int i = 0; i < n_live; i++) {
        struct m_alloc *a = &live[i];
        if (!selected(a, t) || a->state != TMS_PAUSED) continue;
        a->state = TMS_ACTIVE;
        if (a->backup) {
            check_contents(a);  /* every byte came back */
            ev.restored_bytes += a->size;
            a->has_copy = retain;
            if (retain) check_copy(a), ev.retained_copies++;
        } else {
            a->known = 0;
            fill_all(a);        /* contents undefined: give it known ones */
        }
    }
    check_counters(&b, 0);
    ev.resume_ok++;
}

static void op_region(struct reader *r)
{
    cur_op = "region";
    unsigned c = byte(r);
    struct tms_region *reg = tms_region_current();
    reg->active = 1;
    reg->tag_id = tag_ids[c % N_TAGS];
    reg->backup = (c >> 2) % 3 != 0;
    reg->backup_kind = (c >> 4) & 1 ? TMS_BACKUP_PINNED : TMS_BACKUP_MMAP;
}

static void op_settings(struct reader *r)
{
    unsigned c = byte(r);
    if (c & 1) {
        cur_op = "retain";
        retain = (c >> 1) & 1;
        tms_core_set_retain(retain);
        REQUIRE(tms_core_retain() == retain, "retain");
        return;
    }
    cur_op = "margin";
    switch ((c >> 1) % 8) {  /* mostly lifted again: a margin makes most allocations fail */
    case 5: margin = capacity / 4; break;
    case 6: margin = capacity / 2 + gran / 2; break;
    case 7: margin = SIZE_MAX; break;
    default: margin = 0; break;
    }
    tms_core_set_margin(margin);
    REQUIRE(tms_core_margin() == margin, "margin");
}

static void op_write(struct reader *r)
{
    cur_op = "write";
    unsigned c = byte(r), w = word(r);
    if (!n_live) return;
    struct m_alloc *a = &live[c % (unsigned)n_live];
    if (a->state != TMS_ACTIVE) return;
    size_t off = (size_t)w * 131 % a->size, n = 1 + (size_t)(c * 977 + w) % (a->size - off);
    write_window(a, off, n);
}

/* tms_core_backup_of over a random range of a live allocation, or past it. */
static void op_read_backup(struct reader *r)
{
    cur_op = "backup_of";
    unsigned c = byte(r), w = word(r);
    if (!n_live) return;
    struct m_alloc *a = &live[c % (unsigned)n_live];
    size_t off = (size_t)w % a->size;
    size_t n = (c & 0x40) ? a->size - off + 1 + (c & 0x80 ? gran : 0)  /* past the end (into the rounding) */
                          : (a->size - off) / (1 + c % 4);
    struct tms_err err = {0};
    struct tms_backup *b = (struct tms_backup *)1;
    size_t offset = 0;
    int rc = tms_core_backup_of((uint64_t)(uintptr_t)(a->ptr + off), n, 0, &b, &offset, &err);
    if (off + n > a->size) {
        expect_rc(rc, TMS_E_ARG, &err, "tms_core_backup_of past the end");
        REQUIRE(strstr(err.msg, "runs past allocation"), "%s", err.msg);
        ev.backup_range_errors++;
        return;
    }
    expect_rc(rc, TMS_OK, &err, "tms_core_backup_of");
    if (!a->has_copy) {
        REQUIRE(b == NULL, "a host copy of %p, none expected", (void *)a->ptr);
        return;
    }
    REQUIRE(b && offset == off, "host copy of %p: offset %zu, want %zu", (void *)a->ptr, offset, off);
    check_bytes(a, tms_backup_host(b), a->copy, off, n, "host copy range");
    tms_backup_unref(b);
    ev.backup_reads++;
}

/* Pointers the core does not own: errors, and nothing changes. */
static void op_bad_pointer(struct reader *r)
{
    cur_op = "bad pointer";
    unsigned c = byte(r);
    struct tms_err err = {0};
    uint8_t *p = (uint8_t *)(uintptr_t)4096;  /* below mmap_min_addr: never an allocation */
    if (n_live && (c & 1)) p = live[(c >> 1) % (unsigned)n_live].ptr + 1 + (c >> 4);  /* inside, not the start */
    REQUIRE(!tms_core_owns(p), "owns %p", (void *)p);
    expect_rc(tms_core_free(p, &err), TMS_E_NOT_FOUND, &err, "tms_core_free of a foreign pointer");
    ev.bad_free++;
    if (p == (uint8_t *)(uintptr_t)4096) {
        struct tms_backup *b = (struct tms_backup *)1;
        size_t offset = 0;
        memset(&err, 0, sizeof err);
        /* Foreign memory has no backup (get_cpu_backup returns None, as upstream). */
        expect_rc(tms_core_backup_of(4096, 1, 0, &b, &offset, &err), TMS_OK, &err, "backup_of(4096)");
        REQUIRE(b == NULL, "backup_of(4096) gave a backup");
    }
}

static void run_input(const uint8_t *data, size_t len)
{
    init_once();
    cur_input = data;
    cur_len = len;
    struct reader r = {data, len, 0};
    rng_state = 0x5EED;
    for (size_t i = 0; i < len && i < 16; i++) rng_state = rng_state * 131 + data[i];
    retain = 0;
    margin = 0;
    tms_core_set_retain(0);
    tms_core_set_margin(0);
    struct tms_region *reg = tms_region_current();
    *reg = (struct tms_region){.active = 1, .tag_id = tag_ids[0], .backup = 1, .backup_kind = TMS_BACKUP_MMAP};
    ev.inputs++;
    for (cur_step = 0; r.i < r.n && cur_step < MAX_STEPS; cur_step++) {
        switch (byte(&r) % 16) {
        case 0: case 1: case 2: op_alloc(&r); break;
        case 3: case 4: op_free(&r); break;
        case 5: case 6: case 7: op_pause(&r); break;
        case 8: case 9: case 10: op_resume(&r); break;
        case 11: op_region(&r); break;
        case 12: op_settings(&r); break;
        case 13: op_write(&r); break;
        case 14: op_read_backup(&r); break;
        default: op_bad_pointer(&r); break;
        }
        ev.steps++;
        check_all(0);
    }
    /* Teardown: everything is freed, paused or not; nothing may be left. */
    cur_op = "teardown";
    check_all(1);
    for (int attempt = 0; n_live && attempt < 2 * MAX_LIVE + 8; attempt++) {
        struct tms_err err = {0};
        int rc = tms_core_free(live[n_live - 1].ptr, &err);
        if (tolerated(rc, TMS_OK, &err, "tms_core_free at teardown")) continue;  /* an injected fault fires once */
        drop(n_live - 1);
        ev.frees++;
    }
    REQUIRE(n_live == 0, "%d allocations could not be freed", n_live);
    check_all(1);
    for (int d = 0; d < n_devices; d++) REQUIRE(device_free(d) == capacity, "device %d not empty", d);
    tms_core_set_margin(0);
    tms_core_set_retain(0);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    run_input(data, size);
    return 0;
}

#ifndef TMS_FUZZ_LIBFUZZER

/* ---- the plain driver ---------------------------------------------------------- */

static unsigned long long seed = 1, cur_index;

static void write_crash(void)
{
    const char *dir = getenv("TMS_FUZZ_ARTIFACT_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/fuzz-crash-%llu-%llu", dir && *dir ? dir : ".", seed, cur_index);
    FILE *f = fopen(path, "wb");
    if (f && fwrite(cur_input, 1, cur_len, f) == cur_len && fclose(f) == 0)
        fprintf(stderr, "fuzz_core: input written to %s (replay: fuzz_core %s; or --seed %llu --only %llu)\n", path,
                path, seed, cur_index);
    else
        fprintf(stderr, "fuzz_core: cannot write %s: %s (reproduce: --seed %llu --only %llu)\n", path,
                strerror(errno), seed, cur_index);
}

static int replay_file(const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) return fprintf(stderr, "fuzz_core: cannot open %s: %s\n", path, strerror(errno)), 1;
    static uint8_t buf[1 << 16];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    run_input(buf, n);
    return 0;
}

static int replay_path(const char *path)
{
    struct stat st;
    if (stat(path, &st) != 0) return fprintf(stderr, "fuzz_core: %s: %s\n", path, strerror(errno)), 1;
    if (!S_ISDIR(st.st_mode)) return replay_file(path);
    DIR *dir = opendir(path);
    if (!dir) return fprintf(stderr, "fuzz_core: %s: %s\n", path, strerror(errno)), 1;
    int rc = 0;
    for (struct dirent *e; (e = readdir(dir));) {
        if (e->d_name[0] == '.') continue;
        char sub[4096];
        snprintf(sub, sizeof sub, "%s/%s", path, e->d_name);
        rc |= replay_file(sub);
    }
    closedir(dir);
    return rc;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Input k of a seed: its own generator, so one input is reproducible alone. */
static size_t make_input(unsigned long long k, size_t max_len, uint8_t *out)
{
    rng_state = seed * 0xD1B54A32D192ED03ull ^ (k + 1) * 0x9E3779B97F4A7C15ull;
    size_t len = 1 + (size_t)(rng() % max_len);
    random_bytes(out, len);
    return len;
}

static void usage(void)
{
    fprintf(stderr, "usage: fuzz_core [--seconds S] [--runs N] [--seed N] [--max-len N] [--only K] [FILE|DIR ...]\n");
    exit(2);
}

int main(int argc, char **argv)
{
    double seconds = 0;
    unsigned long long runs = 0, only = 0;
    int have_only = 0, replay = 0, rc = 0;
    size_t max_len = 512;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (i + 1 < argc && !strcmp(a, "--seconds")) seconds = atof(argv[++i]);
        else if (i + 1 < argc && !strcmp(a, "--runs")) runs = strtoull(argv[++i], NULL, 10);
        else if (i + 1 < argc && !strcmp(a, "--seed")) seed = strtoull(argv[++i], NULL, 10);
        else if (i + 1 < argc && !strcmp(a, "--max-len")) max_len = strtoull(argv[++i], NULL, 10);
        else if (i + 1 < argc && !strcmp(a, "--only")) only = strtoull(argv[++i], NULL, 10), have_only = 1;
        else if (a[0] == '-') usage();
        else replay = 1;
    }
    if (max_len < 1 || max_len > (1 << 16)) usage();
    setvbuf(stdout, NULL, _IOLBF, 0);
    init_once();
    double start = now_s();
    if (replay) {
        for (int i = 1; i < argc; i++) {
            if (argv[i][0] == '-') {
                i++;
                continue;
            }
            rc |= replay_path(argv[i]);
        }
    } else {
        if (!seconds && !runs && !have_only) seconds = 10;
        save_input = write_crash;
        static uint8_t buf[1 << 16];
        for (unsigned long long k = have_only ? only : 0;; k++) {
            if (have_only && k > only) break;
            if (runs && k >= runs) break;
            if (seconds && now_s() - start >= seconds) break;
            cur_index = k;
            size_t len = make_input(k, max_len, buf);
            run_input(buf, len);
        }
    }
    printf("fuzz_core: seed %llu, %.1f s, TMS_CHUNK_BYTES=%zu%s\n", seed, now_s() - start, tms_defaults()->chunk_bytes,
           lenient ? ", TMS_FAULT set" : "");
#define EVENT_PRINT(name) printf("fuzz_core: %s %llu\n", #name, ev.name);
    EVENTS(EVENT_PRINT)
#undef EVENT_PRINT
    printf("%llu passed, 0 failed\n", ev.inputs);
    return rc;
}

#endif
