/* A resume's check of what came back: the chunks a backup's pause recorded, fingerprinted on the device again and compared. */
#include "backup/kind.h"

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

/* Bytes of chunk c that belong to an allocation of size bytes. */
static size_t chunk_bytes(size_t c, size_t size)
{
    size_t start = c * TMS_FP_CHUNK;
    return size - start < TMS_FP_CHUNK ? size - start : TMS_FP_CHUNK;
}

/* Calls fn(arg, c) for each chunk the backup holds whole (ranges start and
 * end on whole chunks, but the last, which may end with the allocation). */
static void each_held_chunk(const struct tms_backup *b, void (*fn)(void *, size_t), void *arg)
{
    struct tms_range whole = {0, b->size};
    const struct tms_range *r = b->ranges ? b->ranges : &whole;
    size_t n = b->ranges ? b->n_ranges : 1;
    for (size_t i = 0; i < n; i++)
        for (size_t c = r[i].off / TMS_FP_CHUNK; r[i].len && c < chunks_of(r[i].off + r[i].len); c++) fn(arg, c);
}

struct listing {
    const struct tms_backup *b;
    tms_va va;
    int tail_ok;
    size_t n, raced, tail;
    tms_va *at;        /* NULL: only count */
    size_t *index;
};

static void list_chunk(void *arg, size_t c)
{
    struct listing *l = arg;
    if ((c + 1) * TMS_FP_CHUNK > l->b->size && !l->tail_ok) {
        l->tail++;  /* its bytes past the allocation could not be zeroed: not comparable */
        return;
    }
    if (c >= l->b->n_fp || !l->b->fp_valid[c]) {
        l->raced++;
        return;
    }
    if (l->at) l->at[l->n] = l->va + c * TMS_FP_CHUNK, l->index[l->n] = c;
    l->n++;
}

void tms_verify_restored(const struct tms_driver *drv, const struct tms_backup *b, struct tms_backup_move *m,
                         int tail_zeroed, uint64_t *ns)
{
    m->verified = 0, m->bad = 0, m->bad_offset = 0, m->unverified = NULL;
    if (__atomic_load_n(&b->viewed, __ATOMIC_ACQUIRE)) {
        m->unverified = "a view of its backup that can be written was handed out (get_cpu_backup zero_copy=True, or "
                        "the native call): restored as written";
        return;
    }
    if (!drv->fingerprint) {
        m->unverified = "the backend has no fingerprint kernel";
        return;
    }
    if (!b->fp) {
        m->unverified = "its pause recorded no fingerprints (the kernel did not run, or verify_restore was off)";
        return;
    }
    if (b->fp_generation != tms_fp_generation()) {
        m->unverified = "its fingerprints were taken under the key of the process it was forked from";
        return;
    }
    struct listing l = {.b = b, .va = m->va, .tail_ok = tail_zeroed};
    each_held_chunk(b, list_chunk, &l);
    if (l.raced)
        m->unverified = "its pause did not trust some chunks (written while it copied them, or a last chunk whose "
                        "bytes past the allocation it could not zero): restored as copied";
    else if (l.tail) m->unverified = "its last chunk's bytes past the allocation could not be zeroed to compare it";
    if (!l.n) return;
    size_t count = l.n;
    l.at = malloc(count * sizeof *l.at);
    l.index = malloc(count * sizeof *l.index);
    struct tms_fp *out = malloc(count * sizeof *out);
    if (!l.at || !l.index || !out) {
        m->unverified = "out of host memory to list what to check";
    } else {
        l.n = 0, l.raced = 0, l.tail = 0;
        each_held_chunk(b, list_chunk, &l);
        uint64_t t0 = now_ns();
        int rc = drv->fingerprint(m->device, l.at, l.n, out);
        *ns += now_ns() - t0;
        if (rc) {
            m->unverified = "fingerprinting what came back failed";
        } else {
            for (size_t k = 0; k < l.n; k++) {
                size_t c = l.index[k];
                if (memcmp(&out[k], &b->fp[c], sizeof out[k]) == 0) {
                    m->verified += chunk_bytes(c, b->size);
                } else if (!m->bad) {
                    m->bad = 1;
                    m->bad_offset = c * TMS_FP_CHUNK;
                }
            }
        }
    }
    free(l.at);
    free(l.index);
    free(out);
}
