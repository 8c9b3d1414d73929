"""PyTorch's expandable segments in preload mode (issue 15): the runtime's driver
entry-point lookups are answered with the library's cuMem* wrappers for PyTorch's
libc10_cuda only, with LD_PRELOAD and with relocation hooks; a handle created in a
region is a token whose release reaches the runtime as the handle it stands for.
A stub runtime and two small libraries built here (one named libc10_cuda.so) stand
in for CUDA and PyTorch. The translation itself is tests/c/test_cumem_host.c's."""
import subprocess

import pytest

from conftest import REPO, cc, check_ok

C = REPO / "tests" / "c"


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cumem")
    cc("-shared", "-fPIC", "-O2", "-o", d / "libcudart_stub.so", C / "cumem_runtime_stub.c")
    for name in ("libc10_cuda.so", "libother.so"):
        cc("-shared", "-fPIC", "-O2", "-Wl,-z,relro,-z,now", "-o", d / name, C / "cumem_user.c", f"-L{d}",
            "-lcudart_stub", f"-Wl,-rpath,{d}")
    return d


PRELUDE = """
D = sys.argv[1]
tms.hook_mode = "preload"
core = tms._core
stub = ctypes.CDLL(os.path.join(D, "libcudart_stub.so"))
stub.stub_function.restype = ctypes.c_void_p
stub.stub_function.argtypes = [ctypes.c_char_p]

def load(name):
    lib = ctypes.CDLL(os.path.join(D, name))
    lib.user_lookup.restype = ctypes.c_void_p
    lib.user_lookup.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return lib

c10, other = load("libc10_cuda.so"), load("libother.so")
Create = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_ulonglong), ctypes.c_size_t, ctypes.c_void_p,
                          ctypes.c_ulonglong)
Release = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_ulonglong)
prop = (ctypes.c_int * 8)(1, 1, 1, 0)  # pinned, POSIX fd, on device 0

def is_token(h):
    return h >> 48 == 0x7E5A

def check_wrapped(by_version):
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
    core.set_region(True, "exp", False, "mmap")
    try:
        assert create(ctypes.byref(h), 2 * MiB, prop, 0) == 0
    finally:
        core.set_region(False, "default", False, "mmap")
    assert is_token(h.value) and stub.stub_creates() == n + 2, hex(h.value)
    released = stub.stub_releases()
    assert release(h.value) == 0 and stub.stub_releases() == released + 1  # reaches the runtime translated
    assert release(h.value) == 1                                             # twice: CUDA_ERROR_INVALID_VALUE
    assert stub.stub_releases() == released + 1 and stub.stub_bad_handles() == 0
"""


def test_lookups_wrapped_for_pytorch_under_ld_preload(run_py, libs, built_libs):
    out = check_ok(run_py(PRELUDE + """
assert core.preload_method() == "ld_preload"
check_wrapped(by_version=1)
check_wrapped(by_version=0)
print("done")
""", load_core=False, args=(libs,), env={"LD_PRELOAD": built_libs["preload"]}))
    assert out == "done\n"


def test_lookups_wrapped_after_relocation_install(run_py, libs):
    out = check_ok(run_py(PRELUDE + """
real = stub.stub_function(b"cuMemCreate")
assert c10.user_lookup(b"cuMemCreate", 1) == real   # before: the runtime's own answer
core.install_relocation_hooks()
assert core.preload_method() == "relocation"
check_wrapped(by_version=1)
check_wrapped(by_version=0)
print("done")
""", load_core=False, args=(libs,)))
    assert out == "done\n"


def test_torch_mode_has_no_lookup_hooks(built_libs):
    # Torch mode serves regions through its MemPool's allocator: nothing to interpose.
    out = subprocess.run(["nm", "-D", "--defined-only", str(built_libs["torch"])], capture_output=True, text=True)
    assert "cudaGetDriverEntryPoint" not in out.stdout
