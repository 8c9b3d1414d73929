"""The core on the host backend (TMS_BACKEND=host: VMM emulated on memfd/mmap).

Every scenario runs in a fresh subprocess (`run_py`): the backend, the TMS_*
environment, the fault-injection counters and the allocation table are per
process. Children get the helpers of conftest.CHILD_PRELUDE: `tms` (the public
singleton), `core` (its native module), fill/read (random bytes through
ctypes), row(ptr) (the allocation's entry of core.allocations()), rss_bytes()
and expect(exc_type, fn, *args, match=...).
"""
import os
import signal
import textwrap

import pytest

from conftest import HOOK_MODES, MiB, check_ok

# ---- allocation, pause/resume, RSS ----------------------------------------------


def test_alloc_in_region_holds_random_bytes(run_py):
    out = check_ok(run_py("""
        sizes = [1, 4095, 2 * MiB - 1, 2 * MiB, 2 * MiB + 1, 5 * MiB + 12345]
        with tms.region("t1"):
            ptrs = [core.malloc(n) for n in sizes]
            assert core.malloc(0) == 0                     # like cudaMalloc(0): NULL, no entry
        assert len(core.allocations()) == len(sizes)
        data = [fill(p, n) for p, n in zip(ptrs, sizes)]
        for p, n in zip(ptrs, sizes):
            r = row(p)
            assert p % (2 * MiB) == 0, hex(p)              # granularity-aligned like cuMemAddressReserve
            assert r["size"] == n and r["reserved"] == -(-n // (2 * MiB)) * 2 * MiB, r
            assert (r["tag"], r["state"], r["device"], r["cpu_backup"], r["has_cpu_backup"], r["chunks"]) == \\
                ("t1", "active", 0, False, False, 1), r
        # read back only after every fill: the ranges do not overlap
        assert [read(p, n) for p, n in zip(ptrs, sizes)] == data
        for p in ptrs:
            core.free(p)
        assert core.allocations() == []
        expect(ValueError, core.free, ptrs[0], match="not an allocation of torch_memory_saver")
        print("done")
    """))
    assert out == "done\n"


def test_pause_returns_pages_and_resume_maps_them_back(run_py):
    out = check_ok(run_py("""
        N = 256 * MiB
        with tms.region("kv"):
            p = core.malloc(N)
        before = rss_bytes()
        ctypes.memset(p, 0xA5, N)
        touched = rss_bytes()
        assert touched - before >= 0.95 * N, (before, touched)
        tms.pause("kv")
        paused = rss_bytes()
        assert touched - paused >= 0.95 * N, ("pause kept the pages", touched, paused)
        assert row(p)["state"] == "paused"
        tms.resume("kv")
        assert row(p)["state"] == "active"
        ctypes.memset(p, 0x5A, N)                          # same address, usable again
        again = rss_bytes()
        assert again - paused >= 0.95 * N, ("resumed memory is not backed", paused, again)
        assert read(p + N - 4096, 4096) == b"\\x5a" * 4096
        core.free(p)
        assert again - rss_bytes() >= 0.95 * N
        print("done")
    """))
    assert out == "done\n"


@pytest.mark.parametrize("access", ["read", "write"])
def test_touching_paused_memory_faults(run_py, access):
    proc = run_py(f"""
        with tms.region("x"):
            p = core.malloc(4 * MiB)
        fill(p, 4 * MiB)
        tms.pause("x")
        print("paused", flush=True)
        if "{access}" == "read":
            ctypes.string_at(p + 3 * MiB, 1)
        else:
            ctypes.memset(p + 3 * MiB, 1, 1)
        print("survived", flush=True)
    """)
    assert proc.returncode == -signal.SIGSEGV, (proc.returncode, proc.stdout, proc.stderr)
    assert proc.stdout == "paused\n"


def test_pause_resume_by_tag(run_py):
    out = check_ok(run_py("""
        NA, NB = 3 * MiB + 1, MiB + 7
        with tms.region("a", enable_cpu_backup=True):
            a = [core.malloc(NA) for _ in range(2)]
        with tms.region("b", enable_cpu_backup=True, cpu_backup_backend="pinned"):
            b = [core.malloc(NB) for _ in range(3)]
        with tms.region("c"):
            c = core.malloc(MiB)
        da = [fill(p, NA) for p in a]
        db = [fill(p, NB) for p in b]
        st = lambda ptrs: [row(p)["state"] for p in ptrs]

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
    """))
    assert out == "done\n"


@pytest.mark.parametrize("threads", ["1", "3"])
@pytest.mark.parametrize("kind", ["pinned", "mmap"])
def test_cpu_backup_restores_random_bytes_exactly(run_py, kind, threads):
    # Copies move in 8 MiB blocks spread over TMS_BACKUP_THREADS workers:
    # sizes below, at and across block boundaries.
    out = check_ok(run_py(f"""
        sizes = [1, 7, 4095, 2 * MiB - 1, 2 * MiB + 1, 3 * MiB + 12345, 8 * MiB, 8 * MiB + 1, 17 * MiB + 4097]
        with tms.region("w", enable_cpu_backup=True, cpu_backup_backend="{kind}"):
            ptrs = [core.malloc(n) for n in sizes]
        for p in ptrs:
            assert (row(p)["cpu_backup"], row(p)["cpu_backup_backend"]) == (True, "{kind}")
        for cycle in range(3):                             # new contents each cycle
            data = [fill(p, n) for p, n in zip(ptrs, sizes)]
            tms.pause("w")
            assert all(row(p)["state"] == "paused" and row(p)["has_cpu_backup"] for p in ptrs)
            assert [bytes(core.get_cpu_backup(p, n)) for p, n in zip(ptrs, sizes)] == data
            tms.resume("w")
            assert [read(p, n) for p, n in zip(ptrs, sizes)] == data, cycle
            assert not any(row(p)["has_cpu_backup"] for p in ptrs)   # not retained
        print("done")
    """, env={"TMS_BACKUP_THREADS": threads}))
    assert out == "done\n"


