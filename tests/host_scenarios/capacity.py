# Tests the native module too: get_memory_margin_bytes (what reached the core) and defaults().
"""Device memory on the host backend (tests/test_host_backend.py): memory_margin_bytes
and the emulated device's capacity give OutOfMemoryError (a failed resume keeps what
did not fit paused), allocations on other devices, chunked allocations."""
import ctypes
import sys

import torch_memory_saver
from _prelude import MiB, core, device_used, expect, fill, read, row, run_cases, tms


def margin():
    """memory_margin_bytes, set before and after first use, on a 64 MiB device."""
    tms.memory_margin_bytes = 60 * MiB                 # before first use: applied at init
    assert tms.memory_margin_bytes == 60 * MiB
    native = core()
    assert native.get_memory_margin_bytes() == 60 * MiB
    with tms.region("m"):
        tms.malloc(2 * MiB)                            # leaves 62 MiB of 64
        tms.malloc(2 * MiB - 5)                        # leaves exactly the margin: allowed
        e = expect(torch_memory_saver.OutOfMemoryError, tms.malloc, 1, match="below memory_margin_bytes=62914560")
        assert isinstance(e, MemoryError) and isinstance(e, torch_memory_saver.Error) and isinstance(e, RuntimeError)
        assert len(tms.allocations()) == 2
        tms.memory_margin_bytes = 0                    # lifts it
        tms.malloc(20 * MiB)
        tms.memory_margin_bytes = 50 * MiB             # after first use: straight to the core
        assert native.get_memory_margin_bytes() == 50 * MiB
        expect(MemoryError, tms.malloc, 1, match="memory_margin_bytes")   # 40 MiB free < 50
        tms.pause("m")                                 # paused memory counts as free
        tms.malloc(2 * MiB)
    assert len(tms.allocations()) == 4
    print("done")


def device_capacity():
    """A full 32 MiB device raises OutOfMemoryError; a resume that does not fit keeps the rest paused."""
    with tms.region("w", enable_cpu_backup=True):
        w = [tms.malloc(8 * MiB), tms.malloc(8 * MiB - 3)]
    dw = [fill(w[0], 8 * MiB), fill(w[1], 8 * MiB - 3)]
    with tms.region("x"):
        e = expect(torch_memory_saver.OutOfMemoryError, tms.malloc, 16 * MiB + 1, match="Cannot allocate memory")
        assert isinstance(e, MemoryError) and "'x'" in str(e), e
        tms.malloc(16 * MiB)                           # exactly fills device 0
        expect(MemoryError, tms.malloc, 1)
        tms.malloc(32 * MiB, 1)                        # device 1 has its own capacity
    assert len(tms.allocations()) == 4
    tms.pause("w")
    with tms.region("z"):
        z = tms.malloc(8 * MiB)                        # takes half of what w gave back
    expect(torch_memory_saver.OutOfMemoryError, tms.resume, "w", match="'w'")
    st = sorted(row(p)["state"] for p in w)
    assert st == ["active", "paused"], st              # one fits, the other stays paused...
    for p, d in zip(w, dw):
        if row(p)["state"] == "paused":
            assert row(p)["has_cpu_backup"] is True    # ...with its backup
        else:
            assert read(p, len(d)) == d
    tms.free(z)
    tms.resume("w")                                    # the retry restores the rest
    assert [read(p, len(d)) for p, d in zip(w, dw)] == dw
    print("done")


def other_devices(good, bad, n_devices):
    """An allocation on device `good` pauses and resumes; device `bad` does not exist."""
    good, bad = int(good), int(bad)
    n = 3 * MiB + 1
    with tms.region("dev", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        p0 = tms.malloc(n)                             # current device: 0
        pg = tms.malloc(n, good)
        expect(ValueError, tms.malloc, n, bad, match=f"device {bad} does not exist ({n_devices} devices)")
    assert row(p0)["device"] == 0 and row(pg)["device"] == good
    d0, dg = fill(p0, n), fill(pg, n)
    tms.pause("dev")
    assert row(pg)["state"] == "paused" and row(pg)["has_cpu_backup"]
    tms.resume("dev")
    assert read(p0, n) == d0 and read(pg, n) == dg
    print("done")


def chunked(kind):
    """TMS_CHUNK_BYTES=4MiB: every chunk is released and mapped again, bytes exact across boundaries."""
    assert core().defaults()["chunk_bytes"] == 4 * MiB
    # size -> chunks of 4 MiB (reserved rounds to 2 MiB, the last chunk may be 2 MiB)
    specs = [(9 * MiB + 5, 3), (4 * MiB, 1), (12 * MiB, 3), (6 * MiB - 1, 2), (1, 1), (8 * MiB + 1, 3)]
    with tms.region("c", enable_cpu_backup=True, cpu_backup_backend=kind):
        ptrs = [tms.malloc(n) for n, _ in specs]
    assert [row(p)["chunks"] for p in ptrs] == [k for _, k in specs]
    N = 40 * MiB
    with tms.region("discard"):
        big = tms.malloc(N)
    assert row(big)["chunks"] == 10
    ctypes.memset(big, 7, N)
    for cycle in range(2):
        data = [fill(p, n) for p, (n, _) in zip(ptrs, specs)]
        before = device_used()
        released = tms.pause("discard").released_bytes
        assert (released, before - device_used()) == (N, N), (released, before, device_used())  # every chunk
        tms.pause("c")
        tms.resume()
        ctypes.memset(big, 8, N)                       # every chunk mapped again
        assert [read(p, n) for p, (n, _) in zip(ptrs, specs)] == data, cycle
        for p, (n, _) in zip(ptrs, specs):             # straddling each boundary
            for b in range(4 * MiB, n - 3, 4 * MiB):
                assert read(p + b - 3, 6) == data[ptrs.index(p)][b - 3:b + 3]
    print("done")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
