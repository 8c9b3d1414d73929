/* Binds the glibc functions whose default version is newer than 2.28 to their
 * older versions, so the libraries load on glibc 2.28 and later (the wheel's
 * manylinux_2_28 tag; tests/test_build.py reads the dynamic symbol table).
 * glibc 2.34 moved libdl and libpthread into libc and kept these versions
 * there; before 2.34 they live in libdl.so.2 and libpthread.so.0, which the
 * build links with --no-as-needed. Included in every file by the build (-include). */
#ifndef TMS_GLIBC_COMPAT_H
#define TMS_GLIBC_COMPAT_H

#ifdef __linux__
#include <features.h>  /* defines __GLIBC__; this file comes before every other header */
#endif

/* glibc 2.38 redirects strtol and friends to __isoc23_* (GLIBC_2.38) under
 * _GNU_SOURCE; the C23 forms differ only for base 0 or 2 ("0b" prefixes),
 * which nothing here uses. Keep the classic symbols. */
#if defined(__GLIBC_USE_C2X_STRTOL)
#undef __GLIBC_USE_C2X_STRTOL
#define __GLIBC_USE_C2X_STRTOL 0
#endif
#if defined(__GLIBC_USE_C23_STRTOL)
#undef __GLIBC_USE_C23_STRTOL
#define __GLIBC_USE_C23_STRTOL 0
#endif

#if defined(__x86_64__) && defined(__GLIBC__)
__asm__(".symver dlopen,dlopen@GLIBC_2.2.5");
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");
__asm__(".symver dlerror,dlerror@GLIBC_2.2.5");
__asm__(".symver dladdr,dladdr@GLIBC_2.2.5");
__asm__(".symver dladdr1,dladdr1@GLIBC_2.3.3");
__asm__(".symver dlinfo,dlinfo@GLIBC_2.3.3");
__asm__(".symver dlclose,dlclose@GLIBC_2.2.5");
__asm__(".symver pthread_create,pthread_create@GLIBC_2.2.5");
__asm__(".symver pthread_join,pthread_join@GLIBC_2.2.5");
__asm__(".symver pthread_once,pthread_once@GLIBC_2.2.5");
__asm__(".symver pthread_sigmask,pthread_sigmask@GLIBC_2.2.5");
__asm__(".symver pthread_mutex_trylock,pthread_mutex_trylock@GLIBC_2.2.5");
__asm__(".symver pthread_key_create,pthread_key_create@GLIBC_2.2.5");
__asm__(".symver pthread_setspecific,pthread_setspecific@GLIBC_2.2.5");
#endif

#endif
