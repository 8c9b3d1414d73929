/* Text from outside (environment, C ABI arguments) read one way everywhere: strict, overflow-checked. */
#include "platform/parse.h"

#include <stdint.h>
#include <string.h>
#include <strings.h>

#include "platform/error.h"

/* The leading digits of s into *out (at most max); the first other
 * character in *end. */
static int digits(const char *s, unsigned long long max, unsigned long long *out, const char **end)
{
    unsigned long long v = 0;
    const char *p = s;
    for (; *p >= '0' && *p <= '9'; p++) {
        unsigned d = (unsigned)(*p - '0');
        if (d > max || v > (max - d) / 10) return TMS_E_ARG;
        v = v * 10 + d;
    }
    if (p == s) return TMS_E_ARG;
    *out = v;
    *end = p;
    return TMS_OK;
}

int tms_parse_uint(const char *s, unsigned long long max, unsigned long long *out)
{
    const char *end;
    unsigned long long v;
    if (!s || digits(s, max, &v, &end) || *end) return TMS_E_ARG;
    *out = v;
    return TMS_OK;
}

int tms_parse_bytes(const char *s, size_t *out)
{
    const char *end;
    unsigned long long v;
    if (!s || digits(s, SIZE_MAX, &v, &end)) return TMS_E_ARG;
    static const struct { const char *name[3]; unsigned shift; } units[] = {
        {{"k", "kib", "kb"}, 10}, {{"m", "mib", "mb"}, 20}, {{"g", "gib", "gb"}, 30}, {{"t", "tib", "tb"}, 40},
    };
    unsigned shift = 0;
    int known = !*end;
    for (size_t u = 0; !known && u < sizeof units / sizeof *units; u++)
        for (int k = 0; k < 3 && !known; k++)
            if (!strcasecmp(end, units[u].name[k])) known = 1, shift = units[u].shift;
    if (!known || (shift && v > ((unsigned long long)SIZE_MAX >> shift))) return TMS_E_ARG;
    *out = (size_t)(v << shift);
    return TMS_OK;
}

int tms_parse_bool(const char *s, int *out)
{
    static const char *const yes[] = {"1", "true", "TRUE", "yes", "YES"};
    static const char *const no[] = {"0", "false", "FALSE", "no", "NO"};
    if (!s) return TMS_E_ARG;
    for (size_t i = 0; i < sizeof yes / sizeof *yes; i++)
        if (!strcmp(s, yes[i])) return *out = 1, TMS_OK;
    for (size_t i = 0; i < sizeof no / sizeof *no; i++)
        if (!strcmp(s, no[i])) return *out = 0, TMS_OK;
    return TMS_E_ARG;
}

int tms_ascii_case_equal(const char *a, const char *b)
{
    for (;; a++, b++) {
        unsigned char x = (unsigned char)*a, y = (unsigned char)*b;
        if (x >= 'A' && x <= 'Z') x = (unsigned char)(x - 'A' + 'a');
        if (y >= 'A' && y <= 'Z') y = (unsigned char)(y - 'A' + 'a');
        if (x != y) return 0;
        if (!x) return 1;
    }
}

int tms_utf8_valid(const char *s, size_t *bad)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t i = 0;
    while (p[i]) {
        unsigned c = p[i];
        size_t n = c < 0x80 ? 1 : (c & 0xE0) == 0xC0 ? 2 : (c & 0xF0) == 0xE0 ? 3 : (c & 0xF8) == 0xF0 ? 4 : 0;
        unsigned cp = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
        for (size_t k = 1; k < n; k++) {
            if ((p[i + k] & 0xC0) != 0x80) {
                n = 0;
                break;
            }
            cp = cp << 6 | (p[i + k] & 0x3F);
        }
        /* Overlong forms, surrogates and code points past U+10FFFF are not UTF-8. */
        static const unsigned least[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (!n || cp < least[n] || (cp >= 0xD800 && cp <= 0xDFFF) || cp > 0x10FFFF) {
            if (bad) *bad = i;
            return 0;
        }
        i += n;
    }
    return 1;
}
