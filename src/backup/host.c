/* What the host-memory backup kinds share (pageable.c, pinned.c, retained.c): fresh pages, page-locked pieces, copies out of the staging. */
#include "backup/host.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#if defined(__x86_64__)
#include <emmintrin.h>
#endif

#include "platform/log.h"
#include "platform/topology.h"

size_t tms_host_pieces(size_t size) { return (size + TMS_PIN_PIECE_BYTES - 1) / TMS_PIN_PIECE_BYTES; }

unsigned char *tms_host_piece_map(size_t size) { return calloc(tms_host_pieces(size) ? tms_host_pieces(size) : 1, 1); }

/* Huge pages: fewer page faults when the backup is first written and a much
 * cheaper munmap when it goes (docs/performance.md). Placed on the device's
 * NUMA node where the host has several: a DMA across the socket link runs
 * slower and takes the other socket's memory bandwidth. */
void *tms_host_map_fresh(const struct tms_driver *drv, int device, size_t size)
{
    void *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    (void)madvise(p, size, MADV_HUGEPAGE);
    int node = drv->numa_node ? drv->numa_node(device) : -1;
    if (node >= 0) {
        int rc = tms_topology_prefer_node(p, size, node);
        if (rc) TMS_DEBUG("backup of %zu bytes not placed on NUMA node %d: errno %d", size, node, rc);
    }
    return p;
}

void tms_host_unlock_pieces(struct tms_backup *b)
{
    if (!b->locked) return;
    for (size_t k = 0; k < tms_host_pieces(b->size); k++)
        if (b->locked[k]) {
            if (b->locked[k] == TMS_PIECE_LOCKED) (void)b->drv->host_unregister(b->device, (char *)b->host + k * TMS_PIN_PIECE_BYTES);
            b->locked[k] = 0;
        }
}

/* Driver calls here fail only at driver teardown, when the process ends. */
void tms_host_release(struct tms_backup *b)
{
    if (!b->host) return;
    tms_host_unlock_pieces(b);  /* those of a failed pause or of a locking cut short by the exit too */
    free(b->locked);
    b->locked = NULL;
    munmap(b->host, b->size);
    b->host = NULL;
}

int tms_host_page_locked(const struct tms_backup *b)
{
    return __atomic_load_n(&b->pinning, __ATOMIC_ACQUIRE) == TMS_PIN_DONE;
}

void *tms_host_direct_at(const struct tms_backup *b, size_t off) { return (char *)b->host + off; }

/* Staged: the staging's size. Direct: up to the direct size, never across a
 * piece's end (a DMA range within one registration). Prepared: a whole piece,
 * registered as one range so that it can be unregistered as one. */
size_t tms_host_block_len(const struct tms_backup *b, enum tms_backup_path path, size_t off, size_t left,
                          const struct tms_block_sizes *sizes)
{
    (void)b;
    size_t to_piece_end = TMS_PIN_PIECE_BYTES - off % TMS_PIN_PIECE_BYTES;
    size_t len = path == TMS_PATH_STAGED ? sizes->staged : path == TMS_PATH_DIRECT ? sizes->direct : to_piece_end;
    if (len > left) len = left;
    return path != TMS_PATH_STAGED && len > to_piece_end ? to_piece_end : len;
}

/* Moves a block out of the staging into a backup's fresh pages with
 * streaming stores: a plain store reads each destination line before
 * writing it, and the kernel has just zeroed these lines out of the cache,
 * so that read is one more pass over memory per byte backed up. */
int tms_host_write_block(struct tms_backup *b, const void *staging, size_t len, size_t off, struct tms_err *err)
{
    (void)err;
#if defined(__x86_64__)
    char *d = (char *)b->host + off;
    const char *s = staging;
    size_t n = len;
    size_t head = (16 - ((uintptr_t)d & 15)) & 15;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i w0 = _mm_loadu_si128((const __m128i *)(const void *)s);
        __m128i w1 = _mm_loadu_si128((const __m128i *)(const void *)(s + 16));
        __m128i w2 = _mm_loadu_si128((const __m128i *)(const void *)(s + 32));
        __m128i w3 = _mm_loadu_si128((const __m128i *)(const void *)(s + 48));
        _mm_stream_si128((__m128i *)(void *)d, w0);
        _mm_stream_si128((__m128i *)(void *)(d + 16), w1);
        _mm_stream_si128((__m128i *)(void *)(d + 32), w2);
        _mm_stream_si128((__m128i *)(void *)(d + 48), w3);
    }
    memcpy(d, s, n);
    _mm_sfence();  /* streaming stores are weakly ordered: visible before the block counts as done */
