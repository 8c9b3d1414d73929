/* Allocations shared with other processes: the token a handle carries, the handles exported to a receiver, who maps what, and who hung up without letting go. */
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <unistd.h>

#include "core/core.h"
#include "core/core_internal.h"
#include "platform/log.h"

static void (*reaper)(void);        /* atomic: set once by the sender's thread (share/serve.c) */

void tms_core_share_set_reaper(void (*fn)(void)) { __atomic_store_n(&reaper, fn, __ATOMIC_RELEASE); }

void tms_core_share_reap(void)
{
    void (*fn)(void) = __atomic_load_n(&reaper, __ATOMIC_ACQUIRE);
    if (fn && tms_table_share_holders() > 0) fn();  /* holders, or receivers marked as hung up */
}

static int token_unset(const unsigned char *token)
{
    static const unsigned char zero[TMS_SHARE_TOKEN_BYTES];
    return memcmp(token, zero, sizeof zero) == 0;
}

/* Its extents are its plain chunks, all its own: described as chunks, as
 * before any came from a provider; else handle by handle, with each one's length. */
static int plain(const struct tms_alloc *a)
{
    if (a->n_ext != a->n_chunks) return 0;
    for (int i = 0; i < a->n_ext; i++)
        if (a->ext[i].from.kind != TMS_MEM_OWN || a->ext[i].len != tms_chunk_size(a, i) || a->ext[i].size != a->ext[i].len)
            return 0;
    return 1;
}

/* Handles a share of a carries: its extents while mapped, else its chunks.
 * A moving allocation's extents are its mover's (written outside the lock). */
static int handle_count(const struct tms_alloc *a) { return !a->moving && a->n_ext ? a->n_ext : a->n_chunks; }

static void fill_info(const struct tms_alloc *a, struct tms_share_info *out)
{
    int by_chunk = a->moving || !a->n_ext || plain(a);
    *out = (struct tms_share_info){.va = a->va, .size = a->size, .reserved = a->reserved,
                                   .chunk = by_chunk ? a->chunk : 0, .n_chunks = handle_count(a),
                                   .device = a->device, .tag_id = a->tag_id};
    for (int i = 0; !by_chunk && i < a->n_ext && i < TMS_SHARE_MAX_CHUNKS; i++) out->lens[i] = a->ext[i].len;
    memcpy(out->token, a->share_token, sizeof out->token);
}

int tms_core_share_find(uint64_t ptr, struct tms_share_info *out, struct tms_err *err)
{
    /* Drawn before the lock (getrandom may block early in boot); used only if the allocation has none. */
    unsigned char fresh[TMS_SHARE_TOKEN_BYTES];
    if (getrandom(fresh, sizeof fresh, 0) != (ssize_t)sizeof fresh)
        return tms_fail(err, TMS_E_HOST_OOM, 0, "share of 0x%llx: no random bytes for its token",
                        (unsigned long long)ptr);
    tms_table_lock();
    struct tms_alloc *a = (struct tms_alloc *)tms_table_owner_locked(ptr);
    int rc = TMS_OK;
    if (!a)
        rc = tms_fail(err, TMS_E_NOT_FOUND, 0, "share: 0x%llx is not memory of torch_memory_saver",
                      (unsigned long long)ptr);
    else if (!a->handle_types)
        rc = tms_fail(err, TMS_E_UNSUPPORTED, 0,
                      "share: allocation 0x%llx (tag '%s', device %d) was made without an exportable handle "
                      "(TMS_SHAREABLE=0, or the driver refused one)",
                      (unsigned long long)a->va, tms_core_tag_name(a->tag_id), a->device);
    else if (handle_count(a) > TMS_SHARE_MAX_CHUNKS)
        rc = tms_fail(err, TMS_E_UNSUPPORTED, 0, "share: allocation 0x%llx has %d chunks, more than the %d one share "
                      "carries (TMS_CHUNK_BYTES, or memory lent in pieces)", (unsigned long long)a->va,
                      handle_count(a), TMS_SHARE_MAX_CHUNKS);
    if (!rc) {
        if (token_unset(a->share_token)) memcpy(a->share_token, fresh, sizeof fresh);
        fill_info(a, out);
    }
    tms_table_unlock();
    return rc;
}

