/* The runtime's CUDA IPC calls on this library's memory: a handle of share/ instead of the runtime's, in both hook variants. */
#ifndef TMS_HOOK_IPC_H
#define TMS_HOOK_IPC_H

#include "hooks/hook_preload.h"

/* cudaIpcMemHandle_t: 64 opaque bytes, passed by value to the open call. */
typedef struct {
    char reserved[64];
} tms_ipc_mem_handle;

/* Routers, exported for the shims: memory of this library (and handles it
 * made) are served by share/; anything else goes to next(caller). Each
 * returns a cudaError_t; a failure of ours is logged with its reason and
 * kept for tms_core_last_error(), since the runtime's caller only sees the code. */
int tms_ipc_get_mem_handle(tms_ipc_mem_handle *handle, void *ptr, tms_next_fn next, const void *caller);
int tms_ipc_open_mem_handle(void **ptr, tms_ipc_mem_handle handle, unsigned flags, tms_next_fn next,
                            const void *caller);
int tms_ipc_close_mem_handle(void *ptr, tms_next_fn next, const void *caller);

/* The relocation targets of the three calls, for a variant's install. */
#define TMS_IPC_RELOC_TARGETS                                                            \
    {"cudaIpcGetMemHandle", (void *)tms_own_ipc_get}, {"cudaIpcOpenMemHandle", (void *)tms_own_ipc_open}, \
        {"cudaIpcCloseMemHandle", (void *)tms_own_ipc_close}

/* Defines cudaIpcGetMemHandle, cudaIpcOpenMemHandle and cudaIpcCloseMemHandle
 * with visibility vis ("default" where LD_PRELOAD interposes them, "hidden"
 * where only relocation reaches them) through the routers above, and hidden
 * aliases tms_own_ipc_* for the relocation targets. */
#define TMS_DEFINE_IPC_HOOKS(vis)                                                                                \
    TMS_NEXT_RESOLVER(cudaIpcGetMemHandle)                                                                    \
    TMS_NEXT_RESOLVER(cudaIpcOpenMemHandle)                                                                   \
    TMS_NEXT_RESOLVER(cudaIpcCloseMemHandle)                                                                  \
    __attribute__((visibility(vis))) int cudaIpcGetMemHandle(tms_ipc_mem_handle *handle, void *ptr)    \
    {                                                                                                         \
        return tms_ipc_get_mem_handle(handle, ptr, next_cudaIpcGetMemHandle, __builtin_return_address(0));   \
    }                                                                                                         \
    __attribute__((visibility(vis))) int cudaIpcOpenMemHandle(void **ptr, tms_ipc_mem_handle handle,   \
                                                                     unsigned flags)                          \
    {                                                                                                         \
        return tms_ipc_open_mem_handle(ptr, handle, flags, next_cudaIpcOpenMemHandle,                         \
                                       __builtin_return_address(0));                                          \
    }                                                                                                         \
    __attribute__((visibility(vis))) int cudaIpcCloseMemHandle(void *ptr)                              \
    {                                                                                                         \
        return tms_ipc_close_mem_handle(ptr, next_cudaIpcCloseMemHandle, __builtin_return_address(0));       \
    }                                                                                                         \
    extern int tms_own_ipc_get(tms_ipc_mem_handle *handle, void *ptr)                                         \
        __attribute__((alias("cudaIpcGetMemHandle"), visibility("hidden")));                                  \
    extern int tms_own_ipc_open(void **ptr, tms_ipc_mem_handle handle, unsigned flags)                        \
        __attribute__((alias("cudaIpcOpenMemHandle"), visibility("hidden")));                                 \
    extern int tms_own_ipc_close(void *ptr) __attribute__((alias("cudaIpcCloseMemHandle"), visibility("hidden")));

#endif
