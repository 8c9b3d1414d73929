# Tests the native module too: backend(), loaded_backend(), use_backend, library_path's hipMalloc, get_cpu_backup.
"""The HIP backend over a stub HIP runtime (tests/test_hip_stub.py; run with
TMS_BACKEND=hip and TMS_HIP_LIBRARY naming the stub): the Python path, chunking by
ROCm version, the hipMalloc hook, how the backend is chosen, and its errors.

device_free() is the stub's own view of device memory (the library the backend
dlopen'ed), so a pause is seen to give memory back to the "GPU"; mark/marked write
and check a few bytes, so big ranges stay untouched."""
import ctypes
import os
import sys

import torch_memory_saver
from _prelude import MiB, core, expect, fill, read, row, run_cases, start, tms


def device_free(device=0):
    hip = ctypes.CDLL(os.environ["TMS_HIP_LIBRARY"])
    free, total, current = ctypes.c_size_t(), ctypes.c_size_t(), ctypes.c_int()
    assert hip.hipGetDevice(ctypes.byref(current)) == 0
    assert hip.hipSetDevice(device) == 0
    assert hip.hipMemGetInfo(ctypes.byref(free), ctypes.byref(total)) == 0
    assert hip.hipSetDevice(current.value) == 0
    return free.value


def mark(ptr, offsets, salt):
    for off in offsets:
        ctypes.memset(ptr + off, (off * 131 + salt) & 0xFF, 1)


def marked(ptr, offsets, salt):
    return all(read(ptr + off, 1)[0] == (off * 131 + salt) & 0xFF for off in offsets)


