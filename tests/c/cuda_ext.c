/* A CUDA library loaded after import torch_memory_saver (tests/test_gpu.py): allocates through
 * libcudart as a CUDA extension does, and fills/reads its memory with cudaMemcpy. */
#include <cuda_runtime_api.h>
#include <stddef.h>

void *ext_alloc(size_t n)
{
    void *p = NULL;
    return cudaMalloc(&p, n) == cudaSuccess ? p : NULL;
}

int ext_free(void *p) { return (int)cudaFree(p); }

int ext_copy(void *dst, const void *src, size_t n, int to_device)
{
    return (int)cudaMemcpy(dst, src, n, to_device ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost);
}
