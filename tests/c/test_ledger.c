/* C tests of the host backup ledger (backup/ledger.c): liveness by lock, forks, zombies, in-flight bytes, meminfo, removal. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "backup/ledger.h"
#include "platform/config.h"
#include "check.h"  /* failed: counted in each case's process */

#define MiB ((size_t)1 << 20)


static char name[64], ledger_file[512], meminfo_path[256], runtime_dir[256];

static void put_byte(int fd)
{
    char c = 1;
    if (write(fd, &c, 1) != 1) _exit(3);
}

static void get_byte(int fd)
{
    char c;
    ssize_t n;
    while ((n = read(fd, &c, 1)) < 0 && errno == EINTR) {}
    if (n != 1) _exit(4);
}

static size_t reserved_now(void)
{
    struct tms_ledger_info info;
    struct tms_err err = {0};
    CHECK_RC(tms_ledger_info(&info, &err), TMS_OK);
    return info.reserved;
}

static int ledger_exists(void) { return access(ledger_file, F_OK) == 0; }

/* A child that runs body and exits with whether its checks passed. */
static pid_t spawn(void (*body)(int in, int out), int *to_child, int *from_child)
{
    int down[2], up[2];
    if (pipe(down) || pipe(up)) _exit(5);
    pid_t pid = fork();
    if (pid == 0) {
        close(down[1]);
        close(up[0]);
        body(down[0], up[1]);
        exit(failed ? 1 : 0);
    }
    close(down[0]);
    close(up[1]);
    *to_child = down[1];
    *from_child = up[0];
    return pid;
}

