# Tests the native module too: its argument checks, get_region, defaults() and variants.
"""The Python layer once the core is loaded (tests/test_api.py): hook_mode and the
settings around first use, argument errors of the native module, the environment's
sizes and booleans as parsed, the one public exception type, public malloc/free, and
the command line's usage line, no CUDA driver (tests/test_build.py), and a pause or
resume as one call into the core (tests/test_one_call.py)."""
import ast
import ctypes
import os
import sys

import torch_memory_saver
from _prelude import MiB, core, expect, fill, raw_region, read, row, run_cases, start, states, tms


def enabled_without_starting_the_core():
    """enabled is True in both hook modes without LD_PRELOAD, and loads no core."""
    import os

    from torch_memory_saver import TorchMemorySaver

    assert "LD_PRELOAD" not in os.environ
    for mode in ("preload", "torch"):
        t = TorchMemorySaver()
        t.hook_mode = mode
        assert t.enabled is True and t._impl is None, mode
    cores = [m for m in sys.modules if m in ("torch_memory_saver._tms_preload", "torch_memory_saver._tms_torch")]
    assert cores == [], cores
    print("done")


def hook_mode_after_first_use():
    """hook_mode is fixed by the first use: the same value is fine, another raises."""
    tms.hook_mode = "torch"
    tms.pause()                                        # first use
    assert core().VARIANT == "torch"
    tms.hook_mode = "torch"                            # same value: fine
    e = expect(RuntimeError, setattr, tms, "hook_mode", "preload", match="set hook_mode before first use")
    assert "'torch'" in str(e)
    assert tms.hook_mode == "torch"
    assert "torch_memory_saver._tms_preload" not in sys.modules
    expect(ValueError, setattr, tms, "hook_mode", "cuda", match="'cuda'")
    print("done")


def settings_before_first_use():
    """memory_margin_bytes and retain_cpu_backup set before the core starts reach it."""
    tms.memory_margin_bytes = 12345
    tms.retain_cpu_backup = True
    assert tms._impl is None
    native = core()
    assert native.get_memory_margin_bytes() == 12345 and native.get_retain_cpu_backup() is True
    assert tms.memory_margin_bytes == 12345 and tms.retain_cpu_backup is True
    tms.retain_cpu_backup = False
    assert native.get_retain_cpu_backup() is False
    expect(ValueError, setattr, tms, "memory_margin_bytes", -1, match=">= 0")
    assert native.get_memory_margin_bytes() == 12345
    print("done")


def native_argument_errors():
    """The native module checks its own arguments; a failed set_region changes nothing."""
    native = core()
    expect(TypeError, native.pause, 1, match="tag must be a str, a list of str or None, not int")
    expect(ValueError, native.resume, "", match="tag must be a non-empty string")
    expect(ValueError, native.set_region, True, "t", True, "disk", match="'disk'")
    expect(ValueError, native.set_region, True, "", False, "mmap", match="non-empty")
    expect(TypeError, native.set_memory_margin_bytes, 1.5, match="must be an int, not float")
    expect(ValueError, native.set_memory_margin_bytes, -3, match="memory_margin_bytes must be >= 0, got -3")
    with tms.region("t"):
        expect(ValueError, native.malloc, -1, match="nbytes must be >= 0")
    expect(ValueError, native.free, 4096, match="not an allocation of torch_memory_saver")
    assert native.get_region() == (False, "default", False, "mmap", False, None, None)   # failed set_region changed nothing
    print("done")


def chunk_bytes_at_its_bound():
    """TMS_CHUNK_BYTES at its bound (1 TiB): one chunk, pause and resume work; prints it."""
    start()
    with raw_region("t"):
        p = tms.malloc(3 * MiB)
    assert row(p)["chunks"] == 1, row(p)          # a chunk above the allocation: one handle
    tms.pause("t")
    tms.resume("t")
    tms.free(p)
    print(core().defaults()["chunk_bytes"])


def env_value_parses(key, expected):
    """defaults()[key] equals the Python literal `expected`, of the same type."""
    got = core().defaults()[key]
    expected = ast.literal_eval(expected)
    assert got == expected and type(got) is type(expected), got
    print("done")


