/* A save's fingerprints, taken on the device: unchanged memory left out of the copy, and the record of what each copy carried. */
#include "backup/save.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static size_t chunks_of(size_t bytes) { return (bytes + TMS_FP_CHUNK - 1) / TMS_FP_CHUNK; }

/* The move's ranges, one whole range where it has none. */
static const struct tms_range *ranges_of(const struct tms_backup_move *m, struct tms_range *whole, size_t *n)
{
    if (m->ranges) return *n = m->n_ranges, m->ranges;
    *whole = (struct tms_range){0, m->size};
    return *n = 1, whole;
}

/* The chunks of range r that plan p lists: [*first, *end). A last chunk
 * that runs past the allocation is listed only if the rest of it was zeroed. */
static void range_chunks(const struct tms_save_plan *p, const struct tms_range *r, size_t *first, size_t *end)
{
    *first = r->off / TMS_FP_CHUNK;
    *end = r->len ? chunks_of(r->off + r->len) : *first;
    if (*end > *first && !p->tail_listed && *end * TMS_FP_CHUNK > p->m->size) (*end)--;
}

static size_t listed(const struct tms_save_plan *p)
{
    struct tms_range whole;
    size_t n, count = 0, first, end;
    const struct tms_range *r = ranges_of(p->m, &whole, &n);
    for (size_t i = 0; i < n; i++) {
        range_chunks(p, &r[i], &first, &end);
        count += end - first;
    }
    return count;
}

int tms_fp_zero_tail(const struct tms_driver *drv, const struct tms_backup_move *m)
{
    size_t rem = m->size % TMS_FP_CHUNK;
    if (!rem) return 1;
    if (!drv->fill || m->size - rem + TMS_FP_CHUNK > m->reserved) return 0;
    tms_va at = m->va + m->size;
    size_t len = TMS_FP_CHUNK - rem;
    return drv->fill(m->device, &at, &len, 1, 0) == 0;
}

/* The backup a move reuses recorded fingerprints this save may compare. */
static int comparable(const struct tms_backup_move *m, uint64_t generation)
{
    const struct tms_backup *b = m->held;
    return b && b->kind == m->kind && b->device == m->device && b->size == m->size && b->fp &&
           b->n_fp == chunks_of(m->size) && b->fp_generation == generation &&
           !__atomic_load_n(&b->viewed, __ATOMIC_ACQUIRE);
}

static void free_lists(struct tms_skip *s)
{
    free(s->chunks), free(s->index), free(s->fp), free(s->post), free(s->copied), free(s->posted);
    *s = (struct tms_skip){0};
}

/* Nothing is compared or recorded: every move copies all of its ranges, and
 * why is said for the moves that were to skip and those that were to verify. */
static void give_up(struct tms_save_plan *p, size_t n, struct tms_skip *s, struct tms_save_info *info, const char *why)
{
    int skipping = 0, verifying = 0;
    for (size_t i = 0; i < n; i++) {
        skipping |= p[i].fingerprinted && p[i].m->skip_unchanged;
        verifying |= p[i].fingerprinted && p[i].m->verify;
        p[i].fingerprinted = 0, p[i].compare = 0;
    }
    if (skipping) snprintf(info->why_not, sizeof info->why_not, "%s", why);
    if (verifying) snprintf(info->why_not_recorded, sizeof info->why_not_recorded, "%s", why);
    free_lists(s);
}

/* Runs the kernel over chunks at[0..count) of device, into out. */
static int run(const struct tms_driver *drv, int device, const tms_va *at, size_t count, struct tms_fp *out,
               char *why, size_t why_size)
{
    if (!count) return 0;
    int rc = drv->fingerprint(device, at, count, out);
    if (rc)
        snprintf(why, why_size, "fingerprinting %zu chunks on device %d failed: %s (%d)", count, device,
                 drv->code_name(rc), rc);
    return rc;
}

