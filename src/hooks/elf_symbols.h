/* What a loaded object's own dynamic symbol table says, read through its GNU hash table. */
#ifndef TMS_HOOKS_ELF_SYMBOLS_H
#define TMS_HOOKS_ELF_SYMBOLS_H

#include <link.h>
#include <stddef.h>
#include <stdint.h>

/* The symbols a GNU hash table leaves out of its buckets come first: every symbol an
 * object imports has an index below this one (the table's second word). */
static inline uint32_t tms_elf_first_hashed(const uint32_t *gnu_hash) { return gnu_hash[1]; }

/* The object's own definition of name (a symbol with a section), or NULL. */
const ElfW(Sym) *tms_elf_own_definition(const uint32_t *gnu_hash, const ElfW(Sym) *symtab, const char *strtab,
                                        const char *name);

struct tms_elf_import {
    uint32_t symbol;  /* its index in the symbol table */
    int wanted;       /* what index_of answered for its name */
};

/* The imported symbols (below tms_elf_first_hashed()) for whose names index_of
 * answers >= 0, up to cap of them in out; returns how many there are, which
 * may exceed cap. */
size_t tms_elf_imports(const uint32_t *gnu_hash, const ElfW(Sym) *symtab, const char *strtab,
                       int (*index_of)(const char *name), struct tms_elf_import *out, size_t cap);

#endif
