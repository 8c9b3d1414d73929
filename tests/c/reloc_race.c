/* Relocation passes racing dlclose (src/hooks/reloc.c): one thread dlopens through a patched dlopen, another dlcloses.
 *
 * Usage: test_reloc_race [--seconds S] [--rounds N] LIB
 * LIB is tests/c/reloc_user.c built as a shared object against
 * tests/c/reloc_runtime_stub.c. It is loaded before the hooks are installed,
 * so its GOT entries for dlopen and dlclose lead to the hooks: each of its
 * user_open calls runs a whole relocation pass over every loaded object. One
 * thread opens copies of LIB (files of their own in a directory made under
 * $TMPDIR, so each is an object of its own) through it, the other unloads
 * them through user_close meanwhile; the opener checks that each copy it
 * opened has its cudaMalloc/cudaFree entries patched when dlopen returns.
 * Stops after N rounds or S seconds, whichever comes first; prints
 * "reloc_race: <rounds> rounds, ok" and exits 0 when every check held (a
 * crash is the failure this program exists for). */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "hooks/reloc.h"
#include "platform/error.h"

typedef int (*malloc_fn)(void **, size_t);
typedef int (*free_fn)(void *);
typedef void *(*open_fn)(const char *);
typedef int (*close_fn)(void *);
typedef int (*churn_fn)(int);

static int failed;      /* atomic */
static int hook_calls;  /* atomic */

/* A failed check is counted and the race goes on (the first few are printed):
 * a crash later in the run is the finding that matters most. */
