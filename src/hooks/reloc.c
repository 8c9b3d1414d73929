/* Preload mode without LD_PRELOAD: the hooks installed by rewriting the GOT entries of loaded objects. */
#include "hooks/reloc.h"
#include "hooks/elf_symbols.h"

#include <dlfcn.h>
#include <elf.h>
#include <errno.h>
#include <limits.h>
#include <link.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "core/core.h"
#include "platform/config.h"
#include "platform/fork.h"
#include "platform/log.h"

/*
 * Why: a worker started without LD_PRELOAD (a launcher that
 * rewrites the variable, a child that was not configured) would otherwise
 * have unpauseable memory. PyTorch's libraries call cudaMalloc through their
 * GOT; pointing those entries at our hooks is what LD_PRELOAD's symbol
 * interposition achieves, object by object (UCX's memory hooks do the same).
 * dlopen is redirected the same way, so objects loaded later are patched as
 * soon as they are loaded.
 */
#if defined(__x86_64__)
#define RELOC_JUMP_SLOT R_X86_64_JUMP_SLOT
#define RELOC_GLOB_DAT R_X86_64_GLOB_DAT
#elif defined(__aarch64__)
#define RELOC_JUMP_SLOT R_AARCH64_JUMP_SLOT
#define RELOC_GLOB_DAT R_AARCH64_GLOB_DAT
#endif

#define MAX_TARGETS 12

struct target {
    const char *name;
    void *hook;
};

/*
 * A pass runs in two phases. The first, holding no lock of ours, lists the
 * loaded objects, takes a reference on each (so none is unloaded under the
 * second), and plans every store: it asks the loader (dlopen RTLD_NOLOAD,
 * dlsym), which may wait for a thread inside dlopen. The second, under
 * reloc_lock, makes the stores and records them; it never calls into the
 * loader, so a thread that waits for reloc_lock inside a library constructor
 * (holding the loader's lock) cannot deadlock with it. A patched dlopen runs
 * a whole pass before it returns.
 *
 * Another thread may dlclose any object between the listing and the
 * reference, so an object's memory is read only where it cannot be unmapped:
 * inside dl_iterate_phdr's callback (glibc unmaps an object and frees its
 * link map under the lock the iteration holds), or while our reference is
 * held, once the loader confirmed that the reference is to the very object
 * listed. The callback copies what the rest of the pass needs (name, base,
 * dynamic section's address, program headers); it cannot take the reference
 * itself: dlopen there would wait for the loader's main lock while holding
 * the iteration's, the reverse of the order dlopen and dlclose take them in.
 */

/* What a patched object's entries held: where its calls go on. Records are
 * appended to pages that never move and are read by the hooks without a
 * lock; a record of an object that was unloaded and loaded again is marked
 * dead, and the newest live record holding an address wins. A dead record is
 * made live again when the same object comes back at the same place with the
 * same originals (a process that loads and unloads a library in a loop would
 * otherwise use up the records); only slot, slot_hook, made and live change. */
struct patched {
    uintptr_t lo, hi;                 /* its PT_LOAD span */
    uintptr_t dynamic;                /* its identity while loaded */
    /* One patched entry, still the hook while the object is the same, and that
     * hook; atomic: slot_hook is written before slot, slot is NULL until stored. */
    void **slot;
    void *slot_hook;
    void *original[MAX_TARGETS];      /* per target; NULL if it has no entry for it */
    uintptr_t original_dynamic[MAX_TARGETS];  /* the object defining each original (0: unknown) */
    unsigned long made;               /* the epoch it was made live in; under reloc_lock */
    int live;                         /* atomic: its object and the objects its originals are in are loaded */
};
#define PATCHED_PAGE 64
#define PATCHED_PAGES 256
static struct patched *patched_pages[PATCHED_PAGES];  /* filled under reloc_lock */
static size_t patched_count;                           /* atomic: published after the record is complete */

static pthread_mutex_t reloc_lock = PTHREAD_MUTEX_INITIALIZER;  /* guards the records and names below */
static struct target targets[MAX_TARGETS];
static size_t target_count;  /* atomic: published before the first entry is patched */
/* First bytes of the targets' names, set with them: most symbols a large
 * library imports (C++ ones, "_Z...") are passed over without a string compare. */
static unsigned char target_first[256];
static int installed;  /* atomic */
static uintptr_t self_base;  /* set once, before target_count is published */
static char patched_names[8192];
static char static_names[4096];
static unsigned long epoch;  /* atomic: counts records made live; incremented under reloc_lock */

static void *reloc_dlopen(const char *file, int mode);
static int reloc_dlclose(void *handle);

/* dlopen and dlclose are patched too; they are no allocator targets. */
static int is_loader_hook(const void *hook) { return hook == (void *)reloc_dlopen || hook == (void *)reloc_dlclose; }

