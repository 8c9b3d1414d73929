/* Preload mode without LD_PRELOAD: the hooks installed by rewriting the GOT entries of loaded objects. */
#include "reloc.h"

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

#include "config.h"
#include "log.h"

/*
 * Why (issue 14): a worker started without LD_PRELOAD (a launcher that
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

#define MAX_TARGETS 8

struct target {
    const char *name;
    void *hook;
    void *original;  /* atomic: read by the hooks without the lock */
};

/* An object seen by a pass, by the address of its dynamic section; a
 * patched one keeps a patched slot, which shows whether it was unloaded and
 * loaded again (fresh GOT) at the same place. */
struct seen {
    uintptr_t dynamic;
    void **slot;
    void *hook;
};

struct object {
    char *name;
    uintptr_t base;
    const ElfW(Phdr) *phdr;
    int phnum;
};

static pthread_mutex_t reloc_lock = PTHREAD_MUTEX_INITIALIZER;  /* guards all below */
static struct target targets[MAX_TARGETS];
static size_t target_count;  /* atomic: published before the first entry is patched */
static int installed;  /* atomic */
static uintptr_t self_base;
static struct seen *seen;
static size_t seen_count;
static char patched_names[8192];
static char static_names[4096];

static void *reloc_dlopen(const char *file, int mode);

static void append_name(char *list, size_t cap, const char *name)
{
    size_t used = strlen(list);
    snprintf(list + used, cap - used, "%s\n", name && *name ? name : "<main program>");
}

/* glibc stores the dynamic section's addresses relocated, the vDSO's not. */
static uintptr_t dyn_addr(uintptr_t base, ElfW(Addr) value) { return base && value < base ? base + value : value; }

static int inside(const struct object *o, uintptr_t p)
{
    for (int i = 0; i < o->phnum; i++) {
        const ElfW(Phdr) *ph = &o->phdr[i];
        if (ph->p_type == PT_LOAD && p >= o->base + ph->p_vaddr && p < o->base + ph->p_vaddr + ph->p_memsz) return 1;
    }
    return 0;
}

/* The protection of the page at addr now (RELRO made it read-only after
 * relocation, or the loader left it writable): from /proc/self/maps. */
static int page_prot(uintptr_t addr, int *prot)
{
    FILE *maps = fopen("/proc/self/maps", "re");
    if (!maps) return -1;
    char line[512];
    int found = -1;
    while (found < 0 && fgets(line, sizeof line, maps)) {
        unsigned long lo, hi;
        char perms[5];
        if (sscanf(line, "%lx-%lx %4s", &lo, &hi, perms) != 3 || addr < lo || addr >= hi) continue;
        *prot = (perms[0] == 'r' ? PROT_READ : 0) | (perms[1] == 'w' ? PROT_WRITE : 0) |
                (perms[2] == 'x' ? PROT_EXEC : 0);
        found = 0;
    }
    fclose(maps);
    return found;
}

/* One aligned pointer store: a thread calling through the entry meanwhile
 * sees the old or the new function, both valid. */
static int store(void **slot, void *value)
{
    int prot;
    if (page_prot((uintptr_t)slot, &prot) != 0) return ENOENT;
    if (prot & PROT_WRITE) {
        __atomic_store_n(slot, value, __ATOMIC_RELEASE);
        return 0;
    }
    uintptr_t page = (uintptr_t)slot & ~((uintptr_t)sysconf(_SC_PAGESIZE) - 1);
    if (mprotect((void *)page, (size_t)sysconf(_SC_PAGESIZE), prot | PROT_WRITE) != 0) return errno;
    __atomic_store_n(slot, value, __ATOMIC_RELEASE);
    if (mprotect((void *)page, (size_t)sysconf(_SC_PAGESIZE), prot) != 0)
        tms_log_warn("relocation hooks: cannot make the GOT page at %p read-only again: %s", (void *)page,
                     strerror(errno));
    return 0;
}

static struct target *target_named(const char *name)
{
    size_t count = __atomic_load_n(&target_count, __ATOMIC_ACQUIRE);
    for (size_t i = 0; i < count; i++)
        if (strcmp(targets[i].name, name) == 0) return &targets[i];
    return NULL;
}

static int is_hook(void *p)
{
    for (size_t i = 0; i < target_count; i++)
        if (targets[i].hook == p) return 1;
    return 0;
}

/* An object that defines an allocator target itself is the runtime (or a
 * copy of it linked in): its own references are left alone. */
static const char *defined_target(const struct object *o)
{
    void *h = dlopen(o->name[0] ? o->name : NULL, RTLD_LAZY | RTLD_NOLOAD);
    if (!h) return NULL;
    const char *which = NULL;
    for (size_t i = 0; i < target_count && !which; i++) {
        if (targets[i].hook == (void *)reloc_dlopen) continue;
        void *s = dlsym(h, targets[i].name);
        if (s && inside(o, (uintptr_t)s)) which = targets[i].name;
    }
    dlclose(h);
    return which;
}

