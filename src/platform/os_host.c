/* The host and the user as the OS tells them: /proc/meminfo, the descriptor budget, the boot id, the user's home, cache and runtime directories. */
#include "platform/os.h"

#include <errno.h>
#include <pwd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

#include "platform/config.h"

static int fail(void) { return errno > 0 ? -errno : -EIO; }

/* ---- /proc/meminfo ------------------------------------------------------------------------- */

/* 4 PiB: a larger figure is a corrupt file, and shifting it to bytes would wrap. */
#define MEMINFO_MAX_KIB ((unsigned long long)1 << 42)

/* The "<key> <digits> kB" line's bytes; 0 if absent or malformed. */
static size_t meminfo_field(const char *text, const char *key)
{
    size_t key_len = strlen(key);
    for (const char *line = text; *line;) {
        const char *end = strchr(line, '\n');
        if (strncmp(line, key, key_len) == 0) {
            const char *p = line + key_len;
            unsigned long long kib = 0;
            int digits = 0;
            while (*p == ' ' || *p == '\t') p++;
            for (; *p >= '0' && *p <= '9' && kib <= MEMINFO_MAX_KIB; p++, digits++) kib = kib * 10 + (unsigned)(*p - '0');
            if (!digits || kib > MEMINFO_MAX_KIB || strncmp(p, " kB", 3) != 0 || (p[3] && p[3] != '\n')) return 0;
            return (size_t)kib << 10;
        }
        if (!end) break;
        line = end + 1;
    }
    return 0;
}

const char *tms_os_meminfo_path(void)
{
    const char *seam = tms_defaults()->host_meminfo;
    return seam[0] ? seam : "/proc/meminfo";
}

int tms_os_meminfo(size_t *total, size_t *available)
{
    *total = *available = 0;
    int fd = open(tms_os_meminfo_path(), O_RDONLY | O_NONBLOCK | O_NOFOLLOW | O_CLOEXEC);
    if (fd < 0) return fail();
    char text[4096];
    size_t len = 0;
    struct statx st;
    int rc = tms_os_stat_fd(fd, &st);
    if (!rc && !S_ISREG(st.stx_mode)) rc = -EINVAL;
    while (!rc && len < sizeof text - 1) {
        ssize_t got = read(fd, text + len, sizeof text - 1 - len);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;
        len += (size_t)got;
    }
    close(fd);
    text[len] = 0;
    *total = meminfo_field(text, "MemTotal:");
    *available = meminfo_field(text, "MemAvailable:");
    return rc ? rc : *total && *available ? 0 : -ENODATA;
}

/* ---- descriptors ----------------------------------------------------------------------------- */

size_t tms_os_fd_limit(void)
{
    struct rlimit r;
    if (getrlimit(RLIMIT_NOFILE, &r) != 0) return 1024;
    return r.rlim_cur == RLIM_INFINITY || r.rlim_cur > SIZE_MAX ? SIZE_MAX : (size_t)r.rlim_cur;
}

/* Past 4096 held descriptors a sender says its limit rather than keep more; below 16 it could not serve one process. */
#define HELD_MIN 16
#define HELD_MAX 4096

size_t tms_os_fd_budget(enum tms_os_fd_use use)
{
    size_t quarter = tms_os_fd_limit() / 4;
    if (use != TMS_OS_FDS_HELD) return quarter;
    return quarter < HELD_MIN ? HELD_MIN : quarter > HELD_MAX ? HELD_MAX : quarter;
}

/* ---- the boot id ----------------------------------------------------------------------------- */

int tms_os_boot_id(char *out)
{
    out[0] = 0;
    int fd = open("/proc/sys/kernel/random/boot_id", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return fail();
    char id[36];
    ssize_t n = read(fd, id, sizeof id);
    int e = n < 0 ? fail() : 0;
    close(fd);
    if (e) return e;
    if (n != (ssize_t)sizeof id) return -EINVAL;
    for (size_t i = 0; i < sizeof id; i++)
        if (!((id[i] >= '0' && id[i] <= '9') || (id[i] >= 'a' && id[i] <= 'f') || id[i] == '-')) return -EINVAL;
    memcpy(out, id, sizeof id);
    out[sizeof id] = 0;
    return 0;
}

/* ---- the user's directories -------------------------------------------------------------------- */

/* snprintf's result as a primitive's: 0, or -ENAMETOOLONG with buf cut. */
static int fitted(int n, size_t size)
{
    if (n < 0) return -EINVAL;
    return (size_t)n < size ? 0 : -ENAMETOOLONG;
}

/* The home joined with tail ("" for the home itself). */
static int home_with(const char *tail, char *buf, size_t size)
{
    struct passwd pw, *found = NULL;
    char db[4096];
    if (size) buf[0] = 0;
    int e = getpwuid_r(geteuid(), &pw, db, sizeof db, &found);
    if (e) return -e;
    if (!found || pw.pw_dir[0] != '/') return -ENOENT;
    return fitted(snprintf(buf, size, "%s%s", pw.pw_dir, tail), size);
}

int tms_os_home_dir(char *buf, size_t size) { return home_with("", buf, size); }

int tms_os_cache_dir(char *buf, size_t size) { return home_with("/.cache", buf, size); }

int tms_os_runtime_dir(const char *xdg, char *buf, size_t size)
{
    int n = xdg && xdg[0] == '/' ? snprintf(buf, size, "%s", xdg) : snprintf(buf, size, "/run/user/%u", (unsigned)geteuid());
    return fitted(n, size);
}
