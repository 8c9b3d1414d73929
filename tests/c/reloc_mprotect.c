/* Another party changing a page's protection while the relocation hooks patch (tests/test_reloc.py, on
 * LD_PRELOAD): mprotect is interposed; once armed, the first call that makes a page other than the watched
 * one writable (the pass storing into an earlier object) first sets the watched page to the armed protection,
 * as another patcher would between the pass's start and its store into that page. */
#define _GNU_SOURCE
#include <stdint.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

static uintptr_t watched;
static int armed = -1;      /* the protection to set, -1: not armed */
static int fired;           /* set it, while the watched page had not been made writable by anyone */
static int watched_calls;   /* calls that made the watched page writable */

void reloc_mprotect_arm(void *page, int prot)
{
    watched = (uintptr_t)page;
    armed = prot;
    fired = 0;
    watched_calls = 0;
}

/* 1 if the change came before any store into the watched page; 0 if not, or never. */
int reloc_mprotect_fired_first(void) { return fired; }

int mprotect(void *addr, size_t len, int prot)
{
    if ((prot & PROT_WRITE) && (uintptr_t)addr == watched) watched_calls++;
    if (armed >= 0 && (prot & PROT_WRITE) && (uintptr_t)addr != watched) {
        fired = watched_calls == 0;
        (void)syscall(SYS_mprotect, (void *)watched, (size_t)sysconf(_SC_PAGESIZE), armed);
        armed = -1;
    }
    return (int)syscall(SYS_mprotect, addr, len, prot);
}
