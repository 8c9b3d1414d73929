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

static inline void fill(void *p, size_t n, uint64_t seed)
{
    uint64_t s = seed * 0x9E3779B97F4A7C15ull | 1;
    unsigned char *b = p;
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v = next_rand(&s);
        memcpy(b + i, &v, n - i < 8 ? n - i : 8);
    }
}

static inline int matches(const void *p, size_t n, uint64_t seed)
{
    uint64_t s = seed * 0x9E3779B97F4A7C15ull | 1;
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v = next_rand(&s);
        if (memcmp(b + i, &v, n - i < 8 ? n - i : 8) != 0) return 0;
    }
    return 1;
}

#endif
