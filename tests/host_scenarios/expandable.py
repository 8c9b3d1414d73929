# Tests the native module: preload_method, install_relocation_hooks, set_region.
"""PyTorch's expandable segments in preload mode (tests/test_expandable.py): the
runtime's driver entry-point lookups are answered with the library's cuMem* wrappers
for libc10_cuda only. A stub runtime and two small libraries the test builds into a
directory (one named libc10_cuda.so) stand in for CUDA and PyTorch: every case takes
that directory first."""
import ctypes
import os
import sys

from _prelude import MiB, core, run_cases, start, tms

Create = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t, ctypes.c_void_p,
                          ctypes.c_ulonglong)
Release = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong)
prop = (ctypes.c_int * 8)(1, 1, 1, 0)  # pinned, POSIX fd, on device 0


def begin(d):
    """hook_mode "preload", the core started, the stub runtime and both libraries loaded:
    (stub, libc10_cuda, libother)."""
    tms.hook_mode = "preload"
    start()
    stub = ctypes.CDLL(os.path.join(d, "libcudart_stub.so"))
    stub.stub_function.restype = ctypes.c_void_p
    stub.stub_function.argtypes = [ctypes.c_char_p]

    def load(name):
        lib = ctypes.CDLL(os.path.join(d, name))
        lib.user_lookup.restype = ctypes.c_void_p
        lib.user_lookup.argtypes = [ctypes.c_char_p, ctypes.c_int]
        return lib

    return stub, load("libc10_cuda.so"), load("libother.so")


def is_token(h):
    return h >> 48 == 0x7E5A


def check_wrapped(stub, c10, other, by_version):
    for name in (b"cuMemCreate", b"cuMemRelease", b"cuMemMap", b"cuMemSetAccess", b"cuMemUnmap"):
        real = stub.stub_function(name)
        assert other.user_lookup(name, by_version) == real, name        # other libraries: untouched
        wrapped = c10.user_lookup(name, by_version)
        assert wrapped and wrapped != real, name                         # PyTorch's: the wrapper
    real = stub.stub_function(b"cuMemAddressReserve")
    assert c10.user_lookup(b"cuMemAddressReserve", by_version) == real  # not one the library wraps
    create = Create(c10.user_lookup(b"cuMemCreate", by_version))
    release = Release(c10.user_lookup(b"cuMemRelease", by_version))
    h = ctypes.c_ulonglong()
    n = stub.stub_creates()
    assert create(ctypes.byref(h), 2 * MiB, prop, 0) == 0 and not is_token(h.value)  # outside a region
    assert release(h.value) == 0
    core().set_region(True, "exp", False, "mmap")
    try:
        assert create(ctypes.byref(h), 2 * MiB, prop, 0) == 0
    finally:
        core().set_region(False, "default", False, "mmap")
    assert is_token(h.value) and stub.stub_creates() == n + 2, hex(h.value)
    released = stub.stub_releases()
    assert release(h.value) == 0 and stub.stub_releases() == released + 1  # reaches the runtime translated
    assert release(h.value) == 1                                             # twice: CUDA_ERROR_INVALID_VALUE
    assert stub.stub_releases() == released + 1 and stub.stub_bad_handles() == 0


def under_ld_preload(d):
    stub, c10, other = begin(d)
    assert core().preload_method() == "ld_preload"
    check_wrapped(stub, c10, other, by_version=1)
    check_wrapped(stub, c10, other, by_version=0)
    print("done")


def after_relocation_install(d):
    stub, c10, other = begin(d)
    real = stub.stub_function(b"cuMemCreate")
    assert c10.user_lookup(b"cuMemCreate", 1) == real   # before: the runtime's own answer
    core().install_relocation_hooks()
    assert core().preload_method() == "relocation"
    check_wrapped(stub, c10, other, by_version=1)
    check_wrapped(stub, c10, other, by_version=0)
    print("done")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
