/* The slice of the CUDA driver ABI the cuda backend calls, declared here so
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

enum {
    TMS_CUDA_SUCCESS = 0,
    TMS_CUDA_ERROR_INVALID_VALUE = 1,
    TMS_CUDA_ERROR_OUT_OF_MEMORY = 2,
    TMS_CUDA_ERROR_NOT_INITIALIZED = 3,
    TMS_CUDA_ERROR_DEINITIALIZED = 4,
    TMS_CUDA_ERROR_INVALID_DEVICE = 101,
    TMS_CUDA_ERROR_ILLEGAL_STATE = 401,
    TMS_CUDA_ERROR_NOT_SUPPORTED = 801,
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

#endif
