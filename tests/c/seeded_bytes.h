/* Deterministic bytes per seed, so a C test checks contents without keeping a copy. */
#ifndef TMS_TEST_SEEDED_BYTES_H
#define TMS_TEST_SEEDED_BYTES_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

static inline uint64_t next_rand(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    return *s = x;
}

/* Word i of seed's bytes, computed on its own (splitmix64 of a counter), so a
 * check can sample words anywhere without generating those before them. */
static inline uint64_t seeded_word(uint64_t seed, size_t i)
{
    uint64_t z = seed * 0x9E3779B97F4A7C15ull + (uint64_t)i * 0xBF58476D1CE4E5B9ull + 0x94D049BB133111EBull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Words are stored and compared inline: a memcpy/memcmp call per 8 bytes
 * costs most of a C test's time, and far more under AddressSanitizer, which
 * intercepts every call. */
static inline void fill(void *p, size_t n, uint64_t seed)
{
    unsigned char *b = p;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = seeded_word(seed, i / 8);
        __builtin_memcpy(b + i, &v, 8);
    }
    if (i < n) {
        uint64_t v = seeded_word(seed, i / 8);
        memcpy(b + i, &v, n - i);
    }
}

static inline int matches(const void *p, size_t n, uint64_t seed)
{
    const unsigned char *b = p;
    uint64_t diff = 0;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t have;
        __builtin_memcpy(&have, b + i, 8);
        diff |= have ^ seeded_word(seed, i / 8);
    }
    if (i < n) {
        uint64_t v = seeded_word(seed, i / 8);
        if (memcmp(b + i, &v, n - i) != 0) return 0;
    }
    return diff == 0;
}

/* One word of every `stride` bytes (a multiple of 8) and the last whole
 * word: catches a page mapped at the wrong place, zeroed or lost, at a
 * fraction of a full check's cost. */
static inline int matches_sampled(const void *p, size_t n, uint64_t seed, size_t stride)
{
    if (n < 8) return matches(p, n, seed);
    const unsigned char *b = p;
    uint64_t diff = 0, have;
    for (size_t i = 0; i + 8 <= n; i += stride) {
        __builtin_memcpy(&have, b + i, 8);
        diff |= have ^ seeded_word(seed, i / 8);
    }
    size_t last = (n / 8 - 1) * 8;
    __builtin_memcpy(&have, b + last, 8);
    return (diff | (have ^ seeded_word(seed, last / 8))) == 0;
}

#endif