static struct patched *patched_at(size_t i) { return &patched_pages[i / PATCHED_PAGE][i % PATCHED_PAGE]; }

static const char *shown(const char *name) { return name && *name ? name : "<main program>"; }

/* An object loaded again is patched again: its name is listed once. */
static void append_name(char *list, size_t cap, const char *name)
{
    size_t len = strlen(shown(name));
    for (const char *line = list, *end; (end = strchr(line, '\n')) != NULL; line = end + 1)
        if ((size_t)(end - line) == len && strncmp(line, shown(name), len) == 0) return;
    size_t used = strlen(list);
    snprintf(list + used, cap - used, "%s\n", shown(name));
}

/* glibc stores the dynamic section's addresses relocated, the vDSO's not. */
static uintptr_t dyn_addr(uintptr_t base, ElfW(Addr) value) { return base && value < base ? base + value : value; }

/* A loaded object as the listing saw it: copies, readable after the object is gone. */
struct object {
    char *name;
    uintptr_t base;
    uintptr_t dynamic;  /* its dynamic section: with base, which object this is while it stays loaded */
    ElfW(Phdr) *phdr;
    int phnum;
};

static int inside(const struct object *o, uintptr_t p)
{
    for (int i = 0; i < o->phnum; i++) {
        const ElfW(Phdr) *ph = &o->phdr[i];
        if (ph->p_type == PT_LOAD && p >= o->base + ph->p_vaddr && p < o->base + ph->p_vaddr + ph->p_memsz) return 1;
    }
    return 0;
}

/* 1 if the n bytes at p lie in one readable segment of o. */
static int readable_in(const struct object *o, uintptr_t p, size_t n)
{
    for (int i = 0; i < o->phnum; i++) {
        const ElfW(Phdr) *ph = &o->phdr[i];
        uintptr_t lo = o->base + ph->p_vaddr;
        if (ph->p_type == PT_LOAD && (ph->p_flags & PF_R) && p >= lo && p - lo <= ph->p_memsz &&
            n <= ph->p_memsz - (p - lo))
            return 1;
    }
    return 0;
}

static void span_of(const struct object *o, uintptr_t *lo, uintptr_t *hi)
{
    *lo = UINTPTR_MAX, *hi = 0;
    for (int i = 0; i < o->phnum; i++) {
        const ElfW(Phdr) *ph = &o->phdr[i];
        if (ph->p_type != PT_LOAD) continue;
        if (o->base + ph->p_vaddr < *lo) *lo = o->base + ph->p_vaddr;
        if (o->base + ph->p_vaddr + ph->p_memsz > *hi) *hi = o->base + ph->p_vaddr + ph->p_memsz;
    }
}

/* The protection of the page holding addr now: /proc/self/maps read up to
 * that address (the kernel lists mappings in address order). Read at each
 * store, not once per pass: another thread (another patcher, the loader of
 * another object) may change a page's protection at any time, and restoring
 * what an earlier read said would undo its change or leave the page
 * writable. ENOENT if no mapping holds addr. */
static int page_prot_now(uintptr_t addr, int *prot)
{
    FILE *maps = fopen("/proc/self/maps", "re");
    if (!maps) return errno ? errno : EIO;
    char line[512];
    int rc = ENOENT;
    while (fgets(line, sizeof line, maps)) {
        size_t len = strlen(line);
        int whole = len && line[len - 1] == '\n';
        unsigned long lo, hi;
        char perms[5];
        int parsed = sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) == 3;
        while (!whole && fgets(line, sizeof line, maps)) {  /* the rest of a long path */
            len = strlen(line);
            whole = len && line[len - 1] == '\n';
        }
        if (!parsed) continue;
        if (addr < lo) break;
        if (addr >= hi) continue;
        *prot = (perms[0] == 'r' ? PROT_READ : 0) | (perms[1] == 'w' ? PROT_WRITE : 0) | (perms[2] == 'x' ? PROT_EXEC : 0);
        rc = 0;
        break;
    }
    fclose(maps);
    return rc;
}

/* One aligned pointer store: a thread calling through the entry meanwhile
 * sees the old or the new function, both valid. The page's protection is
 * read just before and put back just after; a change by someone else in
 * those microseconds is the one window left (no call sets a protection
 * conditionally). */
static int store(void **slot, void *value)
{
    int prot;
    int rc = page_prot_now((uintptr_t)slot, &prot);
    if (rc) return rc;
    /* Made writable even where it is: a page made read-only since the read must not fault the store. */
    uintptr_t page = (uintptr_t)slot & ~((uintptr_t)sysconf(_SC_PAGESIZE) - 1);
    if (mprotect((void *)page, (size_t)sysconf(_SC_PAGESIZE), prot | PROT_WRITE) != 0) return errno;
    __atomic_store_n(slot, value, __ATOMIC_RELEASE);
    if (!(prot & PROT_WRITE) && mprotect((void *)page, (size_t)sysconf(_SC_PAGESIZE), prot) != 0)
        tms_log_warn("relocation hooks: cannot make the GOT page at %p read-only again: %s", (void *)page,
                     strerror(errno));
    return 0;
}