/* Where o's entry for t leads if it is not resolved yet (lazy binding):
 * what o's own lookup scope resolves the name to. */
static void *resolve_for(const struct object *o, const char *name)
{
    void *h = dlopen(o->name[0] ? o->name : NULL, RTLD_LAZY | RTLD_NOLOAD);
    void *s = h ? dlsym(h, name) : NULL;
    if (h) dlclose(h);
    return s && !inside(o, (uintptr_t)s) && !is_hook(s) ? s : NULL;
}

static void patch_relocs(const struct object *o, const ElfW(Rela) *rel, size_t n, const ElfW(Sym) *symtab,
                         const char *strtab, struct seen *record, int *patched)
{
    for (size_t i = 0; i < n; i++) {
        unsigned long type = ELF64_R_TYPE(rel[i].r_info);
        if (type != RELOC_JUMP_SLOT && type != RELOC_GLOB_DAT) continue;
        struct target *t = target_named(strtab + symtab[ELF64_R_SYM(rel[i].r_info)].st_name);
        if (!t) continue;
        void **slot = (void **)(o->base + rel[i].r_offset);
        void *cur = __atomic_load_n(slot, __ATOMIC_ACQUIRE);
        if (cur == t->hook) continue;
        if (!__atomic_load_n(&t->original, __ATOMIC_ACQUIRE)) {
            void *orig = inside(o, (uintptr_t)cur) || is_hook(cur) ? resolve_for(o, t->name) : cur;
            __atomic_store_n(&t->original, orig, __ATOMIC_RELEASE);  /* before any call can reach the hook */
        }
        if (!__atomic_load_n(&t->original, __ATOMIC_ACQUIRE)) {
            /* The hook could not forward what it does not serve: leave the entry. */
            TMS_DEBUG("relocation hooks: %s in %s left alone: no definition to forward to", t->name, o->name);
            continue;
        }
        int rc = store(slot, t->hook);
        if (rc) {
            tms_log_warn("relocation hooks: cannot patch %s in %s: %s", t->name, o->name[0] ? o->name : "<main>",
                         strerror(rc));
            continue;
        }
        if (!record->slot) record->slot = slot, record->hook = t->hook;
        if (t->hook != (void *)reloc_dlopen) *patched = 1;
    }
}

static void patch_object(const struct object *o)
{
    const ElfW(Phdr) *dyn_ph = NULL;
    for (int i = 0; i < o->phnum; i++)
        if (o->phdr[i].p_type == PT_DYNAMIC) dyn_ph = &o->phdr[i];
    if (!dyn_ph || o->base == self_base || strstr(o->name, "linux-vdso")) return;
    uintptr_t dynamic = o->base + dyn_ph->p_vaddr;
    for (size_t i = 0; i < seen_count; i++) {
        if (seen[i].dynamic != dynamic) continue;
        if (!seen[i].slot || __atomic_load_n(seen[i].slot, __ATOMIC_ACQUIRE) == seen[i].hook) return;
        seen[i] = seen[--seen_count];  /* unloaded and loaded again: its GOT is new */
        break;
    }
    struct seen *grown = realloc(seen, (seen_count + 1) * sizeof *seen);
    if (!grown) return;
    seen = grown;
    struct seen *record = &seen[seen_count++];
    *record = (struct seen){.dynamic = dynamic};

    const ElfW(Sym) *symtab = NULL;
    const char *strtab = NULL;
    const ElfW(Rela) *jmprel = NULL, *rela = NULL;
    size_t jmprel_bytes = 0, rela_bytes = 0;
    int pltrel_is_rela = 1;
    for (const ElfW(Dyn) *d = (const ElfW(Dyn) *)dynamic; d->d_tag != DT_NULL; d++) {
        switch (d->d_tag) {
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
    const char *defines = defined_target(o);
    if (defines) {
        if (!strstr(o->name, "libcudart") && !strstr(o->name, "libamdhip64") && !strstr(o->name, "torch_memory_saver")) {
            append_name(static_names, sizeof static_names, o->name);
            tms_log_warn("relocation hooks: %s defines %s itself (the CUDA runtime linked statically): its "
                         "allocations cannot be hooked without LD_PRELOAD", o->name[0] ? o->name : "<main program>",
                         defines);
        }
        return;
    }
    int patched = 0;
    if (jmprel && pltrel_is_rela) patch_relocs(o, jmprel, jmprel_bytes / sizeof *jmprel, symtab, strtab, record, &patched);
    if (rela) patch_relocs(o, rela, rela_bytes / sizeof *rela, symtab, strtab, record, &patched);
    if (patched) append_name(patched_names, sizeof patched_names, o->name);
}

struct object_list {
    struct object *items;
    size_t count, cap;
};

static int collect(struct dl_phdr_info *info, size_t size, void *data)
{
    (void)size;
    struct object_list *l = data;
    if (l->count == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        struct object *grown = realloc(l->items, cap * sizeof *grown);
        if (!grown) return 1;
        l->items = grown;
        l->cap = cap;
    }
    char *name = strdup(info->dlpi_name ? info->dlpi_name : "");
    if (!name) return 1;
    l->items[l->count++] = (struct object){name, info->dlpi_addr, info->dlpi_phdr, info->dlpi_phnum};
    return 0;
}

/* Objects are listed first and patched after: the patching itself calls
 * dlopen (RTLD_NOLOAD), which must not run inside dl_iterate_phdr. */
static void patch_all_locked(void)
{
    struct object_list l = {0};
    dl_iterate_phdr(collect, &l);
    for (size_t i = 0; i < l.count; i++) patch_object(&l.items[i]);
    for (size_t i = 0; i < l.count; i++) free(l.items[i].name);
    free(l.items);
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
            if ((h = open_in(getenv("LD_LIBRARY_PATH"), origin, file, mode))) return h;
            if ((h = open_in(strtab + runpath, origin, file, mode))) return h;
        } else if (strtab && has_rpath && (h = open_in(strtab + rpath, origin, file, mode))) {
            return h;
        }
    }
    return dlopen(file, mode);
}

