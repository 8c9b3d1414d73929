/* Sharing allocations with other processes of the same user: the handle (wire.h), the sender (serve.c and its protocols, serve_share.c and serve_job.c), the receiver (open.c). */
#ifndef TMS_SHARE_H
#define TMS_SHARE_H

#include <stddef.h>
#include <stdint.h>

#include "platform/error.h"

#define TMS_SHARE_HANDLE_BYTES 64  /* the size of a cudaIpcMemHandle_t, so the runtime's calls can carry it */

/* A handle for the allocation holding ptr (its start or inside it), for
 * another process to open; *base and *size: the allocation's start and size
 * (the handle maps it whole). Starts this process's sender thread on first
 * use. TMS_E_NOT_FOUND if ptr is not ours. */
int tms_share_export(uint64_t ptr, unsigned char *handle, uint64_t *base, size_t *size, struct tms_err *err);

/* 1 if the 64 bytes are a handle made by tms_share_export (its magic). */
int tms_share_is_handle(const unsigned char *handle);

/* Maps the allocation a handle names, readable and writable by device (-1:
 * the calling thread's current one), and returns its start and size. The
 * same handle opened again returns the same start and needs one more close.
 * The sender counts this process as holding it (its pauses of it are
 * refused) until the last close or this process's exit. */
int tms_share_open(const unsigned char *handle, int device, uint64_t *va, size_t *size, struct tms_err *err);

/* 1 if va is the start of a mapping tms_share_open made. */
int tms_share_is_open(uint64_t va);

/* Undoes one tms_share_open of va; the last unmaps it and tells the sender. */
int tms_share_close(uint64_t va, struct tms_err *err);

/* Mappings this process holds open, and processes holding this one's (for reports and tests). */
size_t tms_share_open_count(void);

#endif