static int target_index(const char *name)
{
    size_t count = __atomic_load_n(&target_count, __ATOMIC_ACQUIRE);
    if (!count || !target_first[(unsigned char)name[0]]) return -1;
    for (size_t i = 0; i < count; i++)
        if (strcmp(targets[i].name, name) == 0) return (int)i;
    return -1;
}

static int is_hook(void *p)
{
    size_t count = __atomic_load_n(&target_count, __ATOMIC_ACQUIRE);
    for (size_t i = 0; i < count; i++)
        if (targets[i].hook == p) return 1;
    return 0;
}

/* 1 if r's patched entry lies in o and still holds the hook: o is the object
 * r was made for, not one loaded at its place since. o must be mapped (inside
 * the listing's callback, or held open); an entry outside o is not read. */
static int still_patched(const struct patched *r, const struct object *o)
{
    void **slot = __atomic_load_n(&r->slot, __ATOMIC_ACQUIRE);
    if (!slot || !readable_in(o, (uintptr_t)slot, sizeof *slot)) return 0;
    return __atomic_load_n(slot, __ATOMIC_ACQUIRE) == __atomic_load_n(&r->slot_hook, __ATOMIC_RELAXED);
}

/* ---- phase one: plan, without our lock ---------------------------------------- */

/* Objects planned before, by dynamic section and name, with the record the
 * plan made: a pass skips them while that record is live and its entry still
 * leads to the hooks (else the object was unloaded and maybe loaded again),
 * so a process that dlopens many small libraries does not read every
 * object's relocations each time. Checked inside the listing's callback,
 * where the object is mapped. seen_lock is held for lookups and changes
 * only: never across a call into the loader (it is taken under the loader's
 * lock), and entries of objects no longer loaded are dropped by prune. */
struct seen {
    uintptr_t dynamic;
    char *name;
    size_t record;  /* 1 + the index of its record; 0: nothing to patch */
};
static pthread_mutex_t seen_lock = PTHREAD_MUTEX_INITIALIZER;
static struct seen *seen;
static size_t seen_count;

static int unchanged_since_seen(const struct object *o)
{
    int found = 0;
    size_t record = 0;
    pthread_mutex_lock(&seen_lock);
    for (size_t i = 0; i < seen_count && !found; i++) {
        found = seen[i].dynamic == o->dynamic && !strcmp(seen[i].name, o->name);
        record = seen[i].record;
    }
    pthread_mutex_unlock(&seen_lock);
    if (!found) return 0;
    if (!record) return 1;
    const struct patched *r = patched_at(record - 1);
    return __atomic_load_n(&r->live, __ATOMIC_ACQUIRE) && still_patched(r, o);
}

static void remember(uintptr_t dynamic, const char *name, size_t record)
{
    pthread_mutex_lock(&seen_lock);
    for (size_t i = 0; i < seen_count; i++) {
        if (seen[i].dynamic == dynamic && !strcmp(seen[i].name, name)) {
            seen[i].record = record;
            pthread_mutex_unlock(&seen_lock);
            return;
        }
    }
    pthread_mutex_unlock(&seen_lock);
    char *copy = strdup(name);  /* outside the lock: the loader's callback waits for it */
    pthread_mutex_lock(&seen_lock);
    struct seen *grown = copy ? realloc(seen, (seen_count + 1) * sizeof *seen) : NULL;
    if (grown) {
        seen = grown;
        seen[seen_count++] = (struct seen){dynamic, copy, record};
    } else {
        free(copy);
    }
    pthread_mutex_unlock(&seen_lock);
}

struct store_plan {
    void **slot;
    int target;
};

struct plan {
    struct object o;
    void *handle;                      /* our reference: the object stays loaded until the pass ends */
    const char *defines;               /* a target it defines itself (a runtime), else NULL */
    struct store_plan *stores;
    size_t n_stores;
    void *original[MAX_TARGETS];
    uintptr_t original_dynamic[MAX_TARGETS];
};

/* What o's own lookup scope resolves name to (its dependencies first): the
 * definition its calls reached before the patch. */
static void *resolve_for(const struct plan *p, const char *name)
{
    void *s = dlsym(p->handle, name);
    return s && !inside(&p->o, (uintptr_t)s) && !is_hook(s) ? s : NULL;
}

/* An object that defines an allocator target itself is the runtime (or a
 * copy of it linked in): its own references are left alone. With a GNU hash
 * table its own symbols answer; dlsym would search its whole scope. */
