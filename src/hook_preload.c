/* Preload variant: cudaMalloc/cudaFree (and hipMalloc/hipFree) defined here; regions go to the core, the rest forwards. */
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

/* ROCm builds of PyTorch call the HIP names; the routing is the same and the
 * error codes the hooks return (0, 2 = out of memory, 3, 999) mean the same. */
static cuda_malloc_fn next_hip_malloc;  /* atomic */
static cuda_free_fn next_hip_free;      /* atomic */

TMS_EXPORT int hipMalloc(void **ptr, size_t size)
{
    if (tms_region_current()->active) return tms_hook_alloc(ptr, size, -1);
    cuda_malloc_fn real = (cuda_malloc_fn)next_symbol((void **)&next_hip_malloc, "hipMalloc");
    return real ? real(ptr, size) : TMS_CUDA_ERROR_INITIALIZATION;
}

TMS_EXPORT int hipFree(void *ptr)
{
    if (tms_core_owns(ptr)) return tms_hook_free(ptr);
    cuda_free_fn real = (cuda_free_fn)next_symbol((void **)&next_hip_free, "hipFree");
    return real ? real(ptr) : TMS_CUDA_ERROR_INITIALIZATION;
}

/* A hidden alias names this library's own definition: taking &cudaMalloc
 * would go through the GOT and find whichever definition wins. */
extern int tms_own_cuda_malloc(void **ptr, size_t size)
    __attribute__((alias("cudaMalloc"), visibility("hidden")));

/* For the Python layer: 1 if this library's cudaMalloc is the one the
 * process resolves (loaded through LD_PRELOAD); 0 if none or another is;
 * *winner names the library that defines the one that wins, if any. */
int tms_preload_is_interposed(const char **winner)
{
    /* The main program's handle searches the global scope only, which is
     * what PyTorch's references resolve against first; RTLD_DEFAULT from
     * here would also search this library's own local scope. */
    void *global = dlopen(NULL, RTLD_NOW);
    void *found = global ? dlsym(global, "cudaMalloc") : NULL;
    if (global) dlclose(global);
    Dl_info info;
    *winner = (found && dladdr(found, &info)) ? info.dli_fname : NULL;
    return found == (void *)tms_own_cuda_malloc;
}