@pytest.mark.parametrize("kind", ["pinned", "mmap"])
def test_retain_cpu_backup_keeps_the_host_copy(run_py, kind):
    out = check_ok(run_py(f"""
        assert tms.retain_cpu_backup is False
        tms.retain_cpu_backup = True
        assert tms.retain_cpu_backup is True and core.get_retain_cpu_backup() is True
        n = 3 * MiB + 333
        with tms.region("r", enable_cpu_backup=True, cpu_backup_backend="{kind}"):
            p = core.malloc(n)
        d1 = fill(p, n)
        assert core.get_cpu_backup(p, n) is None           # nothing saved before the first pause
        tms.pause("r")
        v = core.get_cpu_backup(p, n)
        assert isinstance(v, memoryview) and v.nbytes == n and v.tobytes() == d1
        del v
        tms.resume("r")
        assert read(p, n) == d1
        assert row(p)["has_cpu_backup"] is True
        assert core.get_cpu_backup(p, n).tobytes() == d1   # retained across resume
        d2 = fill(p, n)
        tms.pause("r")                                     # the retained copy is refreshed
        assert core.get_cpu_backup(p, n).tobytes() == d2
        tms.resume("r")
        assert read(p, n) == d2
        tms.retain_cpu_backup = False
        tms.pause("r")
        tms.resume("r")
        assert read(p, n) == d2
        assert core.get_cpu_backup(p, n) is None and row(p)["has_cpu_backup"] is False
        print("done")
    """))
    assert out == "done\n"


def test_retained_mmap_backup_is_page_locked_in_the_background(run_py):
    # Issue 16: a retained backup is copied every cycle; once page-locked (on a thread
    # of its own, after the pause) its copies skip the staging. Without retain the
    # backup goes at resume and is never page-locked. The host backend's
    # "page-locking" is a no-op, so this checks the bookkeeping and the direct
    # copies' contents (blocks of 32 MiB plus a tail), not the speed.
    out = check_ok(run_py("""
        import time

        def wait_locked(p):
            deadline = time.monotonic() + 10
            while not row(p)["cpu_backup_page_locked"] and time.monotonic() < deadline:
                time.sleep(0.01)
            return row(p)["cpu_backup_page_locked"]

        n = 70 * MiB + 123
        with tms.region("plain", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            q = core.malloc(n)
        fill(q, n)
        tms.pause("plain")
        time.sleep(0.2)
        assert row(q)["has_cpu_backup"] and not row(q)["cpu_backup_page_locked"]   # not retained: never
        tms.resume("plain")

        tms.retain_cpu_backup = True
        with tms.region("r", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            p = core.malloc(n)
        d1 = fill(p, n)
        tms.pause("r")
        assert wait_locked(p), row(p)
        tms.resume("r")                                   # restored straight from the locked copy
        assert read(p, n) == d1 and row(p)["cpu_backup_page_locked"]
        d2 = fill(p, n)
        tms.pause("r")                                    # refreshed straight into it
        assert core.get_cpu_backup(p, n).tobytes() == d2
        tms.resume("r")
        assert read(p, n) == d2
        d3 = fill(p, n)
        tms.pause("r")                                    # exit with the tag paused: exits 0
        assert core.get_cpu_backup(p, n).tobytes() == d3
        print("done")
    """))
    assert out == "done\n"