/* A pass asked for while another thread holds reloc_lock. */
static int pass_pending;  /* atomic */

/* Never waits for reloc_lock: this runs inside dlopen, possibly in a
 * library constructor under the loader's lock, while the thread holding
 * reloc_lock may be waiting for that loader lock (its pass calls dlopen).
 * A busy lock leaves the pass pending; its holder runs it before leaving. */
static void patch_all_soon(void)
{
    __atomic_store_n(&pass_pending, 1, __ATOMIC_RELEASE);
    while (__atomic_load_n(&pass_pending, __ATOMIC_ACQUIRE) && pthread_mutex_trylock(&reloc_lock) == 0) {
        while (__atomic_exchange_n(&pass_pending, 0, __ATOMIC_ACQ_REL)) patch_all_locked();
        pthread_mutex_unlock(&reloc_lock);
    }
}

static void *reloc_dlopen(const char *file, int mode)
{
    void *h = dlopen_for(__builtin_return_address(0), file, mode);
    if (h) {
        int saved = errno;
        patch_all_soon();
        errno = saved;
    }
    return h;
}

/* ---- API ------------------------------------------------------------------ */

int tms_reloc_install(const struct tms_reloc_target *t, size_t count, struct tms_err *err)
{
    if (!tms_defaults()->reloc_hooks)
        return tms_fail(err, TMS_E_UNSUPPORTED, 0, "relocation hooks are off (TMS_RELOC_HOOKS=0)");
    if (count + 1 > MAX_TARGETS) return tms_fail(err, TMS_E_ARG, 0, "too many relocation targets (%zu)", count);
    pthread_mutex_lock(&reloc_lock);
    if (!target_count) {
        Dl_info self;
        if (dladdr((void *)reloc_dlopen, &self)) self_base = (uintptr_t)self.dli_fbase;
        for (size_t i = 0; i < count; i++) targets[i] = (struct target){t[i].name, t[i].hook, NULL};
        targets[count] = (struct target){"dlopen", (void *)reloc_dlopen, NULL};
        __atomic_store_n(&target_count, count + 1, __ATOMIC_RELEASE);
    }
    patch_all_locked();
    __atomic_store_n(&installed, 1, __ATOMIC_RELEASE);
    pthread_mutex_unlock(&reloc_lock);
    if (__atomic_load_n(&pass_pending, __ATOMIC_ACQUIRE)) patch_all_soon();  /* what a dlopen meanwhile left */
    TMS_DEBUG("relocation hooks installed; patched:\n%s", patched_names);
    return TMS_OK;
}

int tms_reloc_installed(void) { return __atomic_load_n(&installed, __ATOMIC_ACQUIRE); }

/* No lock: the hooks call this, also while a pass is patching, and the
 * targets do not change once published (only their atomic originals do,
 * each set before the first entry that leads to the hook). */
void *tms_reloc_original(const char *name)
{
    struct target *t = target_named(name);
    return t ? __atomic_load_n(&t->original, __ATOMIC_ACQUIRE) : NULL;
}

void tms_reloc_report(char *patched, size_t patched_n, char *static_runtime, size_t static_n)
{
    pthread_mutex_lock(&reloc_lock);
    snprintf(patched, patched_n, "%s", patched_names);
    snprintf(static_runtime, static_n, "%s", static_names);
    pthread_mutex_unlock(&reloc_lock);
}
