/* Directories the OS must not let another user touch: private ones made and checked, paths walked and trusted. */
#include "platform/os.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int fail(void) { return errno > 0 ? -errno : -EIO; }

/* ---- private directories --------------------------------------------------------------------- */

int tms_os_make_dir(int at, const char *path)
{
    return mkdirat(at, path, 0700) == 0 || errno == EEXIST ? 0 : fail();
}

int tms_os_open_private_dir(int at, const char *path, int *fd, struct tms_os_owner *found)
{
    int opened = openat(at, path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    int open_rc = opened < 0 ? fail() : 0;
    struct statx st;
    /* Where it cannot be opened, what stands there says whether to refuse it
     * (another user's directory is not readable) or report why. */
    int rc = opened < 0 ? tms_os_stat_at(at, path, AT_SYMLINK_NOFOLLOW, &st) : tms_os_stat_fd(opened, &st);
    if (!rc) {
        *found = (struct tms_os_owner){.uid = st.stx_uid, .mode = st.stx_mode};
        if (S_ISLNK(st.stx_mode)) rc = TMS_OS_LINK;
        else if (!S_ISDIR(st.stx_mode)) rc = TMS_OS_NOT_DIR;
        else if (st.stx_uid != geteuid() || (st.stx_mode & 077)) rc = TMS_OS_NOT_PRIVATE;
        else rc = open_rc;
    } else if (opened < 0) {
        rc = open_rc;
    }
    if (rc) {
        if (opened >= 0) close(opened);
        return rc;
    }
    *fd = opened;
    return 0;
}

/* ---- trusted paths ------------------------------------------------------------------------- */

int tms_os_absolute(const char *path, char **out)
{
    char *made = NULL;
    if (path[0] == '/') {
        made = strdup(path);
    } else {
        char cwd[PATH_MAX];
        if (!getcwd(cwd, sizeof cwd)) return fail();
        if (asprintf(&made, "%s/%s", cwd, path) < 0) made = NULL;
    }
    if (!made) return errno > 0 ? -errno : -ENOMEM;
    *out = made;
    return 0;
}

int tms_os_make_dirs(const char *path)
{
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return -ENAMETOOLONG;
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/') continue;
        *p = '\0';
        if (mkdir(buf, 0700) != 0 && errno != EEXIST) return fail();
        *p = '/';
    }
    if (mkdir(buf, 0700) != 0 && errno != EEXIST) return fail();
    return 0;
}

int tms_os_resolve(const char *path, char *resolved)
{
    return realpath(path, resolved) ? 0 : fail();
}

static void stop_at(struct tms_os_stop *stop, const char *at, int len, int opening, const struct statx *st)
{
    snprintf(stop->at, sizeof stop->at, "%.*s", len, at);
    stop->opening = opening;
    stop->uid = st ? st->stx_uid : 0;
    stop->mode = st ? st->stx_mode : 0;
}

int tms_os_check_links(const char *path, struct tms_os_stop *stop)
{
    char buf[PATH_MAX];
    stop_at(stop, path, (int)strlen(path), 0, NULL);
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) return -ENAMETOOLONG;
    for (char *p = buf + 1;; p++) {
        if (*p != '/' && *p) continue;
        char saved = *p;
        *p = '\0';
        struct statx link, parent;
        char *slash = strrchr(buf, '/');
        char parent_path[PATH_MAX];
        snprintf(parent_path, sizeof parent_path, "%.*s", slash == buf ? 1 : (int)(slash - buf), buf);
        if (tms_os_stat_at(AT_FDCWD, buf, AT_SYMLINK_NOFOLLOW, &link) == 0 && S_ISLNK(link.stx_mode) &&
            tms_os_stat_at(AT_FDCWD, parent_path, 0, &parent) == 0) {
            int others_write = (parent.stx_mode & (S_IWGRP | S_IWOTH)) != 0, sticky = (parent.stx_mode & S_ISVTX) != 0;
            int link_owner_ok = link.stx_uid == geteuid() || link.stx_uid == 0;
            if (others_write && !(sticky && link_owner_ok)) {
                stop_at(stop, buf, (int)strlen(buf), 0, &link);
                return TMS_OS_UNSAFE;
            }
        }
        if (!saved) break;
        *p = saved;
    }
    return 0;
}

/* Another user can neither write st's directory nor rename what is in it
 * (final: the directory walked to; else a directory above it). */
static int safe_dir(const struct statx *st, int final)
{
    uid_t me = geteuid();
    int others_write = (st->stx_mode & (S_IWGRP | S_IWOTH)) != 0;
    int sticky = (st->stx_mode & S_ISVTX) != 0;
    int owner_ok = st->stx_uid == me || st->stx_uid == 0;
    if (final) return (st->stx_uid == me && !others_write) || (sticky && owner_ok);
    return owner_ok && (!others_write || sticky);
}

int tms_os_open_trusted(const char *path, int check, int *fd, struct tms_os_stop *stop)
{
    stop_at(stop, "/", 1, 1, NULL);
    int dir = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) return fail();
    char buf[PATH_MAX];
    snprintf(buf, sizeof buf, "%s", path);
    char *save = NULL, *next = strtok_r(buf + 1, "/", &save);
    struct statx st;
    int rc = tms_os_stat_fd(dir, &st);
    stop->opening = 0;
    if (!rc && check && !safe_dir(&st, next == NULL)) {
        stop_at(stop, "/", 1, 0, &st);
        rc = TMS_OS_UNSAFE;
    }
    while (!rc && next) {
        const char *comp = next;
        int len = (int)(comp - buf + strlen(comp));  /* path up to and with comp */
        next = strtok_r(NULL, "/", &save);
        stop_at(stop, path, len, 1, NULL);
        int sub = openat(dir, comp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
        rc = sub < 0 ? fail() : 0;
        close(dir);
        dir = sub;
        if (rc) break;
        stop->opening = 0;
        if ((rc = tms_os_stat_fd(dir, &st)) == 0 && check && !safe_dir(&st, next == NULL)) {
            stop_at(stop, path, len, 0, &st);
            rc = TMS_OS_UNSAFE;
        }
    }
    if (rc) {
        if (dir >= 0) close(dir);
        return rc;
    }
    *fd = dir;
    return 0;
}
