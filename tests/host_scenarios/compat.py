# Tests the native module too: get_region (one thread state with the C ABI), preload_active, get_cpu_backup.
"""Drop-in compatibility with the upstream library (tests/test_compat.py): the call
shapes of slime and AReaL against the package as `pip install .` lays it out (the
test runs those with the installed package on PYTHONPATH), the C ABI through the
binary wrapper and the private paths frameworks reach into (tms._impl, _ensure_initialized),
and what we add: lists of tags, state queries."""
import ctypes
import os
import sys

import torch_memory_saver
from _prelude import MiB, core, expect, fill, read, row, run_cases, start, states, tms


def slime_disk_offload():
    """slime's --offload-train-target disk: TMS_INIT_ENABLE=1, disk backup from the
    environment, untagged pause/resume; one file, no CPU backup."""
    tms._ensure_initialized()
    native = core()
    cdll = tms._impl._binary_wrapper.cdll
    assert cdll.tms_get_enable_disk_backup() is True and cdll.tms_get_enable_cpu_backup() is False
    n = 5 * MiB + 3
    p = tms.malloc(n)
    data = fill(p, n)
    tms.pause()
    d = os.environ["TMS_DISK_BACKUP_DIR"]
    assert len([f for f in os.listdir(d) if f.endswith(".bin")]) == 1
    assert tms.get_cpu_backup.__self__ is tms and native.get_cpu_backup(p, n) is None
    tms.resume()
    assert read(p, n) == data
    print("done")


def slime_preload_path():
    """slime: the _cu12 preload name on LD_PRELOAD, TMS_INIT_ENABLE(_CPU_BACKUP)=1, the cdll
    toggle around an allocation, get_cpu_backup(zero_copy=True): one core."""
    import torch

    assert torch_memory_saver.__file__.startswith(os.environ["PYTHONPATH"]), torch_memory_saver.__file__
    dynlib = os.path.join(os.path.dirname(os.path.dirname(torch_memory_saver.__file__)),
                          "torch_memory_saver_hook_mode_preload_cu12.abi3.so")
    assert os.environ["LD_PRELOAD"] == dynlib, (os.environ["LD_PRELOAD"], dynlib)
    tms._ensure_initialized()
    native = core()
    assert native.preload_active()[0] is True          # our cudaMalloc is the process's
    assert tms._impl._hook_mode == "preload"
    cdll = tms._impl._binary_wrapper.cdll
    assert cdll.tms_get_interesting_region() is True   # TMS_INIT_ENABLE=1 reached this thread
    assert cdll.tms_get_enable_cpu_backup() is True
    n = 3 * MiB + 5
    p = tms.malloc(n)                                  # allocated "outside any region": the default tag
    data = fill(p, n)
    cdll.tms_set_interesting_region(False)             # slime's toggle (deep_ep buffer init)
    assert native.get_region()[0] is False             # the same thread state as the module's
    expect(ValueError, tms.malloc, MiB, match="outside a region")
    cdll.tms_set_interesting_region(True)
    assert native.get_region() == (True, "default", True, "mmap", False, None, None)
    tms.pause()
    assert tms.allocations()[0]["state"] == "paused"
    t = torch.frombuffer((ctypes.c_uint8 * n).from_address(p), dtype=torch.uint8)
    alias = tms.get_cpu_backup(t, zero_copy=True)
    assert bytes(alias.numpy()) == data
    host = cdll.tms_get_cpu_backup_pointer(ctypes.cast(p, ctypes.POINTER(ctypes.c_uint8)), n)
    assert ctypes.string_at(host, n) == data
    assert cdll.tms_pause(None) != 0 and b"already paused" in cdll.tms_get_last_error()
    tms.resume()
    assert read(p, n) == data
    print("done")


def areal_cdll_none():
    """AReaL: the ABI resolved in the process's global scope (ctypes.CDLL(None)), then
    hook_mode "preload", pause()/resume(); prints the name of the library in use."""
    g = ctypes.CDLL(None)
    g.tms_get_current_tag.restype = ctypes.c_char_p
    assert g.tms_get_interesting_region() == 1
    assert g.tms_set_current_tag(b"actor") == 0 and g.tms_get_current_tag() == b"actor"
    tms.hook_mode = "preload"
    native = core()
    assert native.get_region()[1] == "actor"           # set through the ABI, seen by the module
    p = tms.malloc(2 * MiB)
    fill(p, 2 * MiB)
    tms.pause()
    assert tms.paused_tags() == ["actor"]
    tms.resume()
    assert tms.paused_tags() == []
    print(os.path.basename(native.library_path()).split(".")[0])


