# Tests the native module too: get_region (this thread's settings) and defaults().
"""Regions on the host backend (tests/test_host_backend.py): nesting restores the
outer settings, each thread has its own, and the TMS_INIT_* / TMS_RETAIN_* defaults
of fresh threads."""
import sys
import threading

from _prelude import MiB, core, expect, fill, read, row, run_cases, start, states, tms


def nested():
    """Nested regions and disable() restore the outer settings, after an exception too."""
    native = core()
    assert native.get_region() == (False, "default", False, "mmap", False, None, None)
    with tms.region("outer", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        assert native.get_region() == (True, "outer", True, "pinned", False, None, None)
        o1 = tms.malloc(MiB)
        with tms.region("inner"):
            assert native.get_region() == (True, "inner", False, "mmap", False, None, None)
            i1 = tms.malloc(MiB)
            with tms.disable():
                assert native.get_region()[0] is False
                expect(ValueError, tms.malloc, MiB, match="inside disable()")
                with tms.region("deep", enable_cpu_backup=True):
                    tms.free(tms.malloc(MiB))
                    assert native.get_region() == (True, "deep", True, "mmap", False, None, None)
                assert native.get_region()[0] is False
            assert native.get_region() == (True, "inner", False, "mmap", False, None, None)
        assert native.get_region() == (True, "outer", True, "pinned", False, None, None)
        try:
            with tms.region("boom", enable_cpu_backup=True, cpu_backup_backend="mmap"):
                raise KeyError("inside")
        except KeyError:
            pass
        assert native.get_region() == (True, "outer", True, "pinned", False, None, None)
        o2 = tms.malloc(MiB)
    assert native.get_region() == (False, "default", False, "mmap", False, None, None)
    expect(ValueError, tms.malloc, MiB, match="outside a region")
    for p in (o1, o2):
        assert (row(p)["tag"], row(p)["cpu_backup"], row(p)["cpu_backup_backend"]) == ("outer", True, "pinned")
    assert (row(i1)["tag"], row(i1)["cpu_backup"]) == ("inner", False)
    print("done")


def per_thread():
    """Threads in different regions, one outside any and one pausing another tag, meanwhile."""
    native = core()
    K = 30
    barrier = threading.Barrier(4)
    errors, results = [], {}
    with tms.region("c", enable_cpu_backup=True):
        c = [tms.malloc(MiB + 5) for _ in range(3)]
    dc = [fill(p, MiB + 5) for p in c]

    def allocator(tag, backup, kind):
        try:
            with tms.region(tag, enable_cpu_backup=backup, cpu_backup_backend=kind):
                barrier.wait()
                mine = []
                for i in range(K):
                    assert native.get_region() == (True, tag, backup, kind or "mmap", False, None, None), native.get_region()
                    mine.append(tms.malloc(MiB + i))
                results[tag] = mine
        except BaseException as e:
            errors.append(repr(e))

    def outsider():
        try:
            barrier.wait()
            for _ in range(K):
                assert native.get_region()[0] is False
                expect(ValueError, tms.malloc, MiB, match="outside a region")
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
    rows = {r["ptr"]: r for r in tms.allocations()}
    assert len(rows) == 2 * K + 3
    for p in results["a"]:
        assert (rows[p]["tag"], rows[p]["cpu_backup"], rows[p]["cpu_backup_backend"]) == ("a", True, "pinned")
    for p in results["b"]:
        assert (rows[p]["tag"], rows[p]["cpu_backup"]) == ("b", False)
    assert native.get_region() == (False, "default", False, "mmap", False, None, None)   # main thread never entered one
    assert [read(p, MiB + 5) for p in c] == dc
    tms.pause("a")
    assert sorted(set(states())) == [("a", "paused"), ("b", "active"), ("c", "active")], states()
    print("done")


def init_enable(active):
    """TMS_INIT_ENABLE: fresh threads start in the 'default' region when active ("True")."""
    native = core()
    active = active in (True, "True")                  # "True" on the command line
    assert native.defaults()["init_enable"] is active
    got = {}

    def fresh():
        got["region"] = native.get_region()
        if active:
            got["ptr"] = tms.malloc(MiB)
        else:
            expect(ValueError, tms.malloc, MiB, match="outside a region")

    t = threading.Thread(target=fresh)
    t.start()
    t.join()
    assert got["region"] == (active, "default", False, "mmap", False, None, None), got
    assert native.get_region() == (active, "default", False, "mmap", False, None, None)
    with tms.region("x"):
        pass
    assert native.get_region() == (active, "default", False, "mmap", False, None, None)   # restored to the env default
    if active:
        assert (row(got["ptr"])["tag"], row(got["ptr"])["state"]) == ("default", "active")
        with tms.disable():
            expect(ValueError, tms.malloc, MiB, match="inside disable()")
        tms.pause("default")
        assert row(got["ptr"])["state"] == "paused"
    print("done")


def default_tag_without_regions():
    """With TMS_INIT_ENABLE=1 allocations outside any region are tag 'default', pauseable by name."""
    start()
    p = tms.malloc(MiB)                                # active from TMS_INIT_ENABLE, tag 'default'
    assert row(p)["tag"] == "default"
    d = fill(p, MiB)
    tms.pause("default")
    assert row(p)["state"] == "paused", row(p)
    tms.resume("default")
    assert row(p)["state"] == "active" and read(p, MiB) == d
    print("done")


def init_backup_and_retain_env():
    """TMS_INIT_ENABLE=1, TMS_INIT_ENABLE_CPU_BACKUP=true, TMS_INIT_CPU_BACKUP_BACKEND=pinned and
    TMS_RETAIN_CPU_BACKUP=yes reach fresh threads, regions and the retain setting."""
    assert tms.retain_cpu_backup is True               # read from the env before first use
    native = core()
    assert native.defaults() == {"init_enable": True, "init_enable_cpu_backup": True,
                                 "init_cpu_backup_backend": "pinned", "init_enable_disk_backup": False,
                                 "retain_cpu_backup": True, "chunk_bytes": 0,
                                 "disk_backup_chunk_bytes": 256 * MiB, "progress": False,
                                 "backup_live_only": True, "spill_to_disk": False, "job": None}, native.defaults()
    got = {}

    def fresh():
        got["region"] = native.get_region()
        got["ptr"] = tms.malloc(3 * MiB + 1)

    t = threading.Thread(target=fresh)
    t.start()
    t.join()
    assert got["region"] == (True, "default", True, "pinned", False, None, None), got
    p, n = got["ptr"], 3 * MiB + 1
    assert (row(p)["cpu_backup"], row(p)["cpu_backup_backend"]) == (True, "pinned")
    d = fill(p, n)
    tms.pause()             # all tags: pause("default") here is default_tag_without_regions
    assert row(p)["state"] == "paused"
    tms.resume()
    assert read(p, n) == d
    assert row(p)["has_cpu_backup"] is True                            # retained
    assert native.get_cpu_backup(p, n).tobytes() == d
    with tms.region("e", enable_cpu_backup=True):                      # backend default from the env
        assert native.get_region() == (True, "e", True, "pinned", False, None, None)
    print("done")


def init_backup_without_init_enable():
    """TMS_INIT_ENABLE_CPU_BACKUP=1 without TMS_INIT_ENABLE: backup on, but no region."""
    assert tms.retain_cpu_backup is False
    native = core()
    d = native.defaults()
    assert (d["init_enable"], d["init_enable_cpu_backup"], d["init_cpu_backup_backend"], d["retain_cpu_backup"]) \
        == (False, True, "mmap", False), d
    assert native.get_region() == (False, "default", True, "mmap", False, None, None)
    expect(ValueError, tms.malloc, MiB, match="outside a region")
    with tms.region("z", enable_cpu_backup=True):
        assert native.get_region() == (True, "z", True, "mmap", False, None, None)
        p = tms.malloc(MiB)
    data = fill(p, MiB)
    tms.pause("z")
    tms.resume("z")
    assert read(p, MiB) == data and row(p)["has_cpu_backup"] is False
    print("done")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
