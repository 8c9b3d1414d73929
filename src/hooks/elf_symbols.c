/* Lookups in a loaded object's own symbols, without the loader: dlsym would search
 * the object's whole scope, and a scan of its relocations would read all of them. */
#include "hooks/elf_symbols.h"

#include <string.h>

static uint32_t gnu_hash_of(const char *name)
{
    uint32_t h = 5381;
    for (const unsigned char *s = (const unsigned char *)name; *s; s++) h = h * 33 + *s;
    return h;
}

const ElfW(Sym) *tms_elf_own_definition(const uint32_t *gnu_hash, const ElfW(Sym) *symtab, const char *strtab,
                                        const char *name)
{
    const uint32_t n_buckets = gnu_hash[0], first = gnu_hash[1], bloom_words = gnu_hash[2], shift = gnu_hash[3];
    if (!n_buckets || !bloom_words) return NULL;
    const ElfW(Addr) *bloom = (const ElfW(Addr) *)(gnu_hash + 4);
    const uint32_t *buckets = (const uint32_t *)(bloom + bloom_words);
    const uint32_t *chain = buckets + n_buckets;
    const unsigned bits = 8 * sizeof(ElfW(Addr));
    uint32_t h = gnu_hash_of(name);
    ElfW(Addr) word = bloom[(h / bits) % bloom_words];
    ElfW(Addr) mask = ((ElfW(Addr))1 << (h % bits)) | ((ElfW(Addr))1 << ((h >> shift) % bits));
    if ((word & mask) != mask) return NULL;
    uint32_t i = buckets[h % n_buckets];
    if (i < first) return NULL;
    for (;; i++) {
        uint32_t h2 = chain[i - first];
        const ElfW(Sym) *s = &symtab[i];
        if ((h | 1) == (h2 | 1) && s->st_shndx != SHN_UNDEF && strcmp(strtab + s->st_name, name) == 0) return s;
        if (h2 & 1) return NULL;
    }
}

size_t tms_elf_imports(const uint32_t *gnu_hash, const ElfW(Sym) *symtab, const char *strtab,
                       int (*index_of)(const char *name), struct tms_elf_import *out, size_t cap)
{
    size_t n = 0;
    for (uint32_t i = 1; i < tms_elf_first_hashed(gnu_hash); i++) {
        if (symtab[i].st_shndx != SHN_UNDEF) continue;
        int wanted = index_of(strtab + symtab[i].st_name);
        if (wanted < 0) continue;
        if (n < cap) out[n] = (struct tms_elf_import){i, wanted};
        n++;
    }
    return n;
}
