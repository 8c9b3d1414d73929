/* The settings table read: each row's variable parsed once by its type (malformed ones reported, defaults kept), the rows described, run-time values checked. */
#include "platform/config.h"

#include "platform/parse.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- the rows ------------------------------------------------------------------------ */

#define DEFAULT_boolean(d) .number = (d),
#define DEFAULT_count(d) .number = (d),
#define DEFAULT_size(d) .number = (long long)(d),
#define DEFAULT_mib(d) .number = (long long)(d),
#define DEFAULT_device(d) .number = (d),
#define DEFAULT_limit(d) .number = (d),
#define DEFAULT_faults(d)
#define DEFAULT_choice(d) .text = (d),
#define DEFAULT_choice_anycase(d) .text = (d),
#define DEFAULT_name(d) .text = (d),
#define DEFAULT_path(d) .text = (d),

#define RANGE_boolean()
#define RANGE_count(l, h) .lo = (unsigned long long)(l), .hi = (h),
#define RANGE_size(l, h, m) .lo = (l), .hi = (h), .multiple = (m),
#define RANGE_mib(l, h) .lo = (l), .hi = (h),
#define RANGE_device()
#define RANGE_limit(l, h) .lo = (l), .hi = (h),
#define RANGE_faults()
#define RANGE_choice(...) .choices = (const char *const[]){__VA_ARGS__, NULL},
#define RANGE_choice_anycase(...) .choices = (const char *const[]){__VA_ARGS__, NULL},
#define RANGE_name(longest) .hi = (longest),
#define RANGE_path(longest) .hi = (longest),

