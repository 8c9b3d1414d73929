/* C tests of the OS primitives (platform/os.h): private directories, trusted paths, the user's directories, file checks, meminfo, the boot id, the descriptor budget, sockets in a directory and their peers. */
#include <errno.h>
#include <fcntl.h>
#include <pwd.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "platform/os.h"
#include "check.h"

/* A primitive's result is want (a negative errno, a verdict, or 0); the call is made once. */
static void check_is(int rc, int want, const char *file, int line, const char *what)
{
    char detail[200];
    snprintf(detail, sizeof detail, "got %d (%s), want %d (%s)", rc, rc < 0 ? strerror(-rc) : "", want,
             want < 0 ? strerror(-want) : "");
    check_at(rc == want, file, line, what, rc == want ? NULL : detail);
}
#define CHECK_IS(expr, want) check_is((expr), (want), __FILE__, __LINE__, #expr)

static char base[64];

static const char *at(const char *rel)
{
    static char paths[8][512];
    static int next;
    char *p = paths[next++ % 8];
    snprintf(p, sizeof paths[0], "%s/%s", base, rel);
    return p;
}

static int is_dir(const char *path)
{
    struct statx st;
    return tms_os_stat_at(AT_FDCWD, path, AT_SYMLINK_NOFOLLOW, &st) == 0 && S_ISDIR(st.stx_mode);
}

/* ---- private directories ------------------------------------------------------------------ */

static void private_dir_case(void)
{
    int fd = -1;
    struct tms_os_owner found;
    CHECK_IS(tms_os_make_dir(AT_FDCWD, at("mine")), 0);
    CHECK_IS(tms_os_make_dir(AT_FDCWD, at("mine")), 0);  /* already there: left as it is */
    CHECK_IS(tms_os_open_private_dir(AT_FDCWD, at("mine"), &fd, &found), 0);
    CHECK(fd >= 0 && fcntl(fd, F_GETFD) == FD_CLOEXEC);
    /* Relative to a held directory, as the ledger opens its runtime place's child. */
    int inner = -1;
    CHECK_IS(tms_os_make_dir(fd, "inner"), 0);
    CHECK_IS(tms_os_open_private_dir(fd, "inner", &inner, &found), 0);
    close(inner);
    close(fd);

    CHECK_IS(tms_os_make_dir(AT_FDCWD, at("missing/parent")), -ENOENT);
    CHECK_IS(tms_os_open_private_dir(AT_FDCWD, at("missing"), &fd, &found), -ENOENT);

    CHECK(mkdir(at("open"), 0700) == 0 && chmod(at("open"), 0750) == 0);
    CHECK_IS(tms_os_open_private_dir(AT_FDCWD, at("open"), &fd, &found), TMS_OS_NOT_PRIVATE);
    CHECK(found.uid == geteuid() && (found.mode & 07777) == 0750 && S_ISDIR(found.mode));

    CHECK(symlink(at("mine"), at("link")) == 0);
    CHECK_IS(tms_os_open_private_dir(AT_FDCWD, at("link"), &fd, &found), TMS_OS_LINK);
    CHECK_IS(tms_os_make_dir(AT_FDCWD, at("link")), 0);  /* mkdir does not follow it, nor take it over */
    CHECK_IS(tms_os_open_private_dir(AT_FDCWD, at("link"), &fd, &found), TMS_OS_LINK);

    int file = open(at("file"), O_CREAT | O_WRONLY | O_CLOEXEC, 0600);
    CHECK(file >= 0);
    close(file);
    CHECK_IS(tms_os_open_private_dir(AT_FDCWD, at("file"), &fd, &found), TMS_OS_NOT_DIR);

    if (geteuid() == 0) {  /* another owner's 0700 directory (only root can make one here) */
        CHECK(mkdir(at("theirs"), 0700) == 0 && chown(at("theirs"), 4242, 4242) == 0);
        CHECK_IS(tms_os_open_private_dir(AT_FDCWD, at("theirs"), &fd, &found), TMS_OS_NOT_PRIVATE);
        CHECK(found.uid == 4242 && (found.mode & 07777) == 0700);
    }
}

