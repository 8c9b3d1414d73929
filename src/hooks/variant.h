/* The one seam between the faces and the hook variant they are built with: each variant's hook file (hook_preload.c, hook_torch.c) defines every function here, answering "not applicable" where a question is not its own, so the faces ask without knowing which variant they are in. */
#ifndef TMS_HOOKS_VARIANT_H
#define TMS_HOOKS_VARIANT_H

#include <stddef.h>

struct tms_err;

/* 1 if this variant defines the allocator's entry points (cudaMalloc / cudaFree and the
 * HIP names: the preload variant), so the questions below about them are its own: the
 * CPython face offers preload_active, install_relocation_hooks, relocation_report and
 * preload_method only then. 0 in the torch variant. */
int tms_variant_hooks_allocator(void);

/* 1 if this library's cudaMalloc is the one the process resolves; *winner names the
 * library whose is (NULL: none). Torch variant: 0, and *winner NULL. */
int tms_variant_preload_active(const char **winner);

/* Points every loaded object's GOT entries for the allocator's entry points (and the CUDA
 * IPC calls) at this library, and those of objects loaded later: preload mode without
 * LD_PRELOAD. Idempotent. TMS_E_UNSUPPORTED with TMS_RELOC_HOOKS=0, and in the torch
 * variant (it has no allocator hooks). */
int tms_variant_install_relocation(struct tms_err *err);

/* How the process's allocations reach the hooks: "ld_preload", "relocation", or NULL
 * (not yet, or the torch variant). */
const char *tms_variant_preload_method(void);

/* The relocation hooks' record: the objects patched, and those defining cudaMalloc
 * themselves, one per line (torch variant: both empty). */
void tms_variant_relocation_report(char *patched, size_t patched_n, char *static_runtime, size_t static_n);

/* Routes the runtime's cudaIpc{Get,Open,Close}MemHandle through this library. The preload
 * variant defines them: nothing to do where LD_PRELOAD already interposes them, else the
 * relocation hooks (which include them); the torch variant patches their GOT entries.
 * Idempotent. */
int tms_variant_install_ipc_hooks(struct tms_err *err);
/* The same beside the caller where it takes long (the torch variant's walk of every
 * object), and tms_variant_install_ipc_hooks then waits for it; errors are logged. */
void tms_variant_install_ipc_hooks_later(void);

#endif
