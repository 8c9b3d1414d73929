/* A stand-in CUDA runtime for the relocation-hook tests (tests/test_reloc.py): counts the calls that
 * reach it, so a test can tell whether a call went to the library's hook or here. */
#include <stddef.h>
#include <stdlib.h>

static int mallocs, frees;

int cudaMalloc(void **ptr, size_t size)
{
    mallocs++;
    *ptr = malloc(size ? size : 1);
    return *ptr ? 0 : 2;
}

int cudaFree(void *ptr)
{
    frees++;
    free(ptr);
    return 0;
}

int stub_mallocs(void) { return mallocs; }
int stub_frees(void) { return frees; }