/* A free that came while the handles were exported: finished here, as a
 * mover finishes one (claim.c). */
static void finish_free(struct tms_alloc *a)
{
    const struct tms_driver *drv;
    struct tms_err e = {0};
    tms_va va = a->va;
    if (tms_driver_get(&drv, &e) || tms_alloc_release_detached(drv, a, &e))
        tms_log_warn("free of 0x%llx, finished after a share: %s", (unsigned long long)va, e.msg);
}

int tms_core_share_attach(uint64_t va, const unsigned char *token, int pid, int *fds, struct tms_share_info *out,
                          tms_lent_fd_fn lent_fd, struct tms_err *err)
{
    const struct tms_driver *drv;
    int rc = tms_driver_get(&drv, err);
    if (rc) return rc;
    if (!drv->export_fd) return tms_fail(err, TMS_E_UNSUPPORTED, 0, "share: the %s backend cannot export memory", drv->name);
    struct tms_extent ext[TMS_SHARE_MAX_CHUNKS];
    tms_table_lock();
    struct tms_alloc *a;
    /* A pause or resume in flight settles first; then the state decides. */
    while ((a = tms_table_find_locked(va)) && a->moving) tms_table_wait_settled();
    if (!a || token_unset(a->share_token) || memcmp(a->share_token, token, TMS_SHARE_TOKEN_BYTES) != 0)
        rc = tms_fail(err, TMS_E_NOT_FOUND, 0, "the shared allocation 0x%llx was freed (or never shared)",
                      (unsigned long long)va);
    else if (a->state != TMS_ACTIVE)
        rc = tms_fail(err, TMS_E_STATE, 0, "the shared allocation 0x%llx (tag '%s') is paused: resume it first",
                      (unsigned long long)va, tms_core_tag_name(a->tag_id));
    else if (handle_count(a) > TMS_SHARE_MAX_CHUNKS)
        rc = tms_fail(err, TMS_E_UNSUPPORTED, 0, "the shared allocation 0x%llx is mapped from %d pieces of lent "
                      "memory, more than the %d one share carries", (unsigned long long)va, handle_count(a),
                      TMS_SHARE_MAX_CHUNKS);
    if (!rc) {
        fill_info(a, out);
        memcpy(ext, a->ext, (size_t)a->n_ext * sizeof *ext);
        /* Moving: a pause waits and a free is deferred while the handles are exported. */
        a->moving = 1;
    }
    tms_table_unlock();
    if (rc) return rc;
    /* The provider of memory that came from it hears of the receiver first:
     * nobody may use that memory again once another process may map it. */
    for (int i = 0; i < out->n_chunks; i++)
        if (ext[i].from.kind == TMS_MEM_LENT && lent_fd) (void)lent_fd(ext[i].from.id, pid, NULL, NULL);
    int exported = 0;
    for (; exported < out->n_chunks; exported++) {
        if (ext[exported].from.kind == TMS_MEM_LENT) {
            /* The driver does not export an imported handle again: lent memory goes on as it came. */
            struct tms_err why = {0};
            rc = lent_fd ? lent_fd(ext[exported].from.id, pid, &fds[exported], &why)
                         : tms_fail(&why, TMS_E_UNSUPPORTED, 0, "it is lent memory, and nothing here passes it on");
            if (!rc) continue;
            rc = tms_fail(err, rc, 0, "share of allocation 0x%llx (chunk %d of %d): %s", (unsigned long long)va,
                          exported + 1, out->n_chunks, why.msg);
            break;
        }
        int drc = drv->export_fd(ext[exported].handle, &fds[exported]);
        if (drc) {
            rc = tms_driver_fail(err, TMS_E_DRIVER, drv, drc, "export of allocation 0x%llx (chunk %d of %d) failed",
                                 (unsigned long long)va, exported + 1, out->n_chunks);
            break;
        }
    }
    tms_table_lock();
    a->moving = 0;
    int freed = a->free_requested;
    if (freed) {
        tms_table_unlink_locked(tms_table_link_locked(a->va));
        if (!rc) rc = tms_fail(err, TMS_E_NOT_FOUND, 0, "the shared allocation 0x%llx was freed while it was being "
                               "opened", (unsigned long long)va);
    } else if (!rc) {
        if (a->share_holders < TMS_SHARE_PIDS_KEPT) a->share_pids[a->share_holders] = pid;
        a->share_holders++;
        tms_table_share_holders_add(1);
    }
    tms_table_settled_locked();
    tms_table_unlock();
    if (freed) finish_free(a);
    if (rc)
        for (int i = 0; i < exported; i++) close(fds[i]);
    return rc;
}

