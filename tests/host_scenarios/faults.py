# Tests the native module too: get_cpu_backup on raw pointers, mem_get_info, set_region (raw_region).
"""Injected faults on the host backend (tests/test_host_backend.py): TMS_FAULT="op:n"
fails the n-th call (1-based, per process) of a backend op once. Whatever fails, no
byte is lost: a failed pause leaves allocations active without a half-made copy, a
failed resume leaves the rest paused with their backups, a retry works.

Allocations are made in raw_region (the native set_region): region(enable_cpu_backup=True)
would also start the copy workers, whose pinned staging takes host_alloc calls of its own."""
import sys

import torch_memory_saver
from _prelude import MiB, core, expect, fill, raw_region, read, row, run_cases, start, tms


def one_chunked_allocation(op, exc, fragment, state):
    """One 70 MiB - 1 allocation in 32 MiB chunks with a pinned backup: `op` ("pause" or
    "resume") raises `exc` with `fragment`, leaving it in `state`; then it works."""
    start()
    n = 70 * MiB - 1
    with raw_region("f", True, "pinned"):
        p = tms.malloc(n)
    assert row(p)["chunks"] == 3
    d = fill(p, n)
    if op == "resume":
        tms.pause("f")
    expect(getattr(torch_memory_saver, exc), getattr(tms, op), "f", match=fragment)
    r = row(p)
    assert r["state"] == state, r
    if r["state"] == "paused":
        assert r["has_cpu_backup"] is True, r          # the backup survives a failed resume
        assert core().get_cpu_backup(p, n).tobytes() == d
        tms.resume("f")                                # the fault fires once: the retry works
    else:
        assert r["has_cpu_backup"] is False, r         # a failed pause keeps no (half-made) copy
    assert read(p, n) == d                             # active and intact
    tms.pause("f")
    tms.resume("f")
    assert read(p, n) == d
    print("done")


def failed_unmap():
    """A pause whose unmap fails leaves the allocation active with no (stale) host copy."""
    start()
    n = 10 * MiB - 1
    with raw_region("f", True, "mmap"):
        p = tms.malloc(n)
    fill(p, n)
    expect(torch_memory_saver.Error, tms.pause, "f", match="unmap of allocation")
    assert row(p)["state"] == "active"
    d = fill(p, n)                                     # the device copy moves on
    # retain off: an allocation left active keeps no host copy that would go stale
    assert core().get_cpu_backup(p, n) is None, "stale backup served for an active allocation"
    assert row(p)["has_cpu_backup"] is False, row(p)
    tms.pause("f")                                     # the fault fires once
    tms.resume("f")
    assert read(p, n) == d
    print("done")


def failing_rollback():
    """Creating chunk 2 of 3 fails and undoing it fails too: both in the message, every byte back."""
    native = core()
    free0, total = native.mem_get_info(0)
    with raw_region("r"):
        e = expect(torch_memory_saver.OutOfMemoryError, tms.malloc, 6 * MiB)
    msg = str(e)
    assert "map of 2097152 bytes (chunk 2 of 3)" in msg and "'r'" in msg, msg
    assert "undoing it, unmap of chunk 1 failed" in msg, msg
    assert native.mem_get_info(0) == (free0, total)
    assert tms.allocations() == []
    with raw_region("r"):
        p = tms.malloc(6 * MiB)                        # each fault fires once
    tms.free(p)
    print("done")


def several():
    """Four allocations in tag "p", two with mmap and two with pinned backups, of 1-3 copy
    blocks each, filled: (sizes, ptrs, data, intact), intact() checking every byte."""
    start()
    sizes = [MiB + 1, 17 * MiB + 7, 2 * MiB, 5]
    ptrs = []
    for i, n in enumerate(sizes):
        with raw_region("p", True, "pinned" if i % 2 else "mmap"):
            ptrs.append(tms.malloc(n))
    data = [fill(p, n) for p, n in zip(ptrs, sizes)]

    def intact():
        return [read(p, n) for p, n in zip(ptrs, sizes)] == data

    return sizes, ptrs, data, intact


def backed_up_pause(exc, fragment):
    """A pause of several that fails (exc, fragment) leaves every allocation active, no backup kept."""
    sizes, ptrs, data, intact = several()
    expect(getattr(torch_memory_saver, exc), tms.pause, "p", match=fragment)
    assert [r["state"] for r in tms.allocations()] == ["active"] * 4, tms.allocations()
    assert not any(r["has_cpu_backup"] for r in tms.allocations())   # this call's backups undone
    assert all(core().get_cpu_backup(p, 1) is None for p in ptrs)
    assert intact()
    tms.pause("p")                                     # the fault fires once
    assert [r["state"] for r in tms.allocations()] == ["paused"] * 4
    tms.resume("p")
    assert intact()
    print("done")


def stale_retained_copies():
    """Retained copies, then new bytes: a pause that fails midway serves no half-refreshed copy."""
    sizes, ptrs, data, intact = several()
    tms.retain_cpu_backup = True
    tms.pause("p")
    tms.resume("p")
    assert intact() and all(row(p)["has_cpu_backup"] for p in ptrs)
    data[:] = [fill(p, n) for p, n in zip(ptrs, sizes)]   # the retained copies are now stale
    expect(torch_memory_saver.Error, tms.pause, "p", match="backup copy")
    assert [r["state"] for r in tms.allocations()] == ["active"] * 4
    # a half-refreshed retained copy must not be served as the backup; one the
    # pause finished (its allocation let go early, then restored) holds the new bytes
    served = [core().get_cpu_backup(p, n) for p, n in zip(ptrs, sizes)]
    assert all(c is None or c.tobytes() == d for c, d in zip(served, data))
    assert any(c is None for c in served)
    assert intact()
    tms.pause("p")
    assert [core().get_cpu_backup(p, n).tobytes() for p, n in zip(ptrs, sizes)] == data
    tms.resume("p")
    assert intact()
    print("done")


def create_fault_in_resume(failing):
    """The resume maps in address order and stops at the `failing`-th: those before are back."""
    failing = int(failing)
    sizes, ptrs, data, intact = several()
    tms.pause("p")
    expect(torch_memory_saver.OutOfMemoryError, tms.resume, "p", match="create of")
    rows = sorted(tms.allocations(), key=lambda r: r["ptr"])
    for i, r in enumerate(rows):
        if i < failing:                                # resumed before the failure, contents back
            assert r["state"] == "active", rows
            assert read(r["ptr"], r["size"]) == data[ptrs.index(r["ptr"])]
        else:                                          # the failed one and the rest: paused, backed up
            assert r["state"] == "paused" and r["has_cpu_backup"] is True, rows
    tms.resume("p")                                    # retry
    assert all(r["state"] == "active" for r in tms.allocations())
    assert intact()
    print("done")


def restore_fault_in_resume():
    """A restore copy fails: an allocation is active only if all its bytes came back."""
    sizes, ptrs, data, intact = several()
    tms.pause("p")
    expect(torch_memory_saver.Error, tms.resume, "p", match="restore copy")
    st = [r["state"] for r in tms.allocations()]
    assert "paused" in st, tms.allocations()
    for r in tms.allocations():
        i = ptrs.index(r["ptr"])
        if r["state"] == "active":
            assert read(r["ptr"], sizes[i]) == data[i]
        else:
            assert r["has_cpu_backup"] and core().get_cpu_backup(r["ptr"], sizes[i]).tobytes() == data[i]
    tms.resume("p")
    assert intact()
    print("done")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
