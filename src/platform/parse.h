/* Text from outside (environment, C ABI arguments) read one way everywhere: strict, overflow-checked. */
#ifndef TMS_PARSE_H
#define TMS_PARSE_H

#include <stddef.h>

/* Decimal digits only (no sign, space or prefix), at most max: 0 and *out,
 * else TMS_E_ARG (empty, another character, or out of range). */
int tms_parse_uint(const char *s, unsigned long long max, unsigned long long *out);

/* "64MiB", "2GiB", "1048576": decimal bytes with an optional unit K/KiB/KB,
 * M/MiB/MB, G/GiB/GB, T/TiB/TB (case-insensitive; all powers of 1024). */
int tms_parse_bytes(const char *s, size_t *out);

/* Exactly the upstream library's spellings: 1, true, TRUE, yes, YES and 0,
 * false, FALSE, no, NO. */
int tms_parse_bool(const char *s, int *out);

/* 1 if a and b are the same text but for the case of ASCII letters (the locale
 * plays no part: a name means the same in every process). */
int tms_ascii_case_equal(const char *a, const char *b);

/* 1 if s is valid UTF-8; else 0 and *bad the offset of the first byte that
 * is not. */
int tms_utf8_valid(const char *s, size_t *bad);

#endif
