"""The Python package on the hip backend, against tests/c/hip_stub.c: a
stand-in libamdhip64 over host memory that checks its arguments as HIP does.

No AMD GPU is needed: the stub is compiled here with `cc -shared -fPIC`, and each
scenario runs in a fresh subprocess with TMS_BACKEND=hip and TMS_HIP_LIBRARY=<stub>
(the programs are tests/host_scenarios/hip.py).
The stub is compiled behind the prototypes of src/platform/driver_hip.c's HIP_ENTRIES, so a
signature of the stub that drifts from what the backend calls fails to compile.
"""
import ctypes
import os
import re
import shlex
import shutil
import subprocess

import pytest

from conftest import HOOK_MODES, REPO
from host_scenarios import hip

STUB_SOURCE = REPO / "tests" / "c" / "hip_stub.c"
DRIVER_HIP = REPO / "src" / "platform" / "driver_hip.c"
ROCM6, ROCM7 = 60342131, 70051831  # hipRuntimeGetVersion of ROCm 6.3 and 7.0


def hip_entries():
    """(the HIP_ENTRIES macro of driver_hip.c, the names in it)."""
    m = re.search(r"^#define HIP_ENTRIES\(X\).*?[^\\]\n", DRIVER_HIP.read_text(), re.M | re.S)
    assert m, f"no HIP_ENTRIES macro in {DRIVER_HIP}"
    return m.group(0), re.findall(r"\bX\((hip\w+),", m.group(0))


def hip_names_looked_up():
    """Every HIP function driver_hip.c resolves: HIP_ENTRIES, and the optional
    ones it names in string literals (hipGetErrorName, ...)."""
    _, names = hip_entries()
    literals = re.findall(r'"(hip[A-Z]\w+)"', DRIVER_HIP.read_text())
    return sorted(set(names) | {n for n in literals if not n.startswith("hipError")})


# The real HIP prototypes of the optional entries (hip_runtime_api.h), declared
# before the stub's definitions: a stub signature that differs fails to compile.
OPTIONAL_PROTOTYPES = {
    "hipGetErrorName": "const char *hipGetErrorName(tms_hipError_t code);",
    "hipHostRegister": "tms_hipError_t hipHostRegister(void *p, size_t size, unsigned flags);",
    "hipHostUnregister": "tms_hipError_t hipHostUnregister(void *p);",
    "hipDevicePrimaryCtxGetState": "tms_hipError_t hipDevicePrimaryCtxGetState(int dev, unsigned *flags, int *active);",
}


