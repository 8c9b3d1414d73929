/* Where this user's sockets are: the first of its runtime directory, names under /dev/shm and its home's cache that is a directory of the user's alone. */
#include "share/place.h"

#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "platform/config.h"
#include "platform/os.h"

/* Names under /dev/shm tried in turn: another user can take a name there
 * before this user's first process (the directory is sticky, the name stays
 * theirs), which sends every process of the user on to the next. */
#define SHARED_NAMES 8

/* The place, found once (pthread_once: glibc runs it again in a child forked
 * while another thread ran it) and not changed after: place_fd stays open for
 * the process and its forked children (the same user, the same place). A
 * failure is kept too: a process without a place does not look again at
 * every pause. */
static pthread_once_t place_once = PTHREAD_ONCE_INIT;
static int place_fd = -1;
static char place_path[PATH_MAX];
static char place_why[1024];  /* why none was had */

/* path (relative to at) opened as a directory of this user's alone, made
 * (mode 0700) first if make; -1 with why where it is not. */
static int open_private(int at, const char *path, int make, char *why, size_t why_size)
{
    int rc = make ? tms_os_make_dir(at, path) : 0;
    int fd = -1;
    struct tms_os_owner found;
    if (!rc) rc = tms_os_open_private_dir(at, path, &fd, &found);
    if (!rc) return fd;
    if (rc == TMS_OS_LINK) snprintf(why, why_size, "it is a symbolic link");
    else if (rc == TMS_OS_NOT_DIR) snprintf(why, why_size, "it is not a directory");
    else if (rc > 0)
        snprintf(why, why_size, "it is not this user's alone (owner uid %u, mode %04o)", (unsigned)found.uid,
                 (unsigned)(found.mode & 07777));
    else snprintf(why, why_size, "%s", strerror(-rc));
    return -1;
}

/* <runtime directory>/torch_memory_saver (the host backup ledger's place
 * too): the runtime directory must exist and be the user's alone. */
static int open_runtime(char *path, size_t size, char *why, size_t why_size)
{
    if (tms_os_runtime_dir(tms_defaults()->xdg_runtime_dir, path, size - 32) != 0) {
        snprintf(why, why_size, "its path is too long");
        return -1;
    }
    int top = open_private(AT_FDCWD, path, 0, why, why_size);
    if (top < 0) return -1;
    size_t n = strlen(path);
    snprintf(path + n, size - n, "/torch_memory_saver");
    int fd = open_private(top, "torch_memory_saver", 1, why, why_size);
    close(top);
    return fd;
}

/* /dev/shm/tms-run-<uid>, -1 ... (/tmp where there is no /dev/shm): what
 * containers that share a GPU's IPC namespace share too. */
static int open_shared_name(int k, char *path, size_t size, char *why, size_t why_size)
{
    struct statx st;
    const char *base = tms_os_stat_at(AT_FDCWD, "/dev/shm", 0, &st) == 0 && S_ISDIR(st.stx_mode) ? "/dev/shm" : "/tmp";
    if (k) snprintf(path, size, "%s/tms-run-%u-%d", base, (unsigned)geteuid(), k);
    else snprintf(path, size, "%s/tms-run-%u", base, (unsigned)geteuid());
    return open_private(AT_FDCWD, path, 1, why, why_size);
}

/* <home>/.cache/torch_memory_saver/run-<boot id>: the home from the user
 * database; the boot id keeps apart hosts that share a network home. */
static int open_home(char *path, size_t size, char *why, size_t why_size)
{
    char boot[37];
    int rc = tms_os_cache_dir(path, size - 64);
    if (rc) {
        snprintf(path, size, "~/.cache/torch_memory_saver");
        snprintf(why, why_size, "%s", rc == -ENAMETOOLONG ? "its path is too long" : "no home in the user database");
        return -1;
    }
    if (tms_os_boot_id(boot) != 0) {
        snprintf(why, why_size, "cannot read the boot id");
        return -1;
    }
    size_t n = strlen(path);
    (void)tms_os_make_dir(AT_FDCWD, path);  /* the parents follow links: a ~/.cache elsewhere is the user's choice */
    snprintf(path + n, size - n, "/torch_memory_saver");
    (void)tms_os_make_dir(AT_FDCWD, path);
    snprintf(path + n, size - n, "/torch_memory_saver/run-%s", boot);
    return open_private(AT_FDCWD, path, 1, why, why_size);
}

/* The first place of the user's alone, in the order every process of the user tries them. */
static void find(void)
{
    char why[256];
    size_t used = 0;
    for (int i = 0; i < SHARED_NAMES + 2 && place_fd < 0; i++) {
        why[0] = 0;
        if (i == 0) place_fd = open_runtime(place_path, sizeof place_path, why, sizeof why);
        else if (i <= SHARED_NAMES) place_fd = open_shared_name(i - 1, place_path, sizeof place_path, why, sizeof why);
        else place_fd = open_home(place_path, sizeof place_path, why, sizeof why);
        if (place_fd >= 0 || (i > 1 && i <= SHARED_NAMES)) continue;  /* the first name under /dev/shm stands for all */
        int n = snprintf(place_why + used, sizeof place_why - used, "%s%s%s: %s", used ? "; " : "", place_path,
                         i == 1 ? " and the next names" : "", why);
        if (n > 0) used = (size_t)n < sizeof place_why - used ? used + (size_t)n : sizeof place_why - 1;
    }
}

int tms_share_place(const char *who, int *fd, char *path, size_t size, struct tms_err *err)
{
    pthread_once(&place_once, find);
    *fd = place_fd;
    snprintf(path, size, "%s", place_fd >= 0 ? place_path : "");
    int rc = place_fd >= 0 ? TMS_OK
                           : tms_fail(err, TMS_E_IO, EACCES,
                                      "%s: no directory of this user's alone for its sockets (another user could "
                                      "reach them anywhere else): %s",
                                      who, place_why);
    return rc;
}

void tms_share_sender_name(char *buf, size_t size, unsigned pid, unsigned long long id)
{
    snprintf(buf, size, "s-%u-%016llx", pid, id);
}