#define CHECK(cond, ...)                                                          \
    do {                                                                          \
        if (!(cond) && __atomic_add_fetch(&failed, 1, __ATOMIC_RELAXED) <= 5) {  \
            fprintf(stderr, "reloc_race.c:%d: FAILED: %s: ", __LINE__, #cond);     \
            fprintf(stderr, __VA_ARGS__);                                         \
            fputc('\n', stderr);                                                  \
        }                                                                         \
    } while (0)

/* The hooks: count the call, forward to the definition the caller's entry held. */
static int race_malloc(void **ptr, size_t size)
{
    __atomic_add_fetch(&hook_calls, 1, __ATOMIC_RELAXED);
    malloc_fn real = (malloc_fn)tms_reloc_original("cudaMalloc", __builtin_return_address(0));
    return real ? real(ptr, size) : 3;
}

static int race_free(void *ptr)
{
    __atomic_add_fetch(&hook_calls, 1, __ATOMIC_RELAXED);
    free_fn real = (free_fn)tms_reloc_original("cudaFree", __builtin_return_address(0));
    return real ? real(ptr) : 3;
}

static open_fn user_open;
static close_fn user_close;
#define COPIES 24
static char libs[COPIES][4096];
static long max_rounds;
static struct timespec deadline;

/* Handles the opener passes to the closer: a dozen stay loaded at a time, so
 * each pass lists several objects the closer is unloading meanwhile. */
#define RING 12
static void *ring[RING];
static size_t ring_head, ring_tail;  /* guarded by ring_lock */
static int opener_done;              /* guarded by ring_lock */
static pthread_mutex_t ring_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t ring_changed = PTHREAD_COND_INITIALIZER;

static int past_deadline(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec > deadline.tv_sec || (now.tv_sec == deadline.tv_sec && now.tv_nsec >= deadline.tv_nsec);
}

/* One allocate/free pair in the library must reach both hooks: its entries
 * were patched before dlopen returned. Only the opener calls the hooks. */
static void check_patched(void *h, const char *path)
{
    churn_fn churn = (churn_fn)dlsym(h, "user_churn");
    CHECK(churn, "%s has no user_churn", path);
    if (!churn) return;
    int before = __atomic_load_n(&hook_calls, __ATOMIC_RELAXED);
    int failures = churn(1);
    int calls = __atomic_load_n(&hook_calls, __ATOMIC_RELAXED) - before;
    CHECK(failures == 0 && calls == 2, "%s: %d failed calls, %d reached the hooks", path, failures, calls);
}

static long rounds;  /* written by the opener, read after it is joined */

static void *opener(void *unused)
{
    (void)unused;
    for (long r = 0; r < max_rounds && !past_deadline(); r++) {
        const char *path = libs[r % COPIES];
        void *h = user_open(path);
        CHECK(h, "dlopen %s: %s", path, dlerror());
        if (!h) break;
        check_patched(h, path);
        pthread_mutex_lock(&ring_lock);
        while (ring_tail - ring_head == RING) pthread_cond_wait(&ring_changed, &ring_lock);
        ring[ring_tail++ % RING] = h;
        pthread_cond_broadcast(&ring_changed);
        pthread_mutex_unlock(&ring_lock);
        rounds = r + 1;
    }
    pthread_mutex_lock(&ring_lock);
    opener_done = 1;
    pthread_cond_broadcast(&ring_changed);
    pthread_mutex_unlock(&ring_lock);
    return NULL;
}

static void *closer(void *unused)
{
    (void)unused;
    for (;;) {
        pthread_mutex_lock(&ring_lock);
        while (ring_tail == ring_head && !opener_done) pthread_cond_wait(&ring_changed, &ring_lock);
        if (ring_tail == ring_head) {
            pthread_mutex_unlock(&ring_lock);
            return NULL;
        }
        void *h = ring[ring_head++ % RING];
        pthread_cond_broadcast(&ring_changed);
        pthread_mutex_unlock(&ring_lock);
        int rc = user_close(h);
        CHECK(rc == 0, "dlclose: %s", dlerror());
    }
}

/* Writes the copies of lib into a new directory under $TMPDIR; 0 on success. */
static int make_copies(const char *lib, char *dir, size_t dir_n)
{
    const char *tmp = getenv("TMPDIR");
    if (snprintf(dir, dir_n, "%s/tms-reloc-race.XXXXXX", tmp && *tmp ? tmp : "/tmp") >= (int)dir_n)
        return ENAMETOOLONG;
    if (!mkdtemp(dir)) return errno;
    int in = open(lib, O_RDONLY | O_CLOEXEC);
    if (in < 0) return errno;
    static char bytes[1 << 20];
    ssize_t n = read(in, bytes, sizeof bytes);
    int rc = n < 0 ? errno : n == (ssize_t)sizeof bytes ? EFBIG : 0;
    close(in);
    for (int k = 0; k < COPIES && !rc; k++) {
        if (snprintf(libs[k], sizeof libs[k], "%s/lib%d.so", dir, k) >= (int)sizeof libs[k]) {
            libs[k][0] = '\0';
            rc = ENAMETOOLONG;
            break;
        }
        int out = open(libs[k], O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0700);
        if (out < 0) rc = errno;
        else if (write(out, bytes, (size_t)n) != n) rc = EIO;
        if (out >= 0 && close(out) != 0 && !rc) rc = errno;
    }
    return rc;
}

static void remove_copies(const char *dir)
{
    for (int k = 0; k < COPIES; k++)
        if (libs[k][0]) unlink(libs[k]);
    rmdir(dir);
}

static void set_deadline(double seconds)
{
    clock_gettime(CLOCK_MONOTONIC, &deadline);
    deadline.tv_sec += (time_t)seconds;
    deadline.tv_nsec += (long)((seconds - (double)(time_t)seconds) * 1e9);
    if (deadline.tv_nsec >= 1000000000L) deadline.tv_sec++, deadline.tv_nsec -= 1000000000L;
}

/* The race over the copies, LIB driving it; returns the exit status. */
static int race(const char *lib, double seconds)
{
    void *driver = dlopen(lib, RTLD_NOW);
    if (!driver) {
        fprintf(stderr, "dlopen %s: %s\n", lib, dlerror());
        return 2;
    }
    user_open = (open_fn)dlsym(driver, "user_open");
    user_close = (close_fn)dlsym(driver, "user_close");
    churn_fn driver_churn = (churn_fn)dlsym(driver, "user_churn");
    if (!user_open || !user_close || !driver_churn) {
        fprintf(stderr, "%s lacks user_open, user_close or user_churn\n", lib);
        return 2;
    }
    const struct tms_reloc_target targets[] = {{"cudaMalloc", (void *)race_malloc}, {"cudaFree", (void *)race_free}};
    struct tms_err err = {0};
    if (tms_reloc_install(targets, 2, &err) != TMS_OK) {
        fprintf(stderr, "tms_reloc_install: %s\n", err.msg);
        return 2;
    }
    int failures = driver_churn(1), calls = __atomic_load_n(&hook_calls, __ATOMIC_RELAXED);
    CHECK(failures == 0 && calls == 2, "%s: %d failed calls, %d reached the hooks", lib, failures, calls);

    set_deadline(seconds);
    pthread_t open_thread, close_thread;
    int rc = pthread_create(&close_thread, NULL, closer, NULL);
    if (rc) {
        fprintf(stderr, "pthread_create: %s\n", strerror(rc));
        return 2;
    }
    if ((rc = pthread_create(&open_thread, NULL, opener, NULL)) != 0) {
        fprintf(stderr, "pthread_create: %s\n", strerror(rc));
        max_rounds = 0;
        opener(NULL);  /* no rounds: only tells the closer to finish */
    } else {
        pthread_join(open_thread, NULL);
    }
    pthread_join(close_thread, NULL);
    if (rc) return 2;

    /* After the race: a library loaded again is patched again. */
    void *h = user_open(libs[0]);
    CHECK(h, "dlopen %s: %s", libs[0], dlerror());
    if (h) {
        check_patched(h, libs[0]);
        CHECK(user_close(h) == 0, "dlclose: %s", dlerror());
    }
    dlclose(driver);
    failures = __atomic_load_n(&failed, __ATOMIC_RELAXED);
    printf("reloc_race: %ld rounds, ", rounds);
    if (failures) printf("%d failed\n", failures);
    else printf("ok\n");
    return failures ? 1 : 0;
}

int main(int argc, char **argv)
{
    double seconds = 3;
    max_rounds = 1000000;
    int i = 1;
    for (; i + 1 < argc && strncmp(argv[i], "--", 2) == 0; i += 2) {
        if (strcmp(argv[i], "--seconds") == 0) seconds = atof(argv[i + 1]);
        else if (strcmp(argv[i], "--rounds") == 0) max_rounds = atol(argv[i + 1]);
        else break;
    }
    if (argc - i != 1 || seconds <= 0 || max_rounds <= 0) {
        fprintf(stderr, "usage: %s [--seconds S] [--rounds N] LIB\n", argv[0]);
        return 2;
    }
    char dir[4096];
    int rc = make_copies(argv[i], dir, sizeof dir);
    if (rc) fprintf(stderr, "copies of %s in %s: %s\n", argv[i], dir, strerror(rc));
    int status = rc ? 2 : race(argv[i], seconds);
    remove_copies(dir);
    return status;
}
