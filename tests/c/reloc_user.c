/* A library that allocates through the CUDA runtime, as PyTorch's do (tests/test_reloc.py builds it
 * with lazy binding, full RELRO and -fno-plt). user_open names a library to dlopen by bare name:
 * with DT_RUNPATH=$ORIGIN/sub it is found only through this library's own search path. */
#include <dlfcn.h>
#include <stddef.h>

int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);

void *user_alloc(size_t size)
{
    void *p = NULL;
    return cudaMalloc(&p, size) == 0 ? p : NULL;
}

int user_free(void *ptr) { return cudaFree(ptr); }

void *user_open(const char *name)
{
    void *h = dlopen(name, RTLD_NOW);
    /* dlopen knows its caller by the return address: no tail call to it. */
    __asm__ volatile("" : : "r"(h) : "memory");
    return h;
}
