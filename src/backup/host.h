/* What the host-memory backup kinds share (pageable.c, pinned.c, retained.c): fresh pages, page-locked pieces, copies out of the staging. */
#ifndef TMS_BACKUP_HOST_H
#define TMS_BACKUP_HOST_H

#include <stddef.h>

#include "backup/kind.h"

/* Page-locked host memory is registered in pieces of this many bytes, each
 * unregistered as one range; a direct copy block never crosses a piece's end. */
#define TMS_PIN_PIECE_BYTES ((size_t)64 << 20)

/* A piece's entry in a backup's map of pieces. */
enum { TMS_PIECE_UNLOCKED = 0, TMS_PIECE_LOCKED = 1, TMS_PIECE_REFUSED = 2 };

size_t tms_host_pieces(size_t size);
/* A zeroed per-piece map (TMS_PIECE_*), or NULL out of memory. */
unsigned char *tms_host_piece_map(size_t size);

/* Fresh pages for a backup of device's memory, placed (once touched) on the
 * device's NUMA node where the driver knows it; NULL with errno on failure. */
void *tms_host_map_fresh(const struct tms_driver *drv, int device, size_t size);

/* Unregisters every registered piece of b, whoever registered it. */
void tms_host_unlock_pieces(struct tms_backup *b);
/* Unlocks and unmaps b's memory (kept record; host NULL after). */
void tms_host_release(struct tms_backup *b);

/* The contract's operations that every host-memory kind does the same way. */
int tms_host_page_locked(const struct tms_backup *b);
void *tms_host_direct_at(const struct tms_backup *b, size_t off);
size_t tms_host_block_len(const struct tms_backup *b, enum tms_backup_path path, size_t off, size_t left,
                          const struct tms_block_sizes *sizes);
int tms_host_write_block(struct tms_backup *b, const void *staging, size_t len, size_t off, struct tms_err *err);
int tms_host_read_block(struct tms_backup *b, void *staging, size_t len, size_t off, struct tms_err *err);

/* Locking as the first copy goes (pinned backups; a pageable one the pause
 * that makes it will keep across resume): each copy worker page-locks the
 * piece it copies next, then DMAs straight into it. */
void tms_host_lock_on_first_copy(struct tms_backup *b);
enum tms_backup_path tms_host_path(const struct tms_backup *b, int to_host, size_t off, size_t len);
int tms_host_prepare_block(struct tms_backup *b, size_t off, size_t len, struct tms_err *err);
void tms_host_copied(struct tms_backup *b);

/* Queues b (a pageable backup kept across resume) to be page-locked, once, by
 * a background thread while no copy runs (retained.c). */
void tms_backup_pin_later(struct tms_backup *b);

#endif