static void reap_ok(pid_t pid)
{
    int status;
    CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* ---- a budget of 48 MiB ------------------------------------------------------ */

static void child_sees_parent_and_owns_nothing(int in, int out)
{
    (void)in, (void)out;
    struct tms_ledger_info info;
    struct tms_err err;
    CHECK_RC(tms_ledger_info(&info, &err), TMS_OK);
    CHECK(info.mine == 0 && info.reserved == 32 * MiB);  /* the parent's record is the parent's */
    CHECK_RC(tms_ledger_reserve(32 * MiB, NULL, &err), TMS_E_HOST_OOM);
    CHECK(strstr(err.msg, "host backup budget") != NULL);
    CHECK_RC(tms_ledger_reserve(16 * MiB, NULL, &err), TMS_OK);
    tms_ledger_copied(16 * MiB);
    tms_ledger_release(16 * MiB);
}

static void child_holds_until_killed(int in, int out)
{
    struct tms_err err;
    CHECK_RC(tms_ledger_reserve(16 * MiB, NULL, &err), TMS_OK);
    put_byte(out);
    get_byte(in);  /* killed here */
}

static void budget_case(void)
{
    struct tms_err err;
    CHECK_RC(tms_ledger_reserve(32 * MiB, NULL, &err), TMS_OK);
    tms_ledger_copied(32 * MiB);
    CHECK(reserved_now() == 32 * MiB);
    int to, from;
    /* A forked child: it does not own this process's record, and closing its
     * copy of the ledger's descriptor (at fork and at exit) does not drop the
     * record's lock. */
    reap_ok(spawn(child_sees_parent_and_owns_nothing, &to, &from));
    close(to), close(from);
    reap_ok(spawn(child_sees_parent_and_owns_nothing, &to, &from));
    close(to), close(from);
    /* A child killed while it holds 16 MiB, a zombie not reaped yet: its share is free. */
    pid_t victim = spawn(child_holds_until_killed, &to, &from);
    get_byte(from);
    CHECK(reserved_now() == 48 * MiB);
    CHECK(kill(victim, SIGKILL) == 0);
    siginfo_t si;
    CHECK(waitid(P_PID, (id_t)victim, &si, WEXITED | WNOWAIT) == 0);  /* dead, left a zombie */
    CHECK(reserved_now() == 32 * MiB);
    CHECK_RC(tms_ledger_reserve(16 * MiB, NULL, &err), TMS_OK);
    tms_ledger_copied(16 * MiB);
    CHECK(waitpid(victim, NULL, 0) == victim);
    close(to), close(from);
    tms_ledger_release(48 * MiB);
    CHECK(reserved_now() == 0);
    CHECK(ledger_exists());  /* this process is in it until it exits */
}

/* ---- no budget: 5 % of 100 GiB kept, 40 MiB above it ------------------------- */

static void child_in_flight(int in, int out)
{
    struct tms_err err;
    CHECK_RC(tms_ledger_reserve(32 * MiB, NULL, &err), TMS_OK);
    put_byte(out);
    get_byte(in);
    tms_ledger_copied(32 * MiB);  /* copied: MemAvailable counts it from now on */
    put_byte(out);
    get_byte(in);
}

static void safety_case(void)
{
    struct tms_err err;
    size_t room = 0;
    int to, from;
    pid_t other = spawn(child_in_flight, &to, &from);
    get_byte(from);
    /* Another process's pause in flight: 32 of the 40 MiB are taken. */
    CHECK_RC(tms_ledger_reserve(32 * MiB, &room, &err), TMS_E_HOST_OOM);
    CHECK(room == 8 * MiB);
    CHECK(strstr(err.msg, "5 %") && strstr(err.msg, "pauses still copying"));
    put_byte(to);
    get_byte(from);
    CHECK_RC(tms_ledger_reserve(32 * MiB, &room, &err), TMS_OK);
    CHECK(room == 40 * MiB);
    /* This process's own pause in flight counts too. */
    CHECK_RC(tms_ledger_reserve(16 * MiB, &room, &err), TMS_E_HOST_OOM);
    CHECK(room == 8 * MiB);
    tms_ledger_copied(32 * MiB);
    CHECK_RC(tms_ledger_reserve(16 * MiB, NULL, &err), TMS_OK);
    tms_ledger_copied(16 * MiB);
    tms_ledger_release(48 * MiB);
    put_byte(to);
    reap_ok(other);
    close(to), close(from);
}

/* ---- meminfo: bounded numbers, regular files only ------------------------------ */

static void write_meminfo(const char *text)
{
    FILE *f = fopen(meminfo_path, "w");
    if (!f || fputs(text, f) < 0 || fclose(f) != 0) _exit(6);
}

static void meminfo_case(void)
{
    struct tms_ledger_info info;
    struct tms_err err;
    write_meminfo("MemTotal: 67108864 kB\nMemFree: 1 kB\nMemAvailable: 33554432 kB\n");
    CHECK_RC(tms_ledger_info(&info, &err), TMS_OK);
    CHECK(info.mem_total == (size_t)64 << 30 && info.mem_available == (size_t)32 << 30);
    write_meminfo("MemTotal: -5 kB\nMemAvailable: 18446744073709551615 kB\n");
    CHECK_RC(tms_ledger_info(&info, &err), TMS_OK);
    CHECK(info.mem_total == 0 && info.mem_available == 0);
    write_meminfo("MemTotal: 4398046511105 kB\nMemAvailable: 12 MB\n");  /* 2^42 + 1 KiB; not kB */
    CHECK_RC(tms_ledger_info(&info, &err), TMS_OK);
    CHECK(info.mem_total == 0 && info.mem_available == 0);
    /* Unknown memory: no 5 % check is possible, and the pause goes on. */
    CHECK_RC(tms_ledger_reserve(MiB, NULL, &err), TMS_OK);
    tms_ledger_copied(MiB);
    tms_ledger_release(MiB);
}

/* Not a regular file: read as unknown at once (alarm: a hang fails the case). */
static void meminfo_not_a_file_case(void)
{
    struct tms_ledger_info info;
    struct tms_err err;
    CHECK_RC(tms_ledger_info(&info, &err), TMS_OK);
    CHECK(info.mem_total == 0 && info.mem_available == 0);
    CHECK_RC(tms_ledger_reserve(MiB, NULL, &err), TMS_OK);
    tms_ledger_copied(MiB);
    tms_ledger_release(MiB);
}

/* ---- the file goes with the last process to leave it ---------------------------- */

static void child_reserves_and_leaves(int in, int out)
{
    (void)in, (void)out;
    struct tms_err err;
    CHECK_RC(tms_ledger_reserve(16 * MiB, NULL, &err), TMS_OK);
    tms_ledger_copied(16 * MiB);
}

static void child_checks_parent_holds_16(int in, int out)
{
    (void)in, (void)out;
    CHECK(reserved_now() == 16 * MiB);
}

static void removal_case(void)
{
    int to, from;
    struct tms_err err;
    reap_ok(spawn(child_reserves_and_leaves, &to, &from));  /* exits holding 16 MiB */
    close(to), close(from);
    CHECK(!ledger_exists());
    CHECK(reserved_now() == 0);  /* opens (makes) the file: this process holds no record in it */
    CHECK(ledger_exists());
    reap_ok(spawn(child_reserves_and_leaves, &to, &from));  /* the last to leave: it removes the file */
    close(to), close(from);
    CHECK(!ledger_exists());
    /* This process's descriptor names a removed file: it opens the one the path names now. */
    CHECK_RC(tms_ledger_reserve(16 * MiB, NULL, &err), TMS_OK);
    tms_ledger_copied(16 * MiB);
    CHECK(ledger_exists());
    reap_ok(spawn(child_checks_parent_holds_16, &to, &from));
    close(to), close(from);
    CHECK(ledger_exists());
}

/* ---- the driver: each case in a process of its own (the settings are read once) ---- */

static int run_case(const char *case_name, void (*fn)(void), const char *limit, const char *meminfo)
{
    snprintf(name, sizeof name, "ctest-%d-%s", (int)getpid(), case_name);
    snprintf(ledger_file, sizeof ledger_file, "%s/torch_memory_saver/%s.ledger", runtime_dir, name);
    pid_t pid = fork();
    if (pid == 0) {
        setenv("TMS_HOST_BACKUP_LIMIT_NAME", name, 1);
        if (limit) setenv("TMS_HOST_BACKUP_LIMIT", limit, 1);
        if (meminfo) setenv("TMS_HOST_MEMINFO", meminfo, 1);
        setenv("TMS_LOG", "off", 1);
        alarm(60);
        fn();
        exit(failed ? 1 : 0);
    }
    int status;
    int ok = waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0;
    if (ok && access(ledger_file, F_OK) == 0) {
        fprintf(stderr, "%s: %s is left behind\n", case_name, ledger_file);
        ok = 0;
    }
    fprintf(stderr, "%s %s\n", ok ? "ok    " : "FAILED", case_name);
    return ok;
}

int main(void)
{
    unsetenv("TMS_HOST_BACKUP_LIMIT");
    unsetenv("TMS_HOST_MEMORY_SAFETY");
    char dir[] = "/tmp/tms-ledger-test-XXXXXX";
    if (!mkdtemp(dir)) return 2;
    /* The ledger's first place, the user's runtime directory: one of the test's own (mkdtemp's mode is 0700). */
    snprintf(runtime_dir, sizeof runtime_dir, "%s/run", dir);
    if (mkdir(runtime_dir, 0700) != 0) return 2;
    setenv("XDG_RUNTIME_DIR", runtime_dir, 1);
    char fifo[300];
    snprintf(meminfo_path, sizeof meminfo_path, "%s/meminfo", dir);
    snprintf(fifo, sizeof fifo, "%s/fifo", dir);
    if (mkfifo(fifo, 0600) != 0) return 2;
    FILE *f = fopen(meminfo_path, "w");
    if (!f || fprintf(f, "MemTotal: %llu kB\nMemAvailable: %llu kB\n", 100ull << 20,
                      (5ull << 20) + (40ull << 10)) < 0 || fclose(f) != 0)
        return 2;
    const struct {
        const char *name;
        void (*fn)(void);
        const char *limit, *meminfo;
    } cases[] = {
        {"budget", budget_case, "48MiB", NULL},
        {"safety", safety_case, NULL, meminfo_path},
        {"meminfo", meminfo_case, NULL, meminfo_path},
        {"meminfo_dev_zero", meminfo_not_a_file_case, NULL, "/dev/zero"},
        {"meminfo_fifo", meminfo_not_a_file_case, NULL, fifo},
        {"removal", removal_case, "48MiB", NULL},
    };
    int n = (int)(sizeof cases / sizeof *cases), ok = 0;
    for (int i = 0; i < n; i++) ok += run_case(cases[i].name, cases[i].fn, cases[i].limit, cases[i].meminfo);
    unlink(meminfo_path);
    unlink(fifo);
    char made[300];
    snprintf(made, sizeof made, "%s/torch_memory_saver", runtime_dir);
    rmdir(made);
    rmdir(runtime_dir);
    rmdir(dir);
    printf("%d passed, %d failed\n", ok, n - ok);
    return ok == n ? 0 : 1;
}
