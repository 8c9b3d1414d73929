# Tests the native module too: which variant is loaded, and its Error for a double pause.
"""Allocation, pause and resume on the host backend (tests/test_host_backend.py):
random bytes at granularity-aligned addresses, pages given back on pause and mapped
again on resume (what the emulated device holds), faults on paused memory, tags paused and resumed apart, frees
of paused allocations, double pause/resume and unknown tags."""
import ctypes
import sys

from _prelude import MiB, backup_bytes, core, device_used, expect, fill, read, row, run_cases, tms


def random_bytes_in_a_region():
    """Allocations of every size hold what was written; their rows say so; free empties the table."""
    sizes = [1, 4095, 2 * MiB - 1, 2 * MiB, 2 * MiB + 1, 5 * MiB + 12345]
    with tms.region("t1"):
        ptrs = [tms.malloc(n) for n in sizes]
        assert tms.malloc(0) == 0                      # like cudaMalloc(0): NULL, no entry
    assert len(tms.allocations()) == len(sizes)
    data = [fill(p, n) for p, n in zip(ptrs, sizes)]
    for p, n in zip(ptrs, sizes):
        r = row(p)
        assert p % (2 * MiB) == 0, hex(p)              # granularity-aligned like cuMemAddressReserve
        assert r["size"] == n and r["reserved"] == -(-n // (2 * MiB)) * 2 * MiB, r
        assert (r["tag"], r["state"], r["device"], r["cpu_backup"], r["has_cpu_backup"], r["chunks"]) == \
            ("t1", "active", 0, False, False, 1), r
    # read back only after every fill: the ranges do not overlap
    assert [read(p, n) for p, n in zip(ptrs, sizes)] == data
    for p in ptrs:
        tms.free(p)
    assert tms.allocations() == []
    expect(ValueError, tms.free, ptrs[0], match="not an allocation of torch_memory_saver")
    print("done")


def pages_go_and_come_back(n):
    """Pause gives the device pages back, resume maps usable memory at the same address:
    {step: (bytes the emulated device holds, the allocation's state, what the call's
    report says it released or mapped)}, and whether the resumed memory holds new bytes."""
    with tms.region("kv"):
        p = tms.malloc(n)
    ctypes.memset(p, 0xA5, n)
    steps = {"allocated": (device_used(), row(p)["state"], None)}
    report = tms.pause("kv")
    steps["paused"] = (device_used(), row(p)["state"], report.released_bytes)
    report = tms.resume("kv")
    steps["resumed"] = (device_used(), row(p)["state"], report.released_bytes)
    ctypes.memset(p, 0x5A, n)                          # same address, usable again
    usable = read(p + n - 4096, 4096) == b"\x5a" * 4096
    tms.free(p)
    steps["freed"] = (device_used(), None, None)
    return steps, usable


def touch_paused_memory(access):
    """Reads or writes (access) paused memory: the process must die of SIGSEGV after "paused"."""
    with tms.region("x"):
        p = tms.malloc(4 * MiB)
    fill(p, 4 * MiB)
    tms.pause("x")
    print("paused", flush=True)
    if access == "read":
        ctypes.string_at(p + 3 * MiB, 1)
    else:
        ctypes.memset(p + 3 * MiB, 1, 1)
    print("survived", flush=True)


def by_tag():
    """Tags pause and resume apart; None (or nothing) means every tag."""
    NA, NB = 3 * MiB + 1, MiB + 7
    with tms.region("a", enable_cpu_backup=True):
        a = [tms.malloc(NA) for _ in range(2)]
    with tms.region("b", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        b = [tms.malloc(NB) for _ in range(3)]
    with tms.region("c"):
        c = tms.malloc(MiB)
    da = [fill(p, NA) for p in a]
    db = [fill(p, NB) for p in b]

    def st(ptrs):
        return [row(p)["state"] for p in ptrs]

    tms.pause("a")
    assert st(a) == ["paused"] * 2 and st(b) == ["active"] * 3 and st([c]) == ["active"]
    assert [read(p, NB) for p in b] == db              # other tags untouched and usable
    db = [fill(p, NB) for p in b]
    tms.pause("b")
    assert st(a + b) == ["paused"] * 5 and st([c]) == ["active"]
    tms.resume("a")
    assert st(a) == ["active"] * 2 and st(b) == ["paused"] * 3
    assert [read(p, NA) for p in a] == da
    tms.pause(None)                                    # every tag: a and c; b stays paused
    assert st(a + b + [c]) == ["paused"] * 6
    tms.resume()                                       # every tag
    assert st(a + b + [c]) == ["active"] * 6
    assert [read(p, NA) for p in a] == da and [read(p, NB) for p in b] == db
    print("done")


def free_while_paused():
    """Freeing paused allocations frees their backups; capacity and ranges come back (64 MiB device)."""
    N = 32 * MiB
    with tms.region("d"):
        a = tms.malloc(N)
    with tms.region("k", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        b = tms.malloc(N)
    fill(a, N), fill(b, N)
    tms.pause()
    assert device_used() == 0 and backup_bytes("k")["pinned"] == N
    tms.free(b)                                        # paused with a backup: the backup goes too
    assert backup_bytes("k")["pinned"] == 0 and core().host_budget()["mine"] == 0
    tms.free(a)
    assert tms.allocations() == []
    expect(ValueError, tms.free, a, match="not an allocation")
    tms.pause("d")
    tms.resume("k")                                    # tags without allocations: no-op
    # Device capacity (2 * N here) and the ranges came back: the whole device is allocatable.
    with tms.region("again"):
        c = tms.malloc(2 * N)
    d = fill(c, 2 * N)
    assert read(c, 2 * N) == d
    print("done")


def double_pause_and_resume():
    """A second pause or resume raises the library's Error naming the tag; nothing is lost."""
    import torch_memory_saver._tms_preload as native

    assert core() is native and issubclass(native.Error, RuntimeError)
    with tms.region("dbl", enable_cpu_backup=True):
        p = tms.malloc(MiB)
    d = fill(p, MiB)
    tms.pause("dbl")
    e = expect(native.Error, tms.pause, "dbl", match="'dbl'")
    assert "already paused" in str(e) and not isinstance(e, MemoryError), e
    assert row(p)["state"] == "paused" and row(p)["has_cpu_backup"]
    tms.resume("dbl")
    e = expect(native.Error, tms.resume, "dbl", match="'dbl'")
    assert "not paused" in str(e), e
    assert row(p)["state"] == "active" and read(p, MiB) == d
    tms.pause()
    expect(native.Error, tms.pause, match="already paused")
    tms.resume()
    expect(native.Error, tms.resume, None, match="not paused")
    assert read(p, MiB) == d
    print("done")


def unknown_tags():
    """Pause/resume of a tag never seen, or emptied, does nothing and never raises (a
    tag never seen warns: tests/test_api.py checks what it says)."""
    import warnings

    with tms.region("known"):
        p = tms.malloc(MiB)
    with tms.region("emptied"):
        q = tms.malloc(MiB)
    tms.free(q)
    d = fill(p, MiB)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for tag in ("never-seen", "emptied"):
            tms.pause(tag)
            tms.resume(tag)
            tms.pause(tag)
            tms.pause(tag)                             # no allocations: no double-pause error
    assert row(p)["state"] == "active" and read(p, MiB) == d
    print("done")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
