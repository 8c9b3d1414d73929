/* Where this user's sockets are: a directory no other user can enter (share/place.c). */
#ifndef TMS_SHARE_PLACE_H
#define TMS_SHARE_PLACE_H

#include <stddef.h>

#include "platform/error.h"

/* The directory this process names its sockets in and finds other processes'
 * in, the same for every process of the user that sees the same places:
 * opened on first use and kept for the process and its forked children (*fd
 * is never to be closed), its path into path. Where no place is the user's
 * alone: TMS_E_IO, the message starting with who, naming each place and why
 * it was refused (every time: the places are looked at once). */
int tms_share_place(const char *who, int *fd, char *path, size_t size, struct tms_err *err);

/* A sender's socket's name within the place ("s-<pid>-<id>"), into buf. */
void tms_share_sender_name(char *buf, size_t size, unsigned pid, unsigned long long id);

#endif
