"""The built libraries: dependencies, symbols, loading into non-Python processes, packaging."""
import os
import re
import shutil
import subprocess
import sys
import zipfile

import pytest

from conftest import HOOK_MODES, REPO, check_ok, libcuda_present, tree_build_lock
from torch_memory_saver._abi import SIGNATURES

FORBIDDEN_NEEDED = re.compile(r"lib(cuda|cudart|python)", re.IGNORECASE)
# The C ABI both variants export (include/torch_memory_saver.h).
ABI = set(SIGNATURES)
# The runtime's CUDA IPC calls routed for the shims (hooks/ipc.c); in the torch
# variant only relocation reaches its cudaIpc* definitions, which stay hidden.
IPC_ROUTERS = {"tms_ipc_get_mem_handle", "tms_ipc_open_mem_handle", "tms_ipc_close_mem_handle"}
EXPORTS = {
    "preload": {"cudaMalloc", "cudaFree", "PyInit__tms_preload", "tms_preload_malloc", "tms_preload_free",
                "cudaGetDriverEntryPoint", "cudaGetDriverEntryPointByVersion", "tms_preload_entry_point",
                "cudaIpcGetMemHandle", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle"} | ABI | IPC_ROUTERS,
    "torch": {"tms_torch_malloc", "tms_torch_free", "PyInit__tms_torch"} | ABI | IPC_ROUTERS,
}
# The preload library may also hook the HIP runtime's pair (ROCm builds of PyTorch).
OPTIONAL_EXPORTS = {"preload": {"hipMalloc", "hipFree"}, "torch": set()}


def _tool(name):
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} (binutils) is not installed")
    return path


def _run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, **kw)


def _needed(lib):
    out = check_ok(_run([_tool("readelf"), "-d", str(lib)]))
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def _nm(lib, *flags):
    """(type, name) of each dynamic symbol nm lists with these flags."""
    out = check_ok(_run([_tool("nm"), "-D", *flags, str(lib)]))
    rows = []
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            rows.append((parts[-2], parts[-1].split("@")[0]))
    return rows


def _preload_env(lib, **extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "LD_"))}
    env["LD_PRELOAD"] = str(lib)
    env.update(extra)
    return env


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_no_needed_entry_for_cuda_or_python(built_libs, mode):
    needed = _needed(built_libs[mode])
    assert any(n.startswith("libc.so") for n in needed), needed    # the parse found the entries
    assert not [n for n in needed if FORBIDDEN_NEEDED.search(n)], needed


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_python_symbols_are_all_weak(built_libs, mode):
    undefined = _nm(built_libs[mode], "--undefined-only")
    python = [(t, n) for t, n in undefined if n.startswith(("Py", "_Py"))]
    assert len(python) >= 10, undefined                   # module.c does use the C API
    strong = [n for t, n in python if t != "w"]
    assert strong == [], f"strong undefined Python symbols (break LD_PRELOAD into non-Python processes): {strong}"


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_exported_symbols_are_exactly_the_entry_points(built_libs, mode):
    names = {n for _, n in _nm(built_libs[mode], "--defined-only")}
    assert EXPORTS[mode] <= names, sorted(names)
    assert names - EXPORTS[mode] <= OPTIONAL_EXPORTS[mode], f"unexpected exports: {sorted(names - EXPORTS[mode])}"
    if names & OPTIONAL_EXPORTS[mode]:
        assert OPTIONAL_EXPORTS[mode] <= names, sorted(names)   # both of a pair or neither


def test_public_header_declares_exactly_the_abi():
    # The header, the ctypes signatures (_abi.py) and the exports (above) name the same functions.
    text = (REPO / "include" / "torch_memory_saver.h").read_text()
    declared = set(re.findall(r"^[a-z_0-9 ]+[ *]\*?(\w+)\((?:void|[^)]*)\);$", text, re.M))
    assert "tms_pause" in declared and "set_memory_margin_bytes" in declared, declared
    assert declared == ABI, (sorted(declared - ABI), sorted(ABI - declared))


@pytest.mark.parametrize("bind_now", [False, True], ids=["lazy", "LD_BIND_NOW"])
def test_preload_library_loads_into_a_non_python_process(built_libs, bind_now):
    extra = {"LD_BIND_NOW": "1"} if bind_now else {}
    env = _preload_env(built_libs["preload"], **extra)
    proc = _run(["/bin/true"], env=env)
    assert (proc.returncode, proc.stderr) == (0, "")
    proc = _run(["sh", "-c", "echo hi"], env=env)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, "hi\n", "")
    # A failed preload is not fatal to ld.so (a warning on stderr): make sure
    # the library really is mapped into the process.
    proc = _run(["sh", "-c", "cat /proc/$$/maps"], env=env)
    assert proc.returncode == 0 and os.path.basename(built_libs["preload"]) in proc.stdout, proc.stderr