def _mbind_permitted():
    """Can this process set a memory policy (no CONFIG_NUMA, or Docker's default
    seccomp profile, say no)? The library then leaves backups where they fall."""
    import ctypes
    import mmap

    if not os.path.exists("/proc/self/numa_maps"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    buf = mmap.mmap(-1, mmap.PAGESIZE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    mask = ctypes.c_ulong(1)
    ok = libc.syscall(237, ctypes.c_void_p(addr), ctypes.c_size_t(mmap.PAGESIZE), 1, ctypes.byref(mask),
                      ctypes.c_ulong(2), 0) == 0  # SYS_mbind (x86_64), MPOL_PREFERRED, node 0
    return ok


@pytest.mark.parametrize("kind", ["mmap", "pinned"])
@pytest.mark.parametrize("node", [None, "0"])
def test_backup_placed_on_the_devices_numa_node(run_py, kind, node):
    # Issue 16: a backup's host pages are preferred on the GPU's NUMA node (the
    # host backend's devices sit on TMS_HOST_NUMA_NODE); the kernel lists the
    # policy in /proc/self/numa_maps. Where the node is unknown, no policy.
    import platform

    if platform.machine() != "x86_64" or not _mbind_permitted():
        pytest.skip("mbind not permitted here (no NUMA support or a seccomp profile): placement is skipped")
    out = check_ok(run_py(f"""
        def preferred():
            with open("/proc/self/numa_maps") as f:
                return [line.split()[0] for line in f if " prefer:0 " in line]

        n = 6 * MiB + 17
        with tms.region("t", enable_cpu_backup=True, cpu_backup_backend="{kind}"):
            p = core.malloc(n)
        data = fill(p, n)
        before = preferred()
        tms.pause("t")
        placed = [a for a in preferred() if a not in before]
        assert core.get_cpu_backup(p, n).tobytes() == data
        tms.resume("t")
        assert read(p, n) == data
        print(len(placed))
    """, env={"TMS_HOST_NUMA_NODE": node} if node else None))
    assert out == ("1\n" if node else "0\n")


@pytest.mark.parametrize("kind", ["mmap", "pinned"])
def test_resume_releases_each_backup_on_its_copy_worker(run_py, kind):
    # Each restored backup's memory goes on the worker that restored it, while
    # the resume still runs (logged before the resume's own line); one a
    # zero-copy view holds stays, with its bytes, until the view goes.
    proc = run_py(f"""
        import torch
        sizes = [3 * MiB + 5, 5 * MiB, 7 * MiB + 1]
        with tms.region("w", enable_cpu_backup=True, cpu_backup_backend="{kind}"):
            ptrs = [core.malloc(n) for n in sizes]
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
    """, env={"TMS_LOG": "debug"})
    assert check_ok(proc, stderr_empty=False) == "done\n"
    first, second = proc.stderr.split("--- second cycle")
    for log, released in ((first, 3), (second, 2)):
        lines = [line for line in log.splitlines() if "restored and released by its copy worker" in line
                 or "resume w:" in line]
        assert len(lines) == released + 1 and "resume w:" in lines[-1], log


@pytest.mark.parametrize("kind", ["mmap", "pinned"])
def test_backup_memory_returned_after_resume_unless_retained(run_py, kind):
    out = check_ok(run_py(f"""
        N = 128 * MiB
        with tms.region("m", enable_cpu_backup=True, cpu_backup_backend="{kind}"):
            p = core.malloc(N)
        block = os.urandom(MiB)
        for off in range(0, N, MiB):
            ctypes.memmove(p + off, block, MiB)
        base = rss_bytes()
        tms.pause("m")
        tms.resume("m")
        after = rss_bytes()
        assert after - base < 0.1 * N, ("backup not returned after resume", base, after)
        assert row(p)["has_cpu_backup"] is False
        tms.retain_cpu_backup = True
        tms.pause("m")
        tms.resume("m")
        kept = rss_bytes()
        assert kept - base >= 0.9 * N, ("retained backup is not resident", base, kept)
        assert row(p)["has_cpu_backup"] is True
        assert read(p + N - MiB, MiB) == block
        core.free(p)                                       # frees device pages and the retained copy
        assert base - rss_bytes() >= 0.9 * N, (base, rss_bytes())
        print("done")
    """))
    assert out == "done\n"


def test_get_cpu_backup_native(run_py):
    out = check_ok(run_py("""
        n = 5 * MiB + 3
        with tms.region("g", enable_cpu_backup=True):
            p = core.malloc(n)
        with tms.region("nb"):
            q = core.malloc(MiB)
        d = fill(p, n)
        assert core.get_cpu_backup(p, n) is None           # active, not retained
        tms.pause("nb")
        assert core.get_cpu_backup(q, MiB) is None         # paused, no backup
        tms.pause("g")
        whole = core.get_cpu_backup(p, n)
        assert type(whole) is memoryview and whole.nbytes == n and whole.tobytes() == d
        off = 2 * MiB + 1
        part = core.get_cpu_backup(p + off, 1000)
        assert part.tobytes() == d[off:off + 1000]
        assert core.get_cpu_backup(p + n - 10, 10).tobytes() == d[-10:]
        expect(ValueError, core.get_cpu_backup, p, n + 1, match="runs past allocation")
        expect(ValueError, core.get_cpu_backup, p + n - 10, 11, match="runs past allocation")
        expect(ValueError, core.get_cpu_backup, p + n + 1, 1, match="runs past allocation")  # rounding slack
        assert core.get_cpu_backup(p - 1, 1) is None        # outside every allocation: no backup
        assert core.get_cpu_backup(4096, 1) is None
        expect(ValueError, core.get_cpu_backup, p, -1, match="nbytes must be >= 0")
        tms.resume("g")
        assert core.get_cpu_backup(p, n) is None           # the core dropped its copy...
        assert whole.tobytes() == d and part.tobytes() == d[off:off + 1000]   # ...the views keep theirs
        fill(p, n)
        assert whole.tobytes() == d                        # a host copy, not the device memory
        core.free(p)
        assert whole.tobytes() == d
        assert core.get_cpu_backup(p, 1) is None             # freed: no longer ours

        # The view holds the only reference: releasing it returns the memory.
        N = 64 * MiB
        with tms.region("big", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            b = core.malloc(N)
        ctypes.memset(b, 0x33, N)
        tms.pause("big")
        view = core.get_cpu_backup(b, N)
        tms.resume("big")
        held = rss_bytes()
        assert view[N - 1] == 0x33
        del view
        assert held - rss_bytes() >= 0.9 * N, (held, rss_bytes())
        del whole, part
        print("done")
    """))
    assert out == "done\n"


def test_free_while_paused(run_py):
    out = check_ok(run_py("""
        N = 32 * MiB
        with tms.region("d"):
            a = core.malloc(N)
        with tms.region("k", enable_cpu_backup=True, cpu_backup_backend="pinned"):
            b = core.malloc(N)
        fill(a, N), fill(b, N)
        tms.pause()
        before = rss_bytes()
        core.free(b)                                       # paused with a backup: the backup goes too
        assert before - rss_bytes() >= 0.9 * N, (before, rss_bytes())
        core.free(a)
        assert core.allocations() == []
        expect(ValueError, core.free, a, match="not an allocation")
        tms.pause("d"); tms.resume("k")                    # tags without allocations: no-op
        # Device capacity (2 * N here) and the ranges came back: the whole device is allocatable.
        with tms.region("again"):
            c = core.malloc(2 * N)
        d = fill(c, 2 * N)
        assert read(c, 2 * N) == d
        print("done")
    """, env={"TMS_HOST_DEVICE_BYTES": 64 * MiB}))
    assert out == "done\n"


def test_double_pause_and_double_resume_raise_naming_the_tag(run_py):
    out = check_ok(run_py("""
        import torch_memory_saver._tms_preload as native
        assert core is native and issubclass(native.Error, RuntimeError)
        with tms.region("dbl", enable_cpu_backup=True):
            p = core.malloc(MiB)
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
    """))
    assert out == "done\n"


def test_pause_resume_of_unknown_tag_is_a_noop(run_py):
    out = check_ok(run_py("""
        with tms.region("known"):
            p = core.malloc(MiB)
        with tms.region("emptied"):
            q = core.malloc(MiB)
        core.free(q)
        d = fill(p, MiB)
        for tag in ("never-seen", "emptied"):
            tms.pause(tag)
            tms.resume(tag)
            tms.pause(tag)
            tms.pause(tag)                                 # no allocations: no double-pause error
        assert row(p)["state"] == "active" and read(p, MiB) == d
        print("done")
    """))
    assert out == "done\n"


def test_nested_regions_restore_outer_settings(run_py):
    out = check_ok(run_py("""
        assert core.get_region() == (False, "default", False, "mmap", False)
        with tms.region("outer", enable_cpu_backup=True, cpu_backup_backend="pinned"):
            assert core.get_region() == (True, "outer", True, "pinned", False)
            o1 = core.malloc(MiB)
            with tms.region("inner"):
                assert core.get_region() == (True, "inner", False, "mmap", False)
                i1 = core.malloc(MiB)
                with tms.disable():
                    assert core.get_region()[0] is False
                    expect(ValueError, core.malloc, MiB, match="outside a region")
                    with tms.region("deep", enable_cpu_backup=True):
                        assert core.get_region() == (True, "deep", True, "mmap", False)
                    assert core.get_region()[0] is False
                assert core.get_region() == (True, "inner", False, "mmap", False)
            assert core.get_region() == (True, "outer", True, "pinned", False)
            try:
                with tms.region("boom", enable_cpu_backup=True, cpu_backup_backend="mmap"):
                    raise KeyError("inside")
            except KeyError:
                pass
            assert core.get_region() == (True, "outer", True, "pinned", False)
            o2 = core.malloc(MiB)
        assert core.get_region() == (False, "default", False, "mmap", False)
        expect(ValueError, core.malloc, MiB, match="outside a region")
        for p in (o1, o2):
            assert (row(p)["tag"], row(p)["cpu_backup"], row(p)["cpu_backup_backend"]) == ("outer", True, "pinned")
        assert (row(i1)["tag"], row(i1)["cpu_backup"]) == ("inner", False)
        print("done")
    """))
    assert out == "done\n"


def test_threads_have_independent_region_state(run_py):
    out = check_ok(run_py("""
        K = 30
        barrier = threading.Barrier(4)
        errors, results = [], {}
        with tms.region("c", enable_cpu_backup=True):
            c = [core.malloc(MiB + 5) for _ in range(3)]
        dc = [fill(p, MiB + 5) for p in c]

        def allocator(tag, backup, kind):
            try:
                with tms.region(tag, enable_cpu_backup=backup, cpu_backup_backend=kind):
                    barrier.wait()
                    mine = []
                    for i in range(K):
                        assert core.get_region() == (True, tag, backup, kind or "mmap", False), core.get_region()
                        mine.append(core.malloc(MiB + i))
                    results[tag] = mine
            except BaseException as e:
                errors.append(repr(e))

        def outsider():
            try:
                barrier.wait()
                for _ in range(K):
                    assert core.get_region()[0] is False
                    expect(ValueError, core.malloc, MiB, match="outside a region")
            except BaseException as e:
                errors.append(repr(e))

        def pauser():                                      # other tags paused/resumed meanwhile
            try:
                barrier.wait()
                for _ in range(10):
                    tms.pause("c")
                    tms.resume("c")
            except BaseException as e:
                errors.append(repr(e))

        ts = [threading.Thread(target=allocator, args=("a", True, "pinned")),
              threading.Thread(target=allocator, args=("b", False, None)),
              threading.Thread(target=outsider), threading.Thread(target=pauser)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors
        rows = {r["ptr"]: r for r in core.allocations()}
        assert len(rows) == 2 * K + 3
        for p in results["a"]:
            assert (rows[p]["tag"], rows[p]["cpu_backup"], rows[p]["cpu_backup_backend"]) == ("a", True, "pinned")
        for p in results["b"]:
            assert (rows[p]["tag"], rows[p]["cpu_backup"]) == ("b", False)
        assert core.get_region() == (False, "default", False, "mmap", False)   # main thread never entered one
        assert [read(p, MiB + 5) for p in c] == dc
        tms.pause("a")
        assert sorted(set(states())) == [("a", "paused"), ("b", "active"), ("c", "active")], states()
        print("done")
    """))
    assert out == "done\n"


# ---- environment defaults -------------------------------------------------------


@pytest.mark.parametrize("value,active", [("1", True), ("true", True), ("YES", True), ("TRUE", True),
                                          ("0", False), ("NO", False)])
def test_init_enable_makes_fresh_threads_active(run_py, value, active):
    out = check_ok(run_py(f"""
        active = {active}
        assert core.defaults()["init_enable"] is active
        got = {{}}
        def fresh():
            got["region"] = core.get_region()
            if active:
                got["ptr"] = core.malloc(MiB)
            else:
                expect(ValueError, core.malloc, MiB, match="outside a region")
        t = threading.Thread(target=fresh)
        t.start(); t.join()
        assert got["region"] == (active, "default", False, "mmap", False), got
        assert core.get_region() == (active, "default", False, "mmap", False)
        with tms.region("x"):
            pass
        assert core.get_region() == (active, "default", False, "mmap", False)   # restored to the env default
        if active:
            assert (row(got["ptr"])["tag"], row(got["ptr"])["state"]) == ("default", "active")
            with tms.disable():
                expect(ValueError, core.malloc, MiB, match="outside a region")
            tms.pause("default")
            assert row(got["ptr"])["state"] == "paused"
        print("done")
    """, env={"TMS_INIT_ENABLE": value}))
    assert out == "done\n"


def test_pause_default_tag_without_regions(run_py):
    out = check_ok(run_py("""
        p = core.malloc(MiB)                               # active from TMS_INIT_ENABLE, tag 'default'
        assert row(p)["tag"] == "default"
        d = fill(p, MiB)
        tms.pause("default")
        assert row(p)["state"] == "paused", row(p)
        tms.resume("default")
        assert row(p)["state"] == "active" and read(p, MiB) == d
        print("done")
    """, env={"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}))
    assert out == "done\n"


def test_init_cpu_backup_env_and_retain_env_are_honoured(run_py):
    out = check_ok(run_py("""
        assert tms.retain_cpu_backup is True                # read from the env before first use
        core = tms._core
        assert core.defaults() == {"init_enable": True, "init_enable_cpu_backup": True,
                                   "init_cpu_backup_backend": "pinned", "init_enable_disk_backup": False,
                                   "retain_cpu_backup": True, "chunk_bytes": 0,
                                   "disk_backup_chunk_bytes": 256 * MiB}, core.defaults()
        got = {}
        def fresh():
            got["region"] = core.get_region()
            got["ptr"] = core.malloc(3 * MiB + 1)
        t = threading.Thread(target=fresh)
        t.start(); t.join()
        assert got["region"] == (True, "default", True, "pinned", False), got
        p, n = got["ptr"], 3 * MiB + 1
        assert (row(p)["cpu_backup"], row(p)["cpu_backup_backend"]) == (True, "pinned")
        d = fill(p, n)
        tms.pause()             # all tags: pause("default") here is test_pause_default_tag_without_regions
        assert row(p)["state"] == "paused"
        tms.resume()
        assert read(p, n) == d
        assert row(p)["has_cpu_backup"] is True                           # retained
        assert core.get_cpu_backup(p, n).tobytes() == d
        with tms.region("e", enable_cpu_backup=True):                     # backend default from the env
            assert core.get_region() == (True, "e", True, "pinned", False)
        print("done")
    """, load_core=False, env={"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "true",
                               "TMS_INIT_CPU_BACKUP_BACKEND": "pinned", "TMS_RETAIN_CPU_BACKUP": "yes"}))
    assert out == "done\n"


def test_init_backup_env_without_init_enable(run_py):
    out = check_ok(run_py("""
        assert tms.retain_cpu_backup is False
        core = tms._core
        d = core.defaults()
        assert (d["init_enable"], d["init_enable_cpu_backup"], d["init_cpu_backup_backend"], d["retain_cpu_backup"]) \\
            == (False, True, "mmap", False), d
        assert core.get_region() == (False, "default", True, "mmap", False)
        expect(ValueError, core.malloc, MiB, match="outside a region")
        with tms.region("z", enable_cpu_backup=True):
            assert core.get_region() == (True, "z", True, "mmap", False)
            p = core.malloc(MiB)
        data = fill(p, MiB)
        tms.pause("z"); tms.resume("z")
        assert read(p, MiB) == data and row(p)["has_cpu_backup"] is False
        print("done")
    """, load_core=False, env={"TMS_INIT_ENABLE_CPU_BACKUP": "1", "TMS_INIT_CPU_BACKUP_BACKEND": "mmap",
                               "TMS_RETAIN_CPU_BACKUP": "0"}))
    assert out == "done\n"


@pytest.mark.parametrize("var,value,fragment", [
    ("TMS_FAULT", "explode:1", "TMS_FAULT='explode:1' is malformed"),
    ("TMS_FAULT", "create:0", "TMS_FAULT='create:0' is malformed"),
    ("TMS_HOST_DEVICE_BYTES", "lots", "TMS_HOST_DEVICE_BYTES='lots'"),
    ("TMS_HOST_DEVICES", "9", "TMS_HOST_DEVICES='9'"),
    ("TMS_BACKEND", "tpu", "TMS_BACKEND='tpu'"),
])
def test_malformed_backend_env_raises_at_import(run_py, var, value, fragment):
    # The backend's own variables are checked at import too, before the backend loads.
    out = check_ok(run_py(f"""
        import sys
        for name in ("torch_memory_saver", "torch_memory_saver._tms_torch"):
            try:
                __import__(name)
            except ValueError as e:
                assert {fragment!r} in str(e), str(e)
            else:
                raise AssertionError(name)
        assert "torch_memory_saver._tms_preload" not in sys.modules
        print("done")
    """, prelude=False, env={var: value}))
    assert out == "done\n"


# ---- out of memory --------------------------------------------------------------


def test_memory_margin_bytes_gives_out_of_memory_error(run_py):
    out = check_ok(run_py("""
        tms.memory_margin_bytes = 60 * MiB                 # before first use: applied at init
        assert tms.memory_margin_bytes == 60 * MiB
        core = tms._core
        assert core.get_memory_margin_bytes() == 60 * MiB
        with tms.region("m"):
            a = core.malloc(2 * MiB)                       # leaves 62 MiB of 64
            b = core.malloc(2 * MiB - 5)                   # leaves exactly the margin: allowed
            e = expect(core.OutOfMemoryError, core.malloc, 1, match="below memory_margin_bytes=62914560")
            assert isinstance(e, MemoryError) and isinstance(e, core.Error) and isinstance(e, RuntimeError)
            assert len(core.allocations()) == 2
            tms.memory_margin_bytes = 0                    # lifts it
            c = core.malloc(20 * MiB)
            tms.memory_margin_bytes = 50 * MiB             # after first use: straight to the core
            assert core.get_memory_margin_bytes() == 50 * MiB
            expect(MemoryError, core.malloc, 1, match="memory_margin_bytes")   # 40 MiB free < 50
            tms.pause("m")                                 # paused memory counts as free
            d = core.malloc(2 * MiB)
        assert len(core.allocations()) == 4
        print("done")
    """, load_core=False, env={"TMS_HOST_DEVICE_BYTES": 64 * MiB}))
    assert out == "done\n"


def test_device_capacity_gives_out_of_memory_and_resume_recovers(run_py):
    out = check_ok(run_py("""
        with tms.region("w", enable_cpu_backup=True):
            w = [core.malloc(8 * MiB), core.malloc(8 * MiB - 3)]
        dw = [fill(w[0], 8 * MiB), fill(w[1], 8 * MiB - 3)]
        with tms.region("x"):
            e = expect(core.OutOfMemoryError, core.malloc, 16 * MiB + 1, match="Cannot allocate memory")
            assert isinstance(e, MemoryError) and "'x'" in str(e), e
            x = core.malloc(16 * MiB)                      # exactly fills device 0
            expect(MemoryError, core.malloc, 1)
            y = core.malloc(32 * MiB, 1)                   # device 1 has its own capacity
        assert len(core.allocations()) == 4
        tms.pause("w")
        with tms.region("z"):
            z = core.malloc(8 * MiB)                       # takes half of what w gave back
        e = expect(core.OutOfMemoryError, tms.resume, "w", match="'w'")
        st = sorted(row(p)["state"] for p in w)
        assert st == ["active", "paused"], st              # one fits, the other stays paused...
        for p, d in zip(w, dw):
            if row(p)["state"] == "paused":
                assert row(p)["has_cpu_backup"] is True    # ...with its backup
            else:
                assert read(p, len(d)) == d
        core.free(z)
        tms.resume("w")                                    # the retry restores the rest
        assert [read(p, len(d)) for p, d in zip(w, dw)] == dw
        print("done")
    """, env={"TMS_HOST_DEVICE_BYTES": 32 * MiB}))
    assert out == "done\n"


# ---- devices and chunks ---------------------------------------------------------


@pytest.mark.parametrize("devices,good,bad", [(None, 1, 2), ("1", 0, 1), ("4", 3, 4)])
def test_allocations_on_other_devices(run_py, devices, good, bad):
    n_devices = int(devices or 2)
    out = check_ok(run_py(f"""
        n = 3 * MiB + 1
        with tms.region("dev", enable_cpu_backup=True, cpu_backup_backend="pinned"):
            p0 = core.malloc(n)                            # current device: 0
            pg = core.malloc(n, {good})
            expect(ValueError, core.malloc, n, {bad}, match="device {bad} does not exist ({n_devices} devices)")
        assert row(p0)["device"] == 0 and row(pg)["device"] == {good}
        d0, dg = fill(p0, n), fill(pg, n)
        tms.pause("dev")
        assert row(pg)["state"] == "paused" and row(pg)["has_cpu_backup"]
        tms.resume("dev")
        assert read(p0, n) == d0 and read(pg, n) == dg
        print("done")
    """, env={"TMS_HOST_DEVICES": devices}))
    assert out == "done\n"


@pytest.mark.parametrize("kind", ["pinned", "mmap"])
def test_chunked_allocations_are_byte_exact_across_chunk_boundaries(run_py, kind):
    out = check_ok(run_py(f"""
        assert core.defaults()["chunk_bytes"] == 4 * MiB
        # size -> chunks of 4 MiB (reserved rounds to 2 MiB, the last chunk may be 2 MiB)
        specs = [(9 * MiB + 5, 3), (4 * MiB, 1), (12 * MiB, 3), (6 * MiB - 1, 2), (1, 1), (8 * MiB + 1, 3)]
        with tms.region("c", enable_cpu_backup=True, cpu_backup_backend="{kind}"):
            ptrs = [core.malloc(n) for n, _ in specs]
        assert [row(p)["chunks"] for p in ptrs] == [k for _, k in specs]
        N = 40 * MiB
        with tms.region("discard"):
            big = core.malloc(N)
        assert row(big)["chunks"] == 10
        ctypes.memset(big, 7, N)
        for cycle in range(2):
            data = [fill(p, n) for p, (n, _) in zip(ptrs, specs)]
            before = rss_bytes()
            tms.pause("discard")
            assert before - rss_bytes() >= 0.9 * N, (before, rss_bytes())   # every chunk released
            tms.pause("c")
            tms.resume()
            ctypes.memset(big, 8, N)                       # every chunk mapped again
            assert [read(p, n) for p, (n, _) in zip(ptrs, specs)] == data, cycle
            for p, (n, _) in zip(ptrs, specs):             # straddling each boundary
                for b in range(4 * MiB, n - 3, 4 * MiB):
                    assert read(p + b - 3, 6) == data[ptrs.index(p)][b - 3:b + 3]
        print("done")
    """, env={"TMS_CHUNK_BYTES": "4MiB"}))
    assert out == "done\n"


# ---- fault injection ------------------------------------------------------------
#
# TMS_FAULT="op:n": the n-th call (1-based, per process) of a host-backend op
# fails once. Allocations here are made through raw_region (core.set_region):
# region(enable_cpu_backup=True) would also start the copy workers, whose
# pinned staging takes host_alloc calls of its own.

# One chunked allocation of 70 MiB - 1 in 32 MiB chunks (3 chunks: create/map
# calls 1-3 happen at allocation time). Its backup is pinned: the pause locks
# it and copies straight into it a 64 MiB piece at a time (two pieces), the
# resume copies from it in 32 MiB blocks (three).
_ONE_ALLOCATION_FAULTS = [
    # (TMS_FAULT, failing op, exception name, message fragment, state after the failed call)
    ("create:5", "resume", "OutOfMemoryError", "create of", "paused"),      # chunk 2 of 3
    ("map:4", "resume", "OutOfMemoryError", "map of", "paused"),            # chunk 1 of 3
    ("copy_to_device:2", "resume", "Error", "restore copy", "paused"),      # second copy block
    ("unmap:2", "pause", "Error", "unmap of allocation", "active"),         # chunk 2 of 3
    ("copy_to_host:2", "pause", "Error", "backup copy", "active"),
    # The copy workers' staging is host allocations 1-4 (TMS_BACKUP_THREADS=2);
    # locking the pinned backup's pieces is calls 5 and 6 (in the order the two
    # workers get there).
    ("host_alloc:1", "pause", "OutOfMemoryError", "staging", "active"),    # the copy workers' staging
    ("host_alloc:5", "pause", "OutOfMemoryError", "pinned backup", "active"),   # locking a piece of the backup
    ("host_alloc:6", "pause", "OutOfMemoryError", "pinned backup", "active"),   # and the other piece
]


@pytest.mark.parametrize("fault,op,exc,fragment,state", _ONE_ALLOCATION_FAULTS,
                         ids=[f[0] for f in _ONE_ALLOCATION_FAULTS])
def test_fault_in_one_chunked_allocation_loses_nothing(run_py, fault, op, exc, fragment, state):
    out = check_ok(run_py(f"""
        n = 70 * MiB - 1
        with raw_region("f", True, "pinned"):
            p = core.malloc(n)
        assert row(p)["chunks"] == 3
        d = fill(p, n)
        if "{op}" == "resume":
            tms.pause("f")
        e = expect(core.{exc}, getattr(tms, "{op}"), "f", match={fragment!r})
        r = row(p)
        assert r["state"] == "{state}", r
        if r["state"] == "paused":
            assert r["has_cpu_backup"] is True, r          # the backup survives a failed resume
            assert core.get_cpu_backup(p, n).tobytes() == d
            tms.resume("f")                                # the fault fires once: the retry works
        else:
            assert r["has_cpu_backup"] is False, r         # a failed pause keeps no (half-made) copy
        assert read(p, n) == d                             # active and intact
        tms.pause("f")
        tms.resume("f")
        assert read(p, n) == d
        print("done")
    """, env={"TMS_CHUNK_BYTES": "32MiB", "TMS_FAULT": fault}))
    assert out == "done\n"


def test_failed_unmap_keeps_no_backup(run_py):
    out = check_ok(run_py("""
        n = 10 * MiB - 1
        with raw_region("f", True, "mmap"):
            p = core.malloc(n)
        fill(p, n)
        expect(core.Error, tms.pause, "f", match="unmap of allocation")
        assert row(p)["state"] == "active"
        d = fill(p, n)                                     # the device copy moves on
        # retain off: an allocation left active keeps no host copy that would go stale
        assert core.get_cpu_backup(p, n) is None, "stale backup served for an active allocation"
        assert row(p)["has_cpu_backup"] is False, row(p)
        tms.pause("f")                                     # the fault fires once
        tms.resume("f")
        assert read(p, n) == d
        print("done")
    """, env={"TMS_CHUNK_BYTES": "4MiB", "TMS_FAULT": "unmap:2"}))
    assert out == "done\n"


def test_a_failing_rollback_is_reported_in_the_error(run_py):
    # Creating chunk 2 of 3 fails; undoing it, unmapping chunk 1 fails too:
    # both are in the message, and the emulated device gets every byte back.
    out = check_ok(run_py("""
        free0, total = core.mem_get_info(0)
        with raw_region("r"):
            e = expect(core.OutOfMemoryError, core.malloc, 6 * MiB)
        msg = str(e)
        assert "map of 2097152 bytes (chunk 2 of 3)" in msg and "'r'" in msg, msg
        assert "undoing it, unmap of chunk 1 failed" in msg, msg
        assert core.mem_get_info(0) == (free0, total)
        assert core.allocations() == []
        with raw_region("r"):
            p = core.malloc(6 * MiB)                      # each fault fires once
        core.free(p)
        print("done")
    """, env={"TMS_CHUNK_BYTES": "2MiB", "TMS_FAULT": "map:2,unmap:1"}))
    assert out == "done\n"


# Four allocations, two pinned and two mmap backups, of 1-3 copy blocks each.
_SEVERAL = textwrap.dedent("""
    sizes = [MiB + 1, 17 * MiB + 7, 2 * MiB, 5]
    ptrs = []
    for i, n in enumerate(sizes):
        with raw_region("p", True, "pinned" if i % 2 else "mmap"):
            ptrs.append(core.malloc(n))
    data = [fill(p, n) for p, n in zip(ptrs, sizes)]
    def intact():
        return [read(p, n) for p, n in zip(ptrs, sizes)] == data
""")


@pytest.mark.parametrize("fault,exc,fragment", [
    ("copy_to_host:1", "Error", "backup copy"),
    ("copy_to_host:3", "Error", "backup copy"),
    ("host_alloc:1", "OutOfMemoryError", "staging"),                   # workers start for the first copy
    ("host_alloc:5", "OutOfMemoryError", "pinned backup"),             # locking one pinned backup (a piece each)
    ("host_alloc:6", "OutOfMemoryError", "pinned backup"),             # locking the other
])
def test_fault_during_backed_up_pause_leaves_every_allocation_active(run_py, fault, exc, fragment):
    out = check_ok(run_py(_SEVERAL + textwrap.dedent(f"""
        e = expect(core.{exc}, tms.pause, "p", match={fragment!r})
        assert [r["state"] for r in core.allocations()] == ["active"] * 4, core.allocations()
        assert not any(r["has_cpu_backup"] for r in core.allocations())   # this call's backups undone
        assert all(core.get_cpu_backup(p, 1) is None for p in ptrs)
        assert intact()
        tms.pause("p")                                     # the fault fires once
        assert [r["state"] for r in core.allocations()] == ["paused"] * 4
        tms.resume("p")
        assert intact()
        print("done")
    """), env={"TMS_FAULT": fault}))
    assert out == "done\n"


def test_failed_pause_drops_stale_retained_copies(run_py):
    # copy_to_host calls with 8 MiB blocks: the first pause copies
    # 1 + 3 + 1 + 1 = 6 blocks; the second pause fails on its second block.
    out = check_ok(run_py(_SEVERAL + textwrap.dedent("""
        tms.retain_cpu_backup = True
        tms.pause("p")
        tms.resume("p")
        assert intact() and all(row(p)["has_cpu_backup"] for p in ptrs)
        data = [fill(p, n) for p, n in zip(ptrs, sizes)]   # the retained copies are now stale
        expect(core.Error, tms.pause, "p", match="backup copy")
        assert [r["state"] for r in core.allocations()] == ["active"] * 4
        # a half-refreshed retained copy must not be served as the backup
        assert all(core.get_cpu_backup(p, n) is None for p, n in zip(ptrs, sizes))
        assert intact()
        tms.pause("p")
        assert [core.get_cpu_backup(p, n).tobytes() for p, n in zip(ptrs, sizes)] == data
        tms.resume("p")
        assert intact()
        print("done")
    """), env={"TMS_FAULT": "copy_to_host:8", "TMS_BACKUP_BLOCK_BYTES": "8MiB"}))
    assert out == "done\n"


@pytest.mark.parametrize("failing", [0, 1, 3])
def test_create_fault_during_resume_keeps_the_failed_allocation_paused(run_py, failing):
    # One create per allocation at allocation time (calls 1-4); resume maps in
    # address order (calls 5-8: the order the driver is fastest in) and stops
    # at the first failure.
    out = check_ok(run_py(_SEVERAL + textwrap.dedent(f"""
        tms.pause("p")
        expect(core.OutOfMemoryError, tms.resume, "p", match="create of")
        rows = sorted(core.allocations(), key=lambda r: r["ptr"])
        for i, r in enumerate(rows):
            if i < {failing}:                              # resumed before the failure, contents back
                assert r["state"] == "active", rows
                assert read(r["ptr"], r["size"]) == data[ptrs.index(r["ptr"])]
            else:                                          # the failed one and the rest: paused, backed up
                assert r["state"] == "paused" and r["has_cpu_backup"] is True, rows
        tms.resume("p")                                    # retry
        assert all(r["state"] == "active" for r in core.allocations())
        assert intact()
        print("done")
    """), env={"TMS_FAULT": f"create:{5 + failing}"}))
    assert out == "done\n"


def test_restore_fault_during_resume_keeps_unrestored_allocations_paused(run_py):
    # copy_to_device blocks: 1 + 3 + 1 + 1; the 4th fails and the copy job
    # stops: an allocation is active only if all its bytes came back.
    out = check_ok(run_py(_SEVERAL + textwrap.dedent("""
        tms.pause("p")
        expect(core.Error, tms.resume, "p", match="restore copy")
        st = [r["state"] for r in core.allocations()]
        assert "paused" in st, core.allocations()
        for r in core.allocations():
            i = ptrs.index(r["ptr"])
            if r["state"] == "active":
                assert read(r["ptr"], sizes[i]) == data[i]
            else:
                assert r["has_cpu_backup"] and core.get_cpu_backup(r["ptr"], sizes[i]).tobytes() == data[i]
        tms.resume("p")
        assert intact()
        print("done")
    """), env={"TMS_FAULT": "copy_to_device:4"}))
    assert out == "done\n"


# ---- hook variants and teardown -------------------------------------------------


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_both_hook_variants_work_on_the_host_backend(run_py, mode):
    out = check_ok(run_py(f"""
        tms.hook_mode = "{mode}"
        core = tms._core
        assert core.__name__ == "torch_memory_saver._tms_{mode}" and core.VARIANT == "{mode}"
        assert core.backend() == "host"
        other = "torch_memory_saver._tms_" + ("torch" if "{mode}" == "preload" else "preload")
        assert other not in sys.modules, "two cores in one process"
        n = 3 * MiB + 1
        with tms.region("h", enable_cpu_backup=True):
            p = core.malloc(n)
        with tms.region("k"):
            q = core.malloc(MiB)
        d = fill(p, n)
        tms.pause()
        assert states() == [("h", "paused"), ("k", "paused")]
        tms.resume()
        assert read(p, n) == d
        tms.pause("h")
        expect(core.Error, tms.pause, "h", match="'h'")
        tms.resume("h")
        assert read(p, n) == d
        core.free(p); core.free(q)
        assert core.allocations() == []
        print("done")
    """, load_core=False))
    assert out == "done\n"


@pytest.mark.parametrize("mode,env", [
    ("preload", {}),
    ("torch", {}),
    ("preload", {"TMS_RETAIN_CPU_BACKUP": "1", "TMS_CHUNK_BYTES": "4MiB"}),
    ("torch", {"TMS_RETAIN_CPU_BACKUP": "1", "TMS_CHUNK_BYTES": "4MiB"}),
], ids=["preload", "torch", "preload-retain-chunked", "torch-retain-chunked"])
def test_process_exits_cleanly_with_live_allocations(run_py, mode, env):
    proc = run_py(f"""
        tms.hook_mode = "{mode}"
        core = tms._core
        with tms.region("active"):
            a = core.malloc(9 * MiB)
        with tms.region("discard"):
            b = core.malloc(9 * MiB)
        with tms.region("pinned", enable_cpu_backup=True, cpu_backup_backend="pinned"):
            c = core.malloc(9 * MiB)
        with tms.region("mmap", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            d = core.malloc(9 * MiB)
        with tms.region("resumed", enable_cpu_backup=True):
            e = core.malloc(9 * MiB)
        for p in (a, b, c, d, e):
            fill(p, 9 * MiB)
        for tag in ("discard", "pinned", "mmap", "resumed"):
            tms.pause(tag)
        tms.resume("resumed")
        view = core.get_cpu_backup(c, 100)                 # a live backup view at exit
        assert states() == [("active", "active"), ("discard", "paused"), ("mmap", "paused"),
                            ("pinned", "paused"), ("resumed", "active")], states()
        print("bye")
    """, load_core=False, env=env)
    assert proc.returncode == 0, proc
    assert proc.stderr == ""
    assert proc.stdout == "bye\n"


def test_backed_up_pause_in_a_forked_child(run_py):
    # The parent starts the copy workers; a forked child (multiprocessing's
    # default start method on Linux) then pauses and resumes with backups.
    out = check_ok(run_py("""
        import time
        n = 20 * MiB
        with tms.region("w", enable_cpu_backup=True):
            p = core.malloc(n)
        d = fill(p, n)
        tms.pause("w"); tms.resume("w")
        import warnings; warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12 warns on fork with threads
        pid = os.fork()
        if pid == 0:
            try:
                with tms.region("c", enable_cpu_backup=True):
                    q = core.malloc(n)
                e = fill(q, n)
                for _ in range(3):
                    tms.pause(); tms.resume()
                os._exit(0 if read(q, n) == e and read(p, n) == d else 1)
            except BaseException:
                os._exit(2)
        deadline = time.monotonic() + 60  # a hang, not a slow machine
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.02)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung in a backed-up pause/resume")
        assert os.waitstatus_to_exitcode(status) == 0, status
        tms.pause(); tms.resume()                          # the parent's pool still works
        assert read(p, n) == d
        print("done")
    """))
    assert out == "done\n"