/* ---- trusted paths -------------------------------------------------------------------------- */

static void trusted_case(void)
{
    int fd = -1;
    struct tms_os_stop stop;
    /* The test's own directory must be trusted for the rest to say anything: its
     * ancestors are the host's (/tmp: sticky, root's). */
    int rc = tms_os_open_trusted(base, 1, &fd, &stop);
    if (rc) {
        fprintf(stderr, "note: %s is not trusted here (%d, at %s): the trust cases are skipped\n", base, rc, stop.at);
        return;
    }
    close(fd);
    CHECK_IS(tms_os_make_dirs(at("a/b/c")), 0);
    CHECK(is_dir(at("a/b/c")));
    CHECK_IS(tms_os_make_dirs(at("a/b/c")), 0);
    CHECK_IS(tms_os_open_trusted(at("a/b/c"), 1, &fd, &stop), 0);
    close(fd);

    /* A directory above it that others can write, not sticky: where it stopped is named. */
    CHECK(chmod(at("a"), 0777) == 0);
    CHECK_IS(tms_os_open_trusted(at("a/b/c"), 1, &fd, &stop), TMS_OS_UNSAFE);
    CHECKF(strcmp(stop.at, at("a")) == 0 && stop.opening == 0, "stopped at %s", stop.at);
    CHECK(stop.uid == geteuid() && (stop.mode & 07777) == 0777);
    CHECK_IS(tms_os_open_trusted(at("a/b/c"), 0, &fd, &stop), 0);  /* unchecked: vouched for */
    close(fd);
    /* Sticky, and this user's: nobody else can rename what is in it. */
    CHECK(chmod(at("a"), 01777) == 0);
    CHECK_IS(tms_os_open_trusted(at("a/b/c"), 1, &fd, &stop), 0);
    close(fd);
    CHECK(chmod(at("a"), 0700) == 0);

    /* The last directory: writable by others is refused, sticky and this user's is not. */
    CHECK(chmod(at("a/b/c"), 0777) == 0);
    CHECK_IS(tms_os_open_trusted(at("a/b/c"), 1, &fd, &stop), TMS_OS_UNSAFE);
    CHECKF(strcmp(stop.at, at("a/b/c")) == 0, "stopped at %s", stop.at);
    CHECK(chmod(at("a/b/c"), 01777) == 0);
    CHECK_IS(tms_os_open_trusted(at("a/b/c"), 1, &fd, &stop), 0);
    close(fd);
    CHECK(chmod(at("a/b/c"), 0700) == 0);

    /* A link on the way is never followed by the walk; a missing directory stops it. */
    CHECK(symlink(at("a/b"), at("a/ln")) == 0);
    rc = tms_os_open_trusted(at("a/ln/c"), 0, &fd, &stop);
    CHECKF(rc == -ELOOP || rc == -ENOTDIR, "got %d", rc);
    CHECKF(strcmp(stop.at, at("a/ln")) == 0 && stop.opening == 1, "stopped at %s", stop.at);
    CHECK_IS(tms_os_open_trusted(at("a/none/c"), 0, &fd, &stop), -ENOENT);
    CHECKF(strcmp(stop.at, at("a/none")) == 0 && stop.opening == 1, "stopped at %s", stop.at);

    /* realpath follows it; the check says where it may be followed. */
    char resolved[PATH_MAX];
    CHECK_IS(tms_os_resolve(at("a/ln/c"), resolved), 0);
    CHECKF(strcmp(resolved, at("a/b/c")) == 0, "resolved %s", resolved);
    CHECK_IS(tms_os_check_links(at("a/ln/c"), &stop), 0);  /* in a directory only this user can write */
    CHECK(mkdir(at("w"), 0777) == 0 && chmod(at("w"), 0777) == 0 && symlink(at("a/b"), at("w/ln")) == 0);
    CHECK_IS(tms_os_check_links(at("w/ln/c"), &stop), TMS_OS_UNSAFE);
    CHECKF(strcmp(stop.at, at("w/ln")) == 0 && S_ISLNK(stop.mode), "stopped at %s", stop.at);
    CHECK(chmod(at("w"), 01777) == 0);  /* sticky, the link this user's: only this user could have made it */
    CHECK_IS(tms_os_check_links(at("w/ln/c"), &stop), 0);
    if (geteuid() == 0) {
        CHECK(lchown(at("w/ln"), 4242, 4242) == 0);  /* sticky, another user's link */
        CHECK_IS(tms_os_check_links(at("w/ln/c"), &stop), TMS_OS_UNSAFE);
        CHECK(stop.uid == 4242);
    }

    char *abs = NULL;
    CHECK_IS(tms_os_absolute("/x/y", &abs), 0);
    CHECK(abs && strcmp(abs, "/x/y") == 0);
    free(abs);
    char cwd[PATH_MAX], want[PATH_MAX + 8];
    CHECK(getcwd(cwd, sizeof cwd) != NULL);
    snprintf(want, sizeof want, "%s/rel", cwd);
    abs = NULL;
    CHECK_IS(tms_os_absolute("rel", &abs), 0);
    CHECK(abs && strcmp(abs, want) == 0);
    free(abs);
}

