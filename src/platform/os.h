/* The operating system's primitives: the host's memory, the boot id, the descriptor budget, the user's directories, private and trusted directories, file checks, Unix sockets in a directory and their peers. */
#ifndef TMS_OS_H
#define TMS_OS_H

#include <fcntl.h>     /* AT_FDCWD, AT_SYMLINK_NOFOLLOW */
#include <limits.h>    /* PATH_MAX */
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>  /* socklen_t */
#include <sys/stat.h>  /* struct statx */
#include <sys/un.h>  /* struct sockaddr_un */

/*
 * Conventions every primitive keeps:
 *  - Each returns int: 0 on success; a negative errno where the system
 *    refused a call (-ENOENT, -EACCES: errno as the call set it, negated,
 *    never 0); or a positive TMS_OS_* verdict where the system answered and
 *    what stands there fails the check the primitive makes. errno is not
 *    part of the result. The few that cannot fail say what they return.
 *  - Out-parameters are never NULL. A path written into a caller's buffer
 *    is always NUL-terminated; one that does not fit is cut and the call
 *    fails with -ENAMETOOLONG.
 *  - Paths are relative to `at` (a directory descriptor, or AT_FDCWD) where
 *    the primitive takes one. No primitive follows a final symbolic link
 *    unless it says so; descriptors it returns are O_CLOEXEC and the
 *    caller's to close.
 *  - "This user" is the effective uid. Nothing here logs, takes a lock or
 *    keeps state: what a result means and what to say is the caller's.
 *  - Files are examined with statx, never stat/fstat: those are GLIBC_2.33
 *    symbols, and the wheel loads on glibc 2.28 (platform/glibc_compat.h).
 */

/* What stands there, where a primitive's check fails. */
enum tms_os_verdict {
    TMS_OS_LINK = 1,     /* a symbolic link */
    TMS_OS_NOT_DIR,      /* not a directory */
    TMS_OS_NOT_FILE,     /* not a regular file */
    TMS_OS_NOT_OWNER,    /* a file of another owner than the one asked for */
    TMS_OS_NOT_PRIVATE,  /* a directory another user owns, or one others may use (mode & 077) */
    TMS_OS_UNSAFE,       /* a place where another user could make or replace names */
    TMS_OS_OTHER_FILE,   /* another file than the one named by identity */
    TMS_OS_UNSEALED,     /* a file its owner could still shrink (no F_SEAL_SHRINK) */
    TMS_OS_SHORT,        /* a file that holds fewer bytes than asked for */
    TMS_OS_ENDED,        /* a process that has ended */
};

/* ---- files: statx, identity, owner checks ----------------------------------------------------- */

/* STATX_BASIC_STATS of the open descriptor fd itself. */
int tms_os_stat_fd(int fd, struct statx *st);
/* STATX_BASIC_STATS of path; flags: AT_SYMLINK_NOFOLLOW for the link itself, 0 to follow it. */
int tms_os_stat_at(int at, const char *path, int flags, struct statx *st);

/* A file's identity: while it is held open, no other file has the same. */
struct tms_os_id {
    uint64_t dev;  /* major << 32 | minor */
    uint64_t ino;
};
/* st's identity (cannot fail). */
static inline struct tms_os_id tms_os_id_of(const struct statx *st)
{
    return (struct tms_os_id){(uint64_t)st->stx_dev_major << 32 | st->stx_dev_minor, st->stx_ino};
}
/* 1 if a and b are one file, else 0 (cannot fail). */
static inline int tms_os_same_id(const struct tms_os_id *a, const struct tms_os_id *b)
{
    return a->dev == b->dev && a->ino == b->ino;
}

/* The open descriptor fd is a regular file owned by uid: 0 and *id, else
 * TMS_OS_NOT_FILE or TMS_OS_NOT_OWNER. */
int tms_os_check_file(int fd, uint32_t uid, struct tms_os_id *id);
/* The same of the name itself (a link is TMS_OS_NOT_FILE). */
int tms_os_check_file_at(int at, const char *name, uint32_t uid);
/* Opens name with flags (O_RDONLY, O_RDWR; O_NOFOLLOW | O_NONBLOCK |
 * O_CLOEXEC are added: a FIFO planted there opens at once, then fails the
 * check) and checks it as tms_os_check_file does: 0 and *fd, else the
 * descriptor is closed. */
int tms_os_open_file(int at, const char *name, int flags, uint32_t uid, int *fd);
/* path (not following a final link) names the file id: 0, else
 * TMS_OS_OTHER_FILE. */
int tms_os_names(int at, const char *path, const struct tms_os_id *id);
/* The open descriptor fd is a regular file sealed against shrinking
 * (F_SEAL_SHRINK) that holds at least size bytes, as memory another process
 * hands over must be (a shrunk file would fault the reads of its mappings):
 * 0 and *id; else TMS_OS_NOT_FILE (a socket, a device: nothing to check
 * here), TMS_OS_UNSEALED or TMS_OS_SHORT. */