def torch_variant_has_no_allocator_hook():
    """Only the preload variant defines cudaMalloc/cudaFree (and hip*); run with it on LD_PRELOAD."""
    import ctypes

    import torch_memory_saver._tms_preload as p
    import torch_memory_saver._tms_torch as t

    assert not hasattr(t, "preload_active") and p.preload_active()[0] is True
    torch_lib, preload_lib = ctypes.CDLL(t.library_path()), ctypes.CDLL(p.library_path())
    for name in ("cudaMalloc", "cudaFree", "hipMalloc", "hipFree"):
        assert not hasattr(torch_lib, name), name
        assert hasattr(preload_lib, name), name
    assert hasattr(torch_lib, "tms_torch_malloc") and hasattr(torch_lib, "tms_torch_free")
    print("done")


def one_public_error():
    """Both native variants raise torch_memory_saver.Error (and its OutOfMemoryError), picklable."""
    import pickle

    import torch_memory_saver._tms_preload as p
    import torch_memory_saver._tms_torch as t

    assert p.Error is t.Error is torch_memory_saver.Error and issubclass(torch_memory_saver.Error, RuntimeError)
    assert p.OutOfMemoryError is t.OutOfMemoryError is torch_memory_saver.OutOfMemoryError
    assert issubclass(torch_memory_saver.OutOfMemoryError, (torch_memory_saver.Error, MemoryError))
    assert repr(torch_memory_saver.Error) == "<class 'torch_memory_saver.Error'>"
    e = pickle.loads(pickle.dumps(torch_memory_saver.Error("x")))
    assert type(e) is torch_memory_saver.Error and str(e) == "x"
    for mode in ("preload", "torch"):
        native = getattr(torch_memory_saver, "_tms_" + mode)
        native.set_region(True, "dbl-" + mode, False, "mmap")
        ptr = native.malloc(1 << 20)
        native.set_region(False, "default", False, "mmap")
        native.pause("dbl-" + mode)
        try:
            native.pause("dbl-" + mode)
        except torch_memory_saver.Error as e:
            assert "already paused" in str(e), e
        else:
            raise AssertionError(mode)
        native.free(ptr)
    print("done")


def public_malloc_and_free():
    """tms.malloc/free give pauseable memory on the host backend, on any device."""
    start()
    with tms.region("w", enable_cpu_backup=True):
        p = tms.malloc(3 * MiB + 1)
        q = tms.malloc(MiB, 1)                          # on device 1
    data = fill(p, 3 * MiB + 1)
    tms.pause("w")
    assert row(p)["state"] == "paused" and row(q)["device"] == 1
    tms.resume("w")
    assert read(p, 3 * MiB + 1) == data
    tms.free(p)
    tms.free(q)
    expect(ValueError, tms.malloc, MiB, match="outside a region")
    expect(TypeError, tms.malloc, True, match="nbytes must be an int")
    expect(ValueError, tms.free, p, match="not an allocation")
    print("done")


def no_driver():
    """Without TMS_BACKEND and without a CUDA driver: the import works, the first GPU use
    raises the library's Error saying what is missing and how to run without a GPU."""
    assert tms.enabled is True
    for attempt in range(2):                           # the failure is not cached as success
        try:
            tms.pause()
        except RuntimeError as e:
            msg = str(e)
            assert "CUDA driver" in msg and "libcuda.so.1" in msg, msg
            assert "TMS_BACKEND=host" in msg, msg      # the way to run without a GPU
            assert type(e) is torch_memory_saver.Error, type(e)
        else:
            raise AssertionError("pause() without a driver succeeded")
    print("done")


def module_level_calls(names):
    """Every member README lists (names, comma-separated) is on the module, and the
    module's calls act on the singleton: a region entered on the module, a pause
    and resume through it, a setting assigned on it."""
    import torch_memory_saver as m

    for name in names.split(","):
        assert hasattr(m, name), f"torch_memory_saver.{name} is missing"
        assert hasattr(tms, name), f"torch_memory_saver.torch_memory_saver.{name} is missing"
    with m.region("w", enable_cpu_backup=True):
        p = m.malloc(2 * MiB)
    data = fill(p, 2 * MiB)
    assert m.pause("w").released_bytes == 2 * MiB and m.is_paused("w") and m.paused_tags() == ["w"]
    assert tms.is_paused("w")                          # one state: the singleton's
    m.resume("w")
    assert read(p, 2 * MiB) == data and not m.is_paused("w")
    m.progress = True
    assert tms.progress is True and m.progress is True
    assert m.enabled is True and m.disk_backup_dir == tms.disk_backup_dir
    expect(AttributeError, setattr, m, "enabled", False)
    with m.disable():
        expect(ValueError, m.malloc, MiB, match="inside disable()")
    m.free(p)
    print("done")