/* ---- the user's directories ------------------------------------------------------------------ */

static void user_dirs_case(void)
{
    char buf[PATH_MAX], want[PATH_MAX];
    snprintf(want, sizeof want, "/run/user/%u", (unsigned)geteuid());
    CHECK_IS(tms_os_runtime_dir("/somewhere/run", buf, sizeof buf), 0);
    CHECK(strcmp(buf, "/somewhere/run") == 0);
    CHECK_IS(tms_os_runtime_dir("relative/run", buf, sizeof buf), 0);  /* not a path a session makes: the default */
    CHECK(strcmp(buf, want) == 0);
    CHECK_IS(tms_os_runtime_dir(NULL, buf, sizeof buf), 0);
    CHECK(strcmp(buf, want) == 0);
    CHECK_IS(tms_os_runtime_dir("", buf, sizeof buf), 0);
    CHECK(strcmp(buf, want) == 0);
    char small[8];
    CHECK_IS(tms_os_runtime_dir(NULL, small, sizeof small), -ENAMETOOLONG);
    CHECK(strlen(small) == sizeof small - 1);

    /* The home from the user database, whatever $HOME says. */
    setenv("HOME", "/not/the/home", 1);
    struct passwd *pw = getpwuid(geteuid());
    int rc = tms_os_home_dir(buf, sizeof buf);
    if (pw && pw->pw_dir[0] == '/') {
        CHECK_IS(rc, 0);
        CHECK(strcmp(buf, pw->pw_dir) == 0);
        snprintf(want, sizeof want, "%s/.cache", pw->pw_dir);
        CHECK_IS(tms_os_cache_dir(buf, sizeof buf), 0);
        CHECK(strcmp(buf, want) == 0);
        CHECK_IS(tms_os_cache_dir(buf, strlen(want)), -ENAMETOOLONG);
    } else {
        CHECK_IS(rc, -ENOENT);
        CHECK_IS(tms_os_cache_dir(buf, sizeof buf), -ENOENT);
    }
}

/* ---- the host --------------------------------------------------------------------------------- */

static void boot_id_case(void)
{
    char id[37], want[64] = "";
    CHECK_IS(tms_os_boot_id(id), 0);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    CHECK(f && fgets(want, sizeof want, f));
    if (f) fclose(f);
    want[strcspn(want, "\n")] = 0;
    CHECKF(strlen(id) == 36 && strcmp(id, want) == 0, "%s, the file says %s", id, want);
}

/* Each seam case in a process of its own: the settings are read once per process. */
static void meminfo_seam(const char *path, int want_rc, size_t want_total, size_t want_available)
{
    pid_t pid = fork();
    if (pid == 0) {
        failed = 0;  /* the child's own checks */
        setenv("TMS_HOST_MEMINFO", path, 1);
        alarm(20);  /* a FIFO that held the read would fail the case */
        size_t total = 1, available = 1;
        int rc = tms_os_meminfo(&total, &available);
        CHECK(strcmp(tms_os_meminfo_path(), path) == 0);
        CHECK_IS(rc, want_rc);
        CHECKF(total == want_total && available == want_available, "%s: %zu, %zu", path, total, available);
        _exit(failed ? 1 : 0);
    }
    int status;
    CHECKF(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0, "meminfo from %s", path);
}

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f && fputs(text, f) >= 0);
    if (f) fclose(f);
}

