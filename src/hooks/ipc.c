/* CUDA IPC of this library's memory: the runtime's three calls served by share/ for our pointers and handles, forwarded otherwise. */
#include <stdint.h>
#include <string.h>

#include "core/core.h"
#include "hooks/hook.h"
#include "hooks/ipc.h"
#include "platform/log.h"
#include "share/share.h"

typedef int (*get_fn)(tms_ipc_mem_handle *, void *);
typedef int (*open_fn)(void **, tms_ipc_mem_handle, unsigned);
typedef int (*close_fn)(void *);

/* The runtime's caller (PyTorch, NCCL) sees only a code: the reason goes to the log. */
static int fail(const char *call, const struct tms_err *err)
{
    tms_log_warn("%s: %s", call, err->msg);
    tms_core_keep_error(err);
    return TMS_CUDA_ERROR_INVALID_VALUE_RT;
}

TMS_EXPORT int tms_ipc_get_mem_handle(tms_ipc_mem_handle *handle, void *ptr, tms_next_fn next, const void *caller)
{
    if (handle && ptr && tms_core_holds(ptr)) {
        struct tms_err err = {0};
        uint64_t base;
        size_t size;
        unsigned char bytes[TMS_SHARE_HANDLE_BYTES];
        if (tms_share_export((uint64_t)(uintptr_t)ptr, bytes, &base, &size, &err)) return fail("cudaIpcGetMemHandle", &err);
        memcpy(handle->reserved, bytes, sizeof bytes);
        return TMS_CUDA_SUCCESS_RT;
    }
    get_fn real = (get_fn)next(caller);
    return real ? real(handle, ptr) : TMS_CUDA_ERROR_INITIALIZATION;
}

TMS_EXPORT int tms_ipc_open_mem_handle(void **ptr, tms_ipc_mem_handle handle, unsigned flags, tms_next_fn next,
                                       const void *caller)
{
    if (ptr && tms_share_is_handle((const unsigned char *)handle.reserved)) {
        struct tms_err err = {0};
        uint64_t va;
        size_t size;
        /* Peer access is what the mapping grants the current device: the flag asks nothing more. */
        if (tms_share_open((const unsigned char *)handle.reserved, -1, &va, &size, &err))
            return fail("cudaIpcOpenMemHandle", &err);
        *ptr = (void *)(uintptr_t)va;
        return TMS_CUDA_SUCCESS_RT;
    }
    open_fn real = (open_fn)next(caller);
    return real ? real(ptr, handle, flags) : TMS_CUDA_ERROR_INITIALIZATION;
}

TMS_EXPORT int tms_ipc_close_mem_handle(void *ptr, tms_next_fn next, const void *caller)
{
    if (ptr && tms_share_is_open((uint64_t)(uintptr_t)ptr)) {
        struct tms_err err = {0};
        if (tms_share_close((uint64_t)(uintptr_t)ptr, &err)) return fail("cudaIpcCloseMemHandle", &err);
        return TMS_CUDA_SUCCESS_RT;
    }
    close_fn real = (close_fn)next(caller);
    return real ? real(ptr) : TMS_CUDA_ERROR_INITIALIZATION;
}
