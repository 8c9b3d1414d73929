"""PyTorch's expandable segments in preload mode: the runtime's driver
entry-point lookups are answered with the library's cuMem* wrappers for PyTorch's
libc10_cuda only, with LD_PRELOAD and with relocation hooks; a handle created in a
region is a token whose release reaches the runtime as the handle it stands for.
A stub runtime and two small libraries built here (one named libc10_cuda.so) stand
in for CUDA and PyTorch (tests/host_scenarios/expandable.py). The translation itself is
tests/c/test_cumem_host.c's."""
import subprocess

import pytest

from conftest import REPO, cc
from host_scenarios import expandable

C = REPO / "tests" / "c"


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    d = tmp_path_factory.mktemp("cumem")
    cc("-shared", "-fPIC", "-O2", "-o", d / "libcudart_stub.so", C / "cumem_runtime_stub.c")
    for name in ("libc10_cuda.so", "libother.so"):
        cc("-shared", "-fPIC", "-O2", "-Wl,-z,relro,-z,now", "-o", d / name, C / "cumem_user.c", f"-L{d}",
            "-lcudart_stub", f"-Wl,-rpath,{d}")
    return d


def test_lookups_wrapped_for_pytorch_under_ld_preload(in_child, libs, built_libs):
    in_child(expandable.under_ld_preload, str(libs), env={"LD_PRELOAD": built_libs["preload"]})


def test_lookups_wrapped_after_relocation_install(in_child, libs):
    in_child(expandable.after_relocation_install, str(libs))


def test_torch_mode_has_no_lookup_hooks(built_libs):
    # Torch mode serves regions through its MemPool's allocator: nothing to interpose.
    out = subprocess.run(["nm", "-D", "--defined-only", str(built_libs["torch"])], capture_output=True, text=True)
    assert "cudaGetDriverEntryPoint" not in out.stdout
