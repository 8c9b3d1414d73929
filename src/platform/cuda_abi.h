/* The slice of the CUDA driver ABI the cuda backend calls and the hooks wrap, declared here so
 * the build needs no CUDA headers and links no CUDA library (one build serves CUDA 12 and 13).
 * tests/c/test_cuda_abi.c checks every layout and constant against cuda.h. */
#ifndef TMS_CUDA_ABI_H
#define TMS_CUDA_ABI_H

#include <stddef.h>

typedef int tms_CUresult;
typedef int tms_CUdevice;
typedef struct tms_CUctx_opaque *tms_CUcontext;
typedef struct tms_CUstream_opaque *tms_CUstream;
typedef unsigned long long tms_CUdeviceptr;
typedef unsigned long long tms_CUmemHandle;
typedef struct tms_CUmod_opaque *tms_CUmodule;
typedef struct tms_CUfunc_opaque *tms_CUfunction;

enum {
    TMS_CUDA_SUCCESS = 0,
    TMS_CUDA_ERROR_INVALID_VALUE = 1,
    TMS_CUDA_ERROR_OUT_OF_MEMORY = 2,
    TMS_CUDA_ERROR_NOT_INITIALIZED = 3,
    TMS_CUDA_ERROR_DEINITIALIZED = 4,
    TMS_CUDA_ERROR_INVALID_DEVICE = 101,
    TMS_CUDA_ERROR_ILLEGAL_STATE = 401,
    TMS_CUDA_ERROR_NOT_SUPPORTED = 801,
    TMS_CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103,
    TMS_CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
    TMS_CU_MEM_ALLOCATION_TYPE_PINNED = 1,
    TMS_CU_MEM_LOCATION_TYPE_DEVICE = 1,
    TMS_CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3,
    TMS_CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0,
    TMS_CU_STREAM_NON_BLOCKING = 1,
    TMS_CU_GET_PROC_ADDRESS_DEFAULT = 0,
};

typedef struct {
    int type;
    int id;
} tms_CUmemLocation;

typedef struct {
    int type;
    int requestedHandleTypes;
    tms_CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} tms_CUmemAllocationProp;

typedef struct {
    tms_CUmemLocation location;
    int flags;
} tms_CUmemAccessDesc;

typedef struct {
    char bytes[16];
} tms_CUuuid;

/*
 * The driver entry points the library calls (the cuda backend) or wraps
 * (hooks/cumem.c, for PyTorch's expandable segments), each at the ABI of CUDA
 * 12.0: X(name, parameters, REQUIRED or OPTIONAL). The backend's load fails
 * without a required one; an optional one it does not call may be missing
 * (its pointer stays NULL). The typedef tms_<name>_fn of each is made below.
 * tests/c/test_cuda_abi.c checks every row against cuda.h.
 */
