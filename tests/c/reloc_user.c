/* A library that allocates through the CUDA runtime, as PyTorch's do (tests/test_reloc.py builds it
 * with lazy binding, full RELRO and -fno-plt). user_open names a library to dlopen by bare name:
 * with DT_RUNPATH=$ORIGIN/sub it is found only through this library's own search path; user_open and
 * user_close reach dlopen and dlclose through this library's GOT (tests/c/reloc_race.c). */
#include <dlfcn.h>
#include <stddef.h>

int cudaMalloc(void **ptr, size_t size);
int cudaFree(void *ptr);
int cudaIpcGetMemHandle(void *handle, void *ptr);
int hipMalloc(void **ptr, size_t size);
int hipFree(void *ptr);

void *user_alloc(size_t size)
{
    void *p = NULL;
    return cudaMalloc(&p, size) == 0 ? p : NULL;
}

int user_free(void *ptr) { return cudaFree(ptr); }

/* PyTorch's CUDA IPC, as libc10_cuda calls it: through the GOT. */
int user_ipc_get(void *handle, void *ptr) { return cudaIpcGetMemHandle(handle, ptr); }

void *user_hip_alloc(size_t size)
{
    void *p = NULL;
    return hipMalloc(&p, size) == 0 ? p : NULL;
}

int user_hip_free(void *ptr) { return hipFree(ptr); }

/* n allocate/free pairs: a thread calling through the GOT while it is patched. */
int user_churn(int n)
{
    int failures = 0;
    for (int i = 0; i < n; i++) {
        void *p = NULL;
        if (cudaMalloc(&p, 64) != 0 || cudaFree(p) != 0) failures++;
    }
    return failures;
}

void *user_open(const char *name)
{
    void *h = dlopen(name, RTLD_NOW);
    /* dlopen knows its caller by the return address: no tail call to it. */
    __asm__ volatile("" : : "r"(h) : "memory");
    return h;
}

int user_close(void *handle) { return dlclose(handle); }

/* dlopens the library at path and allocates n times through its user_alloc at
 * once, in C: no time for another thread's patch pass to finish in between. */
int user_open_and_alloc(const char *path, size_t size, int n, void **out)
{
    void *h = dlopen(path, RTLD_NOW);
    if (!h) return -1;
    void *(*alloc)(size_t) = (void *(*)(size_t))dlsym(h, "user_alloc");
    if (!alloc) return -2;
    for (int i = 0; i < n; i++) out[i] = alloc(size);
    return 0;
}
