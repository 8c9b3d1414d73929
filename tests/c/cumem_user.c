/* A library that looks up driver entry points through the CUDA runtime, as PyTorch's libc10_cuda
 * does for its expandable segments (tests/test_expandable.py builds it under that name and another). */
#include <stddef.h>

int cudaGetDriverEntryPoint(const char *symbol, void **fn, unsigned long long flags, int *status);
int cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version, unsigned long long flags,
                                     int *status);

void *user_lookup(const char *symbol, int by_version)
{
    void *fn = NULL;
    int status = -1;
    int rc = by_version ? cudaGetDriverEntryPointByVersion(symbol, &fn, 12000, 0, &status)
                        : cudaGetDriverEntryPoint(symbol, &fn, 0, &status);
    /* The runtime knows its caller by the return address: no tail call. */
    __asm__ volatile("" : : "r"(fn) : "memory");
    return rc == 0 && status == 0 ? fn : NULL;
}
