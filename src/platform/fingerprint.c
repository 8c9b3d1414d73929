/* The fingerprint's key (one per process, drawn again in a forked child) and its CPU computation. */
#include "platform/fingerprint.h"

#include <errno.h>
#include <pthread.h>
#include <string.h>
#include <sys/random.h>

#include "platform/fork.h"

#define P61 0x1FFFFFFFFFFFFFFFull

static pthread_mutex_t key_lock = PTHREAD_MUTEX_INITIALIZER;
static struct tms_fp_key key;      /* guarded by key_lock until generation says it is set */
static uint64_t generation;        /* atomic; 0: no key yet */
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static int draw(struct tms_fp_key *k)
{
    unsigned char *p = (unsigned char *)k;
    for (size_t got = 0; got < sizeof *k;) {
        ssize_t n = getrandom(p + got, sizeof *k - got, 0);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return errno ? errno : EIO;
        got += (size_t)n;
    }
    for (int j = 0; j < TMS_FP_LANES; j++) k->point[j] = 1 + k->point[j] % (P61 - 2);
    return 0;
}

/* A forked child is another process: the parent's fingerprints mean nothing
 * to it (its memory may differ from what they describe), and it keys anew on
 * its first use. */
static void fork_prepare(void) { pthread_mutex_lock(&key_lock); }
static void fork_parent(void) { pthread_mutex_unlock(&key_lock); }
static void fork_child(void)
{
    if (__atomic_load_n(&generation, __ATOMIC_RELAXED)) __atomic_add_fetch(&generation, 1, __ATOMIC_RELAXED);
    memset(&key, 0, sizeof key);
    pthread_mutex_unlock(&key_lock);
}

static void register_fork(void)
{
    static const struct tms_fork_handlers handlers = {fork_prepare, fork_parent, fork_child};
    tms_fork_register(TMS_FORK_FINGERPRINT, &handlers);
}

int tms_fp_key(const struct tms_fp_key **out, uint64_t *gen, struct tms_err *err)
{
    pthread_once(&fork_once, register_fork);
    pthread_mutex_lock(&key_lock);
    int rc = 0;
    uint64_t g = __atomic_load_n(&generation, __ATOMIC_RELAXED);
    if (key.point[0] == 0) {  /* none yet in this process */
        rc = draw(&key);
        if (!rc) __atomic_store_n(&generation, g = g + 1, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&key_lock);
    if (rc) return tms_fail(err, TMS_E_IO, rc, "drawing the fingerprint key from getrandom failed (errno %d)", rc);
    *out = &key;
    *gen = g;
    return TMS_OK;
}

uint64_t tms_fp_generation(void) { return __atomic_load_n(&generation, __ATOMIC_ACQUIRE); }

static uint64_t mulmod(uint64_t a, uint64_t b)
{
    unsigned __int128 x = (unsigned __int128)a * b;
    uint64_t lo = (uint64_t)x, hi = (uint64_t)(x >> 64);
    uint64_t r = (lo & P61) + ((lo >> 61) | (hi << 3));
    return r >= P61 ? r - P61 : r;
}

static uint64_t addmod(uint64_t a, uint64_t b)
{
    uint64_t r = a + b;
    return r >= P61 ? r - P61 : r;
}

void tms_fp_compute(const void *chunk, size_t bytes, const struct tms_fp_key *k, struct tms_fp *out)
{
    const uint32_t *w = chunk;
    size_t groups = bytes / (16u * 64u * TMS_FP_THREADS);
    uint64_t h[TMS_FP_LANES] = {0};
    for (size_t g = 0; g < groups; g++)
        for (size_t t = 0; t < TMS_FP_THREADS; t++) {
            uint64_t nh[TMS_FP_LANES] = {0};
            for (size_t i = 0; i < 64; i++) {
                const uint32_t *m = w + 4 * ((g * 64 + i) * TMS_FP_THREADS + t);
                for (int j = 0; j < TMS_FP_LANES; j++) {
                    const uint32_t *kj = &k->nh[j][4 * i];
                    nh[j] += (uint64_t)(uint32_t)(m[0] + kj[0]) * (uint32_t)(m[1] + kj[1]);
                    nh[j] += (uint64_t)(uint32_t)(m[2] + kj[2]) * (uint32_t)(m[3] + kj[3]);
                }
            }
            for (int j = 0; j < TMS_FP_LANES; j++) {
                h[j] = addmod(mulmod(h[j], k->point[j]), nh[j] >> 32);
                h[j] = addmod(mulmod(h[j], k->point[j]), nh[j] & 0xFFFFFFFFu);
            }
        }
    for (int j = 0; j < TMS_FP_LANES; j++) out->lane[j] = h[j] == P61 ? 0 : h[j];
}
