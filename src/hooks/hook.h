/* What both hook variants share: routing an allocator call into the core. */
#ifndef TMS_HOOK_H
#define TMS_HOOK_H

#include <stddef.h>

#define TMS_EXPORT __attribute__((visibility("default")))

/* cudaError_t values the hooks answer with. */
enum {
    TMS_CUDA_SUCCESS_RT = 0,
    TMS_CUDA_ERROR_INVALID_VALUE_RT = 1,    /* cudaErrorInvalidValue, hipErrorInvalidValue */
    TMS_CUDA_ERROR_MEMORY_ALLOCATION = 2,   /* PyTorch frees its cache and retries */
    TMS_CUDA_ERROR_INITIALIZATION = 3,
    TMS_CUDA_ERROR_UNKNOWN = 999,
};

/* Serves an allocation through the core with the calling thread's region
 * settings; returns a cudaError_t. On failure the message is kept for
 * tms_core_last_error() on this thread. */
int tms_hook_alloc(void **ptr, size_t size, int device);

/* Frees a pointer the core owns; returns a cudaError_t. */
int tms_hook_free(void *ptr);


#endif