def disk_dir_with_missing_parents(base):
    """set_disk_backup_dir of a path whose parents are missing makes each of them,
    mode 0700 and owned by this user, as upstream makes the whole tree."""
    import stat

    target = os.path.join(base, "a", "b", "c")
    tms.set_disk_backup_dir(target)
    assert tms.disk_backup_dir == target, tms.disk_backup_dir
    for d in (os.path.join(base, "a"), os.path.join(base, "a", "b"), target):
        st = os.stat(d)
        assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.geteuid(), (d, oct(st.st_mode), st.st_uid)
    print("done")


def memory_report_arguments():
    """memory_report(devices=...) takes a list of ints; anything else says so."""
    for bad, kind, text in (("0", TypeError, "takes device indices (a list of ints), not str"),
                            (5, TypeError, "not int"),
                            ([1.5], TypeError, "device 1.5 must be an int, not float"),
                            ([True], TypeError, "must be an int, not bool"),
                            ([-1], ValueError, "device must be >= 0, got -1"),
                            ([99], ValueError, "device 99 does not exist")):
        e = expect(kind, tms.memory_report, bad, match=text)
        assert str(e).startswith("torch_memory_saver: "), str(e)
    assert sorted(tms.memory_report([0, 1])) == [0, 1]
    print("done")


def help_as(argv0):
    """`--help` with sys.argv[0] = argv0: prints the usage line and exits 0."""
    sys.argv[0] = argv0
    from torch_memory_saver.__main__ import main

    try:
        main(["--help"])
    except SystemExit as e:
        assert e.code == 0


def unknown_tag_warns_once():
    """pause/resume of a tag no region or allocation of this process used warns once per
    tag, naming the tags that exist, the closest first; known tags never warn."""
    import warnings

    with tms.region("weights"):
        p = tms.malloc(2 * MiB)
    with tms.region("kv_cache"):
        tms.free(tms.malloc(2 * MiB))                  # freed: the tag was still used
    with raw_region("set_through_the_core"):           # as the C ABI sets a tag
        q = core().malloc(2 * MiB)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert tms.pause("wieghts").devices == {}      # still a no-op
        tms.pause("wieghts")
        tms.resume(["wieghts", "kv_cach"])
        tms.pause("weights")
        tms.pause("set_through_the_core")
        tms.resume("kv_cache")                         # no allocation now, but used
        tms.resume(None)
        tms.pause(None)
        tms.resume(None)
    for w in caught:
        assert w.category is RuntimeWarning and w.filename == __file__, (w.category, w.filename)
        print(w.message)
    tms.free(p)
    core().free(q)


def _enter(cm):
    with cm:
        pass


def nested_region_with_another_policy():
    """Re-entering a tag inside a region of that tag with other backup settings raises
    naming the tag and both settings, and changes nothing; the same settings nest."""
    with tms.region("w", enable_cpu_backup=True):
        with tms.region("w", enable_cpu_backup=True):     # the same settings: fine
            pass
        with tms.region("other"):
            print(expect(ValueError, _enter, tms.region("w")))
            assert core().get_region() == (True, "other", False, "mmap", False, None, None), core().get_region()
        print(expect(ValueError, _enter, tms.region("w", enable_cpu_backup=True, cpu_backup_backend="pinned")))
        print(expect(ValueError, _enter, tms.region("w", enable_disk_backup=True)))
        p = tms.malloc(2 * MiB)
    assert (row(p)["cpu_backup"], row(p)["cpu_backup_backend"]) == (True, "mmap"), row(p)
    assert core().get_region()[0] is False
    tms.free(p)


def memory_report_in_a_fresh_process():
    """memory_report() before any allocation: the current device, as the driver counts it."""
    r = tms.memory_report()
    assert list(r) == [0], r
    assert (r[0]["total"], r[0]["ours_active"], r[0]["ours_paused"]) == (16 << 30, 0, 0), r
    print("done")


def report_repr():
    """A Report shows its devices as the dict .devices is."""
    with tms.region("w", enable_cpu_backup=True):
        tms.malloc(2 * MiB)
    r = tms.pause("w")
    assert isinstance(r.devices, dict) and list(r.devices) == [0], r.devices
    assert repr(r).endswith(f", devices={{0: {r.devices[0]!r}}})"), repr(r)
    print("done")


