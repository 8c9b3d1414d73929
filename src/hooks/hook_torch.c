/* Torch variant: the malloc/free pair a CUDAPluggableAllocator calls. */
#include <stddef.h>
#include <sys/types.h>

#include "hooks/hook.h"
#include "hooks/hook_forward.h"
#include "hooks/ipc.h"
#include "hooks/ipc_later.h"
#include "hooks/reloc.h"
#include "hooks/variant.h"
#include "platform/error.h"

/* Only MemPools of torch_memory_saver use this allocator, so every call is
 * served by the core with the calling thread's region settings (its tag). */
TMS_EXPORT void *tms_torch_malloc(ssize_t size, int device, void *stream)
{
    (void)stream;
    void *ptr = NULL;
    if (size < 0 || tms_hook_alloc(&ptr, (size_t)size, device) != 0) return NULL;
    return ptr;
}

TMS_EXPORT void tms_torch_free(void *ptr, ssize_t size, int device, void *stream)
{
    (void)size, (void)device, (void)stream;
    (void)tms_hook_free(ptr);  /* errors are kept for tms_core_last_error */
}

/* PyTorch's CUDA IPC calls (libc10_cuda's) reach this library only through
 * their GOT entries: this variant is loaded RTLD_LOCAL and interposes nothing. */
TMS_DEFINE_IPC_HOOKS("hidden")

/* ---- the faces' questions (hooks/variant.h): the allocator's are not this variant's -------- */

int tms_variant_hooks_allocator(void) { return 0; }

int tms_variant_preload_active(const char **winner)
{
    *winner = NULL;
    return 0;
}

int tms_variant_install_relocation(struct tms_err *err)
{
    return tms_fail(err, TMS_E_UNSUPPORTED, 0, "the torch hook variant has no allocator hooks to install");
}

const char *tms_variant_preload_method(void) { return NULL; }

void tms_variant_relocation_report(char *patched, size_t patched_n, char *static_runtime, size_t static_n)
{
    if (patched_n) patched[0] = '\0';
    if (static_n) static_runtime[0] = '\0';
}

static int install_ipc_hooks_now(struct tms_err *err)
{
    const struct tms_reloc_target hooks[] = {TMS_IPC_RELOC_TARGETS};
    return tms_reloc_install(hooks, sizeof hooks / sizeof *hooks, err);
}

int tms_variant_install_ipc_hooks(struct tms_err *err) { return tms_ipc_hooks_install(install_ipc_hooks_now, err); }

void tms_variant_install_ipc_hooks_later(void) { tms_ipc_hooks_install_later(install_ipc_hooks_now); }
