# Tests the native module too: get_cpu_backup on raw pointers, get_retain_cpu_backup.
"""Host backups on the host backend (tests/test_host_backend.py): bytes restored
exactly through the copy workers, retained copies, page-locking of retained mmap
backups, placement on the device's NUMA node, backup memory released on the copy
worker and returned after resume, the copy workers warmed up beside the caller, and
the native get_cpu_backup."""
import ctypes
import faulthandler
import os
import sys
import time

from _prelude import (MiB, backup_bytes, core, expect, fill, raw_region, read, resident_bytes, row, run_cases,
                      start, tms)


def restores_exactly(kind):
    """Sizes below, at and across the 8 MiB copy blocks come back bit-exact, three cycles."""
    sizes = [1, 7, 4095, 2 * MiB - 1, 2 * MiB + 1, 3 * MiB + 12345, 8 * MiB, 8 * MiB + 1, 17 * MiB + 4097]
    with tms.region("w", enable_cpu_backup=True, cpu_backup_backend=kind):
        ptrs = [tms.malloc(n) for n in sizes]
    for p in ptrs:
        assert (row(p)["cpu_backup"], row(p)["cpu_backup_backend"]) == (True, kind)
    for cycle in range(3):                             # new contents each cycle
        data = [fill(p, n) for p, n in zip(ptrs, sizes)]
        tms.pause("w")
        assert all(row(p)["state"] == "paused" and row(p)["has_cpu_backup"] for p in ptrs)
        assert [bytes(core().get_cpu_backup(p, n)) for p, n in zip(ptrs, sizes)] == data
        tms.resume("w")
        assert [read(p, n) for p, n in zip(ptrs, sizes)] == data, cycle
        assert not any(row(p)["has_cpu_backup"] for p in ptrs)   # not retained
    print("done")


def retained(kind):
    """retain_cpu_backup keeps the host copy across resume, refreshed by each pause."""
    start()                                            # the setting below goes to a running core
    assert tms.retain_cpu_backup is False
    tms.retain_cpu_backup = True
    assert tms.retain_cpu_backup is True and core().get_retain_cpu_backup() is True
    n = 3 * MiB + 333
    with tms.region("r", enable_cpu_backup=True, cpu_backup_backend=kind):
        p = tms.malloc(n)
    d1 = fill(p, n)
    assert core().get_cpu_backup(p, n) is None         # nothing saved before the first pause
    tms.pause("r")
    v = core().get_cpu_backup(p, n)
    assert isinstance(v, memoryview) and v.nbytes == n and v.tobytes() == d1
    del v
    tms.resume("r")
    assert read(p, n) == d1
    assert row(p)["has_cpu_backup"] is True
    assert core().get_cpu_backup(p, n).tobytes() == d1   # retained across resume
    d2 = fill(p, n)
    tms.pause("r")                                     # the retained copy is refreshed
    assert core().get_cpu_backup(p, n).tobytes() == d2
    tms.resume("r")
    assert read(p, n) == d2
    tms.retain_cpu_backup = False
    tms.pause("r")
    tms.resume("r")
    assert read(p, n) == d2
    assert core().get_cpu_backup(p, n) is None and row(p)["has_cpu_backup"] is False
    print("done")