@pytest.fixture(scope="session")
def hip_stub(tmp_path_factory):
    cc = shlex.split(os.environ.get("CC", "")) or ["cc"]
    if not shutil.which(cc[0]):
        pytest.skip("no C compiler (cc, or $CC)")
    tmp = tmp_path_factory.mktemp("hip_stub")
    macro, _ = hip_entries()
    checked = tmp / "hip_stub_checked.c"
    checked.write_text(
        "#define _GNU_SOURCE\n"
        f'#include "{REPO / "src" / "platform" / "hip_abi.h"}"\n'
        f"{macro}\n"
        "#define DECLARE(name, params) tms_hipError_t name params;\n"
        "HIP_ENTRIES(DECLARE)\n"
        + "".join(line + "\n" for line in OPTIONAL_PROTOTYPES.values()) +
        f'#include "{STUB_SOURCE}"\n'
    )
    out = tmp / "libamdhip64_stub.so"
    proc = subprocess.run([*cc, "-std=c11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                           "-o", str(out), str(checked), "-lpthread"], capture_output=True, text=True)
    assert proc.returncode == 0, f"the stub does not compile against driver_hip.c's HIP_ENTRIES:\n{proc.stderr}"
    return out


@pytest.fixture
def run_hip(in_child, hip_stub):
    """run_hip(case, *args, env=None) runs case (a function of tests/host_scenarios/hip.py) on
    the hip backend with the stub, its arguments as the command line gives them (text); env
    entries add to (None removes from) the stub's."""
    def run(case, *args, env=None):
        __tracebackhide__ = True
        return in_child(case, *map(str, args), backend="hip", env={"TMS_HIP_LIBRARY": hip_stub, **(env or {})})
    return run


def test_stub_exports_every_entry_driver_hip_resolves(hip_stub):
    _, required = hip_entries()
    assert len(required) >= 19 and "hipMemCreate" in required and "hipMemSetAccess" in required, required
    names = hip_names_looked_up()
    assert "hipGetErrorName" in names, names
    lib = ctypes.CDLL(str(hip_stub))
    assert [n for n in names if not hasattr(lib, n)] == []
    # Every optional entry is compiled against its real prototype (hip_stub fixture).
    assert sorted(set(names) - set(required)) == sorted(OPTIONAL_PROTOTYPES)


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_python_path_on_the_hip_backend(run_hip, mode):
    run_hip(hip.python_path, mode)


@pytest.mark.parametrize("version,chunk_env,chunk_mib", [
    (ROCM6, None, 256),    # ROCm 6.x: 256 MiB chunks by default
    (ROCM7, None, 0),      # ROCm 7: one handle per allocation
    (ROCM7, "64MiB", 64),  # TMS_CHUNK_BYTES wins over the version...
    (ROCM6, "0", 0),       # ... and turns chunking off
], ids=["rocm6-default", "rocm7-default", "rocm7-forced-64MiB", "rocm6-off"])
def test_default_chunking_follows_the_rocm_version(run_hip, version, chunk_env, chunk_mib):
    """600 MiB (256 + 256 + a partial 88 on ROCm 6) reserved, a few bytes
    touched: the stub's memfd pages cost nothing until written. A 259 MiB one
    with an mmap backup crosses a chunk boundary with a partial last chunk."""
    run_hip(hip.chunking, chunk_mib, env={"HIP_STUB_VERSION": version, "TMS_CHUNK_BYTES": chunk_env,
                                          "HIP_STUB_DEVICE_BYTES": 2 << 30})


def test_preload_library_exports_hip_hooks(built_libs):
    lib = ctypes.CDLL(str(built_libs["preload"]))
    assert hasattr(lib, "hipMalloc") and hasattr(lib, "hipFree")
    assert hasattr(lib, "cudaMalloc") and hasattr(lib, "cudaFree")


def test_hipmalloc_hook_routes_regions_to_the_core(run_hip):
    """hipMalloc/hipFree of _tms_preload, called as a ROCm PyTorch would, on the stub."""
    run_hip(hip.hipmalloc_hook)


@pytest.mark.parametrize("how", ["TMS_BACKEND", "TMS_PLATFORM", "use_backend"])
def test_the_hip_backend_is_selected(run_hip, how):
    env = {"TMS_BACKEND": None, "TMS_PLATFORM": "rocm"} if how == "TMS_PLATFORM" else \
        {"TMS_BACKEND": None} if how == "use_backend" else {}
    run_hip(hip.selected, how, env=env)


def test_missing_hip_runtime_names_libamdhip64(run_hip, tmp_path):
    missing = tmp_path / "no-such-libamdhip64.so"
    run_hip(hip.missing_runtime, missing, env={"TMS_HIP_LIBRARY": missing})


def test_no_hip_library_at_all_names_libamdhip64(run_hip):
    try:
        ctypes.CDLL("libamdhip64.so")
        pytest.skip("a HIP runtime is installed here")
    except OSError:
        pass
    run_hip(hip.no_runtime, env={"TMS_HIP_LIBRARY": None})


def test_no_device_and_out_of_memory_are_clear_errors(run_hip):
    run_hip(hip.no_device, env={"HIP_STUB_DEVICES": 0})
    run_hip(hip.out_of_memory, env={"HIP_STUB_DEVICE_BYTES": 64 << 20})
