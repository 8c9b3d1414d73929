/* Unix sockets named in a directory, who is at their other end, and whether that process still runs. */
#include "platform/os.h"

#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <sys/time.h>
#include <unistd.h>

#ifndef SO_PEERPIDFD
#define SO_PEERPIDFD 77
#endif
#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

/* errno negated, never 0: a call that failed without saying why is still a failure. */
static int fail(void) { return errno > 0 ? -errno : -EIO; }

int tms_os_unix_address(int dirfd, const char *dir, const char *name, struct sockaddr_un *addr, socklen_t *len)
{
    memset(addr, 0, sizeof *addr);
    addr->sun_family = AF_UNIX;
    *len = 0;
    if (!name[0] || strchr(name, '/')) return -EINVAL;
    int n = snprintf(addr->sun_path, sizeof addr->sun_path, "%s/%s", dir, name);
    /* A long directory is reached through the descriptor held on it: sun_path holds 107 bytes. */
    if (n < 0 || (size_t)n >= sizeof addr->sun_path)
        n = snprintf(addr->sun_path, sizeof addr->sun_path, "/proc/self/fd/%d/%s", dirfd, name);
    if (n < 0 || (size_t)n >= sizeof addr->sun_path) return -ENAMETOOLONG;
    *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + (size_t)n + 1);
    return 0;
}

int tms_os_socket(int nonblocking)
{
    int s = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | (nonblocking ? SOCK_NONBLOCK : 0), 0);
    return s >= 0 ? s : fail();
}

int tms_os_accept(int lfd)
{
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    return fd >= 0 ? fd : fail();
}

int tms_os_socket_timeouts(int sock, int seconds)
{
    struct timeval t = {.tv_sec = seconds};
    if (setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &t, sizeof t) != 0 ||
        setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &t, sizeof t) != 0)
        return fail();
    return 0;
}

int tms_os_listen_at(int dirfd, const char *dir, const char *name, int backlog, int *fd)
{
    *fd = -1;
    uint64_t r;
    if (getrandom(&r, sizeof r, 0) != (ssize_t)sizeof r) return fail();
    char tmp[32];
    snprintf(tmp, sizeof tmp, ".bind-%016llx", (unsigned long long)r);
    struct sockaddr_un addr;
    socklen_t len;
    int rc = tms_os_unix_address(dirfd, dir, tmp, &addr, &len);
    if (rc) return rc;
    int s = tms_os_socket(1);
    if (s < 0) return s;
    if (bind(s, (struct sockaddr *)&addr, len) != 0) {
        rc = fail();
        close(s);
        return rc;
    }
    /* Listening before it has its name: a connect that finds the name is never refused by a live socket. */
    if (listen(s, backlog) != 0 || renameat(dirfd, tmp, dirfd, name) != 0) {
        rc = fail();
        (void)unlinkat(dirfd, tmp, 0);
        close(s);
        return rc;
    }
    *fd = s;
    return 0;
}

int tms_os_connect_at(int sock, int dirfd, const char *dir, const char *name)
{
    struct sockaddr_un addr;
    socklen_t len;
    int rc = tms_os_unix_address(dirfd, dir, name, &addr, &len);
    if (rc) return rc;
    do rc = connect(sock, (struct sockaddr *)&addr, len);
    while (rc && errno == EINTR);
    return rc ? fail() : 0;
}

int tms_os_socket_names(int dirfd, const char *prefix, char (*names)[TMS_OS_SOCKET_NAME_MAX], size_t max, size_t *n)
{
    *n = 0;
    int fd = openat(dirfd, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return fail();
    DIR *d = fdopendir(fd);
    if (!d) {
        int rc = fail();
        close(fd);
        return rc;
    }
    size_t plen = strlen(prefix);
    for (struct dirent *e; *n < max && (errno = 0, e = readdir(d));) {
        if (e->d_name[0] == '.' || strncmp(e->d_name, prefix, plen) != 0 || strlen(e->d_name) >= TMS_OS_SOCKET_NAME_MAX)
            continue;
        struct statx st;
        if (e->d_type == DT_UNKNOWN &&
            (tms_os_stat_at(dirfd, e->d_name, AT_SYMLINK_NOFOLLOW, &st) != 0 || !S_ISSOCK(st.stx_mode)))
            continue;
        if (e->d_type != DT_UNKNOWN && e->d_type != DT_SOCK) continue;
        memcpy(names[(*n)++], e->d_name, strlen(e->d_name) + 1);
    }
    int rc = errno ? fail() : 0;
    closedir(d);
    return rc;
}

int tms_os_remove_socket(int dirfd, const char *name)
{
    struct statx st;
    int rc = tms_os_stat_at(dirfd, name, AT_SYMLINK_NOFOLLOW, &st);
    if (rc) return rc;
    if (!S_ISSOCK(st.stx_mode)) return TMS_OS_NOT_FILE;
    return unlinkat(dirfd, name, 0) == 0 ? 0 : fail();
}

int tms_os_peer_of(int sock, struct tms_os_peer *peer)
{
    struct ucred cred;
    socklen_t len = sizeof cred;
    *peer = (struct tms_os_peer){.uid = (uint32_t)-1};
    if (getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) return fail();
    *peer = (struct tms_os_peer){.uid = cred.uid, .pid = cred.pid};
    return cred.uid == geteuid() ? 0 : TMS_OS_NOT_OWNER;
}

int tms_os_peer_process(int sock, int pid, int *pidfd)
{
    *pidfd = -1;
    int fd = -1;
    socklen_t len = sizeof fd;
    if (getsockopt(sock, SOL_SOCKET, SO_PEERPIDFD, &fd, &len) != 0) {
        if (errno == ESRCH) return TMS_OS_ENDED;
        if (pid <= 0) return -ESRCH;
        long r = syscall(SYS_pidfd_open, pid, 0);
        if (r < 0) return errno == ESRCH ? TMS_OS_ENDED : fail();
        fd = (int)r;
    }
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 0) > 0) {  /* a pidfd polls readable once its process has ended */
        close(fd);
        return TMS_OS_ENDED;
    }
    *pidfd = fd;
    return 0;
}

int tms_os_process_runs(int pid)
{
    return pid <= 0 || kill(pid, 0) == 0 || errno != ESRCH;
}
