/* Unchanged memory left out of a save: the chunks' fingerprints on the device, compared with those the backup recorded when it was written. */
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

static size_t listed(const struct tms_backup_move *m)
{
    struct tms_range whole;
    size_t n, count = 0;
    const struct tms_range *r = ranges_of(m, &whole, &n);
    for (size_t i = 0; i < n; i++)
        if (r[i].len) count += chunks_of(r[i].off + r[i].len) - r[i].off / TMS_FP_CHUNK;
    return count;
}

/* The backup a move reuses recorded fingerprints this save may compare. */
static int comparable(const struct tms_backup_move *m, uint64_t generation)
{
    const struct tms_backup *b = m->held;
    return b && b->kind == m->kind && b->device == m->device && b->size == m->size && b->fp &&
           b->n_fp == chunks_of(m->size) && b->fp_generation == generation &&
           !__atomic_load_n(&b->viewed, __ATOMIC_ACQUIRE);
}

static void give_up(struct tms_save_plan *p, size_t n, struct tms_skip *s)
{
    for (size_t i = 0; i < n; i++) p[i].fingerprinted = 0, p[i].compare = 0;
    free(s->chunks), free(s->index), free(s->fp);
    *s = (struct tms_skip){0};
}

void tms_skip_fingerprint(const struct tms_driver *drv, struct tms_save_plan *p, size_t n, struct tms_skip *s,
                          struct tms_save_info *info)
{
    *s = (struct tms_skip){0};
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        const struct tms_backup_move *m = p[i].m;
        p[i].fingerprinted = m->skip_unchanged && tms_backup_kind_is_host(m->kind);
        if (p[i].fingerprinted) total += listed(m);
    }
    if (!total) return;
    const struct tms_fp_key *key;
    struct tms_err err = {0};
    if (!drv->fingerprint) {
        snprintf(info->why_not, sizeof info->why_not, "the %s backend has no fingerprint kernel", drv->name);
        return give_up(p, n, s);
    }
    if (tms_fp_key(&key, &s->generation, &err)) {
        snprintf(info->why_not, sizeof info->why_not, "%.150s", err.msg);
        return give_up(p, n, s);
    }
    s->chunks = malloc(total * sizeof *s->chunks);
    s->index = malloc(total * sizeof *s->index);
    s->fp = malloc(total * sizeof *s->fp);
    if (!s->chunks || !s->index || !s->fp) {
        snprintf(info->why_not, sizeof info->why_not, "out of host memory listing %zu chunks to fingerprint", total);
        return give_up(p, n, s);
    }
    for (size_t i = 0; i < n; i++) {
        if (!p[i].fingerprinted) continue;
        const struct tms_backup_move *m = p[i].m;
        struct tms_range whole;
        size_t nr;
        const struct tms_range *r = ranges_of(m, &whole, &nr);
        p[i].fp_first = s->n;
        for (size_t k = 0; k < nr; k++)
            for (size_t c = r[k].off / TMS_FP_CHUNK; r[k].len && c < chunks_of(r[k].off + r[k].len); c++) {
                s->chunks[s->n] = m->va + c * TMS_FP_CHUNK;
                s->index[s->n++] = c;
            }
        p[i].fp_n = s->n - p[i].fp_first;
        p[i].compare = comparable(m, s->generation);
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
        int rc = drv->fingerprint(device, s->chunks + first, last - first, s->fp + first);
        if (rc) {
            snprintf(info->why_not, sizeof info->why_not, "fingerprinting %zu chunks on device %d failed: %s (%d)",
                     last - first, device, drv->code_name(rc), rc);
            info->fingerprint_ns += now_ns() - t0;
            return give_up(p, n, s);
        }
        i = end;
    }
    info->fingerprint_ns += now_ns() - t0;
}

/* Does every chunk of [off, end) match what the backup recorded? k: the
 * position of the plan's first chunk at or after off in the call's list. */
static int unchanged(const struct tms_backup *b, const struct tms_skip *s, size_t k, size_t off, size_t end)
{
    for (size_t c = off / TMS_FP_CHUNK; c < chunks_of(end); c++, k++)
        if (s->index[k] != c || !b->fp_valid[c] || memcmp(&b->fp[c], &s->fp[k], sizeof b->fp[c])) return 0;
    return 1;
}

int tms_skip_ranges(struct tms_save_plan *p, const struct tms_skip *s, struct tms_err *err)
{
    struct tms_backup_move *m = p->m;
    p->copy = NULL, p->n_copy = 0;
    if (!p->fingerprinted || !p->compare || m->copy != m->held) return TMS_OK;  /* all of its ranges */
    struct tms_range whole;
    size_t nr, cap = 0, k = p->fp_first;
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
            if (unchanged(m->held, s, k, at, stop)) {
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
                tms_backup_forget_fingerprints(b);  /* the next save copies all of it */
                continue;
            }
            b->n_fp = want;
            b->fp_generation = s->generation;
        }
        for (size_t k = p[i].fp_first; k < p[i].fp_first + p[i].fp_n; k++) {
            b->fp[s->index[k]] = s->fp[k];
            b->fp_valid[s->index[k]] = 1;
        }
    }
}

void tms_skip_end(struct tms_save_plan *p, size_t n, struct tms_skip *s)
{
    for (size_t i = 0; i < n; i++) {
        free(p[i].copy);
        p[i].copy = NULL;
    }
    free(s->chunks), free(s->index), free(s->fp);
    *s = (struct tms_skip){0};
}
