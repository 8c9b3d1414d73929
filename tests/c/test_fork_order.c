/* Fork while another thread holds a lock and waits for the next: the fork handlers take the library's locks in one order (platform/fork.c), whichever subsystem a process touched first.
 *
 * The expandable-segments wrappers hold cumem_lock while they call the core,
 * which takes the table lock: cumem_lock comes first. A fork's prepare
 * handlers must take them in that order too, or a fork racing such a call
 * deadlocks. Each scenario runs in a process of its own, which touches the
 * subsystems in a given order (the order their handlers are registered in),
 * then holds the table lock while a forking thread and a wrapper thread queue
 * up behind it, the forking thread first: each is let go only once the kernel
 * shows it waiting on a lock (/proc/self/task/TID/syscall), so the order holds
 * on a machine of any speed. An alarm turns a deadlock into a failure.
 * Usage: test_fork_order [--rounds N] */
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "check.h"
#include "core/core.h"
#include "core/core_internal.h"
#include "hooks/cumem.h"
#include "platform/cuda_abi.h"
#include "platform/driver.h"

#define PAGE ((size_t)2 << 20)
#define DEADLOCK_SECONDS 5

static const struct tms_driver *drv;

/* ---- the driver's functions, as PyTorch would find them (host backend) ---------- */

static tms_CUresult real_create(tms_CUmemHandle *h, size_t size, const tms_CUmemAllocationProp *prop,
                                unsigned long long flags)
{
    (void)flags;
    tms_phys p;
    if (drv->create(prop->location.id, size, &p)) return TMS_CUDA_ERROR_OUT_OF_MEMORY;
    *h = p;
    return TMS_CUDA_SUCCESS;
}

static tms_CUresult real_map(tms_CUdeviceptr va, size_t size, size_t offset, tms_CUmemHandle h,
                             unsigned long long flags)
{
    (void)flags, (void)offset;
    return drv->map(0, va, size, h) ? TMS_CUDA_ERROR_INVALID_VALUE : TMS_CUDA_SUCCESS;
}

static tms_CUresult real_set_access(tms_CUdeviceptr va, size_t size, const tms_CUmemAccessDesc *desc, size_t n)
{
    (void)va, (void)size, (void)desc, (void)n;
    return TMS_CUDA_SUCCESS;
}

static tms_CUresult real_unmap(tms_CUdeviceptr va, size_t size)
{
    return drv->unmap(va, size) ? TMS_CUDA_ERROR_INVALID_VALUE : TMS_CUDA_SUCCESS;
}

static tms_CUresult real_release(tms_CUmemHandle h)
{
    return drv->release(h) ? TMS_CUDA_ERROR_INVALID_VALUE : TMS_CUDA_SUCCESS;
}

typedef tms_CUresult (*create_fn)(tms_CUmemHandle *, size_t, const tms_CUmemAllocationProp *, unsigned long long);
typedef tms_CUresult (*map_fn)(tms_CUdeviceptr, size_t, size_t, tms_CUmemHandle, unsigned long long);
typedef tms_CUresult (*set_access_fn)(tms_CUdeviceptr, size_t, const tms_CUmemAccessDesc *, size_t);
typedef tms_CUresult (*unmap_fn)(tms_CUdeviceptr, size_t);
typedef tms_CUresult (*release_fn)(tms_CUmemHandle);

static struct {
    create_fn create;
    map_fn map;
    set_access_fn set_access;
    unmap_fn unmap;
    release_fn release;
} cu;

static void *wrapped(const char *name, void *real)
{
    void *fn = real;
    tms_cumem_wrap(name, &fn);
    CHECK(fn != real);
    return fn;
}

static const tms_CUmemAccessDesc access_rw = {.location = {TMS_CU_MEM_LOCATION_TYPE_DEVICE, 0},
                                              .flags = TMS_CU_MEM_ACCESS_FLAGS_PROT_READWRITE};

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0) {}
}

