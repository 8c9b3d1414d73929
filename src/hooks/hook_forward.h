/* The allocator entry points the preload library interposes, shared by hook_preload.c and the shims (shim.c). */
#ifndef TMS_HOOK_FORWARD_H
#define TMS_HOOK_FORWARD_H

#include <dlfcn.h>
#include <stddef.h>

#include "hooks/hook_preload.h"

/*
 * Each interposed function forwards to a router (the preload library's
 * region check) with a resolver of "the next definition": dlsym(RTLD_NEXT)
 * answers relative to the object whose code calls it, so each object that
 * defines cudaMalloc resolves its own next. That matters for the shims: a
 * shim on LD_PRELOAD comes right after the executable in the search order,
 * but the library it needs comes after the executable's own dependencies,
 * libcudart among them for a C program linked with it.
 */
/* When the hooks were installed by relocation (reloc.c) rather than
 * LD_PRELOAD, the library was loaded RTLD_LOCAL and RTLD_NEXT does not see
 * the runtime: the GOT entries it replaced name the definition, one for each
 * patched object (the caller's address says which). Weak and hidden: the
 * shims have no reloc.c and see NULL. */
extern void *tms_reloc_original(const char *name, const void *caller) __attribute__((weak, visibility("hidden")));

#define TMS_NEXT_RESOLVER(fn_name)                                      \
    static void *next_##fn_name(const void *caller)                     \
    {                                                                   \
        static void *slot; /* atomic: what RTLD_NEXT finds never changes */ \
        void *fn = tms_reloc_original ? tms_reloc_original(#fn_name, caller) : NULL; \
        if (fn) return fn;                                              \
        fn = __atomic_load_n(&slot, __ATOMIC_ACQUIRE);                   \
        if (!fn) {                                                      \
            fn = dlsym(RTLD_NEXT, #fn_name);                            \
            __atomic_store_n(&slot, fn, __ATOMIC_RELEASE);               \
        }                                                               \
        return fn;                                                      \
    }

/* Defines malloc_name(void **, size_t) and free_name(void *), exported,
 * routed through route_malloc(ptr, size, next, caller) and
 * route_free(ptr, next, caller); caller is the address the call came from. */
#define TMS_DEFINE_ALLOCATOR_HOOKS(malloc_name, free_name, route_malloc, route_free)          \
    TMS_NEXT_RESOLVER(malloc_name)                                                            \
    TMS_NEXT_RESOLVER(free_name)                                                              \
    __attribute__((visibility("default"))) int malloc_name(void **ptr, size_t size)          \
    {                                                                                         \
        return route_malloc(ptr, size, next_##malloc_name, __builtin_return_address(0));      \
    }                                                                                         \
    __attribute__((visibility("default"))) int free_name(void *ptr)                          \
    {                                                                                         \
        return route_free(ptr, next_##free_name, __builtin_return_address(0));                \
    }

/* The runtime's definition of `name` as seen from the object holding
 * `caller`: for a runtime RTLD_NEXT cannot see (loaded RTLD_LOCAL, as
 * Python loads extension libraries), the caller's own dependencies have it. */
static inline void *tms_next_for_caller(const char *name, const void *caller, const void *self)
{
    Dl_info info;
    if (!caller || !dladdr(caller, &info) || !info.dli_fname) return NULL;
    void *lib = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    void *fn = lib ? dlsym(lib, name) : NULL;
    if (lib) dlclose(lib);
    return fn == self ? NULL : fn;
}

/* The runtime's lookups of driver entry points (PyTorch's expandable
 * segments find cuMemCreate & co. this way): answered by the next
 * definition, then passed to route(symbol, fn, status, caller), which may
 * put a wrapper in *fn. The caller's address says which library asked.
 * status is the cudaError_t (3, initialization error, if there is no next). */
#define TMS_DEFINE_ENTRY_POINT_HOOKS(route)                                                              \
    TMS_NEXT_RESOLVER(cudaGetDriverEntryPoint)                                                           \
    TMS_NEXT_RESOLVER(cudaGetDriverEntryPointByVersion)                                                  \
    __attribute__((visibility("default"))) int cudaGetDriverEntryPoint(const char *symbol, void **fn,   \
                                                                        unsigned long long flags,        \
                                                                        int *status)                     \
    {                                                                                                     \
        typedef int (*lookup_fn)(const char *, void **, unsigned long long, int *);                      \
        const void *caller = __builtin_return_address(0);                                                \
        lookup_fn next = (lookup_fn)next_cudaGetDriverEntryPoint(caller);                                \
        if (!next)                                                                                        \
            next = (lookup_fn)tms_next_for_caller("cudaGetDriverEntryPoint", caller,                     \
                                                  (const void *)cudaGetDriverEntryPoint);                \
        int rc = next ? next(symbol, fn, flags, status) : 3;                                             \
        return route(symbol, fn, rc, caller);                                                            \
    }                                                                                                     \
    __attribute__((visibility("default"))) int cudaGetDriverEntryPointByVersion(                         \
        const char *symbol, void **fn, unsigned int version, unsigned long long flags, int *status)      \
    {                                                                                                     \
        typedef int (*lookup_fn)(const char *, void **, unsigned int, unsigned long long, int *);        \
        const void *caller = __builtin_return_address(0);                                                \
        lookup_fn next = (lookup_fn)next_cudaGetDriverEntryPointByVersion(caller);                       \
        if (!next)                                                                                        \
            next = (lookup_fn)tms_next_for_caller("cudaGetDriverEntryPointByVersion", caller,            \
                                                  (const void *)cudaGetDriverEntryPointByVersion);       \
        int rc = next ? next(symbol, fn, version, flags, status) : 3;                                    \
        return route(symbol, fn, rc, caller);                                                            \
    }


#endif