def configure_subprocess_upstream_names():
    """configure_subprocess replaces upstream's preload names on LD_PRELOAD by our library."""
    from torch_memory_saver import _library

    root = os.path.dirname(os.path.dirname(torch_memory_saver.__file__))
    ours = _library.path("preload")
    for name in ("torch_memory_saver_hook_mode_preload.abi3.so", "torch_memory_saver_hook_mode_preload_cu13.abi3.so"):
        os.environ["LD_PRELOAD"] = f"/nonexistent/libx.so:{root}/{name}"
        with torch_memory_saver.configure_subprocess():
            assert os.environ["LD_PRELOAD"].split() == [ours, "/nonexistent/libx.so"], os.environ["LD_PRELOAD"]
    print("done")


def binary_path_from_package():
    """utils.get_binary_path_from_package finds upstream's names at the site root."""
    from torch_memory_saver.utils import get_binary_path_from_package

    for stem in ("torch_memory_saver_hook_mode_preload", "torch_memory_saver_hook_mode_torch",
                 "torch_memory_saver_hook_mode_preload_cu13"):
        path = get_binary_path_from_package(stem)
        assert path.is_file() and path.name == stem + ".abi3.so", path
        assert str(path.parent) == os.environ["PYTHONPATH"], path
    try:
        get_binary_path_from_package("torch_memory_saver_hook_mode_nope")
    except RuntimeError as e:
        assert "torch_memory_saver_hook_mode_nope.abi3.so" in str(e), e
    else:
        raise AssertionError("unknown stem accepted")
    print("done")


def abi_through_the_binary_wrapper(mode):
    """Upstream's C ABI through tms._impl._binary_wrapper.cdll, in hook mode `mode`."""
    tms.hook_mode = mode
    tms._ensure_initialized()
    native = core()
    cdll = tms._impl._binary_wrapper.cdll
    assert cdll._name == native.library_path()        # the library the module came from
    assert cdll.tms_get_interesting_region() is False
    assert cdll.tms_set_current_tag(b"w") == 0 and cdll.tms_get_current_tag() == b"w"
    assert cdll.tms_set_enable_cpu_backup(True) == 0 and cdll.tms_get_enable_cpu_backup() is True
    assert cdll.tms_set_cpu_backup_backend(b"pinned") == 0 and cdll.tms_get_cpu_backup_backend() == b"pinned"
    assert cdll.tms_set_interesting_region(True) == 0
    assert native.get_region() == (True, "w", True, "pinned", False, None, None)   # one thread state for module and ABI
    n = 5 * MiB + 3
    p = tms.malloc(n)
    assert tms.allocations()[0]["tag"] == "w"
    cdll.tms_set_interesting_region(False)
    data = fill(p, n)
    assert cdll.tms_pause(b"w") == 0 and row(p)["state"] == "paused"
    assert tms.is_paused("w")
    host = cdll.tms_get_cpu_backup_pointer(ctypes.cast(p, ctypes.POINTER(ctypes.c_uint8)), n)
    assert ctypes.string_at(host, n) == data
    assert cdll.tms_pause(b"w") == 5                   # TMS_STATUS_STATE
    assert b"tag 'w'" in cdll.tms_get_last_error() and b"already paused" in cdll.tms_get_last_error()
    assert cdll.tms_resume(b"") == 0 and read(p, n) == data   # "" = every tag, as upstream
    assert cdll.tms_resume(b"w") == 5
    assert not cdll.tms_get_cpu_backup_pointer(ctypes.cast(p, ctypes.POINTER(ctypes.c_uint8)), n)
    assert cdll.tms_set_cpu_backup_backend(b"disk") == 6 and b"'disk'" in cdll.tms_get_last_error()
    assert cdll.tms_set_current_tag(b"") == 6 and cdll.tms_get_current_tag() == b"w"
    assert cdll.tms_set_enable_disk_backup(True) == 0 and cdll.tms_get_enable_disk_backup() is True
    assert native.get_region()[4] is True              # the module sees the ABI's setting
    assert cdll.tms_set_enable_disk_backup(False) == 0 and cdll.tms_get_enable_disk_backup() is False
    assert cdll.set_memory_margin_bytes(12345) == 0 and tms.memory_margin_bytes == 12345
    assert cdll.tms_set_retain_cpu_backup(True) == 0 and tms.retain_cpu_backup is True
    tms.free(p)
    print("done")