void tms_skip_fingerprint(const struct tms_driver *drv, struct tms_save_plan *p, size_t n, struct tms_skip *s,
                          struct tms_save_info *info)
{
    *s = (struct tms_skip){0};
    int any = 0;
    for (size_t i = 0; i < n; i++) {
        const struct tms_backup_move *m = p[i].m;
        p[i].fingerprinted = m->verify || (m->skip_unchanged && tms_backup_kind_is_host(m->kind));
        p[i].compare = 0, p[i].confirmed = 0, p[i].tail_listed = 0;
        any |= p[i].fingerprinted;
    }
    if (!any) return;
    char why[160];
    if (!drv->fingerprint) {
        snprintf(why, sizeof why, "the %s backend has no fingerprint kernel", drv->name);
        return give_up(p, n, s, info, why);
    }
    const struct tms_fp_key *key;
    struct tms_err err = {0};
    if (tms_fp_key(&key, &s->generation, &err)) {
        snprintf(why, sizeof why, "%.150s", err.msg);
        return give_up(p, n, s, info, why);
    }
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (!p[i].fingerprinted) continue;
        p[i].tail_listed = tms_fp_zero_tail(drv, p[i].m);
        if (!p[i].tail_listed && p[i].m->verify && !info->why_not_recorded[0])
            snprintf(info->why_not_recorded, sizeof info->why_not_recorded,
                     "the last chunk of 0x%llx (its bytes past the allocation) could not be zeroed to fingerprint it",
                     (unsigned long long)p[i].m->va);
        total += listed(&p[i]);
    }
    if (!total) return;
    s->chunks = malloc(total * sizeof *s->chunks);
    s->index = malloc(total * sizeof *s->index);
    s->fp = malloc(total * sizeof *s->fp);
    s->post = malloc(total * sizeof *s->post);
    s->copied = calloc(total, 1);
    s->posted = calloc(total, 1);
    if (!s->chunks || !s->index || !s->fp || !s->post || !s->copied || !s->posted) {
        snprintf(why, sizeof why, "out of host memory listing %zu chunks to fingerprint", total);
        return give_up(p, n, s, info, why);
    }
    for (size_t i = 0; i < n; i++) {
        if (!p[i].fingerprinted) continue;
        const struct tms_backup_move *m = p[i].m;
        struct tms_range whole;
        size_t nr, first, end;
        const struct tms_range *r = ranges_of(m, &whole, &nr);
        p[i].fp_first = s->n;
        for (size_t k = 0; k < nr; k++) {
            range_chunks(&p[i], &r[k], &first, &end);
            for (size_t c = first; c < end; c++) {
                s->chunks[s->n] = m->va + c * TMS_FP_CHUNK;
                s->index[s->n++] = c;
            }
        }
        p[i].fp_n = s->n - p[i].fp_first;
        p[i].compare = m->skip_unchanged && tms_backup_kind_is_host(m->kind) && comparable(m, s->generation);
    }
    /* One kernel run per device: the core hands the moves over sorted by device. */
    uint64_t t0 = now_ns();
    for (size_t i = 0; i < n;) {
        if (!p[i].fingerprinted) {
            i++;
            continue;
        }
        int device = p[i].m->device;
        size_t first = p[i].fp_first, end = i;
        while (end < n && (!p[end].fingerprinted || p[end].m->device == device)) end++;
        size_t last = first;
        for (size_t j = i; j < end; j++)
            if (p[j].fingerprinted) last = p[j].fp_first + p[j].fp_n;
        if (run(drv, device, s->chunks + first, last - first, s->fp + first, why, sizeof why)) {
            info->fingerprint_ns += now_ns() - t0;
            return give_up(p, n, s, info, why);
        }
        i = end;
    }
    info->fingerprint_ns += now_ns() - t0;
}

/* Does every chunk of [off, end) match what the backup recorded? k: the
 * position of the plan's first chunk at or after off in the call's list;
 * kend: the end of the plan's chunks there. */
static int unchanged(const struct tms_backup *b, const struct tms_skip *s, size_t k, size_t kend, size_t off,
                     size_t end)
{
    for (size_t c = off / TMS_FP_CHUNK; c < chunks_of(end); c++, k++)
        if (k >= kend || s->index[k] != c || !b->fp_valid[c] || memcmp(&b->fp[c], &s->fp[k], sizeof b->fp[c]))
            return 0;
    return 1;
}

int tms_skip_ranges(struct tms_save_plan *p, const struct tms_skip *s, struct tms_err *err)
{
    struct tms_backup_move *m = p->m;
    p->copy = NULL, p->n_copy = 0;
    if (!p->fingerprinted || !p->compare || m->copy != m->held) return TMS_OK;  /* all of its ranges */
    struct tms_range whole;
    size_t nr, cap = 0, k = p->fp_first, kend = p->fp_first + p->fp_n;
    const struct tms_range *r = ranges_of(m, &whole, &nr);
    size_t unit = tms_backup_granule(m->kind);
    struct tms_range *out = malloc(sizeof *out);
    if (!out) return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning the copy of 0x%llx",
                              (unsigned long long)m->va);
    cap = 1;
    for (size_t i = 0; i < nr; i++) {
        for (size_t at = r[i].off, end = r[i].off + r[i].len; at < end;) {
            size_t stop = at + unit < end ? at + unit : end;
            size_t n_chunks = chunks_of(stop) - at / TMS_FP_CHUNK;
            if (unchanged(m->held, s, k, kend, at, stop)) {
                m->unchanged += stop - at;
            } else if (p->n_copy && out[p->n_copy - 1].off + out[p->n_copy - 1].len == at) {
                out[p->n_copy - 1].len += stop - at;
            } else {
                if (p->n_copy == cap) {
                    struct tms_range *grown = realloc(out, (cap *= 2) * sizeof *out);
                    if (!grown) {
                        free(out);
                        return tms_fail(err, TMS_E_HOST_OOM, 0, "out of host memory planning the copy of 0x%llx",
                                        (unsigned long long)m->va);
                    }
                    out = grown;
                }
                out[p->n_copy++] = (struct tms_range){at, stop - at};
            }
            k += n_chunks;  /* units start on chunks: ranges start on granules, which are whole chunks */
            at = stop;
        }
    }
    p->copy = out;
    return TMS_OK;
}