static const char *defined_target(const struct plan *p, const uint32_t *gnu_hash, const ElfW(Sym) *symtab,
                                  const char *strtab)
{
    size_t count = __atomic_load_n(&target_count, __ATOMIC_ACQUIRE);
    for (size_t i = 0; i < count; i++) {
        if (is_loader_hook(targets[i].hook)) continue;
        if (gnu_hash) {
            if (tms_elf_own_definition(gnu_hash, symtab, strtab, targets[i].name)) return targets[i].name;
            continue;
        }
        void *s = dlsym(p->handle, targets[i].name);
        if (s && inside(&p->o, (uintptr_t)s)) return targets[i].name;
    }
    return NULL;
}

/* The target a relocation names: through the object's imports where they are
 * known (n_imports >= 0), which keeps the symbol table out of the loop. */
static int reloc_target(const ElfW(Rela) *r, const ElfW(Sym) *symtab, const char *strtab,
                        const struct tms_elf_import *imports, long n_imports)
{
    if (n_imports < 0) return target_index(strtab + symtab[ELF64_R_SYM(r->r_info)].st_name);
    uint32_t sym = (uint32_t)ELF64_R_SYM(r->r_info);
    for (long k = 0; k < n_imports; k++)
        if (imports[k].symbol == sym) return imports[k].wanted;
    return -1;
}

static void plan_relocs(struct plan *p, const ElfW(Rela) *rel, size_t n, const ElfW(Sym) *symtab, const char *strtab,
                        const struct tms_elf_import *imports, long n_imports)
{
    for (size_t i = 0; i < n; i++) {
        unsigned long type = ELF64_R_TYPE(rel[i].r_info);
        if (type != RELOC_JUMP_SLOT && type != RELOC_GLOB_DAT) continue;
        int t = reloc_target(&rel[i], symtab, strtab, imports, n_imports);
        if (t < 0) continue;
        void **slot = (void **)(p->o.base + rel[i].r_offset);
        if (!readable_in(&p->o, (uintptr_t)slot, sizeof *slot)) continue;  /* a malformed entry: not in the object */
        void *cur = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
        if (!p->original[t]) {
            p->original[t] = inside(&p->o, (uintptr_t)cur) || is_hook(cur) ? resolve_for(p, targets[t].name) : cur;
            /* The object defining it is one the loader keeps loaded while p's
             * is (a dependency, or an object p's references were bound to),
             * so its link map stays valid while our reference is held. */
            Dl_info info;
            struct link_map *lm = NULL;
            if (p->original[t] && dladdr1(p->original[t], &info, (void **)&lm, RTLD_DL_LINKMAP) && lm)
                p->original_dynamic[t] = (uintptr_t)lm->l_ld;
        }
        if (!p->original[t]) {
            /* The hook could not forward what it does not serve: leave the entry. */
            TMS_DEBUG("relocation hooks: %s in %s left alone: no definition to forward to", targets[t].name, p->o.name);
            continue;
        }
        struct store_plan *grown = realloc(p->stores, (p->n_stores + 1) * sizeof *grown);
        if (!grown) return;
        p->stores = grown;
        p->stores[p->n_stores++] = (struct store_plan){slot, t};
    }
}

/* A reference to the object o lists, or NULL if it was unloaded since. By
 * name, dlopen may find another object (one loaded again elsewhere, or one of
 * the same name in another namespace): the link map it answers must be at o's
 * base with o's dynamic section. */
