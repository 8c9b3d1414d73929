/* A stand-in CUDA runtime for tests/c/abi_client.c on machines without one: cudaMalloc/cudaFree over
 * host memory, and a cudaFree that refuses pointers it did not hand out (as the real one does). */
#include <stddef.h>
#include <stdlib.h>

#define STUB_SLOTS 64
static void *handed_out[STUB_SLOTS];

int cudaMalloc(void **ptr, size_t size)
{
    for (int i = 0; i < STUB_SLOTS; i++) {
        if (!handed_out[i]) {
            if (!(handed_out[i] = malloc(size ? size : 1))) return 2;  /* cudaErrorMemoryAllocation */
            *ptr = handed_out[i];
            return 0;
        }
    }
    return 2;
}

int cudaFree(void *ptr)
{
    for (int i = 0; i < STUB_SLOTS; i++) {
        if (ptr && handed_out[i] == ptr) {
            free(ptr);
            handed_out[i] = NULL;
            return 0;
        }
    }
    return 1;  /* cudaErrorInvalidValue */
}
