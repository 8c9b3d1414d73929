/* A stand-in CUDA runtime for the relocation-hook tests (tests/test_reloc.py): counts the calls that
 * reach it, so a test can tell whether a call went to the library's hook or here. */
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

static int mallocs, frees, ipc_gets;  /* atomic */

int cudaMalloc(void **ptr, size_t size)
{
    __atomic_add_fetch(&mallocs, 1, __ATOMIC_RELAXED);
    *ptr = malloc(size ? size : 1);
    return *ptr ? 0 : 2;
}

int cudaFree(void *ptr)
{
    __atomic_add_fetch(&frees, 1, __ATOMIC_RELAXED);
    free(ptr);
    return 0;
}

/* ROCm builds of PyTorch call the HIP names: the same stand-in. */
int hipMalloc(void **ptr, size_t size) { return cudaMalloc(ptr, size); }
int hipFree(void *ptr) { return cudaFree(ptr); }

/* The runtime's IPC handle of memory it does not know: 64 bytes of 0xAB. */
int cudaIpcGetMemHandle(void *handle, void *ptr)
{
    (void)ptr;
    __atomic_add_fetch(&ipc_gets, 1, __ATOMIC_RELAXED);
    memset(handle, 0xAB, 64);
    return 0;
}

int stub_ipc_gets(void) { return __atomic_load_n(&ipc_gets, __ATOMIC_RELAXED); }
int stub_mallocs(void) { return __atomic_load_n(&mallocs, __ATOMIC_RELAXED); }
int stub_frees(void) { return __atomic_load_n(&frees, __ATOMIC_RELAXED); }