static void *hold(const struct object *o)
{
    void *h = dlopen(o->name[0] ? o->name : NULL, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return NULL;
    struct link_map *lm = NULL;
    if (dlinfo(h, RTLD_DI_LINKMAP, &lm) == 0 && lm && lm->l_addr == o->base && (uintptr_t)lm->l_ld == o->dynamic)
        return h;
    dlclose(h);
    return NULL;
}

static void plan_object(struct plan *p)
{
    const struct object *o = &p->o;
    if (!(p->handle = hold(o))) return;
    /* From here on the object cannot be unloaded: its memory is read freely. */
    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const ElfW(Rela) *jmprel = NULL, *rela = NULL;
    const uint32_t *gnu_hash = NULL;
    size_t jmprel_bytes = 0, rela_bytes = 0, relative = 0;
    int pltrel_is_rela = 1;
    for (const ElfW(Dyn) *d = (const ElfW(Dyn) *)o->dynamic; d->d_tag != DT_NULL; d++) {
        switch (d->d_tag) {
        case DT_RELACOUNT: relative = d->d_un.d_val; break;
        case DT_GNU_HASH: gnu_hash = (const uint32_t *)dyn_addr(o->base, d->d_un.d_ptr); break;
        case DT_SYMTAB: symtab = (const ElfW(Sym) *)dyn_addr(o->base, d->d_un.d_ptr); break;
        case DT_STRTAB: strtab = (const char *)dyn_addr(o->base, d->d_un.d_ptr); break;
        case DT_JMPREL: jmprel = (const ElfW(Rela) *)dyn_addr(o->base, d->d_un.d_ptr); break;
        case DT_PLTRELSZ: jmprel_bytes = d->d_un.d_val; break;
        case DT_RELA: rela = (const ElfW(Rela) *)dyn_addr(o->base, d->d_un.d_ptr); break;
        case DT_RELASZ: rela_bytes = d->d_un.d_val; break;
        case DT_PLTREL: pltrel_is_rela = d->d_un.d_val == DT_RELA; break;
        }
    }
    if (!symtab || !strtab) return;
    if (gnu_hash && (!readable_in(o, (uintptr_t)gnu_hash, 4 * sizeof *gnu_hash) ||
                     !readable_in(o, (uintptr_t)symtab, tms_elf_first_hashed(gnu_hash) * sizeof *symtab)))
        gnu_hash = NULL;  /* not what a linker writes: the slow way, through the loader */
    if ((p->defines = defined_target(p, gnu_hash, symtab, strtab))) return;
    /* Every symbol an object imports lies below the first hashed one: an object
     * importing no target has no entry to patch, and one that does is matched by
     * symbol index, relocation by relocation. */
    struct tms_elf_import imports[2 * MAX_TARGETS];
    long n_imports = -1;
    if (gnu_hash) {
        size_t n = tms_elf_imports(gnu_hash, symtab, strtab, target_index, imports, sizeof imports / sizeof *imports);
        if (!n) return;
        if (n <= sizeof imports / sizeof *imports) n_imports = (long)n;
    }
    if (jmprel && pltrel_is_rela)
        plan_relocs(p, jmprel, jmprel_bytes / sizeof *jmprel, symtab, strtab, imports, n_imports);
    /* The linker puts the relative relocations, which name no symbol, first and
     * counts them: a large library has hundreds of thousands, read for nothing. */
    size_t n_rela = rela_bytes / sizeof *rela;
    if (relative > n_rela) relative = n_rela;
    if (rela) plan_relocs(p, rela + relative, n_rela - relative, symtab, strtab, imports, n_imports);
}

struct object_list {
    struct object *items;
    size_t count, cap;
};

static void object_free(struct object *o)
{
    free(o->name);
    free(o->phdr);
}

/* The listing's callback: the object stays mapped until it returns, so this
 * is where its program headers (and, for an object seen before, its patched
 * entry) are read. It calls nothing of the loader's. */
static int collect(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    struct object_list *l = data;
    const char *name = info->dlpi_name ? info->dlpi_name : "";
    uintptr_t dynamic = 0;
    for (int i = 0; i < info->dlpi_phnum; i++)
        if (info->dlpi_phdr[i].p_type == PT_DYNAMIC) dynamic = info->dlpi_addr + info->dlpi_phdr[i].p_vaddr;
    if (!dynamic || info->dlpi_addr == self_base || strstr(name, "linux-vdso")) return 0;
    if (l->count == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        struct object *grown = realloc(l->items, cap * sizeof *grown);
        if (!grown) return 1;
        l->items = grown;
        l->cap = cap;
    }
    size_t phdr_bytes = info->dlpi_phnum * sizeof(ElfW(Phdr));
    struct object o = {strdup(name), info->dlpi_addr, dynamic, malloc(phdr_bytes), info->dlpi_phnum};
    if (!o.name || !o.phdr) {
        object_free(&o);
        return 1;
    }
    memcpy(o.phdr, info->dlpi_phdr, phdr_bytes);
    if (unchanged_since_seen(&o)) object_free(&o);
    else l->items[l->count++] = o;
    return 0;
}

/* ---- phase two: store, under reloc_lock ----------------------------------------- */

/* p's object is held open. Returns the live record made for it if its entry
 * still leads to the hook (*index set). Every other live record over its
 * addresses is of an object unloaded since (its GOT is gone, or new if the
 * object was loaded again) and dies, so no call from p's object is forwarded
 * by it. */
static struct patched *record_of_locked(const struct plan *p, uintptr_t lo, uintptr_t hi, size_t *index)
{
    struct patched *found = NULL;
    for (size_t i = patched_count; i-- > 0;) {
        struct patched *r = patched_at(i);
        if (!r->live || r->hi <= lo || r->lo >= hi) continue;
        if (!found && r->dynamic == p->o.dynamic && still_patched(r, &p->o)) {
            found = r, *index = i;
            continue;
        }
        __atomic_store_n(&r->live, 0, __ATOMIC_RELEASE);
    }
    return found;
}

/* A dead record that is exactly what p would record (the object loaded again
 * at the same place, its originals the same): made live again, the readers
 * see no field they use change. */
static struct patched *dead_twin_locked(const struct plan *p, uintptr_t lo, uintptr_t hi, size_t *index)
{
    for (size_t i = patched_count; i-- > 0;) {
        struct patched *r = patched_at(i);
        if (!r->live && r->dynamic == p->o.dynamic && r->lo == lo && r->hi == hi &&
            !memcmp(r->original, p->original, sizeof r->original) &&
            !memcmp(r->original_dynamic, p->original_dynamic, sizeof r->original_dynamic)) {
            *index = i;
            return r;
        }
    }
    return NULL;
}

/* Returns what remember keeps: 1 + the index of the object's record, or 0
 * when there is nothing to patch (or patching failed: not tried again). */
static size_t apply_locked(const struct plan *p)
{
    const struct object *o = &p->o;
    if (p->defines) {
        if (!strstr(o->name, "libcudart") && !strstr(o->name, "libamdhip64") && !strstr(o->name, "torch_memory_saver") &&
            !strstr(static_names, shown(o->name))) {
            append_name(static_names, sizeof static_names, o->name);
            tms_log_warn("relocation hooks: %s defines %s itself (the CUDA runtime linked statically): its "
                         "allocations cannot be hooked without LD_PRELOAD", shown(o->name), p->defines);
        }
        return 0;
    }
    if (!p->n_stores) return 0;
    uintptr_t lo, hi;
    span_of(o, &lo, &hi);
    size_t i = 0;
    struct patched *r = record_of_locked(p, lo, hi, &i);
    if (r) return i + 1;
    /* Live before any entry leads to a hook, so the hook finds where to forward. */
    if ((r = dead_twin_locked(p, lo, hi, &i))) {
        __atomic_store_n(&r->slot, NULL, __ATOMIC_RELAXED);
        r->made = __atomic_add_fetch(&epoch, 1, __ATOMIC_RELEASE);
        __atomic_store_n(&r->live, 1, __ATOMIC_RELEASE);
    } else {
        i = patched_count;
        if (i == PATCHED_PAGE * PATCHED_PAGES) {
            tms_log_warn("relocation hooks: %s not patched: %zu objects patched already", shown(o->name), i);
            return 0;
        }
        struct patched **page = &patched_pages[i / PATCHED_PAGE];
        if (!*page && !(*page = calloc(PATCHED_PAGE, sizeof **page))) return 0;
        r = patched_at(i);
        *r = (struct patched){.lo = lo, .hi = hi, .dynamic = o->dynamic, .live = 1};
        memcpy(r->original, p->original, sizeof r->original);
        memcpy(r->original_dynamic, p->original_dynamic, sizeof r->original_dynamic);
        r->made = __atomic_add_fetch(&epoch, 1, __ATOMIC_RELEASE);
        __atomic_store_n(&patched_count, i + 1, __ATOMIC_RELEASE);
    }
    int patched = 0, stored = 0;
    for (size_t k = 0; k < p->n_stores; k++) {
        void *hook = targets[p->stores[k].target].hook;
        int rc = store(p->stores[k].slot, hook);
        if (rc) {
            tms_log_warn("relocation hooks: cannot patch %s in %s: %s", targets[p->stores[k].target].name,
                         shown(o->name), strerror(rc));
            continue;
        }
        if (!stored) {
            __atomic_store_n(&r->slot_hook, hook, __ATOMIC_RELAXED);
            __atomic_store_n(&r->slot, p->stores[k].slot, __ATOMIC_RELEASE);
            stored = 1;
        }
        if (!is_loader_hook(hook)) patched = 1;
    }
    if (!stored) {
        __atomic_store_n(&r->live, 0, __ATOMIC_RELEASE);
        return 0;
    }
    if (patched) append_name(patched_names, sizeof patched_names, o->name);
    return i + 1;
}

static void prune(void);

/* One whole pass; returns once every object loaded when it began is patched. */
static void patch_all(void)
{
    struct object_list l = {0};
    dl_iterate_phdr(collect, &l);
    struct plan *plans = calloc(l.count ? l.count : 1, sizeof *plans);
    size_t *records = calloc(l.count ? l.count : 1, sizeof *records);
    for (size_t i = 0; plans && records && i < l.count; i++) {
        plans[i].o = l.items[i];
        plan_object(&plans[i]);
    }
    pthread_mutex_lock(&reloc_lock);
    for (size_t i = 0; plans && records && i < l.count; i++)
        if (plans[i].handle) records[i] = apply_locked(&plans[i]);
    pthread_mutex_unlock(&reloc_lock);
    for (size_t i = 0; plans && records && i < l.count; i++)
        if (plans[i].handle) remember(plans[i].o.dynamic, plans[i].o.name, records[i]);
    for (size_t i = 0; plans && i < l.count; i++) {
        if (plans[i].handle) dlclose(plans[i].handle);
        free(plans[i].stores);
    }
    for (size_t i = 0; i < l.count; i++) object_free(&l.items[i]);
    free(records);
    free(plans);
    free(l.items);
    /* Our reference may have been an object's last (its owner closed it
     * meanwhile): its records die as after any dlclose. */
    prune();
}

/* ---- dlopen on behalf of the caller ----------------------------------------- */

/* dlopen resolves a bare name with the calling object's RPATH/RUNPATH; called
 * from here it would use this library's. Search the caller's first. */
static void *open_in(const char *dirs, const char *origin, const char *file, int mode)
{
    char path[PATH_MAX];
    for (const char *p = dirs; p && *p;) {
        const char *end = strchr(p, ':');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        const char *rest = NULL;
        if (len >= 7 && strncmp(p, "$ORIGIN", 7) == 0) rest = p + 7;
        else if (len >= 9 && strncmp(p, "${ORIGIN}", 9) == 0) rest = p + 9;
        int n = -1;
        if (rest && !memchr(rest, '$', len - (size_t)(rest - p)))
            n = snprintf(path, sizeof path, "%s%.*s/%s", origin, (int)(len - (size_t)(rest - p)), rest, file);
        else if (!rest && len && !memchr(p, '$', len))
            n = snprintf(path, sizeof path, "%.*s/%s", (int)len, p, file);
        if (n > 0 && (size_t)n < sizeof path && access(path, F_OK) == 0) {
            void *h = dlopen(path, mode);
            if (h) return h;
        }
        p = end ? end + 1 : p + len;
    }
    return NULL;
}

/* The caller's link map and dynamic section are read without a reference:
 * its object is running this call (or, after a tail call, the frame the call
 * returns to), so it stays loaded unless the program unloads code it runs. */
static void *dlopen_for(const void *caller, const char *file, int mode)
{
    if (!file || strchr(file, '/')) return dlopen(file, mode);
    void *h = dlopen(file, mode | RTLD_NOLOAD);
    if (h) return h;
    Dl_info info;
    struct link_map *lm = NULL;
    if (dladdr1(caller, &info, (void **)&lm, RTLD_DL_LINKMAP) && lm && lm->l_ld) {
        const char *strtab = NULL;
        ElfW(Xword) runpath = 0, rpath = 0;
        int has_runpath = 0, has_rpath = 0;
        for (const ElfW(Dyn) *d = lm->l_ld; d->d_tag != DT_NULL; d++) {
            if (d->d_tag == DT_STRTAB) strtab = (const char *)dyn_addr(lm->l_addr, d->d_un.d_ptr);
            else if (d->d_tag == DT_RUNPATH) runpath = d->d_un.d_val, has_runpath = 1;
            else if (d->d_tag == DT_RPATH) rpath = d->d_un.d_val, has_rpath = 1;
        }
        char origin[PATH_MAX] = "";
        const char *self = lm->l_name && *lm->l_name ? lm->l_name : NULL;
        if (self) snprintf(origin, sizeof origin, "%s", self);
        else if (readlink("/proc/self/exe", origin, sizeof origin - 1) < 0) origin[0] = '\0';
        char *slash = strrchr(origin, '/');
        if (slash) *slash = '\0';
        if (strtab && has_runpath) {
            if ((h = open_in(tms_defaults()->ld_library_path, origin, file, mode))) return h;
            if ((h = open_in(strtab + runpath, origin, file, mode))) return h;
        } else if (strtab && has_rpath && (h = open_in(strtab + rpath, origin, file, mode))) {
            return h;
        }
    }
    return dlopen(file, mode);
}

struct loaded {
    uintptr_t *dynamic;
    size_t count, cap;
};

static int collect_dynamic(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    struct loaded *l = data;
    for (int i = 0; i < info->dlpi_phnum; i++) {
        if (info->dlpi_phdr[i].p_type != PT_DYNAMIC) continue;
        if (l->count == l->cap) {
            size_t cap = l->cap ? 2 * l->cap : 128;
            uintptr_t *grown = realloc(l->dynamic, cap * sizeof *grown);
            if (!grown) return 1;
            l->dynamic = grown, l->cap = cap;
        }
        l->dynamic[l->count++] = info->dlpi_addr + info->dlpi_phdr[i].p_vaddr;
    }
    return 0;
}

static int is_loaded(const struct loaded *l, uintptr_t dynamic)
{
    for (size_t i = 0; i < l->count; i++)
        if (l->dynamic[i] == dynamic) return 1;
    return 0;
}

/* After a dlclose: a record whose object, or an object its originals are
 * in, is no longer loaded dies, so no call is ever forwarded into it, and
 * planned objects no longer loaded are forgotten. Only records made live
 * before the listing began are judged: a newer one is of an object held open
 * while the listing ran, which the prune after its own unload judges. */
static void prune(void)
{
    unsigned long listed_after = __atomic_load_n(&epoch, __ATOMIC_ACQUIRE);
    struct loaded l = {0};
    if (dl_iterate_phdr(collect_dynamic, &l) != 0) {  /* out of memory: keep what is known */
        free(l.dynamic);
        return;
    }
    pthread_mutex_lock(&reloc_lock);
    for (size_t i = 0; i < patched_count; i++) {
        struct patched *r = patched_at(i);
        if (!r->live || r->made > listed_after) continue;
        int gone = !is_loaded(&l, r->dynamic);
        for (size_t t = 0; t < MAX_TARGETS && !gone; t++)
            gone = r->original_dynamic[t] && !is_loaded(&l, r->original_dynamic[t]);
        if (gone) __atomic_store_n(&r->live, 0, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&reloc_lock);
    pthread_mutex_lock(&seen_lock);
    size_t kept = 0;
    for (size_t i = 0; i < seen_count; i++) {
        if (is_loaded(&l, seen[i].dynamic)) seen[kept++] = seen[i];
        else free(seen[i].name);
    }
    seen_count = kept;
    pthread_mutex_unlock(&seen_lock);
    free(l.dynamic);
}

static int reloc_dlclose(void *handle)
{
    int rc = dlclose(handle);
    int saved = errno;
    prune();
    errno = saved;
    return rc;
}

static void *reloc_dlopen(const char *file, int mode)
{
    void *h = dlopen_for(__builtin_return_address(0), file, mode);
    if (h) {
        int saved = errno;
        patch_all();  /* the objects it loaded are patched before their caller can use them */
        errno = saved;
    }
    return h;
}

/* ---- API ------------------------------------------------------------------ */

/* A fork while another thread held a lock of ours: the child starts them
 * free (the records are append-only and published last, so consistent). */
static void locks_free_in_child(void)
{
    pthread_mutex_init(&reloc_lock, NULL);
    pthread_mutex_init(&seen_lock, NULL);
}
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
static void register_atfork(void)
{
    static const struct tms_fork_handlers handlers = {.child = locks_free_in_child};
    tms_fork_register(TMS_FORK_RELOC, &handlers);
}

int tms_reloc_install(const struct tms_reloc_target *t, size_t count, struct tms_err *err)
{
    pthread_once(&atfork_once, register_atfork);
    if (!tms_defaults()->reloc_hooks)
        return tms_fail(err, TMS_E_UNSUPPORTED, 0, "relocation hooks are off (TMS_RELOC_HOOKS=0)");
    if (count + 2 > MAX_TARGETS) return tms_fail(err, TMS_E_ARG, 0, "too many relocation targets (%zu)", count);
    Dl_info self;
    uintptr_t base = dladdr((void *)reloc_dlopen, &self) ? (uintptr_t)self.dli_fbase : 0;  /* loader call: no lock held */
    pthread_mutex_lock(&reloc_lock);
    if (!__atomic_load_n(&target_count, __ATOMIC_ACQUIRE)) {
        self_base = base;
        for (size_t i = 0; i < count; i++) targets[i] = (struct target){t[i].name, t[i].hook};
        targets[count] = (struct target){"dlopen", (void *)reloc_dlopen};
        targets[count + 1] = (struct target){"dlclose", (void *)reloc_dlclose};
        for (size_t i = 0; i < count + 2; i++) target_first[(unsigned char)targets[i].name[0]] = 1;
        __atomic_store_n(&target_count, count + 2, __ATOMIC_RELEASE);
    }
    pthread_mutex_unlock(&reloc_lock);
    patch_all();
    __atomic_store_n(&installed, 1, __ATOMIC_RELEASE);
    TMS_DEBUG("relocation hooks installed; patched:\n%s", patched_names);
    return TMS_OK;
}

int tms_reloc_installed(void) { return __atomic_load_n(&installed, __ATOMIC_ACQUIRE); }

/* No lock: the hooks call this, also while a pass is patching. Records are
 * complete before they are counted and never move. The caller's object's
 * record decides; a call from elsewhere (a tail call through a patched
 * entry returns past its object) takes the newest live record's, whose
 * runtime is still loaded (a dlclose prunes the others). */
void *tms_reloc_original(const char *name, const void *caller)
{
    size_t n = __atomic_load_n(&patched_count, __ATOMIC_ACQUIRE);
    if (!n) return NULL;
    int t = target_index(name);
    if (t < 0) return NULL;
    void *fallback = NULL;
    for (size_t i = n; i-- > 0;) {
        const struct patched *r = patched_at(i);
        if (!__atomic_load_n(&r->live, __ATOMIC_ACQUIRE) || !r->original[t]) continue;
        if ((uintptr_t)caller >= r->lo && (uintptr_t)caller < r->hi) return r->original[t];
        if (!fallback) fallback = r->original[t];
    }
    return fallback;
}

void tms_reloc_report(char *patched, size_t patched_n, char *static_runtime, size_t static_n)
{
    pthread_mutex_lock(&reloc_lock);
    snprintf(patched, patched_n, "%s", patched_names);
    snprintf(static_runtime, static_n, "%s", static_names);
    pthread_mutex_unlock(&reloc_lock);
}
