"""Drop-in compatibility with the upstream library, on the host backend, against
the package as `pip install .` installs it: upstream's file names at the site root, its C
ABI (from Python through ctypes and from a C program on LD_PRELOAD), the private paths
frameworks reach into, its environment booleans; and what we add: lists of tags, state
queries, get_cpu_backup of foreign tensors. The programs are tests/host_scenarios/compat.py."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import HOOK_MODES, HOST_SCENARIOS, REPO, cc, check_ok, child_env, installed_env

UPSTREAM_NAMES = [f"torch_memory_saver_hook_mode_{mode}{suffix}.abi3.so"
                  for mode in HOOK_MODES for suffix in ("", "_cu12", "_cu13")]


def _run_installed(site, tmp_path, case, *args, env=None, timeout=120):
    """Runs a case of tests/host_scenarios/compat.py in a fresh python that imports the
    package installed in site, from a directory outside the source tree."""
    return subprocess.run([sys.executable, str(HOST_SCENARIOS / "compat.py"), case, *map(str, args)], cwd=tmp_path,
                          env=installed_env(site, env), capture_output=True, text=True, timeout=timeout)


def _needed(lib):
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf (binutils) is not installed")
    out = check_ok(subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True))
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


# ---- library names ---------------------------------------------------------------


def test_installed_package_has_every_upstream_library_name(installed):
    for name in UPSTREAM_NAMES:
        lib = installed / name
        assert lib.is_file(), f"{name} missing from the site root: {sorted(os.listdir(installed))}"
        mode = "preload" if "preload" in name else "torch"
        needed = _needed(lib)
        # A shim: its one job is to load our library of the same variant.
        assert [n for n in needed if n.startswith(f"_tms_{mode}.")], (name, needed)
        assert not [n for n in needed if re.search(r"lib(cuda|cudart|python)", n)], (name, needed)
    assert (installed / "torch_memory_saver" / "include" / "torch_memory_saver.h").is_file()


@pytest.mark.parametrize("name", [n for n in UPSTREAM_NAMES if "preload" in n])
def test_upstream_preload_names_load_into_a_non_python_process(installed, name):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "LD_"))}
    for extra in ({}, {"LD_BIND_NOW": "1"}):
        proc = subprocess.run(["sh", "-c", "cat /proc/$$/maps"], env={**env, **extra, "LD_PRELOAD": str(installed / name)},
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert "/torch_memory_saver/_tms_preload." in proc.stdout     # the real library came with it


def test_slime_disk_offload_call_shape(installed, tmp_path):
    # slime's --offload-train-target disk: it checks the preload library's bytes for
    # TMS_INIT_ENABLE_DISK_BACKUP, then starts the trainer with LD_PRELOAD and
    # TMS_INIT_ENABLE=1, TMS_INIT_ENABLE_CPU_BACKUP=0, TMS_INIT_ENABLE_DISK_BACKUP=1,
    # TMS_DISK_BACKUP_CHUNK_MB; untagged pause/resume.
    pytest.importorskip("torch")
    from pathlib import Path

    check = subprocess.run([sys.executable, "-c", (
        "from torch_memory_saver.utils import get_binary_path_from_package as g; from pathlib import Path; "
        "p = g('torch_memory_saver_hook_mode_preload'); print(p); "
        "assert b'TMS_INIT_ENABLE_DISK_BACKUP' in Path(p).read_bytes()")],
        env=installed_env(installed), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stderr
    dynlib = check.stdout.strip()
    assert Path(dynlib).parent == installed, dynlib
    backups = tmp_path / "disk"
    out = check_ok(_run_installed(installed, tmp_path, "slime_disk_offload", env={
        "LD_PRELOAD": dynlib, "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "0",
        "TMS_INIT_ENABLE_DISK_BACKUP": "1", "TMS_DISK_BACKUP_CHUNK_MB": "1", "TMS_DISK_BACKUP_DIR": str(backups),
        "TMS_BACKEND": "host"}))
    assert out == "done\n"
    assert os.listdir(backups) == []


def test_slime_style_preload_path_gives_one_core(installed, tmp_path):
    # slime: LD_PRELOAD=<site-packages>/torch_memory_saver_hook_mode_preload_cu12.abi3.so,
    # TMS_INIT_ENABLE=1, TMS_INIT_ENABLE_CPU_BACKUP=1; untagged pause/resume; the cdll
    # toggle around an allocation; get_cpu_backup(zero_copy=True).
    pytest.importorskip("torch")
    out = check_ok(_run_installed(installed, tmp_path, "slime_preload_path", env={
        "LD_PRELOAD": str(installed / "torch_memory_saver_hook_mode_preload_cu12.abi3.so"),
        "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1", "TMS_BACKEND": "host"}))
    assert out == "done\n"


@pytest.mark.parametrize("name", ["torch_memory_saver_hook_mode_preload.abi3.so",
                                  "torch_memory_saver_hook_mode_preload_cu13.abi3.so"])
def test_areal_style_path_with_ctypes_cdll_none(installed, tmp_path, name):
    # AReaL: the unsuffixed name on LD_PRELOAD, hook_mode="preload", pause()/resume().
    # The ABI resolves in the process's global scope (ctypes.CDLL(None)).
    out = check_ok(_run_installed(installed, tmp_path, "areal_cdll_none", env={
        "LD_PRELOAD": str(installed / name), "TMS_INIT_ENABLE": "1", "TMS_BACKEND": "host"}))
    assert out == "_tms_preload\n"


def test_configure_subprocess_accepts_upstream_names(installed, tmp_path):
    out = check_ok(_run_installed(installed, tmp_path, "configure_subprocess_upstream_names",
                                  env={"TMS_BACKEND": "host"}))
    assert out == "done\n"


def test_get_binary_path_from_package(installed, tmp_path):
    out = check_ok(_run_installed(installed, tmp_path, "binary_path_from_package"))
    assert out == "done\n"


# ---- the C ABI ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_abi_through_the_binary_wrapper(run_scenario, mode):
    out = check_ok(run_scenario("compat", "abi_through_the_binary_wrapper", mode))
    assert out == "done\n"


def test_runtime_functions_resolve_through_cdll(run_scenario, tmp_path):
    src = tmp_path / "fake_cudart.c"
    src.write_text("int cudaGetLastError(void) { return 42; }\n"
                   "int cudaHostGetFlags(unsigned *flags, void *p) { *flags = 7u | (unsigned)(unsigned long)p;"
                   " return 0; }\n")
    lib = tmp_path / "libcudart.so.13"
    cc("-shared", "-fPIC", "-o", lib, src)
    out = check_ok(run_scenario("compat", "runtime_functions_through_cdll", lib))
    assert out == "done\n"


def _cc():
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler")
    return cc


@pytest.mark.parametrize("name", ["torch_memory_saver_hook_mode_preload.abi3.so",
                                  "torch_memory_saver_hook_mode_preload_cu13.abi3.so",
                                  "torch_memory_saver/_tms_preload"])
def test_c_program_drives_the_abi_on_ld_preload(installed, tmp_path, name):
    # The program links a CUDA runtime (a stub over host memory here), which then
    # precedes the preloaded library's own dependencies in the search order.
    cc = _cc()
    stub = tmp_path / "libcudart_stub.so"
    check_ok(subprocess.run([cc, "-shared", "-fPIC", "-o", str(stub), str(REPO / "tests" / "c" / "cudart_stub.c")],
                            capture_output=True, text=True), stderr_empty=False)
    exe = tmp_path / "abi_client"
    check_ok(subprocess.run([cc, "-std=c11", "-D_GNU_SOURCE", "-Wall", "-Wextra", "-Werror",
                             f"-I{REPO / 'include'}", str(REPO / "tests" / "c" / "abi_client.c"),
                             "-o", str(exe), f"-L{tmp_path}", "-lcudart_stub", f"-Wl,-rpath,{tmp_path}", "-ldl"],
                            capture_output=True, text=True), stderr_empty=False)
    lib = next(installed.glob(name + ("" if name.endswith(".so") else "*.so")))
    env = {k: v for k, v in child_env().items() if k != "PYTHONPATH"}
    env.update(LD_PRELOAD=str(lib), TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    for bind_now in ({}, {"LD_BIND_NOW": "1"}):
        proc = subprocess.run([str(exe)], env={**env, **bind_now}, capture_output=True, text=True, timeout=60)
        assert check_ok(proc) == "OK host backend\n"
    # Without the library the program reports it rather than crashing.
    proc = subprocess.run([str(exe)], env={k: v for k, v in env.items() if k != "LD_PRELOAD"},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "not in the global scope" in proc.stdout, proc.stdout


# ---- environment booleans ------------------------------------------------------------

_BOOL_VARS = [("TMS_INIT_ENABLE", "init_enable"), ("TMS_INIT_ENABLE_CPU_BACKUP", "init_enable_cpu_backup"),
              ("TMS_RETAIN_CPU_BACKUP", "retain_cpu_backup")]
_TRUE = ["1", "true", "TRUE", "yes", "YES"]
_FALSE = ["0", "false", "FALSE", "no", "NO"]
_REJECTED = ["on", "True", "Yes", "", "2", " 1", "y"]


@pytest.mark.parametrize("var,key", _BOOL_VARS)
def test_env_booleans_accept_exactly_upstreams_spellings(run_scenario, var, key):
    for value in _TRUE + _FALSE:
        out = check_ok(run_scenario("compat", "default", key, env={var: value}))
        assert out == f"{value in _TRUE}\n", (var, value)


@pytest.mark.parametrize("var,key", _BOOL_VARS + [("TMS_PROGRESS", None), ("TMS_BACKUP_LIVE_ONLY", None),
                                                ("TMS_SPILL_TO_DISK", None), ("TMS_HOST_MEMORY_SAFETY", None)])
@pytest.mark.parametrize("value", _REJECTED)
def test_env_booleans_reject_anything_else(run_scenario, var, key, value):
    proc = run_scenario("import_env", "pause_every_tag", env={var: value})
    assert proc.returncode == 1, proc
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: ") and f"{var}='{value}' is not a boolean" in last, proc.stderr


# ---- beyond upstream: lists of tags, state queries -------------------------------------


def test_lists_of_tags_and_state_queries(run_scenario):
    out = check_ok(run_scenario("compat", "lists_of_tags"))
    assert out == "done\n"


def test_get_cpu_backup_of_a_tensor_outside_every_allocation_is_none(run_scenario):
    pytest.importorskip("torch")
    out = check_ok(run_scenario("compat", "foreign_tensor_backup"))
    assert out == "done\n"


def test_upstream_region_signature_and_private_names(run_scenario):
    out = check_ok(run_scenario("compat", "upstream_region_signature"))
    assert out == "done\n"
