"""The Python package on the hip backend (issue 6), against tests/c/hip_stub.c: a
stand-in libamdhip64 over host memory that checks its arguments as HIP does.

No AMD GPU is needed: the stub is compiled here with `cc -shared -fPIC`, and each
scenario runs in a fresh subprocess with TMS_BACKEND=hip and TMS_HIP_LIBRARY=<stub>
(conftest's run_py; its helpers: tms, core, fill/read through ctypes, row, expect).
The stub is compiled behind the prototypes of src/platform/driver_hip.c's HIP_ENTRIES, so a
signature of the stub that drifts from what the backend calls fails to compile.
"""
import ctypes
import os
import re
import shlex
import shutil
import subprocess
import textwrap

import pytest

from conftest import HOOK_MODES, REPO, check_ok, library_file

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


# Helpers every child gets besides conftest's: the stub's own view of device
# memory (the library handle the backend dlopen'ed), so a pause is seen to give
# memory back to the "GPU"; marks of a few bytes, so big ranges stay untouched.
STUB_HELPERS = """
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
"""


@pytest.fixture
def run_hip(run_py, hip_stub):
    """run_py on the hip backend with the stub; env entries add to (None removes from) the stub's."""
    def run(code, env=None, **kw):
        return run_py(STUB_HELPERS + textwrap.dedent(code), backend="hip",
                      env={"TMS_HIP_LIBRARY": hip_stub, **(env or {})}, **kw)
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
    out = check_ok(run_hip(f"""
        tms.hook_mode = "{mode}"
        core = tms._core
        assert core.backend() == "hip" and core.loaded_backend() == "hip"
        total = device_free()
        sizes = [1, 4095, 2 * MiB - 1, 2 * MiB + 1, 5 * MiB + 12345, 17 * MiB + 3]   # the last spans copy blocks
        reserved = sum(-(-n // (2 * MiB)) * 2 * MiB for n in sizes)
        ptrs = {{}}
        with tms.region("discard"):
            ptrs["discard"] = [core.malloc(n) for n in sizes]
        with tms.region("pinned", enable_cpu_backup=True, cpu_backup_backend="pinned"):
            ptrs["pinned"] = [core.malloc(n) for n in sizes]
        with tms.region("mmap", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            ptrs["mmap"] = [core.malloc(n) for n in sizes]
        assert device_free() == total - 3 * reserved
        for tag, ps in ptrs.items():
            for p, n in zip(ps, sizes):
                r = row(p)
                assert p % (2 * MiB) == 0 and r["size"] == n and r["device"] == 0 and r["chunks"] == 1, r
                assert (r["tag"], r["state"], r["cpu_backup"]) == (tag, "active", tag != "discard"), r
        data = {{tag: [fill(p, n) for p, n in zip(ps, sizes)] for tag, ps in ptrs.items()}}

        tms.pause("pinned")
        assert device_free() == total - 2 * reserved                 # the stub got the memory back
        assert [bytes(core.get_cpu_backup(p, n)) for p, n in zip(ptrs["pinned"], sizes)] == data["pinned"]
        assert [read(p, n) for p, n in zip(ptrs["mmap"], sizes)] == data["mmap"]   # other tags untouched
        expect(core.Error, tms.pause, "pinned", match="'pinned'")
        tms.pause()                                                  # the rest
        assert device_free() == total
        assert sorted({{r["state"] for r in core.allocations()}}) == ["paused"]
        assert [bytes(core.get_cpu_backup(p, n)) for p, n in zip(ptrs["mmap"], sizes)] == data["mmap"]
        assert core.get_cpu_backup(ptrs["discard"][0], 1) is None
        tms.resume("mmap")
        tms.resume()
        assert device_free() == total - 3 * reserved
        for tag in ("pinned", "mmap"):                               # same addresses, same bytes
            assert [read(p, n) for p, n in zip(ptrs[tag], sizes)] == data[tag], tag
        for p, n in zip(ptrs["discard"], sizes):                     # mapped and writable to the last byte
            d = fill(p, n)
            assert read(p, n) == d
        expect(core.Error, tms.resume, "mmap", match="'mmap'")

        tms.pause("mmap")
        core.free(ptrs["mmap"][0])                                   # freeing a paused allocation
        for ps in ptrs.values():
            for p in ps:
                if p != ptrs["mmap"][0]:
                    core.free(p)
        assert core.allocations() == [] and device_free() == total
        print("done")
    """, load_core=False))
    assert out == "done\n"


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
    out = check_ok(run_hip(f"""
        def chunk_ends(size):
            reserved = -(-size // (2 * MiB)) * 2 * MiB
            step = {chunk_mib} * MiB or reserved
            return list(range(step, reserved, step)) + [reserved]
        N, M = 600 * MiB - 3, 259 * MiB + 7
        total = device_free()
        with tms.region("big"):
            p = core.malloc(N)
        with tms.region("big-bk", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            q = core.malloc(M)
        assert row(p)["chunks"] == len(chunk_ends(N)) == {{0: 1, 256: 3, 64: 10}}[{chunk_mib}], row(p)
        assert row(q)["chunks"] == len(chunk_ends(M)) == {{0: 1, 256: 2, 64: 5}}[{chunk_mib}], row(q)
        assert device_free() == total - (600 + 260) * MiB
        at_p = sorted({{0, N - 1}} | {{e + d for e in chunk_ends(N)[:-1] for d in (-1, 0)}})
        at_q = sorted({{0, M - 1}} | {{e + d for e in chunk_ends(M)[:-1] for d in (-1, 0)}})
        mark(p, at_p, 1)
        mark(q, at_q, 2)
        tms.pause("big")
        tms.pause("big-bk")
        assert device_free() == total
        backup = core.get_cpu_backup(q, M)
        assert all(backup[off] == (off * 131 + 2) & 0xFF for off in at_q)
        del backup
        tms.resume()
        assert device_free() == total - (600 + 260) * MiB
        assert marked(q, at_q, 2)               # restored across every chunk boundary
        mark(p, at_p, 3)                        # every chunk of the discarded one is mapped again
        assert marked(p, at_p, 3)
        core.free(p)
        core.free(q)
        assert device_free() == total
        print("done")
    """, env={"HIP_STUB_VERSION": version, "TMS_CHUNK_BYTES": chunk_env, "HIP_STUB_DEVICE_BYTES": 2 << 30}))
    assert out == "done\n"