/* A thread of this process tells its kernel id here before it may block. */
struct queued {
    pid_t tid;  /* atomic: 0 until the thread runs */
    void *arg;
};

static void say_tid(struct queued *q) { __atomic_store_n(&q->tid, (pid_t)syscall(SYS_gettid), __ATOMIC_RELEASE); }

/* Returns once the thread of q sleeps in a futex wait, the only way a thread
 * of this test blocks (a mutex it queues behind): the event the order needs.
 * 0 if the kernel does not say (no /proc). */
static int wait_blocked(struct queued *q)
{
    pid_t tid;
    while (!(tid = __atomic_load_n(&q->tid, __ATOMIC_ACQUIRE))) sleep_ms(1);  /* paces the poll */
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%d/syscall", (int)tid);
    for (;;) {
        FILE *f = fopen(path, "r");
        if (!f) return 0;
        long nr = -1;
        if (fscanf(f, "%ld", &nr) != 1) nr = -1;  /* "running": not blocked yet */
        fclose(f);
        if (nr == SYS_futex) return 1;
        sleep_ms(1);  /* paces the poll; the alarm ends a wait that never comes */
    }
}

/* ---- one scenario --------------------------------------------------------------- */

struct segment {
    tms_va va;
    tms_CUmemHandle token;
};

/* A token of the region's tag, mapped by its owner and not yet accessible
 * (not adopted): the next cuMemSetAccess adopts it under cumem_lock. */
static void map_token(struct segment *s, int tag_id)
{
    struct tms_region *r = tms_region_current();
    r->active = 1;
    r->tag_id = tag_id;
    tms_CUmemAllocationProp prop = {.type = TMS_CU_MEM_ALLOCATION_TYPE_PINNED};
    prop.location.type = TMS_CU_MEM_LOCATION_TYPE_DEVICE;
    CHECK(drv->reserve(PAGE, PAGE, &s->va) == 0);
    CHECK(cu.create(&s->token, PAGE, &prop, 0) == TMS_CUDA_SUCCESS);
    CHECK(cu.map(s->va, PAGE, 0, s->token, 0) == TMS_CUDA_SUCCESS);
    r->active = 0;
}

static void unmap_segment(struct segment *s)
{
    CHECK(cu.unmap(s->va, PAGE) == TMS_CUDA_SUCCESS);
    CHECK(cu.release(s->token) == TMS_CUDA_SUCCESS);
    CHECK(drv->unreserve(s->va, PAGE) == 0);
}

static void *forker(void *arg)
{
    say_tid(arg);
    pid_t pid = fork();
    if (pid == 0) _exit(0);
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    return NULL;
}

static void *adopter(void *arg)
{
    struct queued *q = arg;
    struct segment *s = q->arg;
    say_tid(q);
    CHECK(cu.set_access(s->va, PAGE, &access_rw, 1) == TMS_CUDA_SUCCESS);
    return NULL;
}

/* The main thread holds the table lock; the forking thread queues behind it
 * first (its prepare handlers take the locks), then a wrapper that holds
 * cumem_lock and wants the table lock. Released, the lock goes to the
 * forking thread: if its handlers took the table lock before cumem_lock,
 * both wait for each other. */
static void fork_against_adopt(int tag_id)
{
    struct segment s;
    map_token(&s, tag_id);
    pthread_t f, a;
    struct queued qf = {0, NULL}, qa = {0, &s};
    tms_table_lock();
    CHECK(pthread_create(&f, NULL, forker, &qf) == 0);
    CHECKF(wait_blocked(&qf), "the forking thread's state is not in /proc/self/task");
    CHECK(pthread_create(&a, NULL, adopter, &qa) == 0);
    CHECKF(wait_blocked(&qa), "the wrapper thread's state is not in /proc/self/task");
    tms_table_unlock();
    pthread_join(f, NULL);
    pthread_join(a, NULL);
    struct tms_alloc_info row;
    CHECK(tms_core_find(s.va, &row) == TMS_OK && row.adopted);
    unmap_segment(&s);
}

