/* The preload variant's hooks (hook_preload.c): the routers it exports for the shims (shim.c). What the faces ask of it is hooks/variant.h. */
#ifndef TMS_HOOK_PRELOAD_H
#define TMS_HOOK_PRELOAD_H

#include <stddef.h>

/* The next definition of an interposed function, as seen from its caller. */
typedef void *(*tms_next_fn)(const void *caller);

/* cudaMalloc / cudaFree (and the HIP names) of a shim land here: a region's
 * allocation goes to the core, anything else to next(caller). */
int tms_preload_malloc(void **ptr, size_t size, tms_next_fn next, const void *caller);
int tms_preload_free(void *ptr, tms_next_fn next, const void *caller);
/* The runtime's lookup of a driver entry point went through a shim: PyTorch's
 * lookups of cuMem* get the expandable-segment wrappers (cumem.c). */
int tms_preload_entry_point(const char *symbol, void **fn, int status, const void *caller);

#endif