_PROBE = r"""
#include <stdio.h>
#include <string.h>
#include <stddef.h>
#include <stdint.h>
int cudaMalloc(void **p, size_t n);
int cudaFree(void *p);
int main(void)
{
    void *p = NULL;
    int a = cudaMalloc(&p, 3 << 20);
    if (a == 0 && p) memset(p, 0x5a, 3 << 20);
    /* The stub's pointers come from malloc, which at this size returns an
     * address 16 bytes into an mmap; the core's are granule (2 MiB) aligned. */
    const char *who = !p ? "null" : ((uintptr_t)p % (2u << 20)) == 0 ? "core" : "stub";
    int b = p ? cudaFree(p) : -1;
    printf("%d %d %s\n", a, b, who);
    return 0;
}
"""


@pytest.mark.parametrize("env,expect", [
    ({}, "stub"),                                                   # forwarded to the runtime
    ({"TMS_INIT_ENABLE": "1"}, "error"),                            # core, cuda backend: no driver here
    ({"TMS_INIT_ENABLE": "maybe"}, "stub"),                         # malformed: safe default (forward)
    ({"TMS_INIT_ENABLE": "1", "TMS_BACKEND": "host"}, "core"),      # core on the host backend
], ids=["forward", "init-enable-cuda", "malformed-env", "init-enable-host"])
def test_hooks_work_in_a_non_python_program(built_libs, tmp_path, env, expect):
    # A C program linked against a stand-in CUDA runtime (tests/c/cudart_stub.c)
    # and started with the preload library on LD_PRELOAD: cudaMalloc/cudaFree
    # run without any libpython in the process and answer with a status code,
    # never a crash. The probe prints which side served the pointer.
    if expect == "error" and libcuda_present():
        pytest.skip("a CUDA driver is installed here")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    stub = tmp_path / "libcudart.so"
    check_ok(_run([cc, "-shared", "-fPIC", "-o", str(stub), str(REPO / "tests" / "c" / "cudart_stub.c")]))
    src = tmp_path / "probe.c"
    src.write_text(_PROBE)
    exe = tmp_path / "probe"
    check_ok(_run([cc, str(src), "-o", str(exe), f"-L{tmp_path}", "-lcudart", f"-Wl,-rpath,{tmp_path}"]),
             stderr_empty=False)
    lib = built_libs["preload"]
    for bind_now in ({}, {"LD_BIND_NOW": "1"}):
        proc = _run([str(exe)], env=_preload_env(lib, **env, **bind_now))
        assert proc.returncode == 0 and proc.stderr == "", proc
        malloc_rc, free_rc, ptr = proc.stdout.split()
        if expect == "error":
            assert int(malloc_rc) != 0 and ptr == "null", proc.stdout
        else:
            assert (malloc_rc, free_rc, ptr) == ("0", "0", expect), proc.stdout


def test_import_works_without_a_gpu_and_gpu_work_raises_clearly(run_scenario):
    if libcuda_present():
        pytest.skip("a CUDA driver is installed here")
    out = check_ok(run_scenario("api", "no_driver", backend=None))
    assert out == "done\n"


def _glibc_versions(lib):
    """Every GLIBC_x.y version the library needs (readelf's version-needs section)."""
    out = check_ok(_run([_tool("readelf"), "-V", "-W", str(lib)]))
    return {tuple(int(x) for x in v.split(".")) for v in re.findall(r"Name: GLIBC_([0-9.]+)", out)}


def test_every_library_needs_glibc_2_28_at_most(built_libs):
    libs = sorted(REPO.glob("torch_memory_saver/_tms_*.abi3.so")) + sorted(REPO.glob("torch_memory_saver_hook_mode_*.so"))
    assert len(libs) == 9, libs
    for lib in libs:
        versions = _glibc_versions(lib)
        assert versions and max(versions) <= (2, 28), (lib.name, sorted(versions))
        if lib.name.startswith("_tms_"):   # where older glibc keeps dl* and pthread_*
            assert {"libdl.so.2", "libpthread.so.0"} <= set(_needed(lib)), (lib.name, _needed(lib))


@pytest.fixture(scope="session")
def wheel_file(tmp_path_factory):
    """The wheel `pip wheel .` builds from this tree (offline, with this environment's setuptools)."""
    wheels = tmp_path_factory.mktemp("wheels")
    with tree_build_lock():
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
                               "-w", str(wheels), str(REPO)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [wheel] = list(wheels.glob("torch_memory_saver-*.whl"))
    return wheel


