/* What both hook variants share: routing an allocator call into the core. */
#include "hooks/hook.h"

#include "core/core.h"

static int answer(const struct tms_err *err, int rc)
{
    if (rc == TMS_OK) return TMS_CUDA_SUCCESS_RT;
    tms_core_keep_error(err);
    if (rc == TMS_E_OOM) return TMS_CUDA_ERROR_MEMORY_ALLOCATION;
    if (rc == TMS_E_NO_DRIVER) return TMS_CUDA_ERROR_INITIALIZATION;
    return TMS_CUDA_ERROR_UNKNOWN;
}

int tms_hook_alloc(void **ptr, size_t size, int device)
{
    struct tms_err err = {0};
    if (!ptr) {  /* the runtime's answer: nothing allocated, nothing in the table */
        tms_core_keep_error(&(struct tms_err){.status = TMS_E_ARG, .msg = "cudaMalloc: the result pointer is NULL"});
        return TMS_CUDA_ERROR_INVALID_VALUE_RT;
    }
    return answer(&err, tms_core_alloc(size, device, tms_core_region(), ptr, &err));
}

int tms_hook_free(void *ptr)
{
    struct tms_err err = {0};
    return answer(&err, tms_core_free(ptr, &err));
}