/* Which of plan p's listed chunks its copy carried: all of them where it
 * compared nothing, else those in the ranges it copied. */
static void mark_copied(const struct tms_save_plan *p, struct tms_skip *s)
{
    for (size_t k = p->fp_first; k < p->fp_first + p->fp_n; k++) {
        if (!p->copy) {
            s->copied[k] = 1;
            continue;
        }
        size_t start = s->index[k] * TMS_FP_CHUNK, stop = start + TMS_FP_CHUNK;
        s->copied[k] = 0;
        for (size_t r = 0; r < p->n_copy && !s->copied[k]; r++)
            s->copied[k] = p->copy[r].off < stop && start < p->copy[r].off + p->copy[r].len;
    }
}

void tms_skip_confirm(const struct tms_driver *drv, struct tms_save_plan *p, size_t n, struct tms_skip *s,
                      struct tms_save_info *info)
{
    if (!s->n) return;
    uint64_t t0 = now_ns();
    tms_va *at = NULL;
    size_t *pos = NULL;
    struct tms_fp *out = NULL;
    for (size_t i = 0; i < n;) {
        if (!p[i].fingerprinted || p[i].confirmed) {
            i++;
            continue;
        }
        /* The plans of one device, in one run. */
        int device = p[i].m->device;
        size_t end = i, count = 0;
        while (end < n && (!p[end].fingerprinted || p[end].confirmed || p[end].m->device == device)) end++;
        for (size_t j = i; j < end; j++) {
            if (!p[j].fingerprinted || p[j].confirmed) continue;
            mark_copied(&p[j], s);
            for (size_t k = p[j].fp_first; k < p[j].fp_first + p[j].fp_n; k++) count += s->copied[k];
        }
        if (count && (!at || !pos || !out)) {
            free(at), free(pos), free(out);
            at = malloc(s->n * sizeof *at), pos = malloc(s->n * sizeof *pos), out = malloc(s->n * sizeof *out);
        }
        if (count && (!at || !pos || !out)) {
            snprintf(info->why_not_recorded, sizeof info->why_not_recorded,
                     "out of host memory listing %zu chunks to fingerprint", count);
        } else if (count) {
            size_t c = 0;
            for (size_t j = i; j < end; j++)
                for (size_t k = p[j].fp_first; p[j].fingerprinted && !p[j].confirmed && k < p[j].fp_first + p[j].fp_n; k++)
                    if (s->copied[k]) at[c] = s->chunks[k], pos[c++] = k;
            if (!run(drv, device, at, c, out, info->why_not_recorded, sizeof info->why_not_recorded))
                for (size_t x = 0; x < c; x++) s->post[pos[x]] = out[x], s->posted[pos[x]] = 1;
        }
        for (size_t j = i; j < end; j++)
            if (p[j].fingerprinted) p[j].confirmed = 1;
        i = end;
    }
    free(at), free(pos), free(out);
    info->fingerprint_ns += now_ns() - t0;
}

void tms_skip_record(struct tms_save_plan *p, size_t n, const struct tms_skip *s)
{
    for (size_t i = 0; i < n; i++) {
        struct tms_backup *b = p[i].m->copy;
        if (!p[i].fingerprinted || !b) continue;
        if (__atomic_load_n(&b->viewed, __ATOMIC_ACQUIRE)) {
            tms_backup_forget_fingerprints(b);
            continue;
        }
        size_t want = chunks_of(b->size);
        if (!b->fp || b->n_fp != want || b->fp_generation != s->generation) {
            tms_backup_forget_fingerprints(b);
            b->fp = malloc(want * sizeof *b->fp);
            b->fp_valid = calloc(want, 1);
            if (!b->fp || !b->fp_valid) {
                tms_backup_forget_fingerprints(b);  /* the next save copies all of it; the next restore checks nothing */
                continue;
            }
            b->n_fp = want;
            b->fp_generation = s->generation;
        }
        /* A last chunk left unlisted was copied all the same: what the backup recorded of it is stale. */
        if (!p[i].tail_listed && b->size % TMS_FP_CHUNK) b->fp_valid[want - 1] = 0;
        for (size_t k = p[i].fp_first; k < p[i].fp_first + p[i].fp_n; k++) {
            /* A chunk carried while something wrote it holds neither fingerprint's bytes for sure. */
            int trusted = !s->copied[k] || (s->posted[k] && !memcmp(&s->fp[k], &s->post[k], sizeof s->fp[k]));
            b->fp[s->index[k]] = s->fp[k];
            b->fp_valid[s->index[k]] = (unsigned char)trusted;
        }
    }
}

void tms_skip_end(struct tms_save_plan *p, size_t n, struct tms_skip *s)
{
    for (size_t i = 0; i < n; i++) {
        free(p[i].copy);
        p[i].copy = NULL;
    }
    free_lists(s);
}