/* Run before anything in this process reads the settings: the children read their own. */
static void meminfo_case(void)
{
    write_file(at("meminfo"), "MemTotal: 2048 kB\nMemAvailable:\t1024 kB\n");
    meminfo_seam(at("meminfo"), 0, 2048 << 10, 1024 << 10);
    write_file(at("meminfo_half"), "MemTotal: 2048 kB\nMemAvailable: 1 MB\n");
    meminfo_seam(at("meminfo_half"), -ENODATA, 2048 << 10, 0);
    CHECK(mkfifo(at("fifo"), 0600) == 0);
    meminfo_seam(at("fifo"), -EINVAL, 0, 0);
    meminfo_seam(at("no_such_file"), -ENOENT, 0, 0);
    CHECK(symlink(at("meminfo"), at("meminfo_link")) == 0);
    meminfo_seam(at("meminfo_link"), -ELOOP, 0, 0);

    size_t total = 0, available = 0;
    CHECK(strcmp(tms_os_meminfo_path(), "/proc/meminfo") == 0);
    CHECK_IS(tms_os_meminfo(&total, &available), 0);
    CHECK(total > 0 && available <= total);
}

/* ---- files -------------------------------------------------------------------------------------- */

static void files_case(void)
{
    int fd = open(at("f"), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    CHECK(fd >= 0);
    struct tms_os_id id, again;
    struct statx st;
    CHECK_IS(tms_os_check_file(fd, geteuid(), &id), 0);
    CHECK_IS(tms_os_stat_at(AT_FDCWD, at("f"), 0, &st), 0);
    again = tms_os_id_of(&st);
    CHECK(tms_os_same_id(&id, &again));
    CHECK_IS(tms_os_check_file(fd, geteuid() + 1, &again), TMS_OS_NOT_OWNER);
    CHECK_IS(tms_os_check_file_at(AT_FDCWD, at("f"), geteuid()), 0);
    CHECK_IS(tms_os_check_file_at(AT_FDCWD, at("f"), geteuid() + 1), TMS_OS_NOT_OWNER);

    int dir = open(base, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    CHECK(dir >= 0);
    CHECK_IS(tms_os_check_file(dir, geteuid(), &again), TMS_OS_NOT_FILE);
    CHECK_IS(tms_os_check_file_at(dir, ".", geteuid()), TMS_OS_NOT_FILE);

    /* Relative to a held directory: a link and a FIFO are never what a file check passes,
     * and the FIFO does not hold the open. */
    CHECK(symlink("f", at("f_link")) == 0 && mkfifo(at("f_fifo"), 0600) == 0);
    CHECK_IS(tms_os_check_file_at(dir, "f_link", geteuid()), TMS_OS_NOT_FILE);
    int opened = -1;
    CHECK_IS(tms_os_open_file(dir, "f", O_RDONLY, geteuid(), &opened), 0);
    CHECK(opened >= 0 && fcntl(opened, F_GETFD) == FD_CLOEXEC);
    close(opened);
    CHECK_IS(tms_os_open_file(dir, "f_link", O_RDONLY, geteuid(), &opened), -ELOOP);
    CHECK_IS(tms_os_open_file(dir, "f_fifo", O_RDONLY, geteuid(), &opened), TMS_OS_NOT_FILE);
    CHECK_IS(tms_os_open_file(dir, "none", O_RDONLY, geteuid(), &opened), -ENOENT);

    /* A name that comes to name another file. */
    CHECK_IS(tms_os_names(dir, "f", &id), 0);
    CHECK_IS(tms_os_names(dir, "f_link", &id), TMS_OS_OTHER_FILE);  /* the link itself, not its target */
    int other = open(at("g"), O_CREAT | O_RDWR | O_CLOEXEC, 0600);
    CHECK(other >= 0 && rename(at("g"), at("f")) == 0);
    CHECK_IS(tms_os_names(dir, "f", &id), TMS_OS_OTHER_FILE);
    CHECK_IS(tms_os_names(dir, "none", &id), -ENOENT);
    close(other);
    close(fd);

    const char *kind = "unset";
    int proc = open("/proc", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    CHECK_IS(tms_os_memory_fs(proc, &kind), 0);
    CHECK(kind == NULL);
    close(proc);
    int shm = open("/dev/shm", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (shm >= 0) {  /* a tmpfs wherever it exists */
        CHECK_IS(tms_os_memory_fs(shm, &kind), 0);
        CHECK(kind && strcmp(kind, "tmpfs") == 0);
        close(shm);
    }
    CHECK_IS(tms_os_memory_fs(-1, &kind), -EBADF);
    close(dir);
}

/* ---- sealed files, the descriptor budget ------------------------------------------------------- */

static void sealed_case(void)
{
    struct tms_os_id id, again;
    int fd = memfd_create("sealed", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    CHECK(fd >= 0 && ftruncate(fd, 8192) == 0);
    CHECK_IS(tms_os_check_sealed(fd, 8192, &id), TMS_OS_UNSEALED);
    CHECK(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK) == 0);
    CHECK_IS(tms_os_check_sealed(fd, 8192, &id), 0);
    CHECK_IS(tms_os_check_sealed(fd, 8193, &again), TMS_OS_SHORT);
    int copy = dup(fd);
    CHECK_IS(tms_os_check_sealed(copy, 4096, &again), 0);
    CHECK(tms_os_same_id(&id, &again));  /* one file, however many descriptors */
    int plain = open(at("plain"), O_CREAT | O_RDWR | O_CLOEXEC, 0600);  /* a file that takes no seals */
    CHECK_IS(tms_os_check_sealed(plain, 0, &again), TMS_OS_UNSEALED);
    int pipes[2];
    CHECK(pipe(pipes) == 0);
    CHECK_IS(tms_os_check_sealed(pipes[0], 0, &again), TMS_OS_NOT_FILE);
    close(pipes[0]), close(pipes[1]), close(plain), close(copy), close(fd);
}

static void fd_budget_case(void)
{
    struct rlimit old, r;
    CHECK(getrlimit(RLIMIT_NOFILE, &old) == 0);
    r = old;
    r.rlim_cur = 256 < old.rlim_max ? 256 : old.rlim_max;
    CHECK(setrlimit(RLIMIT_NOFILE, &r) == 0);
    CHECK(tms_os_fd_budget(TMS_OS_FDS_HELD) == r.rlim_cur / 4 || r.rlim_cur / 4 < 16);
    CHECK(tms_os_fd_budget(TMS_OS_FDS_BORROWED) == r.rlim_cur / 4);
    r.rlim_cur = 40 < old.rlim_max ? 40 : old.rlim_max;
    CHECK(setrlimit(RLIMIT_NOFILE, &r) == 0);
    CHECK(tms_os_fd_budget(TMS_OS_FDS_HELD) == 16);  /* never fewer than one process needs */
    CHECK(setrlimit(RLIMIT_NOFILE, &old) == 0);
}

/* ---- sockets in a directory, their peers ---------------------------------------------------------- */

static int seqpacket(void) { return socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0); }

static void sockets_case(void)
{
    CHECK_IS(tms_os_make_dir(AT_FDCWD, at("socks")), 0);
    int dir = open(at("socks"), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    CHECK(dir >= 0);
    struct sockaddr_un addr;
    socklen_t len;
    CHECK_IS(tms_os_unix_address(dir, at("socks"), "a/b", &addr, &len), -EINVAL);
    /* A directory whose path does not fit sun_path is reached through its descriptor. */
    char deep[200];
    snprintf(deep, sizeof deep, "%s/%0150d", at("socks"), 0);
    CHECK_IS(tms_os_unix_address(dir, deep, "x", &addr, &len), 0);
    char want[64];
    snprintf(want, sizeof want, "/proc/self/fd/%d/x", dir);
    CHECK(strcmp(addr.sun_path, want) == 0);

    int l1 = -1, l2 = -1;
    CHECK_IS(tms_os_listen_at(dir, at("socks"), "j-1", 4, &l1), 0);
    CHECK_IS(tms_os_listen_at(dir, deep, "j-2", 4, &l2), 0);  /* bound through the descriptor */
    CHECK(l1 >= 0 && l2 >= 0 && fcntl(l1, F_GETFD) == FD_CLOEXEC);
    CHECK(close(open(at("socks/j-file"), O_CREAT | O_RDWR | O_CLOEXEC, 0600)) == 0);  /* not a socket: not listed */
    char names[8][TMS_OS_SOCKET_NAME_MAX];
    size_t n = 0;
    CHECK_IS(tms_os_socket_names(dir, "j-", names, 8, &n), 0);
    CHECK(n == 2);  /* no temporary '.' name is left, and the file is no socket */
    CHECK_IS(tms_os_socket_names(dir, "j-", names, 1, &n), 0);
    CHECK(n == 1);

    int c = seqpacket();
    CHECK_IS(tms_os_connect_at(c, dir, at("socks"), "j-2"), 0);
    int a = accept4(l2, NULL, NULL, SOCK_CLOEXEC);
    CHECK(a >= 0);
    struct tms_os_peer peer;
    CHECK_IS(tms_os_peer_of(a, &peer), 0);
    CHECK(peer.uid == geteuid() && peer.pid == getpid());
    int pidfd = -1;
    CHECK_IS(tms_os_peer_process(a, peer.pid, &pidfd), 0);  /* this process runs */
    CHECK(pidfd >= 0);
    close(pidfd), close(a), close(c);

    /* A peer whose process ended: its socket outlives it in this one. */
    int pair[2];
    CHECK(socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) == 0);
    pid_t child = fork();
    if (child == 0) {
        int s = seqpacket();
        _exit(tms_os_connect_at(s, dir, at("socks"), "j-1") == 0 ? 0 : 1);
    }
    int status = 0;
    CHECK(waitpid(child, &status, 0) == child && WIFEXITED(status) && WEXITSTATUS(status) == 0);
    a = accept4(l1, NULL, NULL, SOCK_CLOEXEC);
    CHECK(a >= 0);
    CHECK_IS(tms_os_peer_of(a, &peer), 0);
    CHECK(peer.pid == child);
    CHECK_IS(tms_os_peer_process(a, peer.pid, &pidfd), TMS_OS_ENDED);
    CHECK(pidfd == -1);
    CHECK(tms_os_process_runs(getpid()) && !tms_os_process_runs(child));
    close(a), close(pair[0]), close(pair[1]);

    /* Nobody listens on a name its process closed: refused, then removed. */
    close(l1);
    c = seqpacket();
    CHECK_IS(tms_os_connect_at(c, dir, at("socks"), "j-1"), -ECONNREFUSED);
    close(c);
    CHECK_IS(tms_os_remove_socket(dir, "j-file"), TMS_OS_NOT_FILE);
    CHECK_IS(tms_os_remove_socket(dir, "j-1"), 0);
    CHECK_IS(tms_os_remove_socket(dir, "j-1"), -ENOENT);
    c = seqpacket();
    CHECK_IS(tms_os_connect_at(c, dir, at("socks"), "j-1"), -ENOENT);
    close(c);
    /* A full backlog: a non-blocking connect says so at once. */
    int full = 0;
    for (int i = 0; i < 64 && !full; i++) {
        c = seqpacket();
        int rc = tms_os_connect_at(c, dir, at("socks"), "j-2");
        full = rc == -EAGAIN;
        if (rc) close(c);
    }
    CHECK(full);
    close(l2);
    close(dir);
}

int main(void)
{
    unsetenv("TMS_HOST_MEMINFO");
    snprintf(base, sizeof base, "/tmp/tms-os-test-XXXXXX");
    if (!mkdtemp(base)) return 2;
    umask(022);
    meminfo_case();
    private_dir_case();
    trusted_case();
    user_dirs_case();
    boot_id_case();
    files_case();
    sealed_case();
    fd_budget_case();
    sockets_case();
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", base);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", base);
    return check_summary();
}
