/* Compile-time check that platform/cuda_abi.h (its types, constants and entry table) matches the real cuda.h. */
#include <cuda.h>
#include <driver_types.h>
#include <stddef.h>
#include <stdio.h>

/* The backend itself, so the TMS_CUDA_ENTRIES table and its typedefs are in reach.
 * cuda.h is included first on purpose: its version macros (cuMemGetInfo ->
 * cuMemGetInfo_v2, ...) rename the table's fields consistently, and the
 * checks below see the names the header maps them to. */
#include "platform/driver_cuda.c"
#include "hooks/hook.h"

#define SAME_CONST(name) \
    _Static_assert((long long)TMS_##name == (long long)name, "cuda_abi.h: TMS_" #name " != cuda.h " #name)
#define SAME_SIZE(ours, real) \
    _Static_assert(sizeof(ours) == sizeof(real) && _Alignof(ours) == _Alignof(real), \
                   "cuda_abi.h: " #ours " differs in size or alignment from cuda.h " #real)
#define SAME_FIELD(ours, real, field)                                                    \
    _Static_assert(offsetof(ours, field) == offsetof(real, field) &&                     \
                   sizeof(((ours *)0)->field) == sizeof(((real *)0)->field),             \
                   "cuda_abi.h: " #ours "." #field " differs in offset or size from cuda.h " #real)
#define SAME_TYPE(ours, real) \
    _Static_assert(_Generic((ours *)0, real *: 1, default: 0), "cuda_abi.h: " #ours " is not cuda.h's " #real)

/* ---- scalar types ------------------------------------------------------------ */

SAME_TYPE(tms_CUdevice, CUdevice);
SAME_TYPE(tms_CUdeviceptr, CUdeviceptr);
SAME_TYPE(tms_CUmemHandle, CUmemGenericAllocationHandle);
SAME_SIZE(tms_CUcontext, CUcontext);
SAME_SIZE(tms_CUstream, CUstream);
SAME_SIZE(tms_CUmodule, CUmodule);
SAME_SIZE(tms_CUfunction, CUfunction);
/* CUresult and the struct fields below are enums in cuda.h and int here:
 * same size and alignment, and every value we use fits both. */
SAME_SIZE(tms_CUresult, CUresult);
SAME_SIZE(int, CUmemAllocationType);
SAME_SIZE(int, CUmemAllocationHandleType);
SAME_SIZE(int, CUmemLocationType);
SAME_SIZE(int, CUmemAccess_flags);
SAME_SIZE(int, CUmemAllocationGranularity_flags);
SAME_SIZE(int, CUdevice_attribute);

/* ---- constants --------------------------------------------------------------- */

SAME_CONST(CUDA_SUCCESS);
SAME_CONST(CUDA_ERROR_OUT_OF_MEMORY);
SAME_CONST(CUDA_ERROR_NOT_INITIALIZED);
SAME_CONST(CUDA_ERROR_DEINITIALIZED);
SAME_CONST(CUDA_ERROR_INVALID_DEVICE);
SAME_CONST(CUDA_ERROR_INVALID_VALUE);
SAME_CONST(CUDA_ERROR_ILLEGAL_STATE);
SAME_CONST(CUDA_ERROR_NOT_SUPPORTED);
SAME_CONST(CU_MEM_ALLOCATION_TYPE_PINNED);
SAME_CONST(CU_MEM_LOCATION_TYPE_DEVICE);
SAME_CONST(CU_MEM_ACCESS_FLAGS_PROT_READWRITE);
SAME_CONST(CU_MEM_ALLOC_GRANULARITY_MINIMUM);
SAME_CONST(CU_STREAM_NON_BLOCKING);
SAME_CONST(CU_GET_PROC_ADDRESS_DEFAULT);
SAME_CONST(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED);
SAME_CONST(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
/* Literals in driver_cuda.c. */
_Static_assert(CU_MEMHOSTALLOC_PORTABLE == 0x01, "driver_cuda.c passes 0x01 as CU_MEMHOSTALLOC_PORTABLE");
_Static_assert(CU_MEMHOSTALLOC_DEVICEMAP == 0x02, "driver_cuda.c passes 0x02 as CU_MEMHOSTALLOC_DEVICEMAP");
_Static_assert(CUDA_ABI_VERSION <= CUDA_VERSION, "driver_cuda.c asks for an ABI newer than this cuda.h");

/* cudaError_t values the hooks answer with (hook.h) against the runtime's. */
_Static_assert((int)TMS_CUDA_SUCCESS_RT == (int)cudaSuccess, "hook.h: TMS_CUDA_SUCCESS_RT != cudaSuccess");
_Static_assert((int)TMS_CUDA_ERROR_MEMORY_ALLOCATION == (int)cudaErrorMemoryAllocation,
               "hook.h: TMS_CUDA_ERROR_MEMORY_ALLOCATION != cudaErrorMemoryAllocation");
_Static_assert((int)TMS_CUDA_ERROR_INITIALIZATION == (int)cudaErrorInitializationError,
               "hook.h: TMS_CUDA_ERROR_INITIALIZATION != cudaErrorInitializationError");
_Static_assert((int)TMS_CUDA_ERROR_UNKNOWN == (int)cudaErrorUnknown, "hook.h: TMS_CUDA_ERROR_UNKNOWN != cudaErrorUnknown");

/* ---- struct layouts (a new field in cuda.h shows up as a size mismatch) ------ */

SAME_SIZE(tms_CUmemLocation, CUmemLocation);
SAME_FIELD(tms_CUmemLocation, CUmemLocation, type);
SAME_FIELD(tms_CUmemLocation, CUmemLocation, id);

SAME_SIZE(tms_CUmemAllocationProp, CUmemAllocationProp);
SAME_FIELD(tms_CUmemAllocationProp, CUmemAllocationProp, type);
SAME_FIELD(tms_CUmemAllocationProp, CUmemAllocationProp, requestedHandleTypes);
SAME_FIELD(tms_CUmemAllocationProp, CUmemAllocationProp, location);
SAME_FIELD(tms_CUmemAllocationProp, CUmemAllocationProp, location.type);
SAME_FIELD(tms_CUmemAllocationProp, CUmemAllocationProp, location.id);
SAME_FIELD(tms_CUmemAllocationProp, CUmemAllocationProp, win32HandleMetaData);
SAME_FIELD(tms_CUmemAllocationProp, CUmemAllocationProp, allocFlags);
SAME_FIELD(tms_CUmemAllocationProp, CUmemAllocationProp, allocFlags.compressionType);
SAME_FIELD(tms_CUmemAllocationProp, CUmemAllocationProp, allocFlags.gpuDirectRDMACapable);
SAME_FIELD(tms_CUmemAllocationProp, CUmemAllocationProp, allocFlags.usage);
SAME_FIELD(tms_CUmemAllocationProp, CUmemAllocationProp, allocFlags.reserved);

SAME_SIZE(tms_CUmemAccessDesc, CUmemAccessDesc);
SAME_SIZE(tms_CUuuid, CUuuid);
SAME_FIELD(tms_CUuuid, CUuuid, bytes);
SAME_FIELD(tms_CUmemAccessDesc, CUmemAccessDesc, location);
SAME_FIELD(tms_CUmemAccessDesc, CUmemAccessDesc, location.type);
SAME_FIELD(tms_CUmemAccessDesc, CUmemAccessDesc, location.id);
SAME_FIELD(tms_CUmemAccessDesc, CUmemAccessDesc, flags);

/* ---- entry points -------------------------------------------------------------
 * Every TMS_CUDA_ENTRIES row, with our typedefs spelled as cuda.h's, must be the
 * exact prototype cuda.h declares for that name (C11 type compatibility via
 * _Generic; nothing is called or linked). Caveats, checked by hand below:
 *  - CUresult is an enum there and int here: covered by SAME_SIZE above.
 *  - cuMemGetAllocationGranularity and cuMemExportToShareableHandle take
 *    their enum arguments as int here.
 *  - cuda.h maps a name to its newest version (cuMemGetInfo -> _v2), while
 *    driver_cuda.c asks cuGetProcAddress for CUDA_ABI_VERSION's. Today no
 *    entry changed after 12.0; if a newer header maps one to a version with
 *    other parameters, this check fails and the entry must be reviewed. */

_Static_assert(_Generic(&cuMemGetAllocationGranularity,
                        CUresult (*)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags): 1,
                        default: 0),
               "cuda.h changed cuMemGetAllocationGranularity");
_Static_assert(_Generic(&((struct cuda_api *)0)->cuMemGetAllocationGranularity,
                        tms_CUresult (**)(size_t *, const tms_CUmemAllocationProp *, int): 1, default: 0),
               "driver_cuda.c changed cuMemGetAllocationGranularity: review the hand check above");
/* Stands in for the real one in the table check: same prototype, option as int. */
CUresult tms_check_granularity(size_t *g, const CUmemAllocationProp *prop, int option);
#define cuMemGetAllocationGranularity tms_check_granularity

_Static_assert(_Generic(&cuMemExportToShareableHandle,
                        CUresult (*)(void *, CUmemGenericAllocationHandle, CUmemAllocationHandleType,
                                     unsigned long long): 1,
                        default: 0),
               "cuda.h changed cuMemExportToShareableHandle");
CUresult tms_check_export(void *shareable, CUmemGenericAllocationHandle h, int type, unsigned long long flags);
#define cuMemExportToShareableHandle tms_check_export

_Static_assert(_Generic(&cuMemImportFromShareableHandle,
                        CUresult (*)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType): 1,
                        default: 0),
               "cuda.h changed cuMemImportFromShareableHandle");
CUresult tms_check_import(CUmemGenericAllocationHandle *h, void *shareable, int type);
#define cuMemImportFromShareableHandle tms_check_import

_Static_assert(_Generic(&cuDeviceGetAttribute, CUresult (*)(int *, CUdevice_attribute, CUdevice): 1, default: 0),
               "cuda.h changed cuDeviceGetAttribute");
CUresult tms_check_attribute(int *value, int attribute, CUdevice dev);
#define cuDeviceGetAttribute tms_check_attribute

#define tms_CUresult CUresult
#define tms_CUdevice CUdevice
#define tms_CUcontext CUcontext
#define tms_CUstream CUstream
#define tms_CUdeviceptr CUdeviceptr
#define tms_CUmemHandle CUmemGenericAllocationHandle
#define tms_CUmemAllocationProp CUmemAllocationProp
#define tms_CUmemAccessDesc CUmemAccessDesc
#define tms_CUmodule CUmodule
#define tms_CUfunction CUfunction
#define tms_CUuuid CUuuid

#define CHECK_ENTRY(name, params, presence) \
    _Static_assert(_Generic(&name, CUresult (*) params: 1, default: 0), \
                   "cuda_abi.h: " #name #params " is not cuda.h's prototype");
TMS_CUDA_ENTRIES(CHECK_ENTRY)

#define COUNT_ENTRY(name, params, presence) +1
enum { ENTRY_COUNT = 0 TMS_CUDA_ENTRIES(COUNT_ENTRY) };

/* cuGetProcAddress itself is looked up with dlsym under local typedefs:
 * cuuint64_t is unsigned long there, unsigned long long here, and the
 * status is an enum; same sizes, so the same ABI. */
SAME_SIZE(unsigned long long, cuuint64_t);
SAME_SIZE(int, CUdriverProcAddressQueryResult);
_Static_assert(_Generic(&cuGetProcAddress,
                        CUresult (*)(const char *, void **, int, cuuint64_t, CUdriverProcAddressQueryResult *): 1,
                        default: 0),
               "cuda.h changed cuGetProcAddress_v2: review get_proc_v2_fn in driver_cuda.c");

int main(void)
{
    printf("cuda_abi: cuda_abi.h, hook.h and %d driver entry points match cuda.h (CUDA_VERSION %d)\n",
           ENTRY_COUNT, CUDA_VERSION);
    printf("1 passed, 0 failed\n");
    return 0;
}