def python_path(mode):
    """Allocations of every size with no, pinned and mmap backups: the stub gets the memory
    back on pause, the same addresses hold the same bytes after resume, free gives it all back."""
    tms.hook_mode = mode
    native = core()
    assert native.backend() == "hip" and native.loaded_backend() == "hip"
    total = device_free()
    sizes = [1, 4095, 2 * MiB - 1, 2 * MiB + 1, 5 * MiB + 12345, 17 * MiB + 3]   # the last spans copy blocks
    reserved = sum(-(-n // (2 * MiB)) * 2 * MiB for n in sizes)
    ptrs = {}
    with tms.region("discard"):
        ptrs["discard"] = [tms.malloc(n) for n in sizes]
    with tms.region("pinned", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        ptrs["pinned"] = [tms.malloc(n) for n in sizes]
    with tms.region("mmap", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        ptrs["mmap"] = [tms.malloc(n) for n in sizes]
    assert device_free() == total - 3 * reserved
    for tag, ps in ptrs.items():
        for p, n in zip(ps, sizes):
            r = row(p)
            assert p % (2 * MiB) == 0 and r["size"] == n and r["device"] == 0 and r["chunks"] == 1, r
            assert (r["tag"], r["state"], r["cpu_backup"]) == (tag, "active", tag != "discard"), r
    data = {tag: [fill(p, n) for p, n in zip(ps, sizes)] for tag, ps in ptrs.items()}

    tms.pause("pinned")
    assert device_free() == total - 2 * reserved                 # the stub got the memory back
    assert [bytes(native.get_cpu_backup(p, n)) for p, n in zip(ptrs["pinned"], sizes)] == data["pinned"]
    assert [read(p, n) for p, n in zip(ptrs["mmap"], sizes)] == data["mmap"]   # other tags untouched
    expect(torch_memory_saver.Error, tms.pause, "pinned", match="'pinned'")
    tms.pause()                                                  # the rest
    assert device_free() == total
    assert sorted({r["state"] for r in tms.allocations()}) == ["paused"]
    assert [bytes(native.get_cpu_backup(p, n)) for p, n in zip(ptrs["mmap"], sizes)] == data["mmap"]
    assert native.get_cpu_backup(ptrs["discard"][0], 1) is None
    tms.resume("mmap")
    tms.resume()
    assert device_free() == total - 3 * reserved
    for tag in ("pinned", "mmap"):                               # same addresses, same bytes
        assert [read(p, n) for p, n in zip(ptrs[tag], sizes)] == data[tag], tag
    for p, n in zip(ptrs["discard"], sizes):                     # mapped and writable to the last byte
        d = fill(p, n)
        assert read(p, n) == d
    expect(torch_memory_saver.Error, tms.resume, "mmap", match="'mmap'")

    tms.pause("mmap")
    tms.free(ptrs["mmap"][0])                                    # freeing a paused allocation
    for ps in ptrs.values():
        for p in ps:
            if p != ptrs["mmap"][0]:
                tms.free(p)
    assert tms.allocations() == [] and device_free() == total
    # The backend cannot fill device memory: memory a resume could never zero is refused where it is asked for.
    with tms.region("zeroed", restore="zero"):
        expect(NotImplementedError, tms.malloc, MiB, match="the hip backend cannot fill device memory")
    assert tms.allocations() == [] and device_free() == total
    print("done")


def chunking(chunk_mib):
    """600 MiB and 259 MiB (mmap backup) in chunks of chunk_mib (0: one handle): marks at
    every chunk boundary survive, every chunk is mapped again."""
    chunk_mib = int(chunk_mib)
    start()

    def chunk_ends(size):
        reserved = -(-size // (2 * MiB)) * 2 * MiB
        step = chunk_mib * MiB or reserved
        return list(range(step, reserved, step)) + [reserved]

    N, M = 600 * MiB - 3, 259 * MiB + 7
    total = device_free()
    with tms.region("big"):
        p = tms.malloc(N)
    with tms.region("big-bk", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        q = tms.malloc(M)
    assert row(p)["chunks"] == len(chunk_ends(N)) == {0: 1, 256: 3, 64: 10}[chunk_mib], row(p)
    assert row(q)["chunks"] == len(chunk_ends(M)) == {0: 1, 256: 2, 64: 5}[chunk_mib], row(q)
    assert device_free() == total - (600 + 260) * MiB
    at_p = sorted({0, N - 1} | {e + d for e in chunk_ends(N)[:-1] for d in (-1, 0)})
    at_q = sorted({0, M - 1} | {e + d for e in chunk_ends(M)[:-1] for d in (-1, 0)})
    mark(p, at_p, 1)
    mark(q, at_q, 2)
    tms.pause("big")
    tms.pause("big-bk")
    assert device_free() == total
    backup = core().get_cpu_backup(q, M)
    assert all(backup[off] == (off * 131 + 2) & 0xFF for off in at_q)
    del backup
    tms.resume()
    assert device_free() == total - (600 + 260) * MiB
    assert marked(q, at_q, 2)               # restored across every chunk boundary
    mark(p, at_p, 3)                        # every chunk of the discarded one is mapped again
    assert marked(p, at_p, 3)
    tms.free(p)
    tms.free(q)
    assert device_free() == total
    print("done")


def hipmalloc_hook():
    """hipMalloc/hipFree of _tms_preload, called as a ROCm PyTorch would, on the stub."""
    native = core()
    assert native.VARIANT == "preload" and native.backend() == "hip"
    lib = ctypes.CDLL(native.library_path())
    lib.hipMalloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    lib.hipFree.argtypes = [ctypes.c_void_p]
    total = device_free()
    ptr = ctypes.c_void_p()
    with tms.region("hooked", enable_cpu_backup=True):
        assert lib.hipMalloc(ctypes.byref(ptr), 3 * MiB + 5) == 0
    p = ptr.value
    assert row(p)["tag"] == "hooked" and row(p)["size"] == 3 * MiB + 5
    assert device_free() == total - 4 * MiB
    d = fill(p, 3 * MiB + 5)
    tms.pause("hooked")
    assert device_free() == total
    tms.resume("hooked")
    assert read(p, 3 * MiB + 5) == d
    assert lib.hipFree(p) == 0
    assert tms.allocations() == [] and device_free() == total
    # Outside a region the hook forwards; with no HIP runtime next in line
    # it answers hipErrorNotInitialized (3) rather than crashing.
    other = ctypes.c_void_p()
    assert lib.hipMalloc(ctypes.byref(other), 4096) == 3
    assert lib.hipFree(12345) == 3
    print("done")


def selected(how):
    """The hip backend is in use, chosen by `how` (use_backend: the native call, first)."""
    if how == "use_backend":
        core().use_backend("hip")
    native = core()
    assert native.backend() == "hip", native.backend()
    with tms.region("x"):
        p = tms.malloc(1000)
    assert row(p)["device"] == 0 and row(p)["chunks"] == 1
    tms.free(p)
    print("done")


def missing_runtime(path):
    """TMS_HIP_LIBRARY names a missing file (path): the error names it and libamdhip64."""
    native = core()
    e = expect(torch_memory_saver.Error, native.backend)
    assert "libamdhip64" in str(e) and path in str(e), str(e)
    expect(torch_memory_saver.Error, tms.region("x").__enter__, match="libamdhip64")   # the first GPU use says why
    print("done")


def no_runtime():
    native = core()
    e = expect(torch_memory_saver.Error, native.backend)
    assert "libamdhip64" in str(e) and "HIP runtime not found" in str(e), str(e)
    print("done")


def no_device():
    native = core()
    e = expect(torch_memory_saver.Error, native.backend)
    assert "no usable GPU" in str(e) and "hipGetDeviceCount" in str(e), str(e)
    print("done")


def out_of_memory():
    """On a 64 MiB device 65 MiB is a MemoryError (the library's) naming hipErrorOutOfMemory; 64 MiB works."""
    start()
    with tms.region("oom"):
        e = expect(MemoryError, tms.malloc, 65 * MiB)
        assert isinstance(e, torch_memory_saver.Error) and "hipErrorOutOfMemory" in str(e), str(e)
        p = tms.malloc(64 * MiB)                       # recoverable: the device still allocates
    tms.free(p)
    print("done")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