def runtime_functions_through_cdll(fake_runtime):
    """cdll.cudaGetLastError and cdll.cudaHostGetFlags, as upstream's tests call them,
    resolve in the CUDA runtime loaded in the process (fake_runtime, a library named
    like it); with none loaded, an AttributeError says so."""
    tms._ensure_initialized()
    cdll = tms._impl._binary_wrapper.cdll
    e = expect(AttributeError, getattr, cdll, "cudaGetLastError", match="no CUDA or HIP runtime is loaded")
    assert "cudaGetLastError" in str(e)
    runtime = ctypes.CDLL(fake_runtime)                # RTLD_LOCAL, as torch loads it
    flags = ctypes.c_uint(0)
    fn = cdll.cudaHostGetFlags
    fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p], ctypes.c_int
    assert fn(ctypes.byref(flags), 0x1000) == 0 and flags.value == 0x1007
    assert cdll.cudaGetLastError() == 42
    assert ctypes.cast(cdll.cudaGetLastError, ctypes.c_void_p).value == \
        ctypes.cast(runtime.cudaGetLastError, ctypes.c_void_p).value
    expect(AttributeError, getattr, cdll, "cudaNoSuchFunction", match="nor of the loaded runtime")
    assert cdll.tms_get_interesting_region() is False   # the library's own functions first
    print("done")


def default(key):
    """Prints defaults()[key], as the environment set it."""
    print(core().defaults()[key])


def lists_of_tags():
    """pause/resume of a list of tags is all-or-nothing; paused_tags() and is_paused()."""
    start()
    ptrs = {}
    for tag in ("a", "b", "c"):
        with tms.region(tag, enable_cpu_backup=True):
            ptrs[tag] = tms.malloc(2 * MiB)
    data = {t: fill(p, 2 * MiB) for t, p in ptrs.items()}
    assert tms.paused_tags() == [] and not tms.is_paused("a") and not tms.is_paused("never-used")
    tms.pause(["a", "b"])
    assert states() == [("a", "paused"), ("b", "paused"), ("c", "active")]
    assert tms.is_paused("a") and tms.is_paused("b") and not tms.is_paused("c")
    assert tms.paused_tags() == ["a", "b"]
    # A state error in a list changes nothing: 'c' is not paused because 'b' already is.
    e = expect(torch_memory_saver.Error, tms.pause, ["c", "b"], match="pause of tag 'b'")
    assert "no tag of the list was paused" in str(e)
    assert states() == [("a", "paused"), ("b", "paused"), ("c", "active")]
    expect(torch_memory_saver.Error, tms.resume, ("a", "c"), match="resume of tag 'c'")
    assert states() == [("a", "paused"), ("b", "paused"), ("c", "active")]
    expect(ValueError, tms.pause, ["c", "c"], match="'c' is listed twice")
    expect(ValueError, tms.pause, ["c", ""], match="non-empty")
    tms.pause([])                                      # nothing to do
    tms.resume(("b", "a"))
    assert [read(p, 2 * MiB) == data[t] for t, p in ptrs.items()] == [True] * 3
    assert tms.paused_tags() == []
    # Memory allocated into a paused tag: the tag is no longer "paused" as a whole.
    tms.pause("c")
    with tms.region("c"):
        tms.malloc(MiB)
    assert not tms.is_paused("c") and tms.paused_tags() == []
    tms.resume("c")
    tms.pause("c")
    assert tms.is_paused("c")
    print("done")


def foreign_tensor_backup():
    """get_cpu_backup of a tensor outside every allocation is None (as upstream)."""
    import torch

    start()
    with tms.region("w", enable_cpu_backup=True):
        tms.malloc(MiB)
    tms.pause("w")
    foreign = torch.arange(1000, dtype=torch.float32)
    assert tms.get_cpu_backup(foreign) is None
    assert tms.get_cpu_backup(foreign, zero_copy=True) is None
    print("done")


def upstream_region_signature():
    """region()'s parameters in upstream's order; the private names frameworks use."""
    import inspect

    params = list(inspect.signature(tms.region).parameters)
    assert params == ["tag", "enable_cpu_backup", "enable_disk_backup", "cpu_backup_backend",  # upstream's, in order
                      "skip_unchanged", "restore"], params                                             # then ours
    with tms.region("w", True, False):                 # upstream's positional order
        assert core().get_region() == (True, "w", True, "mmap", False, None, None)
    with tms.region("w", False, True):                 # enable_disk_backup, third as upstream
        assert core().get_region() == (True, "w", False, "mmap", True, None, None)
    e = expect(ValueError, tms.region("w", True, True).__enter__)
    assert "mutually exclusive" in str(e)
    assert "cpu_backup_backend" in inspect.signature(tms.cuda_graph).parameters
    assert tms._ensure_initialized() is tms._impl and tms._impl._hook_mode == "preload"
    print("done")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