def retained_mmap_is_page_locked():
    """A retained mmap backup is page-locked by the pause that makes it (its first copy
    locks each piece before its DMA), so the next resume and the pause right after it
    go straight to it; a backup made without retain and kept by a later resume is
    page-locked by the background thread; one never retained is never locked."""
    faulthandler.dump_traceback_later(60, exit=True)   # waiting for the lock forever fails here

    def wait_locked(p):
        while not row(p)["cpu_backup_page_locked"]:
            time.sleep(0.01)                           # paces the poll

    n = 70 * MiB + 123
    with tms.region("plain", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        q = tms.malloc(n)
    dq = fill(q, n)
    tms.pause("plain")
    assert row(q)["has_cpu_backup"] and not row(q)["cpu_backup_page_locked"]   # not retained: staged

    tms.retain_cpu_backup = True
    with tms.region("r", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        p = tms.malloc(n)
    d1 = fill(p, n)
    tms.pause("r")
    assert row(p)["cpu_backup_page_locked"]            # by the pause itself, not later
    assert core().get_cpu_backup(p, n).tobytes() == d1
    tms.resume("plain")                                # kept from now on: locked in the background
    assert read(q, n) == dq
    wait_locked(q)
    dq = fill(q, n)
    tms.pause("plain")                                 # refreshed straight into it
    assert core().get_cpu_backup(q, n).tobytes() == dq
    tms.retain_cpu_backup = False
    tms.resume("plain")                                # not retained now: its backup goes
    assert read(q, n) == dq and not row(q)["has_cpu_backup"]
    tms.retain_cpu_backup = True

    tms.resume("r")                                    # restored straight from the locked copy
    assert read(p, n) == d1 and row(p)["cpu_backup_page_locked"]
    d2 = fill(p, n)
    tms.pause("r")                                     # refreshed straight into it
    assert core().get_cpu_backup(p, n).tobytes() == d2
    tms.resume("r")
    assert read(p, n) == d2
    d3 = fill(p, n)
    tms.pause("r")                                     # exit with the tag paused: exits 0
    assert core().get_cpu_backup(p, n).tobytes() == d3
    faulthandler.cancel_dump_traceback_later()
    print("done")


def numa_placement(kind):
    """How many new mappings the pause placed with a preference for node 0."""
    def preferred():
        with open("/proc/self/numa_maps") as f:
            return [line.split()[0] for line in f if " prefer:0 " in line]

    n = 6 * MiB + 17
    with tms.region("t", enable_cpu_backup=True, cpu_backup_backend=kind):
        p = tms.malloc(n)
    data = fill(p, n)
    before = preferred()
    tms.pause("t")
    placed = [a for a in preferred() if a not in before]
    assert core().get_cpu_backup(p, n).tobytes() == data
    tms.resume("t")
    assert read(p, n) == data
    return len(placed)


def released_on_the_copy_worker(kind):
    """Two cycles (TMS_LOG=debug, a marker line between them on stderr); in the second a
    zero-copy view holds one backup across the resume."""
    import torch

    sizes = [3 * MiB + 5, 5 * MiB, 7 * MiB + 1]
    with tms.region("w", enable_cpu_backup=True, cpu_backup_backend=kind):
        ptrs = [tms.malloc(n) for n in sizes]
    data = [fill(p, n) for p, n in zip(ptrs, sizes)]
    tms.pause("w")
    tms.resume("w")
    assert [read(p, n) for p, n in zip(ptrs, sizes)] == data
    print("--- second cycle", file=sys.stderr, flush=True)
    tms.pause("w")
    t = torch.frombuffer((ctypes.c_uint8 * sizes[1]).from_address(ptrs[1]), dtype=torch.uint8)
    view = tms.get_cpu_backup(t, zero_copy=True)
    tms.resume("w")
    assert bytes(view.numpy()) == data[1] and [read(p, n) for p, n in zip(ptrs, sizes)] == data
    del view
    print("done")


def returned_unless_retained(kind, n):
    """The backup's host memory by the library's counters, {step: (bytes of `kind`
    backups, bytes this process holds of host backups in all)}: held while paused,
    gone after the resume, kept when retained (with its pages in memory), gone with free."""
    def held():
        return backup_bytes("m")[kind], core().host_budget()["mine"]

    with tms.region("m", enable_cpu_backup=True, cpu_backup_backend=kind):
        p = tms.malloc(n)
    block = os.urandom(MiB)
    for off in range(0, n, MiB):
        ctypes.memmove(p + off, block, MiB)
    steps = {}
    tms.pause("m")
    steps["paused"] = held()
    tms.resume("m")
    steps["resumed"] = held() + (row(p)["has_cpu_backup"],)
    tms.retain_cpu_backup = True
    tms.pause("m")
    tms.resume("m")
    view = core().get_cpu_backup(p, n)
    steps["retained"] = held() + (row(p)["has_cpu_backup"], resident_bytes(view))   # every page of the copy kept
    del view
    assert read(p + n - MiB, MiB) == block
    tms.free(p)                                        # frees device pages and the retained copy
    steps["freed"] = held()
    return steps


def native_get_cpu_backup():
    """The native get_cpu_backup: ranges, views that outlive the backup, memory returned with the view."""
    native = core()
    n = 5 * MiB + 3
    with tms.region("g", enable_cpu_backup=True):
        p = tms.malloc(n)
    with tms.region("nb"):
        q = tms.malloc(MiB)
    d = fill(p, n)
    assert native.get_cpu_backup(p, n) is None         # active, not retained
    tms.pause("nb")
    assert native.get_cpu_backup(q, MiB) is None       # paused, no backup
    tms.pause("g")
    whole = native.get_cpu_backup(p, n)
    assert type(whole) is memoryview and whole.nbytes == n and whole.tobytes() == d
    off = 2 * MiB + 1
    part = native.get_cpu_backup(p + off, 1000)
    assert part.tobytes() == d[off:off + 1000]
    assert native.get_cpu_backup(p + n - 10, 10).tobytes() == d[-10:]
    expect(ValueError, native.get_cpu_backup, p, n + 1, match="runs past allocation")
    expect(ValueError, native.get_cpu_backup, p + n - 10, 11, match="runs past allocation")
    expect(ValueError, native.get_cpu_backup, p + n + 1, 1, match="runs past allocation")  # rounding slack
    assert native.get_cpu_backup(p - 1, 1) is None     # outside every allocation: no backup
    assert native.get_cpu_backup(4096, 1) is None
    expect(ValueError, native.get_cpu_backup, p, -1, match="nbytes must be >= 0")
    tms.resume("g")
    assert native.get_cpu_backup(p, n) is None         # the core dropped its copy...
    assert whole.tobytes() == d and part.tobytes() == d[off:off + 1000]   # ...the views keep theirs
    fill(p, n)
    assert whole.tobytes() == d                        # a host copy, not the device memory
    tms.free(p)
    assert whole.tobytes() == d
    assert native.get_cpu_backup(p, 1) is None         # freed: no longer ours

    # The view holds the only reference: releasing it returns the memory.
    N = 12 * MiB
    with tms.region("big", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        b = tms.malloc(N)
    ctypes.memset(b, 0x33, N)
    tms.pause("big")
    view = native.get_cpu_backup(b, N)
    tms.resume("big")
    held = native.host_budget()["mine"]                # the view's backup and whole's, part's
    assert view[N - 1] == 0x33 and backup_bytes("big") == {"pinned": 0, "mmap": 0, "disk": 0}
    del view
    assert held - native.host_budget()["mine"] == N, (held, native.host_budget())
    del whole, part
    print("done")


def workers_warm_up_beside_the_caller():
    """The first backed-up allocation starts the copy workers (their staging and
    streams) on a thread of its own, without a Python region and before any pause;
    an allocation without a backup starts nothing. The first pause is then exact."""
    faulthandler.dump_traceback_later(60, exit=True)   # workers that never start fail here
    start()

    def threads():
        return len(os.listdir("/proc/self/task"))

    before = threads()
    with raw_region("plain"):
        p = tms.malloc(MiB)
    assert threads() == before                         # no backup: no workers
    with raw_region("w", True, "mmap"):
        q = tms.malloc(3 * MiB + 5)
    workers = int(os.environ["TMS_BACKUP_THREADS"])
    while threads() < before + workers:                # started without a pause
        time.sleep(0.01)                               # paces the poll
    d = fill(q, 3 * MiB + 5)
    tms.pause("w")
    assert core().get_cpu_backup(q, 3 * MiB + 5).tobytes() == d
    tms.resume("w")
    assert read(q, 3 * MiB + 5) == d
    tms.free(p)
    faulthandler.cancel_dump_traceback_later()
    print("done")

def retained_mmap_lock_refused():
    """Retain on: the pause that makes an mmap backup page-locks it as it copies; when
    the driver lacks the memory to lock a piece (TMS_FAULT=host_alloc:5, the first
    piece after the staging's four), the pause still succeeds and the backup stays
    pageable: locking it is a speed-up, never a condition."""
    start()
    tms.retain_cpu_backup = True
    n = 70 * MiB + 123
    with raw_region("m", True, "mmap"):
        p = tms.malloc(n)
    d = fill(p, n)
    tms.pause("m")
    assert row(p)["state"] == "paused" and not row(p)["cpu_backup_page_locked"], row(p)
    assert core().get_cpu_backup(p, n).tobytes() == d
    tms.resume("m")
    assert read(p, n) == d
    print("done")

if __name__ == "__main__":
    run_cases(globals(), sys.argv)