int tms_os_check_sealed(int fd, uint64_t size, struct tms_os_id *id);
/* The filesystem fd lives on keeps its files in memory: *kind is "tmpfs" or
 * "ramfs", else NULL. */
int tms_os_memory_fs(int fd, const char **kind);

/* ---- the host ----------------------------------------------------------------------------- */

/* The file tms_os_meminfo reads: TMS_HOST_MEMINFO (a test seam, from the
 * process's settings) where set, else /proc/meminfo. Cannot fail. */
const char *tms_os_meminfo_path(void);
/* MemTotal and MemAvailable of tms_os_meminfo_path(), in bytes: a regular
 * file only, opened without blocking or following a link (a FIFO or a
 * device reads as unknown instead of holding the caller), its first 4 KiB.
 * A figure is "<digits> kB" of at most 2^42 KiB (a larger one is a corrupt
 * file, and would wrap as bytes). Both out-parameters are always written,
 * 0 where unknown: 0 when both were read, else -ENODATA (a field absent or
 * malformed), -EINVAL (not a regular file) or the open's error. */
int tms_os_meminfo(size_t *total, size_t *available);

/* The process's soft limit on open descriptors (RLIMIT_NOFILE); 1024 where
 * it cannot be read, SIZE_MAX where unlimited. */
size_t tms_os_fd_limit(void);
/* The uses that keep descriptors for as long as other processes want, each
 * with its share of tms_os_fd_limit(): a quarter each, so together they leave
 * the process half its limit for its own files, whatever the others do. */
enum tms_os_fd_use {
    TMS_OS_FDS_HELD,      /* a sender's receivers' connections and the pidfds it watches (16 to 4096) */
    TMS_OS_FDS_BORROWED,  /* the descriptors memory borrowed within a job keeps */
};
/* The descriptors use may keep (cannot fail). */
size_t tms_os_fd_budget(enum tms_os_fd_use use);

/* The host's boot id, 36 lowercase hex digits and dashes: the same in every
 * container of a host, another after a reboot or on another host. pre: out
 * has 37 bytes. -EINVAL if the file holds something else. */
int tms_os_boot_id(char *out);

/* ---- the user's directories (paths only: nothing is made, opened or checked) --------------------- */

/* This user's home from the user database (getpwuid_r), never $HOME.
 * -ENOENT where the database has no entry, or no absolute home in it. */
int tms_os_home_dir(char *buf, size_t size);
/* <home>/.cache, the home as tms_os_home_dir finds it: a place no other user
 * can make names in, whatever the environment says ($XDG_CACHE_HOME is not
 * read). Its errors. */
int tms_os_cache_dir(char *buf, size_t size);
/* The user's runtime directory: xdg (the value of $XDG_RUNTIME_DIR, as the
 * settings read it; NULL or "": unset) where it is an absolute path, else
 * /run/user/<uid>, where logind makes it. */
int tms_os_runtime_dir(const char *xdg, char *buf, size_t size);

/* ---- private directories ------------------------------------------------------------------- */

/* Makes the directory path, mode 0700 (less the umask). mkdir never takes
 * over a name: whatever already stands there (another user's directory, a
 * link, a file) is left as it is and the call returns 0, so a caller that
 * needs a private directory then opens it with tms_os_open_private_dir,
 * which refuses anything but one. Links in the parents are followed. */
int tms_os_make_dir(int at, const char *path);

/* What stood at a path a check refused. */
struct tms_os_owner {
    uint32_t uid;
    uint32_t mode;  /* type and permission bits (stx_mode) */
};
/* Opens path as a directory of this user's alone: a directory, not a link,
 * owned by this user, no access for group or others. 0 and *fd; else a
 * verdict (TMS_OS_LINK, TMS_OS_NOT_DIR, TMS_OS_NOT_PRIVATE) with *found
 * what stands there, or the error of opening it, or of looking at it where
 * it could not be opened (-ENOENT: nothing stands there). */
int tms_os_open_private_dir(int at, const char *path, int *fd, struct tms_os_owner *found);

/* ---- trusted paths ------------------------------------------------------------------------- */

/* path made absolute against the working directory now: *out is malloc'd
 * (the caller frees it), path itself copied where it is already absolute. */
int tms_os_absolute(const char *path, char **out);
/* Makes every missing directory of the absolute path, mode 0700, following
 * links (tms_os_check_links first where that matters). */
int tms_os_make_dirs(const char *path);
/* The absolute path with every link resolved (realpath). pre: resolved has
 * PATH_MAX bytes. */
