/* A stand-in CUDA runtime for tests/test_expandable.py: cudaGetDriverEntryPoint* answer with cuMem*
 * functions of its own that count their calls and check every handle they are given is one they
 * made and did not release yet (a token, or a stale handle, reaching them counts as a bad handle). */
#include <string.h>

#define MAX_HANDLES 64
static unsigned long long live[MAX_HANDLES];  /* 0: free slot */
static int creates, releases, bad_handles;

static int forget(unsigned long long h)
{
    for (int i = 0; i < MAX_HANDLES; i++)
        if (h && live[i] == h) return live[i] = 0, 1;
    return 0;
}

static int stub_cuMemCreate(unsigned long long *h, size_t size, const void *prop, unsigned long long flags)
{
    (void)size, (void)prop, (void)flags;
    for (int i = 0; i < MAX_HANDLES; i++) {
        if (live[i]) continue;
        live[i] = 0x5000 + (unsigned long long)++creates * 16;  /* a driver-like heap value */
        *h = live[i];
        return 0;
    }
    return 2;
}

static int stub_cuMemRelease(unsigned long long h)
{
    releases++;
    if (!forget(h)) return bad_handles++, 1;
    return 0;
}

static int stub_cuMemMap(unsigned long long va, size_t size, size_t offset, unsigned long long h,
                         unsigned long long flags)
{
    (void)va, (void)size, (void)offset, (void)flags;
    for (int i = 0; i < MAX_HANDLES; i++)
        if (h && live[i] == h) return 0;
    return bad_handles++, 1;
}

static int stub_cuMemSetAccess(unsigned long long va, size_t size, const void *desc, size_t count)
{
    (void)va, (void)size, (void)desc, (void)count;
    return 0;
}

static int stub_cuMemUnmap(unsigned long long va, size_t size)
{
    (void)va, (void)size;
    return 0;
}

static int stub_cuMemAddressReserve(void) { return 0; }

static void *stub_lookup(const char *symbol)
{
    if (!strcmp(symbol, "cuMemCreate")) return (void *)stub_cuMemCreate;
    if (!strcmp(symbol, "cuMemRelease")) return (void *)stub_cuMemRelease;
    if (!strcmp(symbol, "cuMemMap")) return (void *)stub_cuMemMap;
    if (!strcmp(symbol, "cuMemSetAccess")) return (void *)stub_cuMemSetAccess;
    if (!strcmp(symbol, "cuMemUnmap")) return (void *)stub_cuMemUnmap;
    if (!strcmp(symbol, "cuMemAddressReserve")) return (void *)stub_cuMemAddressReserve;
    return NULL;
}

/* Both lookups answer alike; neither calls the other through the PLT (the preloaded one would answer). */
static int answer(const char *symbol, void **fn, int *status)
{
    *fn = stub_lookup(symbol);
    if (status) *status = *fn ? 0 : 1;
    return 0;
}

int cudaGetDriverEntryPoint(const char *symbol, void **fn, unsigned long long flags, int *status)
{
    (void)flags;
    return answer(symbol, fn, status);
}

int cudaGetDriverEntryPointByVersion(const char *symbol, void **fn, unsigned int version, unsigned long long flags,
                                     int *status)
{
    (void)version, (void)flags;
    return answer(symbol, fn, status);
}

void *stub_function(const char *symbol) { return stub_lookup(symbol); }
int stub_creates(void) { return creates; }
int stub_releases(void) { return releases; }
int stub_bad_handles(void) { return bad_handles; }
