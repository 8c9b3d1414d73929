// The fingerprint kernel: a keyed 256-bit fingerprint of each chunk in a list, so a
// pause can tell the chunks that changed since their retained host copy was written.
// `make ptx` builds it into platform/fingerprint_ptx.h, which the cuda backend loads
// through the driver (no CUDA library is linked); platform/fingerprint.c computes the
// same function on the CPU, and platform/fingerprint.h describes it.
typedef unsigned long long u64;
typedef unsigned int u32;
#define P 0x1FFFFFFFFFFFFFFFull
#define THREADS 256
#define LANES 4

__constant__ u32 tms_fp_nh_key[LANES][256];
__constant__ u64 tms_fp_point[LANES];

__device__ __forceinline__ u64 mulmod(u64 a, u64 b)
{
    u64 lo = a * b, hi = __umul64hi(a, b);
    u64 r = (lo & P) + ((lo >> 61) | (hi << 3));
    return r >= P ? r - P : r;
}

__device__ __forceinline__ u64 addmod(u64 a, u64 b)
{
    u64 r = a + b;
    return r >= P ? r - P : r;
}

__device__ u64 powmod(u64 b, u64 e)
{
    u64 r = 1;
    for (; e; e >>= 1) {
        if (e & 1) r = mulmod(r, b);
        b = mulmod(b, b);
    }
    return r;
}

// Block b of the grid fingerprints the chunk_bytes at chunks[b] into out[b * LANES ...].
// chunk_bytes is a multiple of THREADS KiB; chunks and out may be host memory mapped
// into the device's address space. The key is copied to shared memory first: every
// thread reads the same key words at the same step, which shared memory broadcasts.
extern "C" __global__ void __launch_bounds__(THREADS)
tms_fingerprint(const u64 *chunks, u64 chunk_bytes, u64 *out)
{
    __shared__ uint4 key[LANES][64];
    __shared__ u64 part[LANES][THREADS];
    const u32 t = threadIdx.x;
    for (u32 k = t; k < LANES * 64; k += THREADS)
        key[k / 64][k % 64] = ((const uint4 *)tms_fp_nh_key)[k];
    __syncthreads();
    const u64 vectors = chunk_bytes / 16;
    const u32 groups = (u32)(vectors / (64u * THREADS));
    const uint4 *c = (const uint4 *)chunks[blockIdx.x];
    u64 h[LANES], stride[LANES];
    for (int j = 0; j < LANES; j++) {
        h[j] = 0;
        stride[j] = powmod(tms_fp_point[j], 2ull * THREADS);
    }
    for (u32 g = 0; g < groups; g++) {
        u64 nh[LANES] = {0, 0, 0, 0};
        const uint4 *v = c + (u64)g * 64u * THREADS + t;
#pragma unroll 4
        for (u32 i = 0; i < 64; i++) {
            uint4 m = v[(u64)i * THREADS];
#pragma unroll
            for (int j = 0; j < LANES; j++) {
                uint4 k = key[j][i];
                nh[j] += (u64)(m.x + k.x) * (u64)(m.y + k.y);
                nh[j] += (u64)(m.z + k.z) * (u64)(m.w + k.w);
            }
        }
        for (int j = 0; j < LANES; j++) {
            u64 x = tms_fp_point[j];
            h[j] = addmod(mulmod(h[j], stride[j]), addmod(mulmod(nh[j] >> 32, x), nh[j] & 0xFFFFFFFFull));
        }
    }
    for (int j = 0; j < LANES; j++) part[j][t] = mulmod(h[j], powmod(tms_fp_point[j], 2ull * (THREADS - 1 - t)));
    __syncthreads();
    for (u32 s = THREADS / 2; s > 0; s >>= 1) {
        if (t < s)
            for (int j = 0; j < LANES; j++) part[j][t] = addmod(part[j][t], part[j][t + s]);
        __syncthreads();
    }
    if (t < LANES) {
        u64 r = part[t][0];
        out[(u64)blockIdx.x * LANES + t] = r == P ? 0 : r;
    }
}