static int scenario(int cumem_first, int rounds)
{
    struct tms_err err = {0};
    if (tms_core_use_backend("host", &err) || tms_driver_get(&drv, &err)) {
        fprintf(stderr, "host backend: %s\n", err.msg);
        return 1;
    }
    cu.create = (create_fn)wrapped("cuMemCreate", (void *)real_create);
    cu.map = (map_fn)wrapped("cuMemMap", (void *)real_map);
    cu.set_access = (set_access_fn)wrapped("cuMemSetAccess", (void *)real_set_access);
    cu.unmap = (unmap_fn)wrapped("cuMemUnmap", (void *)real_unmap);
    cu.release = (release_fn)wrapped("cuMemRelease", (void *)real_release);
    int tag_id = 0;
    struct segment first;
    if (cumem_first) {
        /* The tokens' lock is taken before the table's for the first time:
         * a process started with TMS_INIT_ENABLE=1 does this. */
        map_token(&first, 0);
        CHECK(tms_core_tag_id("fork_order", &tag_id, &err) == TMS_OK);
    } else {
        CHECK(tms_core_tag_id("fork_order", &tag_id, &err) == TMS_OK);
        map_token(&first, tag_id);
    }
    unmap_segment(&first);
    alarm(DEADLOCK_SECONDS);
    for (int i = 0; i < rounds; i++) fork_against_adopt(tag_id);
    alarm(0);
    return failed ? 1 : 0;
}

/* Runs a scenario in a process of its own: nothing touched before it. */
static void run(const char *name, int cumem_first, int rounds)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) _exit(scenario(cumem_first, rounds));
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    int ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM)
        fprintf(stderr, "test_fork_order: %s: deadlock (no fork within %d s): the prepare handlers took the table "
                "lock before cumem_lock\n", name, DEADLOCK_SECONDS);
    CHECKF(ok, "%s: status 0x%x", name, (unsigned)status);
    printf("%s %s\n", ok ? "ok  " : "FAIL", name);
}

#if __has_include("platform/fork.h")
#include "platform/fork.h"

/* ---- the fork module: handlers run by rank, not by registration ---------------- */

static char trace[64];
static size_t traced;
static void note(char c)
{
    if (traced + 1 < sizeof trace) trace[traced++] = c;
}
static void prepare_a(void) { note('A'); }
static void parent_a(void) { note('a'); }
static void child_a(void) { note('1'); }
static void prepare_b(void) { note('B'); }
static void parent_b(void) { note('b'); }
static void child_b(void) { note('2'); }

static int ranks(void)
{
    static const struct tms_fork_handlers a = {prepare_a, parent_a, child_a}, b = {prepare_b, parent_b, child_b};
    /* Registered inner first: prepare still runs the outer rank first. */
    tms_fork_register(TMS_FORK_DEVICES, &b);
    tms_fork_register(TMS_FORK_CUMEM, &a);
    tms_fork_register(TMS_FORK_CUMEM, &b);  /* a rank is registered once: ignored */
    pid_t pid = fork();
    if (pid == 0) _exit(strcmp(trace, "AB21") == 0 ? 0 : 1);
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECKF(strcmp(trace, "ABba") == 0, "handlers ran as %s", trace);
    return failed ? 1 : 0;
}

static void run_ranks(void)
{
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) _exit(ranks());
    int status = 0;
    CHECK(pid > 0 && waitpid(pid, &status, 0) == pid);
    int ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
    CHECKF(ok, "ranks: status 0x%x", (unsigned)status);
    printf("%s ranks\n", ok ? "ok  " : "FAIL");
}
#endif

int main(int argc, char **argv)
{
    int rounds = 3;
    for (int i = 1; i + 1 < argc; i += 2)
        if (!strcmp(argv[i], "--rounds")) rounds = atoi(argv[i + 1]);
#if __has_include("platform/fork.h")
    run_ranks();
#endif
    run("table_first", 0, rounds);
    run("cumem_first", 1, rounds);
    return check_summary();
}
