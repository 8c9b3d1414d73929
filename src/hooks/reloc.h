/* Preload mode without LD_PRELOAD: the hooks installed by rewriting the GOT entries of loaded objects. */
#ifndef TMS_RELOC_H
#define TMS_RELOC_H

#include <stddef.h>

#include "platform/error.h"

/* One symbol to redirect: every loaded object's GOT entry for `name`
 * (JUMP_SLOT or GLOB_DAT) gets `hook`; the definition the entries held
 * before is kept for tms_reloc_original. */
struct tms_reloc_target {
    const char *name;
    void *hook;
};

/* Patches every loaded object that imports a target (except those that
 * define it: the runtime itself, this library, its shims) and, through a
 * patched dlopen, every object loaded later. Read-only relocations (RELRO)
 * are made writable for the store and read-only again; each store is one
 * aligned pointer, safe while other threads call through the entry.
 * Idempotent; returns once every loaded object is patched, as a patched
 * dlopen does for what it loads. TMS_E_UNSUPPORTED when TMS_RELOC_HOOKS=0. */
int tms_reloc_install(const struct tms_reloc_target *targets, size_t count, struct tms_err *err);

/* 1 once tms_reloc_install succeeded in this process. */
int tms_reloc_installed(void);

/* Where the entry for `name` of the patched object holding caller pointed
 * before (its runtime's function), else the newest patched object's; NULL
 * if none. */
void *tms_reloc_original(const char *name, const void *caller);

/* Names (one per line) of the objects patched so far and of those that
 * define a target themselves (a statically linked runtime: not hookable),
 * for tests and `info`. Copied into buf, truncated to n. */
void tms_reloc_report(char *patched, size_t patched_n, char *static_runtime, size_t static_n);

#endif
