/* Keyed fingerprints of fixed-size chunks of memory: the process's key, the CPU computation, what the GPU kernel computes. */
#ifndef TMS_FINGERPRINT_H
#define TMS_FINGERPRINT_H

#include <stddef.h>
#include <stdint.h>

#include "platform/error.h"

/*
 * A fingerprint is four 61-bit lanes. Lane j: NH (32-bit words added to the
 * lane's 256-word key, multiplied in pairs, summed modulo 2^64) over each
 * 1 KiB block of the chunk, then a polynomial modulo 2^61-1 at the lane's
 * point over the blocks' NH values, high half first. A block is the 64
 * vectors of 16 bytes one of 256 threads reads in 64 steps of a coalesced
 * walk: vector (g * 64 + i) * 256 + t is step i of thread t in group g; the
 * blocks go in the order g * 256 + t. platform/fingerprint.cu computes the
 * same on the GPU; docs/design.md says why a change slips through with a
 * probability below 2^-120.
 */
#define TMS_FP_LANES 4
#define TMS_FP_KEY_WORDS 256
#define TMS_FP_THREADS 256
/* Chunks are fingerprinted (and left out of a copy) in pieces this large. */
#define TMS_FP_CHUNK ((size_t)2 << 20)

struct tms_fp_key {
    uint32_t nh[TMS_FP_LANES][TMS_FP_KEY_WORDS];
    uint64_t point[TMS_FP_LANES];  /* in [1, 2^61 - 2] */
};

struct tms_fp {
    uint64_t lane[TMS_FP_LANES];
};

/* The process's key, drawn from the kernel's random source on first use and
 * again in a forked child; *generation changes with it, so a fingerprint
 * taken under another key is never compared. TMS_E_DRIVER-free: fails only
 * if the random source does (TMS_E_IO). */
int tms_fp_key(const struct tms_fp_key **key, uint64_t *generation, struct tms_err *err);
/* The generation of the key now (0 before the first key). */
uint64_t tms_fp_generation(void);

/* The fingerprint of bytes (a multiple of TMS_FP_THREADS KiB) at chunk, on the CPU. */
void tms_fp_compute(const void *chunk, size_t bytes, const struct tms_fp_key *key, struct tms_fp *out);

#endif
