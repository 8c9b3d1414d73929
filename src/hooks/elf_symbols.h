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

/* How many of the symbols below tms_elf_first_hashed() is_wanted accepts by name. */
size_t tms_elf_count_imports(const uint32_t *gnu_hash, const ElfW(Sym) *symtab, const char *strtab,
                             int (*is_wanted)(const char *name));

#endif