#define FIELD_AT(name) offsetof(struct tms_defaults, name)
#define OFFSETS(name) .offset = FIELD_AT(name), .offset_set = FIELD_AT(name##_set),
#define OFFSETS_boolean OFFSETS
#define OFFSETS_count OFFSETS
#define OFFSETS_size OFFSETS
#define OFFSETS_mib OFFSETS
#define OFFSETS_device OFFSETS
#define OFFSETS_faults OFFSETS
#define OFFSETS_choice OFFSETS
#define OFFSETS_choice_anycase OFFSETS
#define OFFSETS_name OFFSETS
#define OFFSETS_path OFFSETS
#define OFFSETS_limit(name)                                                                                    \
    .offset = FIELD_AT(name##_bytes), .offset_percent = FIELD_AT(name##_percent), .offset_set = FIELD_AT(name##_set),

#define ROW(name_, type_, env_, dflt, range, accepts_, when, doc_)                                             \
    [TMS_SETTING_##name_] = {.name = #name_, .env = (env_), .type = TMS_SETTING_TYPE_##type_,                  \
                             .group = TMS_SETTING_GROUP(when), .accepts = (accepts_), .doc = (doc_),           \
                             DEFAULT_##type_(dflt) OFFSETS_##type_(name_) RANGE_##type_ range},

const struct tms_setting_row tms_setting_rows[TMS_SETTING_COUNT] = {TMS_SETTINGS(ROW)};

const struct tms_setting_row *tms_setting_find(const char *name)
{
    for (size_t i = 0; name && i < TMS_SETTING_COUNT; i++)
        if (strcmp(tms_setting_rows[i].name, name) == 0) return &tms_setting_rows[i];
    return NULL;
}

/* ---- parsing a value, by type ---------------------------------------------------------- */

static pthread_once_t defaults_once = PTHREAD_ONCE_INIT;
static struct tms_defaults defaults;                 /* written once under defaults_once */
static const char *rejected[TMS_SETTING_COUNT];      /* each row's malformed value, written once under defaults_once */

static void *field(struct tms_defaults *d, size_t offset) { return (char *)d + offset; }

const char *tms_setting_accepts(const struct tms_setting_row *r)
{
    if (r->accepts) return r->accepts;
    switch (r->type) {
    case TMS_SETTING_TYPE_boolean: return "a boolean (use 1, true, TRUE, yes, YES or 0, false, FALSE, no, NO)";
    case TMS_SETTING_TYPE_faults: return "op:n[,op:n...], the n-th call of op failing once";
    case TMS_SETTING_TYPE_device: return "a device of the host backend, from 0 to one less than TMS_HOST_DEVICES";
    default: return "a path";
    }
}

static int malformed(const struct tms_setting_row *r, const char *s, struct tms_err *err)
{
    return tms_fail(err, TMS_E_ARG, 0, "%s='%s' is not %s", r->env, s, tms_setting_accepts(r));
}

static int parse_boolean(const struct tms_setting_row *r, const char *s, struct tms_defaults *d, struct tms_err *err)
{
    int v;
    if (tms_parse_bool(s, &v) != TMS_OK) return malformed(r, s, err);
    *(int *)field(d, r->offset) = v;
    return TMS_OK;
}

static int parse_count(const struct tms_setting_row *r, const char *s, struct tms_defaults *d, struct tms_err *err)
{
    unsigned long long n;
    if (tms_parse_uint(s, r->hi, &n) != TMS_OK || n < r->lo) return malformed(r, s, err);
    *(int *)field(d, r->offset) = (int)n;
    return TMS_OK;
}

static int parse_size(const struct tms_setting_row *r, const char *s, struct tms_defaults *d, struct tms_err *err)
{
    size_t n;
    if (tms_parse_bytes(s, &n) != TMS_OK || n < r->lo || n > r->hi || (r->multiple > 1 && n % r->multiple))
        return malformed(r, s, err);
    *(size_t *)field(d, r->offset) = n;
    return TMS_OK;
}

/* Upstream's spelling of a size: whole MiB. */
static int parse_mib(const struct tms_setting_row *r, const char *s, struct tms_defaults *d, struct tms_err *err)
{
    unsigned long long n;
    if (tms_parse_uint(s, r->hi, &n) != TMS_OK || n < r->lo) return malformed(r, s, err);
    *(size_t *)field(d, r->offset) = (size_t)n << 20;
    return TMS_OK;
}

/* The word is kept as the table spells it: one comparison for every reader. */
static int parse_choice(const struct tms_setting_row *r, const char *s, struct tms_defaults *d, struct tms_err *err)
{
    for (const char *const *c = r->choices; *c; c++) {
        if (r->type == TMS_SETTING_TYPE_choice_anycase ? tms_ascii_case_equal(s, *c) : strcmp(s, *c) == 0) {
            *(const char **)field(d, r->offset) = *c;
            return TMS_OK;
        }
    }
    return malformed(r, s, err);
}

/* A copy: the environment's own string may be replaced (and freed) later. */
static int keep_text(const struct tms_setting_row *r, const char *s, struct tms_defaults *d, struct tms_err *err)
{
    char *copy = strdup(s);
    if (!copy) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory for the value of %s", r->env);
    *(const char **)field(d, r->offset) = copy;
    return TMS_OK;
}

/* A name that is a file name too (the ledger's): no path, no hidden file. */
static int name_ok(const struct tms_setting_row *r, const char *s)
{
    size_t n = strlen(s);
    int ok = n >= 1 && n <= r->hi && s[0] != '.';
    for (size_t i = 0; ok && i < n; i++)
        ok = (s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') || (s[i] >= '0' && s[i] <= '9') ||
             s[i] == '_' || s[i] == '-' || s[i] == '.';
    return ok;
}

static int parse_name(const struct tms_setting_row *r, const char *s, struct tms_defaults *d, struct tms_err *err)
{
    return name_ok(r, s) ? keep_text(r, s, d, err) : malformed(r, s, err);
}

/* Checked for length only: its reader opens it as what it must be and bounds what it reads. */
static int parse_path(const struct tms_setting_row *r, const char *s, struct tms_defaults *d, struct tms_err *err)
{
    if (r->hi && strlen(s) > r->hi) return tms_fail(err, TMS_E_ARG, 0, "%s is longer than %llu bytes", r->env, r->hi);
    return keep_text(r, s, d, err);
}

/* A size with units, or a whole percentage of the host's memory ("40%"). */
static int parse_limit(const struct tms_setting_row *r, const char *s, struct tms_defaults *d, struct tms_err *err)
{
    size_t len = strlen(s), bytes = 0;
    unsigned long long pct = 0;
    char digits[8];
    if (s[len - 1] == '%' && len >= 2 && len - 1 < sizeof digits) {
        memcpy(digits, s, len - 1);
        digits[len - 1] = 0;
        if (tms_parse_uint(digits, r->hi, &pct) != TMS_OK || pct < r->lo) pct = 0;
    } else if (tms_parse_bytes(s, &bytes) != TMS_OK) {
        bytes = 0;
    }
    if (!pct && !bytes) return malformed(r, s, err);
    *(size_t *)field(d, r->offset) = bytes;
    *(unsigned *)field(d, r->offset_percent) = (unsigned)pct;
    return TMS_OK;
}

/* op:n[,op:n...]: the n-th call (1-based) of op fails once. */
static int parse_faults(const struct tms_setting_row *r, const char *s, struct tms_defaults *d, struct tms_err *err)
{
#define FAULT_NAME(op, name) name,
    static const char *const names[TMS_FAULT_OPS] = {TMS_FAULT_LIST(FAULT_NAME)};
#undef FAULT_NAME
    char buf[256], expected[256] = "";
    long at[TMS_FAULT_OPS] = {0};
    if (strlen(s) >= sizeof buf) return tms_fail(err, TMS_E_ARG, 0, "%s is too long", r->env);
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
        if (op < 0 || tms_parse_uint(colon + 1, 1000000000, &n) || n == 0) {
            for (int i = 0; i < TMS_FAULT_OPS; i++)
                snprintf(expected + strlen(expected), sizeof expected - strlen(expected), "%s%s", i ? ", " : "",
                         names[i]);
            return tms_fail(err, TMS_E_ARG, 0, "%s='%s' is malformed (expected op:n with op one of %s)", r->env, s,
                            expected);
        }
        at[op] = (long)n;
    }
    memcpy(field(d, r->offset), at, sizeof at);
    return TMS_OK;
}

/* A device of the host backend: below its count, parsed before it in the table. */
static int parse_device(const struct tms_setting_row *r, const char *s, struct tms_defaults *d, struct tms_err *err)
{
    unsigned long long n;
    if (tms_parse_uint(s, (unsigned long long)d->host_devices - 1, &n) != TMS_OK)
        return tms_fail(err, TMS_E_ARG, 0, "%s='%s' is not a device from 0 to %d", r->env, s, d->host_devices - 1);
    *(int *)field(d, r->offset) = (int)n;
    return TMS_OK;
}

typedef int (*parse_fn)(const struct tms_setting_row *, const char *, struct tms_defaults *, struct tms_err *);
static const parse_fn parsers[] = {
    [TMS_SETTING_TYPE_boolean] = parse_boolean,     [TMS_SETTING_TYPE_count] = parse_count,
    [TMS_SETTING_TYPE_size] = parse_size,     [TMS_SETTING_TYPE_mib] = parse_mib,
    [TMS_SETTING_TYPE_choice] = parse_choice, [TMS_SETTING_TYPE_choice_anycase] = parse_choice,
    [TMS_SETTING_TYPE_name] = parse_name,     [TMS_SETTING_TYPE_path] = parse_path,
    [TMS_SETTING_TYPE_limit] = parse_limit,   [TMS_SETTING_TYPE_faults] = parse_faults,
    [TMS_SETTING_TYPE_device] = parse_device,
};

/* The row's default, where its variable is unset, empty or malformed. */
static void store_default(const struct tms_setting_row *r, struct tms_defaults *d)
{
    void *at = field(d, r->offset);
    switch (r->type) {
    case TMS_SETTING_TYPE_boolean:
    case TMS_SETTING_TYPE_count:
    case TMS_SETTING_TYPE_device: *(int *)at = (int)r->number; break;
    case TMS_SETTING_TYPE_size:
    case TMS_SETTING_TYPE_mib:
    case TMS_SETTING_TYPE_limit: *(size_t *)at = (size_t)r->number; break;
    case TMS_SETTING_TYPE_faults: break;  /* zeroed: no fault */
    default: *(const char **)at = r->text; break;
    }
}

static void load_all(void)
{
    for (size_t i = 0; i < TMS_SETTING_COUNT; i++) {
        const struct tms_setting_row *r = &tms_setting_rows[i];
        store_default(r, &defaults);
        if (!r->env) continue;
        /* Other programs' variables are read as glibc reads them (not in a setuid process). */
        const char *s = r->group == TMS_SETTING_GROUP_OUTSIDE ? secure_getenv(r->env) : getenv(r->env);
        if (!s || (!*s && r->type != TMS_SETTING_TYPE_boolean)) continue;
        struct tms_err *first = r->group == TMS_SETTING_GROUP_HOST ? &defaults.host_error : &defaults.parse_error;
        struct tms_err err = {0};
        if (parsers[r->type](r, s, &defaults, &err) == TMS_OK) {
            *(int *)field(&defaults, r->offset_set) = 1;
            continue;
        }
        rejected[i] = strdup(s);
        if (!first->status) *first = err;
    }
}

const struct tms_defaults *tms_defaults(void)
{
    pthread_once(&defaults_once, load_all);
    return &defaults;
}

int tms_setting_error(int id, struct tms_err *err)
{
    pthread_once(&defaults_once, load_all);
    if (id < 0 || id >= TMS_SETTING_COUNT || !rejected[id]) return TMS_OK;
    struct tms_defaults scratch = defaults;  /* a parse again only says why: nothing it stores is kept */
    int rc = parsers[tms_setting_rows[id].type](&tms_setting_rows[id], rejected[id], &scratch, err);
    return rc ? rc : tms_fail(err, TMS_E_ARG, 0, "%s is malformed", tms_setting_rows[id].env);
}

const char *tms_setting_text_now(int id)
{
    if (id < 0 || id >= TMS_SETTING_COUNT) return "";
    const struct tms_setting_row *r = &tms_setting_rows[id];
    if (r->type != TMS_SETTING_TYPE_choice && r->type != TMS_SETTING_TYPE_choice_anycase) return "";
    const char *s = r->env ? getenv(r->env) : NULL;
    struct tms_defaults scratch;
    struct tms_err err = {0};
    store_default(r, &scratch);
    if (s && *s && parsers[r->type](r, s, &scratch, &err) != TMS_OK) return "";
    const char *text = *(const char **)field(&scratch, r->offset);
    return text ? text : "";
}

int tms_env_check(struct tms_err *err)
{
    pthread_once(&defaults_once, load_all);
    const struct tms_err *first = defaults.parse_error.status ? &defaults.parse_error : &defaults.host_error;
    if (!first->status) return TMS_OK;
    if (err) *err = *first;
    return first->status;
}

/* ---- run-time values ----------------------------------------------------------------- */

int tms_setting_check_text(const struct tms_setting_row *r, const char *text, struct tms_err *err)
{
    if (r->type != TMS_SETTING_TYPE_name || name_ok(r, text)) return TMS_OK;
    return tms_fail(err, TMS_E_ARG, 0, "%s '%.80s' is not %s", r->name, text, tms_setting_accepts(r));
}

int tms_setting_check(const struct tms_setting_row *r, int sign, unsigned long long value, const char *text,
                      struct tms_err *err)
{
    if (sign < 0 || value < r->lo) return tms_fail(err, TMS_E_ARG, 0, "%s must be >= %llu, got %s", r->name, r->lo, text);
    if (sign > 0 && r->hi == UINT64_MAX) return tms_fail(err, TMS_E_ARG, 0, "%s must be < 2**64, got %s", r->name, text);
    if (sign > 0 || value > r->hi) return tms_fail(err, TMS_E_ARG, 0, "%s must be <= %llu, got %s", r->name, r->hi, text);
    if (r->multiple > 1 && value % r->multiple)
        return tms_fail(err, TMS_E_ARG, 0, "%s must be a multiple of %llu, got %s", r->name, r->multiple, text);
    return TMS_OK;
}

/* ---- the variables by name ------------------------------------------------------------- */

#define ELSEWHERE_NAME(env, doc) env,
static const char *const elsewhere[] = {TMS_ENV_ELSEWHERE(ELSEWHERE_NAME)};

/* The library's own: every row's variable but other programs'. */
static int own(const struct tms_setting_row *r) { return r->env && r->group != TMS_SETTING_GROUP_OUTSIDE; }

const char *tms_env_name(size_t i)
{
    for (size_t k = 0; k < TMS_SETTING_COUNT; k++)
        if (own(&tms_setting_rows[k]) && i-- == 0) return tms_setting_rows[k].env;
    return i < sizeof elsewhere / sizeof *elsewhere ? elsewhere[i] : NULL;
}

int tms_env_known(const char *name)
{
    static const char *const families[] = {"TMS_BENCH_", "TMS_TEST_", "TMS_FUZZ_"};
    for (size_t i = 0; tms_env_name(i); i++)
        if (strcmp(name, tms_env_name(i)) == 0) return 1;
    for (size_t i = 0; i < sizeof families / sizeof *families; i++)
        if (strncmp(name, families[i], strlen(families[i])) == 0) return 1;
    return 0;
}