int tms_core_mark_exported(uint64_t va, uint64_t owner_handle, int delta, uint64_t *handle, struct tms_err *err)
{
    int rc = TMS_OK;
    tms_table_lock();
    struct tms_alloc *a;
    while ((a = tms_table_find_locked(va)) && a->moving) tms_table_wait_settled();
    if (!a || !a->adopted || a->owner_handle != owner_handle)
        rc = tms_fail(err, TMS_E_NOT_FOUND, 0, "export: no allocation adopted at 0x%llx under that handle",
                      (unsigned long long)va);
    else if (delta > 0 && a->state != TMS_ACTIVE)
        rc = tms_fail(err, TMS_E_STATE, 0, "export: allocation 0x%llx (tag '%s') is paused: resume it first",
                      (unsigned long long)va, tms_core_tag_name(a->tag_id));
    else if (delta > 0)
        a->exported_by_owner++, *handle = a->ext[0].handle;
    else if (a->exported_by_owner > 0)
        a->exported_by_owner--;
    tms_table_unlock();
    return rc;
}

/* One entry of pid out of a count whose first TMS_SHARE_PIDS_KEPT pids are
 * listed: its pid leaves the list if listed (past the list, pids are not kept). */
static void drop_pid(int *count, int *pids, int pid)
{
    int kept = *count < TMS_SHARE_PIDS_KEPT ? *count : TMS_SHARE_PIDS_KEPT;
    for (int i = 0; i < kept; i++) {
        if (pids[i] != pid) continue;
        memmove(&pids[i], &pids[i + 1], (size_t)(kept - i - 1) * sizeof *pids);
        break;
    }
    (*count)--;
}

static void add_pid(int *count, int *pids, int pid)
{
    if (*count < TMS_SHARE_PIDS_KEPT) pids[*count] = pid;
    (*count)++;
}

static struct tms_alloc *shared_locked(uint64_t va, const unsigned char *token)
{
    struct tms_alloc *a = tms_table_find_locked(va);
    return a && memcmp(a->share_token, token, TMS_SHARE_TOKEN_BYTES) == 0 ? a : NULL;
}

uint32_t tms_core_share_detach(uint64_t va, const unsigned char *token, int pid, int let_go)
{
    uint32_t mark = 0;
    /* Counted per attach, whether or not the allocation is still there. */
    tms_table_share_holders_add(-1);
    tms_table_lock();
    struct tms_alloc *a = shared_locked(va, token);
    if (a && a->share_holders > 0) {
        drop_pid(&a->share_holders, a->share_pids, pid);
        if (!let_go) {
            /* It may still map what this allocation holds now: marked until its
             * process ends, or the pause that unmaps the memory reports it. */
            add_pid(&a->share_hung_up, a->share_hung_up_pids, pid);
            tms_table_share_holders_add(1);
            mark = a->share_marks_taken;
        }
    }
    tms_table_unlock();
    return mark;
}

void tms_core_share_gone(uint64_t va, const unsigned char *token, int pid, uint32_t mark)
{
    tms_table_lock();
    struct tms_alloc *a = shared_locked(va, token);
    /* A pause since took every mark (and counted them): nothing left of this one. */
    if (a && a->share_hung_up > 0 && a->share_marks_taken == mark) {
        drop_pid(&a->share_hung_up, a->share_hung_up_pids, pid);
        tms_table_share_holders_add(-1);
    }
    tms_table_unlock();
}

int tms_shares_take_hung_up_locked(struct tms_alloc *a, int *pids)
{
    int n = a->share_hung_up;
    for (int i = 0; i < TMS_SHARE_PIDS_KEPT; i++) pids[i] = i < n ? a->share_hung_up_pids[i] : 0;
    if (n) {
        tms_table_share_holders_add(-n);
        a->share_marks_taken++;
    }
    a->share_hung_up = 0;
    return n;
}
