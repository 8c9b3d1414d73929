/* PyTorch's expandable segments: the cuMem* calls its allocator makes itself, adopted by the core. */
#ifndef TMS_CUMEM_H
#define TMS_CUMEM_H

/*
 * With PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PyTorch does not call
 * cudaMalloc: it reserves a range and maps cuMemCreate handles into it itself,
 * through driver entry points it looks up with cudaGetDriverEntryPoint*. The
 * preload library answers those lookups with the wrappers of this file.
 *
 * A handle created by a thread inside a region is served to its owner as a
 * token (an id no driver handle can be: bits 48..62 set) standing for
 * whichever physical handle backs it now. Once the token is mapped and made
 * accessible, the core adopts the memory: pause backs it up and releases it,
 * resume maps new memory at the same address. The owner's later unmap or
 * release of the token is translated to the handle of the moment, or is
 * finished without a driver call while paused (nothing is mapped then). Calls
 * outside regions, and every call on a driver handle, go straight through.
 */

#include <stddef.h>

#include "platform/cuda_abi.h"

/* One of each wrapped entry point (its typedef is cuda_abi.h's), as an owner looked them up. */
struct tms_cumem_entry_points {
    tms_cuMemCreate_fn create;
    tms_cuMemMap_fn map;
    tms_cuMemSetAccess_fn set_access;
    tms_cuMemUnmap_fn unmap;
    tms_cuMemRelease_fn release;
    tms_cuMemExportToShareableHandle_fn export_handle;
    tms_cuMemGetAllocationPropertiesFromHandle_fn props;
    tms_cuMemRetainAllocationHandle_fn retain;
};

/* If symbol is one of the wrapped entry points and *fn its definition,
 * keeps *fn as the real function and puts the wrapper in its place. */
void tms_cumem_wrap(const char *symbol, void **fn);

/* Tokens alive now (created and not yet given back by their owner). */
unsigned long tms_cumem_tokens(void);

#endif
