/* Preload variant: cudaMalloc/cudaFree defined here; regions go to the core, the rest forwards. */
#include <dlfcn.h>
#include <stddef.h>

#include "config.h"
#include "core.h"
#include "hook.h"

typedef int (*cuda_malloc_fn)(void **, size_t);
typedef int (*cuda_free_fn)(void *);

/* Resolved on first forward: libcudart may be loaded after this library. */
static cuda_malloc_fn next_malloc;  /* atomic */
static cuda_free_fn next_free;      /* atomic */

static void *next_symbol(void **slot, const char *name)
{
    void *fn = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
    if (!fn) {
        fn = dlsym(RTLD_NEXT, name);
        __atomic_store_n(slot, fn, __ATOMIC_RELEASE);
    }
    return fn;
}

TMS_EXPORT int cudaMalloc(void **ptr, size_t size)
{
    if (tms_region_current()->active) return tms_hook_alloc(ptr, size, -1);
    cuda_malloc_fn real = (cuda_malloc_fn)next_symbol((void **)&next_malloc, "cudaMalloc");
    return real ? real(ptr, size) : TMS_CUDA_ERROR_INITIALIZATION;
}

TMS_EXPORT int cudaFree(void *ptr)
{
    if (tms_core_owns(ptr)) return tms_hook_free(ptr);
    cuda_free_fn real = (cuda_free_fn)next_symbol((void **)&next_free, "cudaFree");
    return real ? real(ptr) : TMS_CUDA_ERROR_INITIALIZATION;
}

/* For the Python layer: is this library's cudaMalloc the one the process
 * resolves (i.e. was it loaded through LD_PRELOAD)? */
int tms_preload_is_interposed(void)
{
    return dlsym(RTLD_DEFAULT, "cudaMalloc") == (void *)cudaMalloc;
}
