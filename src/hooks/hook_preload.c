/* Preload variant: cudaMalloc/cudaFree (and hipMalloc/hipFree) defined here; regions go to the core, the rest forwards. */
#include <dlfcn.h>
#include <stddef.h>
#include <string.h>

#include "core/core.h"
#include "hooks/cumem.h"
#include "hooks/hook.h"
#include "hooks/hook_forward.h"
#include "hooks/hook_preload.h"
#include "hooks/ipc.h"
#include "hooks/reloc.h"
#include "platform/log.h"
#include "hooks/variant.h"

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);

/* The next definition is resolved on first forward: libcudart may be
 * loaded after this library. */
static int route_malloc(void **ptr, size_t size, tms_next_fn next, const void *caller)
{
    if (tms_core_region()->active) return tms_hook_alloc(ptr, size, -1);
    malloc_fn real = (malloc_fn)next(caller);
    return real ? real(ptr, size) : TMS_CUDA_ERROR_INITIALIZATION;
}

static int route_free(void *ptr, tms_next_fn next, const void *caller)
{
    if (tms_core_owns(ptr)) return tms_hook_free(ptr);
    free_fn real = (free_fn)next(caller);
    return real ? real(ptr) : TMS_CUDA_ERROR_INITIALIZATION;
}

/* Only PyTorch's own lookups get the cuMem* wrappers: other libraries
 * (NCCL, Triton, extensions) keep the driver's functions untouched. */
static int asked_by_pytorch(const void *caller)
{
    Dl_info info;
    if (!caller || !dladdr(caller, &info) || !info.dli_fname) return 0;
    const char *slash = strrchr(info.dli_fname, '/');
    return strncmp(slash ? slash + 1 : info.dli_fname, "libc10_cuda", 11) == 0;
}

static int route_entry_point(const char *symbol, void **fn, int status, const void *caller)
{
    if (status == 0 && fn && *fn && asked_by_pytorch(caller)) tms_cumem_wrap(symbol, fn);
    return status;
}

TMS_EXPORT int tms_preload_malloc(void **ptr, size_t size, tms_next_fn next, const void *caller)
{
    return route_malloc(ptr, size, next, caller);
}
TMS_EXPORT int tms_preload_entry_point(const char *symbol, void **fn, int status, const void *caller)
{
    return route_entry_point(symbol, fn, status, caller);
}
TMS_EXPORT int tms_preload_free(void *ptr, tms_next_fn next, const void *caller)
{
    return route_free(ptr, next, caller);
}

TMS_DEFINE_ALLOCATOR_HOOKS(cudaMalloc, cudaFree, route_malloc, route_free)
/* ROCm builds of PyTorch call the HIP names; the routing is the same and the
 * error codes the hooks return (0, 2 = out of memory, 3, 999) mean the same. */
TMS_DEFINE_ALLOCATOR_HOOKS(hipMalloc, hipFree, route_malloc, route_free)
TMS_DEFINE_ENTRY_POINT_HOOKS(route_entry_point)
TMS_DEFINE_IPC_HOOKS("default")

/* Hidden aliases name this library's own definitions: taking &cudaMalloc
 * would go through the GOT and find whichever definition wins. */
extern int tms_own_cuda_malloc(void **ptr, size_t size)
    __attribute__((alias("cudaMalloc"), visibility("hidden")));
extern int tms_own_cuda_free(void *ptr) __attribute__((alias("cudaFree"), visibility("hidden")));
extern int tms_own_hip_malloc(void **ptr, size_t size) __attribute__((alias("hipMalloc"), visibility("hidden")));
extern int tms_own_hip_free(void *ptr) __attribute__((alias("hipFree"), visibility("hidden")));
extern int tms_own_entry_point(const char *symbol, void **fn, unsigned long long flags, int *status)
    __attribute__((alias("cudaGetDriverEntryPoint"), visibility("hidden")));
extern int tms_own_entry_point_by_version(const char *symbol, void **fn, unsigned int version, unsigned long long flags,
                                          int *status)
    __attribute__((alias("cudaGetDriverEntryPointByVersion"), visibility("hidden")));
extern int tms_own_preload_malloc(void **ptr, size_t size, tms_next_fn next, const void *caller)
    __attribute__((alias("tms_preload_malloc"), visibility("hidden")));

/* ---- the faces' questions (hooks/variant.h) ------------------------------------ */

int tms_variant_hooks_allocator(void) { return 1; }

/* 1 if the cudaMalloc the process resolves is this library's, or a shim's
 * that routes into this library (an upstream-named file on LD_PRELOAD); 0 if
 * none or another is; *winner names the library that defines the one that
 * wins, if any. */
int tms_variant_preload_active(const char **winner)
{
    /* The main program's handle searches the global scope only, which is
     * what PyTorch's references resolve against first; RTLD_DEFAULT from
     * here would also search this library's own local scope. */
    void *global = dlopen(NULL, RTLD_NOW);
    void *found = global ? dlsym(global, "cudaMalloc") : NULL;
    if (global) dlclose(global);
    Dl_info info;
    *winner = (found && dladdr(found, &info)) ? info.dli_fname : NULL;
    if (found == (void *)tms_own_cuda_malloc) return 1;
    if (!*winner) return 0;
    /* A shim's own scope reaches the library it routes into. */
    void *lib = dlopen(*winner, RTLD_LAZY | RTLD_NOLOAD);
    void *router = lib ? dlsym(lib, "tms_preload_malloc") : NULL;
    if (lib) dlclose(lib);
    return router == (void *)tms_own_preload_malloc;
}

int tms_variant_install_relocation(struct tms_err *err)
{
    const struct tms_reloc_target hooks[] = {
        {"cudaMalloc", (void *)tms_own_cuda_malloc}, {"cudaFree", (void *)tms_own_cuda_free},
        {"hipMalloc", (void *)tms_own_hip_malloc}, {"hipFree", (void *)tms_own_hip_free},
        {"cudaGetDriverEntryPoint", (void *)tms_own_entry_point},
        {"cudaGetDriverEntryPointByVersion", (void *)tms_own_entry_point_by_version},
        TMS_IPC_RELOC_TARGETS,
    };
    return tms_reloc_install(hooks, sizeof hooks / sizeof *hooks, err);
}

const char *tms_variant_preload_method(void)
{
    const char *winner;
    if (tms_variant_preload_active(&winner)) return "ld_preload";
    return tms_reloc_installed() ? "relocation" : NULL;
}

void tms_variant_relocation_report(char *patched, size_t patched_n, char *static_runtime, size_t static_n)
{
    tms_reloc_report(patched, patched_n, static_runtime, static_n);
}

/* This library defines the IPC calls: where LD_PRELOAD interposes its cudaMalloc it
 * interposes them too; else the relocation hooks cover them. */
int tms_variant_install_ipc_hooks(struct tms_err *err)
{
    const char *winner;
    return tms_variant_preload_active(&winner) ? TMS_OK : tms_variant_install_relocation(err);
}

/* The region that asks has installed the allocator hooks already: nothing is left to run beside it. */
void tms_variant_install_ipc_hooks_later(void)
{
    struct tms_err err = {0};
    if (tms_variant_install_ipc_hooks(&err)) TMS_DEBUG("IPC hooks not installed: %s", err.msg);
}