int tms_os_resolve(const char *path, char *resolved);

/* Where a walk stopped. */
struct tms_os_stop {
    char at[PATH_MAX];  /* the path up to where it stopped: "/" or a prefix of the path walked */
    int opening;        /* a negative errno: 1 if opening `at` failed, 0 if looking at it did */
    uint32_t uid;       /* TMS_OS_UNSAFE: the owner and mode of what stands at `at` */
    uint32_t mode;
};

/* Every symbolic link on the way to the absolute path lies where no other
 * user could have made or replaced it: in a directory they cannot write, or
 * in a sticky one with the link owned by root or this user. A link that
 * does not: TMS_OS_UNSAFE, *stop naming it. Links are followed only where
 * checked so (mkdir and realpath follow them): call this before either. */
int tms_os_check_links(const char *path, struct tms_os_stop *stop);

/* Opens the resolved absolute path (tms_os_resolve's) as a directory, one
 * component at a time from "/", never following a link and never blocking.
 * check: each directory on the way must be out of other users' reach --
 * owned by root or this user and writable by no one else unless sticky;
 * the last one owned by this user and writable by no one else, or sticky and
 * owned by root or this user -- else TMS_OS_UNSAFE, *stop naming where. 0
 * and *fd; on any failure *stop says where. */
int tms_os_open_trusted(const char *path, int check, int *fd, struct tms_os_stop *stop);

/* ---- Unix sockets in a directory, their peers and their processes -------------------------------- */
/* A socket named in a directory only this user can enter can be reached by
 * no other user: connect needs search rights on the directory. Sockets here
 * are SOCK_SEQPACKET, AF_UNIX, O_CLOEXEC. */

#define TMS_OS_SOCKET_NAME_MAX 64  /* a socket's name in its directory, with its NUL */

/* The address of name in the directory dir (opened as dirfd): "dir/name"
 * where that fits sun_path, else "/proc/self/fd/<dirfd>/name", which the
 * kernel resolves through the held descriptor. pre: name has no '/'. */
int tms_os_unix_address(int dirfd, const char *dir, const char *name, struct sockaddr_un *addr, socklen_t *len);
/* Listens on a new non-blocking socket named name in the directory, bound
 * under a temporary name starting with '.', then renamed into place: under
 * its name a socket always listens, or its process has ended. 0 and *fd. */
int tms_os_listen_at(int dirfd, const char *dir, const char *name, int backlog, int *fd);
/* A new socket of this kind (non-blocking where asked): its descriptor, or a negative errno. */
int tms_os_socket(int nonblocking);
/* The next connection waiting on listening socket lfd (close-on-exec): its descriptor, or a negative errno. */
int tms_os_accept(int lfd);
/* Sends and receives on sock give up after seconds (SO_SNDTIMEO, SO_RCVTIMEO). */
int tms_os_socket_timeouts(int sock, int seconds);
/* Connects sock (made by the caller) to name in the directory. -ECONNREFUSED:
 * nobody listens there (its process ended); -EAGAIN: its backlog is full
 * (a non-blocking sock). */
int tms_os_connect_at(int sock, int dirfd, const char *dir, const char *name);
/* The sockets in the directory whose names start with prefix (never '.'
 * names), at most max of them, into names; *n how many. */
int tms_os_socket_names(int dirfd, const char *prefix, char (*names)[TMS_OS_SOCKET_NAME_MAX], size_t max, size_t *n);
/* Removes name from the directory where it is a socket (TMS_OS_NOT_FILE:
 * something else stands there, left as it is). */
int tms_os_remove_socket(int dirfd, const char *name);

/* Who is at the other end of a connected socket, as the kernel recorded it
 * when it connected (SO_PEERCRED). */
struct tms_os_peer {
    uint32_t uid;
    int pid;  /* 0 where its process is outside this PID namespace */
};
/* *peer (always written); 0 where it runs as this user, else TMS_OS_NOT_OWNER. */
int tms_os_peer_of(int sock, struct tms_os_peer *peer);
/* Whether the process at the other end of sock still runs: 0 and *pidfd (a
 * descriptor that polls readable once it ends) where it does; TMS_OS_ENDED
 * where it has ended; a negative errno where the kernel cannot tell (no
 * pidfds before Linux 5.3; *pidfd -1). It asks SO_PEERPIDFD (the process
 * that connected, whatever reused its pid since); older kernels by pid (the
 * peer's, from tms_os_peer_of; 0: -ESRCH), where a pid reused meanwhile
 * reads as running, never the other way round. */
int tms_os_peer_process(int sock, int pid, int *pidfd);
/* 1 if a process pid runs in this PID namespace (this user's or another's),
 * else 0 (cannot fail; pid <= 0 is 1: nothing is known of it). */
int tms_os_process_runs(int pid);

#endif