def test_one_abi3_manylinux_wheel_with_its_metadata(wheel_file):
    import platform

    from torch_memory_saver import __version__

    assert wheel_file.name == f"torch_memory_saver-{__version__}-cp310-abi3-manylinux_2_28_{platform.machine()}.whl"
    with zipfile.ZipFile(wheel_file) as z:
        names = z.namelist()
        info = f"torch_memory_saver-{__version__}.dist-info"
        meta = z.read(f"{info}/METADATA").decode()
        wheel_meta = z.read(f"{info}/WHEEL").decode()
    assert f"Tag: cp310-abi3-manylinux_2_28_{platform.machine()}" in wheel_meta and "Root-Is-Purelib: false" in wheel_meta
    assert "License: MIT" in meta or "License-Expression: MIT" in meta, meta[:800]
    for line in ("Requires-Python: >=3.10", 'Requires-Dist: torch>=2.3; extra == "torch"',
                 f"Version: {__version__}"):
        assert line in meta, (line, meta[:800])
    assert any(n.endswith("/LICENSE") and ".dist-info/" in n for n in names), names
    assert not [n for n in names if n.startswith(("tests/", "benchmarks/", "src/", "setup"))], names
    assert "torch_memory_saver/include/torch_memory_saver.h" in names
    assert sorted(n for n in names if n.endswith(".so")) == sorted(
        [f"torch_memory_saver/_tms_{m}.abi3.so" for m in ("env", "preload", "torch")]
        + [f"torch_memory_saver_hook_mode_{m}{s}.abi3.so" for m in HOOK_MODES for s in ("", "_cu12", "_cu13")])


def test_auditwheel_agrees_with_the_manylinux_tag(wheel_file):
    # auditwheel (where installed; `pip install auditwheel`) reads every library's
    # symbol versions and NEEDED entries and names the policy the wheel meets.
    import platform

    pytest.importorskip("auditwheel", reason="auditwheel not installed (pip install auditwheel)")
    proc = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(wheel_file)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = " ".join(proc.stdout.split())
    assert f'consistent with the following platform tag: "manylinux_2_28_{platform.machine()}"' in text, proc.stdout


def test_pip_wheel_contains_both_libraries_and_works(wheel_file, tmp_path):
    wheel = wheel_file
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        bad = z.testzip()
        z.extractall(tmp_path / "site")
    assert bad is None
    for mode in HOOK_MODES:
        assert [n for n in names if re.fullmatch(rf"torch_memory_saver/_tms_{mode}\..*\.so", n)], names
    for py in ("__init__.py", "entrypoint.py", "_library.py", "_preload.py", "_errors.py", "py.typed",
               "_tms_preload.pyi", "_tms_torch.pyi", "_tms_env.pyi"):
        assert f"torch_memory_saver/{py}" in names, names
    assert any(n.endswith(".dist-info/RECORD") for n in names) and any(n.endswith(".dist-info/WHEEL") for n in names)
    # The wheel's own libraries, imported from outside the source tree.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "LD_"))}
    env.update(PYTHONPATH=str(tmp_path / "site"), TMS_BACKEND="host")
    code = (
        "import ctypes, os, torch_memory_saver as m\n"
        "t = m.torch_memory_saver\n"
        "assert m.__file__.startswith(os.environ['PYTHONPATH']), m.__file__\n"
        "with t.region('w', enable_cpu_backup=True):\n"
        "    p = t.malloc(3 << 20)\n"
        "d = os.urandom(3 << 20); ctypes.memmove(p, d, len(d))\n"
        "t.pause('w'); t.resume('w')\n"
        "assert ctypes.string_at(p, len(d)) == d\n"
        "print('ok')\n"
    )
    proc = _run([sys.executable, "-c", code], cwd=tmp_path, env=env)
    assert check_ok(proc) == "ok\n"
    for lib in (tmp_path / "site" / "torch_memory_saver").glob("_tms_*.so"):
        assert not [n for n in _needed(lib) if FORBIDDEN_NEEDED.search(n)]


@pytest.mark.slow
def test_sdist_builds_the_same_wheel_and_holds_no_build_output(tmp_path):
    proc = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    [sdist] = list(tmp_path.glob("torch_memory_saver-*.tar.gz"))
    import tarfile

    with tarfile.open(sdist) as tar:
        names = [n.split("/", 1)[1] for n in tar.getnames() if "/" in n]
    assert not [n for n in names if n.endswith((".so", ".o", ".whl"))], names
    for needed in ("setup.py", "pyproject.toml", "LICENSE", "src/build.txt", "src/hooks/shim.c", "src/platform/glibc_compat.h",
                   "include/torch_memory_saver.h", "torch_memory_saver/py.typed", "torch_memory_saver/_tms_torch.pyi"):
        assert needed in names, (needed, sorted(names))
    # --no-cache-dir: pip would keep a wheel built from an sdist in its cache, outside the tree.
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
                           "--no-cache-dir", "-w", str(tmp_path / "w"), str(sdist)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [w.name.split("-", 2)[2] for w in (tmp_path / "w").glob("*.whl")] == [
        f"cp310-abi3-manylinux_2_28_{__import__('platform').machine()}.whl"]



def test_reading_the_project_metadata_warns_about_nothing():
    # Every build reads pyproject.toml and setup.py's metadata; a deprecation there
    # prints a screenful into each user's install.
    proc = subprocess.run([sys.executable, "setup.py", "--version", "--license"], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0.1.0", "MIT"], proc.stdout
    assert "Warning" not in proc.stderr, proc.stderr
