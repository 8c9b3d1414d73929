/* The slice of the HIP runtime ABI the hip backend calls, declared here so the
 * build needs no ROCm headers and links no ROCm library. Layouts
 * follow hip_runtime_api.h of ROCm 6 and 7, which match CUDA's. */
#ifndef TMS_HIP_ABI_H
#define TMS_HIP_ABI_H

#include <stddef.h>

typedef int tms_hipError_t;
typedef struct tms_hipStream_opaque *tms_hipStream_t;
typedef struct tms_hipMemHandle_opaque *tms_hipMemGenericAllocationHandle_t;

enum {
    TMS_hipSuccess = 0,
    TMS_hipErrorOutOfMemory = 2,
    TMS_hipErrorNotInitialized = 3,
    TMS_hipErrorDeinitialized = 4,
    TMS_hipErrorInvalidDevice = 101,
    TMS_hipMemAllocationTypePinned = 1,
    TMS_hipMemLocationTypeDevice = 1,
    TMS_hipMemAccessFlagsProtReadWrite = 3,
    TMS_hipMemAllocationGranularityMinimum = 0,
    TMS_hipStreamNonBlocking = 1,
    TMS_hipMemcpyHostToDevice = 1,
    TMS_hipMemcpyDeviceToHost = 2,
    TMS_hipHostMallocPortable = 1,
};

typedef struct {
    int type;
    int id;
} tms_hipMemLocation;

typedef struct {
    int type;
    int requestedHandleType;
    tms_hipMemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
    } allocFlags;
} tms_hipMemAllocationProp;

typedef struct {
    tms_hipMemLocation location;
    int flags;
} tms_hipMemAccessDesc;

#endif