#else
    memcpy((char *)b->host + off, staging, len);
#endif
    return TMS_OK;
}

int tms_host_read_block(struct tms_backup *b, void *staging, size_t len, size_t off, struct tms_err *err)
{
    (void)err;
    memcpy(staging, (const char *)b->host + off, len);
    return TMS_OK;
}

/* ---- locking as the first copy goes ------------------------------------------ */

/* A piece map on a backup whose pinning has not begun marks it to be locked
 * by its first copy (pinned backups, retained fresh ones). */
static int first_copy(const struct tms_backup *b)
{
    return b->locked && __atomic_load_n(&b->pinning, __ATOMIC_ACQUIRE) == TMS_PIN_NONE;
}

void tms_host_lock_on_first_copy(struct tms_backup *b)
{
    if (!b->locked && __atomic_load_n(&b->pinning, __ATOMIC_ACQUIRE) == TMS_PIN_NONE)
        b->locked = tms_host_piece_map(b->size);  /* without memory for the map: locked later, in the background */
}

/* Are the pieces under [off, off+len) all page-locked? */
static int range_locked(const struct tms_backup *b, size_t off, size_t len)
{
    if (!b->locked || !len) return 0;
    for (size_t k = off / TMS_PIN_PIECE_BYTES; k <= (off + len - 1) / TMS_PIN_PIECE_BYTES; k++)
        if (b->locked[k] != TMS_PIECE_LOCKED) return 0;
    return 1;
}

/* Until every piece is locked (copies of part of it lock only their
 * pieces), a copy to it locks what it still needs and one from it goes
 * direct where its pieces are locked. */
enum tms_backup_path tms_host_path(const struct tms_backup *b, int to_host, size_t off, size_t len)
{
    if (tms_host_page_locked(b)) return TMS_PATH_DIRECT;
    if (!first_copy(b)) return TMS_PATH_STAGED;
    if (to_host) return TMS_PATH_PREPARED;
    return range_locked(b, off, len) ? TMS_PATH_DIRECT : TMS_PATH_STAGED;
}

/* Page-locks the piece that is [off, off+len), faulting its fresh pages in
 * first: registering unfaulted memory faults it in on one thread inside the
 * driver, and touching each page beat MADV_POPULATE_WRITE
 * (docs/performance.md). A piece the driver cannot lock stays pageable (0);
 * lacking the memory to lock it fails the copy of a kind that promises
 * page-locked memory, and leaves another kind's piece pageable. */
int tms_host_prepare_block(struct tms_backup *b, size_t off, size_t len, struct tms_err *err)
{
    unsigned char *piece = &b->locked[off / TMS_PIN_PIECE_BYTES];
    if (*piece) return *piece == TMS_PIECE_LOCKED;  /* by an earlier copy of part of the backup */
    volatile char *p = (char *)b->host + off;
    for (size_t at = 0; at < len; at += 4096) p[at] = 0;
    int rc = b->drv->host_register(b->device, (char *)b->host + off, len);
    if (rc == 0) {
        *piece = TMS_PIECE_LOCKED;
        return 1;
    }
    if (!b->drv->is_oom(rc) || !b->ops->must_lock) return *piece = TMS_PIECE_REFUSED, 0;
    tms_driver_fail(err, TMS_E_HOST_OOM, b->drv, rc,
                    "cannot pin %zu bytes of host memory for a %s backup of %zu bytes (offset %zu)", len, b->ops->name,
                    b->size, off);
    return -TMS_E_HOST_OOM;
}

/* A copy succeeded: page-locked from now on once every piece is; pieces a
 * copy of part of it left alone are locked by a later copy that needs them.
 * If the driver refused a piece it stays pageable, the pieces locked so far
 * unlocked (they would only hold memory: copies of it stage). */
void tms_host_copied(struct tms_backup *b)
{
    if (!first_copy(b)) return;
    size_t locked = 0, refused = 0, pieces = tms_host_pieces(b->size);
    for (size_t k = 0; k < pieces; k++) {
        locked += b->locked[k] == TMS_PIECE_LOCKED;
        refused += b->locked[k] == TMS_PIECE_REFUSED;
    }
    if (locked == pieces) {
        __atomic_store_n(&b->pinning, TMS_PIN_DONE, __ATOMIC_RELEASE);
        return;
    }
    if (!refused) return;
    tms_host_unlock_pieces(b);
    __atomic_store_n(&b->pinning, TMS_PIN_FAILED, __ATOMIC_RELEASE);
    TMS_DEBUG("%s backup of %zu bytes stays pageable: the driver locked %zu of its %zu pieces", b->ops->name, b->size,
              locked, pieces);
}
