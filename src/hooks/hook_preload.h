/* The preload variant's hooks (hook_preload.c): the routers it exports for the shims (shim.c), and what the faces ask of it. */
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

/* ---- for the faces of the preload variant (face/module.c) --------------------- */
struct tms_err;
/* 1 if this library's cudaMalloc is the one the process resolves; *winner
 * names the library whose is. */
int tms_preload_active(const char **winner);
/* Installs the relocation hooks (preload mode without LD_PRELOAD). */
int tms_preload_install_relocation(struct tms_err *err);
/* "ld_preload", "relocation" or NULL. */
const char *tms_preload_method(void);
/* The relocation hooks' record (reloc.c): objects patched, and those
 * defining a target themselves. */
void tms_preload_relocation_report(char *patched, size_t patched_n, char *static_runtime, size_t static_n);

#endif