def test_preload_library_exports_hip_hooks(built_libs):
    lib = ctypes.CDLL(str(built_libs["preload"]))
    assert hasattr(lib, "hipMalloc") and hasattr(lib, "hipFree")
    assert hasattr(lib, "cudaMalloc") and hasattr(lib, "cudaFree")


def test_hipmalloc_hook_routes_regions_to_the_core(run_hip):
    """hipMalloc/hipFree of _tms_preload, called as a ROCm PyTorch would, on the stub."""
    out = check_ok(run_hip("""
        assert core.VARIANT == "preload" and core.backend() == "hip"
        lib = ctypes.CDLL(core.library_path())
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
        assert core.allocations() == [] and device_free() == total
        # Outside a region the hook forwards; with no HIP runtime next in line
        # it answers hipErrorNotInitialized (3) rather than crashing.
        other = ctypes.c_void_p()
        assert lib.hipMalloc(ctypes.byref(other), 4096) == 3
        assert lib.hipFree(12345) == 3
        print("done")
    """))
    assert out == "done\n"


@pytest.mark.parametrize("how", ["TMS_BACKEND", "TMS_PLATFORM", "use_backend"])
def test_the_hip_backend_is_selected(run_hip, how):
    env = {"TMS_BACKEND": None, "TMS_PLATFORM": "rocm"} if how == "TMS_PLATFORM" else \
        {"TMS_BACKEND": None} if how == "use_backend" else {}
    select = "tms._core.use_backend('hip')" if how == "use_backend" else "pass"
    out = check_ok(run_hip(f"""
        {select}
        core = tms._core
        assert core.backend() == "hip", core.backend()
        with tms.region("x"):
            p = core.malloc(1000)
        assert row(p)["device"] == 0 and row(p)["chunks"] == 1
        core.free(p)
        print("done")
    """, env=env, load_core=False))
    assert out == "done\n"


def test_missing_hip_runtime_names_libamdhip64(run_hip, tmp_path):
    missing = tmp_path / "no-such-libamdhip64.so"
    out = check_ok(run_hip(f"""
        e = expect(core.Error, core.backend)
        assert "libamdhip64" in str(e) and {str(missing)!r} in str(e), str(e)
        expect(core.Error, tms.region("x").__enter__, match="libamdhip64")   # the first GPU use says why
        print("done")
    """, env={"TMS_HIP_LIBRARY": missing}))
    assert out == "done\n"


def test_no_hip_library_at_all_names_libamdhip64(run_hip):
    try:
        ctypes.CDLL("libamdhip64.so")
        pytest.skip("a HIP runtime is installed here")
    except OSError:
        pass
    out = check_ok(run_hip("""
        e = expect(core.Error, core.backend)
        assert "libamdhip64" in str(e) and "HIP runtime not found" in str(e), str(e)
        print("done")
    """, env={"TMS_HIP_LIBRARY": None}))
    assert out == "done\n"


def test_no_device_and_out_of_memory_are_clear_errors(run_hip):
    out = check_ok(run_hip("""
        e = expect(core.Error, core.backend)
        assert "no usable GPU" in str(e) and "hipGetDeviceCount" in str(e), str(e)
        print("done")
    """, env={"HIP_STUB_DEVICES": 0}))
    assert out == "done\n"
    out = check_ok(run_hip("""
        with tms.region("oom"):
            e = expect(MemoryError, core.malloc, 65 * MiB)
            assert isinstance(e, core.Error) and "hipErrorOutOfMemory" in str(e), str(e)
            p = core.malloc(64 * MiB)                    # recoverable: the device still allocates
        core.free(p)
        print("done")
    """, env={"HIP_STUB_DEVICE_BYTES": 64 << 20}))
    assert out == "done\n"