#define TMS_CUDA_ENTRIES(X) \
    X(cuInit, (unsigned flags), REQUIRED) \
    X(cuDeviceGetCount, (int *count), REQUIRED) \
    X(cuDeviceGet, (tms_CUdevice *dev, int ordinal), REQUIRED) \
    X(cuDeviceGetPCIBusId, (char *bus_id, int len, tms_CUdevice dev), REQUIRED) \
    X(cuDevicePrimaryCtxRetain, (tms_CUcontext *ctx, tms_CUdevice dev), REQUIRED) \
    X(cuDevicePrimaryCtxGetState, (tms_CUdevice dev, unsigned *flags, int *active), REQUIRED) \
    X(cuCtxGetCurrent, (tms_CUcontext *ctx), REQUIRED) \
    X(cuCtxGetDevice, (tms_CUdevice *dev), REQUIRED) \
    X(cuCtxPushCurrent, (tms_CUcontext ctx), REQUIRED) \
    X(cuCtxPopCurrent, (tms_CUcontext *ctx), REQUIRED) \
    X(cuCtxSynchronize, (void), REQUIRED) \
    X(cuMemGetInfo, (size_t *free_bytes, size_t *total_bytes), REQUIRED) \
    X(cuMemGetAllocationGranularity, (size_t *g, const tms_CUmemAllocationProp *prop, int option), REQUIRED) \
    X(cuMemAddressReserve, (tms_CUdeviceptr *va, size_t size, size_t align, tms_CUdeviceptr addr, \
      unsigned long long flags), REQUIRED) \
    X(cuMemAddressFree, (tms_CUdeviceptr va, size_t size), REQUIRED) \
    X(cuMemCreate, (tms_CUmemHandle *h, size_t size, const tms_CUmemAllocationProp *prop, \
      unsigned long long flags), REQUIRED) \
    X(cuMemRelease, (tms_CUmemHandle h), REQUIRED) \
    X(cuMemMap, (tms_CUdeviceptr va, size_t size, size_t offset, tms_CUmemHandle h, \
      unsigned long long flags), REQUIRED) \
    X(cuMemUnmap, (tms_CUdeviceptr va, size_t size), REQUIRED) \
    X(cuMemSetAccess, (tms_CUdeviceptr va, size_t size, const tms_CUmemAccessDesc *desc, size_t count), \
      REQUIRED) \
    X(cuStreamCreate, (tms_CUstream *stream, unsigned flags), REQUIRED) \
    X(cuStreamSynchronize, (tms_CUstream stream), REQUIRED) \
    X(cuMemcpyDtoHAsync, (void *dst, tms_CUdeviceptr src, size_t n, tms_CUstream stream), REQUIRED) \
    X(cuMemcpyHtoDAsync, (tms_CUdeviceptr dst, const void *src, size_t n, tms_CUstream stream), REQUIRED) \
    X(cuMemHostAlloc, (void **p, size_t size, unsigned flags), REQUIRED) \
    X(cuMemFreeHost, (void *p), REQUIRED) \
    X(cuMemHostRegister, (void *p, size_t size, unsigned flags), REQUIRED) \
    X(cuMemHostUnregister, (void *p), REQUIRED) \
    X(cuGetErrorName, (tms_CUresult code, const char **name), REQUIRED) \
    X(cuMemExportToShareableHandle, (void *shareable, tms_CUmemHandle h, int type, \
      unsigned long long flags), OPTIONAL) \
    X(cuMemGetAllocationPropertiesFromHandle, (tms_CUmemAllocationProp *prop, tms_CUmemHandle h), OPTIONAL) \
    X(cuMemRetainAllocationHandle, (tms_CUmemHandle *h, void *addr), OPTIONAL) \
    X(cuMemImportFromShareableHandle, (tms_CUmemHandle *h, void *shareable, int type), OPTIONAL) \
    X(cuDeviceGetAttribute, (int *value, int attribute, tms_CUdevice dev), OPTIONAL) \
    X(cuModuleLoadData, (tms_CUmodule *module, const void *image), OPTIONAL) \
    X(cuModuleGetFunction, (tms_CUfunction *function, tms_CUmodule module, const char *name), OPTIONAL) \
    X(cuModuleGetGlobal, (tms_CUdeviceptr *dptr, size_t *bytes, tms_CUmodule module, const char *name), OPTIONAL) \
    X(cuMemHostGetDevicePointer, (tms_CUdeviceptr *dptr, void *p, unsigned flags), OPTIONAL) \
    X(cuMemcpyHtoD, (tms_CUdeviceptr dst, const void *src, size_t n), OPTIONAL) \
    X(cuLaunchKernel, (tms_CUfunction function, unsigned grid_x, unsigned grid_y, unsigned grid_z, unsigned block_x, \
      unsigned block_y, unsigned block_z, unsigned shared_bytes, tms_CUstream stream, void **params, \
      void **extra), OPTIONAL) \
    X(cuDeviceGetUuid, (tms_CUuuid *uuid, tms_CUdevice dev), OPTIONAL) \
    X(cuMemsetD8Async, (tms_CUdeviceptr dst, unsigned char value, size_t n, tms_CUstream stream), OPTIONAL)

/* The presence column as a number: 1 for a required entry. */
#define TMS_CUDA_REQUIRED 1
#define TMS_CUDA_OPTIONAL 0

#define TMS_CUDA_TYPEDEF(name, params, presence) typedef tms_CUresult (*tms_##name##_fn) params;
TMS_CUDA_ENTRIES(TMS_CUDA_TYPEDEF)
#undef TMS_CUDA_TYPEDEF

#endif