def huge_byte_count_in_gib():
    """The OutOfMemoryError's text for 64 GiB asked with a 15 GiB margin."""
    tms.memory_margin_bytes = 15 << 30
    with tms.region("w"):
        e = expect(torch_memory_saver.OutOfMemoryError, tms.malloc, 64 << 30)
    return str(e)


def one_call_into_the_core():
    """A pause or resume is one call into the core; the driver's free memory is asked
    for only where the report is asked for or the call is logged."""
    import torch_memory_saver._observe as observe

    native = core()
    calls = []
    for name in ("pause", "resume", "check_tags", "selects_backup", "mem_get_info", "stats", "allocations"):
        real = getattr(native, name)

        def counted(*a, _real=real, _name=name):
            calls.append(_name)
            return _real(*a)
        setattr(native, name, counted)
    with tms.region("w", enable_cpu_backup=True):
        w = tms.malloc(2 * MiB)
    data = fill(w, 2 * MiB)
    calls.clear()
    r = tms.pause("w")
    assert calls == ["pause"], calls
    assert r.devices[0].free_before is None and r.devices[0].free_after is None, r.devices[0]
    calls.clear()
    tms.resume("w")
    assert calls == ["resume"], calls
    assert read(w, 2 * MiB) == data
    r = tms.pause("w", measure_free=True)
    assert r.devices[0].free_after - r.devices[0].free_before == r.released_bytes == 2 * MiB, r.devices[0]
    back = tms.resume("w", measure_free=True)
    assert back.devices[0].free_before - back.devices[0].free_after == 2 * MiB, back.devices[0]
    observe.logger.setLevel("INFO")   # a logged call measures: its line can say what was freed
    r = tms.pause("w")
    assert r.devices[0].free_before is not None, r.devices[0]
    tms.resume("w")


def free_blocks_asked_only_for_a_backup():
    """The native pause asks for the caller's free blocks only if it backs something up,
    uses what it gets, and asks nothing when the tags are bad; a callable that raises
    leaves everything as it was. Returns the errors of the bad tags (type, text's start)."""
    import struct

    native = core()
    asked, refused = [], []

    def spans():
        asked.append(1)
        return None
    with tms.region("plain"):
        tms.malloc(2 * MiB)
    with tms.region("backed", enable_cpu_backup=True):
        b = tms.malloc(2 * MiB)
    data = fill(b, 2 * MiB)
    native.pause("plain", spans)
    assert asked == [], "asked for free blocks of a pause that backs nothing up"
    native.pause("backed", spans)
    assert asked == [1], asked
    native.resume(["plain", "backed"])
    assert read(b, 2 * MiB) == data
    # What the callable returns is used: the whole allocation skipped as free.
    r = native.pause("backed", lambda: struct.pack("=QQ", b, 2 * MiB))
    assert r["devices"][0]["skipped_bytes"] == 2 * MiB and r["devices"][0]["copied_bytes"] == 0, r
    native.resume("backed")
    # A bad tag is refused before the callable is asked, and nothing moves.
    for bad in ("", ["backed", "backed"]):
        e = expect(ValueError, native.pause, bad, spans)
        refused.append((type(e).__name__, str(e)[:40]))
    assert asked == [1] and states() == [("backed", "active"), ("plain", "active")], (asked, states())

    # An exception from the callable leaves everything as it was.
    def broken():
        raise RuntimeError("no snapshot")
    expect(RuntimeError, native.pause, "backed", broken, match="no snapshot")
    assert states() == [("backed", "active"), ("plain", "active")], states()
    return refused


def bad_argument_errors(calls):
    """[(call, "ExceptionType first line" or "no error")] for each call (a Python
    expression over tms, torch_memory_saver and t, a tensor over a paused allocation)."""
    import torch

    with tms.region("w", enable_cpu_backup=True):
        p = tms.malloc(MiB)
    t = torch.frombuffer((ctypes.c_char * MiB).from_address(p), dtype=torch.uint8)
    tms.pause("w")
    said = []
    for call in calls:
        try:
            eval(call, {"tms": tms, "torch_memory_saver": torch_memory_saver, "t": t})
            said.append((call, "no error"))
        except (TypeError, ValueError, AttributeError) as e:
            said.append((call, f"{type(e).__name__} {str(e).splitlines()[0]}"))
    return said


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
