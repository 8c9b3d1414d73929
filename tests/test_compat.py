"""Drop-in compatibility with the upstream library (issue 10), on the host backend, against
the package as `pip install .` installs it: upstream's file names at the site root, its C
ABI (from Python through ctypes and from a C program on LD_PRELOAD), the private paths
frameworks reach into, its environment booleans; and what we add: lists of tags, state
queries, get_cpu_backup of foreign tensors."""
import os
import re
import shutil
import subprocess
import sys
import textwrap

import pytest

from conftest import CHILD_PRELUDE, HOOK_MODES, REPO, check_ok, child_env, installed_env

UPSTREAM_NAMES = [f"torch_memory_saver_hook_mode_{mode}{suffix}.abi3.so"
                  for mode in HOOK_MODES for suffix in ("", "_cu12", "_cu13")]


def _run_installed(site, tmp_path, code, env=None, prelude=True, timeout=120):
    """Runs code in a fresh python that imports the package installed in site, from a
    directory outside the source tree."""
    script = tmp_path / "child.py"
    script.write_text((CHILD_PRELUDE if prelude else "") + textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=installed_env(site, env),
                          capture_output=True, text=True, timeout=timeout)


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
    out = check_ok(_run_installed(installed, tmp_path, """
        tms._ensure_initialized()
        core = tms._core
        cdll = tms._impl._binary_wrapper.cdll
        assert cdll.tms_get_enable_disk_backup() is True and cdll.tms_get_enable_cpu_backup() is False
        n = 5 * MiB + 3
        p = core.malloc(n)
        data = fill(p, n)
        tms.pause()
        d = os.environ["TMS_DISK_BACKUP_DIR"]
        assert len([f for f in os.listdir(d) if f.endswith(".bin")]) == 1
        assert tms.get_cpu_backup.__self__ is tms and core.get_cpu_backup(p, n) is None
        tms.resume()
        assert read(p, n) == data
        print("done")
    """, env={"LD_PRELOAD": dynlib, "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "0",
              "TMS_INIT_ENABLE_DISK_BACKUP": "1", "TMS_DISK_BACKUP_CHUNK_MB": "1",
              "TMS_DISK_BACKUP_DIR": str(backups), "TMS_BACKEND": "host"}))
    assert out == "done\n"
    assert os.listdir(backups) == []


def test_slime_style_preload_path_gives_one_core(installed, tmp_path):
    # slime: LD_PRELOAD=<site-packages>/torch_memory_saver_hook_mode_preload_cu12.abi3.so,
    # TMS_INIT_ENABLE=1, TMS_INIT_ENABLE_CPU_BACKUP=1; untagged pause/resume; the cdll
    # toggle around an allocation; get_cpu_backup(zero_copy=True).
    pytest.importorskip("torch")
    out = check_ok(_run_installed(installed, tmp_path, """
        import torch, torch_memory_saver
        assert torch_memory_saver.__file__.startswith(os.environ["PYTHONPATH"]), torch_memory_saver.__file__
        dynlib = os.path.join(os.path.dirname(os.path.dirname(torch_memory_saver.__file__)),
                              "torch_memory_saver_hook_mode_preload_cu12.abi3.so")
        assert os.environ["LD_PRELOAD"] == dynlib, (os.environ["LD_PRELOAD"], dynlib)
        tms._ensure_initialized()
        core = tms._core
        assert core.preload_active()[0] is True                 # our cudaMalloc is the process's
        assert tms._impl._hook_mode == "preload"
        cdll = tms._impl._binary_wrapper.cdll
        assert cdll.tms_get_interesting_region() is True        # TMS_INIT_ENABLE=1 reached this thread
        assert cdll.tms_get_enable_cpu_backup() is True
        n = 3 * MiB + 5
        p = core.malloc(n)                                       # allocated "outside any region": the default tag
        data = fill(p, n)
        cdll.tms_set_interesting_region(False)                  # slime's toggle (deep_ep buffer init)
        assert core.get_region()[0] is False                     # the same thread state as the module's
        expect(ValueError, core.malloc, MiB, match="outside a region")
        cdll.tms_set_interesting_region(True)
        assert core.get_region() == (True, "default", True, "mmap", False)
        tms.pause()
        assert core.allocations()[0]["state"] == "paused"
        t = torch.frombuffer((ctypes.c_uint8 * n).from_address(p), dtype=torch.uint8)
        alias = tms.get_cpu_backup(t, zero_copy=True)
        assert bytes(alias.numpy()) == data
        host = cdll.tms_get_cpu_backup_pointer(ctypes.cast(p, ctypes.POINTER(ctypes.c_uint8)), n)
        assert ctypes.string_at(host, n) == data
        assert cdll.tms_pause(None) != 0 and b"already paused" in cdll.tms_get_last_error()
        tms.resume()
        assert read(p, n) == data
        print("done")
    """, env={"LD_PRELOAD": str(installed / "torch_memory_saver_hook_mode_preload_cu12.abi3.so"),
              "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1", "TMS_BACKEND": "host"}))
    assert out == "done\n"


@pytest.mark.parametrize("name", ["torch_memory_saver_hook_mode_preload.abi3.so",
                                  "torch_memory_saver_hook_mode_preload_cu13.abi3.so"])
def test_areal_style_path_with_ctypes_cdll_none(installed, tmp_path, name):
    # AReaL: the unsuffixed name on LD_PRELOAD, hook_mode="preload", pause()/resume().
    # The ABI resolves in the process's global scope (ctypes.CDLL(None)).
    out = check_ok(_run_installed(installed, tmp_path, """
        g = ctypes.CDLL(None)
        g.tms_get_current_tag.restype = ctypes.c_char_p
        assert g.tms_get_interesting_region() == 1
        assert g.tms_set_current_tag(b"actor") == 0 and g.tms_get_current_tag() == b"actor"
        tms.hook_mode = "preload"
        core = tms._core
        assert core.get_region()[1] == "actor"                   # set through the ABI, seen by the module
        p = core.malloc(2 * MiB)
        data = fill(p, 2 * MiB)
        tms.pause()
        assert tms.paused_tags() == ["actor"]
        tms.resume()
        assert tms.paused_tags() == []
        print(os.path.basename(core.library_path()).split(".")[0])
    """, env={"LD_PRELOAD": str(installed / name), "TMS_INIT_ENABLE": "1", "TMS_BACKEND": "host"}))
    assert out == "_tms_preload\n"


def test_configure_subprocess_accepts_upstream_names(installed, tmp_path):
    out = check_ok(_run_installed(installed, tmp_path, """
        import os
        import torch_memory_saver
        from torch_memory_saver import _library
        root = os.path.dirname(os.path.dirname(torch_memory_saver.__file__))
        ours = _library.path("preload")
        for name in ("torch_memory_saver_hook_mode_preload.abi3.so", "torch_memory_saver_hook_mode_preload_cu13.abi3.so"):
            os.environ["LD_PRELOAD"] = f"/nonexistent/libx.so:{root}/{name}"
            with torch_memory_saver.configure_subprocess():
                assert os.environ["LD_PRELOAD"].split() == [ours, "/nonexistent/libx.so"], os.environ["LD_PRELOAD"]
        print("done")
    """, prelude=False, env={"TMS_BACKEND": "host"}))
    assert out == "done\n"


def test_get_binary_path_from_package(installed, tmp_path):
    out = check_ok(_run_installed(installed, tmp_path, """
        import os
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
    """, prelude=False))
    assert out == "done\n"


# ---- the C ABI ---------------------------------------------------------------------


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_abi_through_the_binary_wrapper(run_py, mode):
    out = check_ok(run_py(f"""
        tms.hook_mode = "{mode}"
        tms._ensure_initialized()
        core = tms._core
        cdll = tms._impl._binary_wrapper.cdll
        assert cdll._name == core.library_path()                  # the library the module came from
        assert cdll.tms_get_interesting_region() is False
        assert cdll.tms_set_current_tag(b"w") == 0 and cdll.tms_get_current_tag() == b"w"
        assert cdll.tms_set_enable_cpu_backup(True) == 0 and cdll.tms_get_enable_cpu_backup() is True
        assert cdll.tms_set_cpu_backup_backend(b"pinned") == 0 and cdll.tms_get_cpu_backup_backend() == b"pinned"
        assert cdll.tms_set_interesting_region(True) == 0
        assert core.get_region() == (True, "w", True, "pinned", False)   # one thread state for module and ABI
        n = 5 * MiB + 3
        p = core.malloc(n)
        assert core.allocations()[0]["tag"] == "w"
        cdll.tms_set_interesting_region(False)
        data = fill(p, n)
        assert cdll.tms_pause(b"w") == 0 and row(p)["state"] == "paused"
        assert tms.is_paused("w")
        host = cdll.tms_get_cpu_backup_pointer(ctypes.cast(p, ctypes.POINTER(ctypes.c_uint8)), n)
        assert ctypes.string_at(host, n) == data
        assert cdll.tms_pause(b"w") == 5                          # TMS_STATUS_STATE
        assert b"tag 'w'" in cdll.tms_get_last_error() and b"already paused" in cdll.tms_get_last_error()
        assert cdll.tms_resume(b"") == 0 and read(p, n) == data   # "" = every tag, as upstream
        assert cdll.tms_resume(b"w") == 5
        assert not cdll.tms_get_cpu_backup_pointer(ctypes.cast(p, ctypes.POINTER(ctypes.c_uint8)), n)
        assert cdll.tms_set_cpu_backup_backend(b"disk") == 6 and b"'disk'" in cdll.tms_get_last_error()
        assert cdll.tms_set_current_tag(b"") == 6 and cdll.tms_get_current_tag() == b"w"
        assert cdll.tms_set_enable_disk_backup(True) == 0 and cdll.tms_get_enable_disk_backup() is True
        assert core.get_region()[4] is True                       # the module sees the ABI's setting
        assert cdll.tms_set_enable_disk_backup(False) == 0 and cdll.tms_get_enable_disk_backup() is False
        assert cdll.set_memory_margin_bytes(12345) == 0 and tms.memory_margin_bytes == 12345
        assert cdll.tms_set_retain_cpu_backup(True) == 0 and tms.retain_cpu_backup is True
        core.free(p)
        print("done")
    """, load_core=False))
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
def test_env_booleans_accept_exactly_upstreams_spellings(run_py, var, key):
    for value in _TRUE + _FALSE:
        out = check_ok(run_py(f'print(core.defaults()["{key}"])', env={var: value}))
        assert out == f"{value in _TRUE}\n", (var, value)


@pytest.mark.parametrize("var,key", _BOOL_VARS + [("TMS_PROGRESS", None)])
@pytest.mark.parametrize("value", _REJECTED)
def test_env_booleans_reject_anything_else(run_py, var, key, value):
    proc = run_py("""
        import torch_memory_saver
        torch_memory_saver.torch_memory_saver.pause()
    """, prelude=False, env={var: value})
    assert proc.returncode == 1, proc
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ValueError: ") and f"{var}='{value}' is not a boolean" in last, proc.stderr


# ---- beyond upstream: lists of tags, state queries -------------------------------------


def test_lists_of_tags_and_state_queries(run_py):
    out = check_ok(run_py("""
        ptrs = {}
        for tag in ("a", "b", "c"):
            with tms.region(tag, enable_cpu_backup=True):
                ptrs[tag] = core.malloc(2 * MiB)
        data = {t: fill(p, 2 * MiB) for t, p in ptrs.items()}
        assert tms.paused_tags() == [] and not tms.is_paused("a") and not tms.is_paused("never-used")
        tms.pause(["a", "b"])
        assert states() == [("a", "paused"), ("b", "paused"), ("c", "active")]
        assert tms.is_paused("a") and tms.is_paused("b") and not tms.is_paused("c")
        assert tms.paused_tags() == ["a", "b"]
        # A state error in a list changes nothing: 'c' is not paused because 'b' already is.
        e = expect(core.Error, tms.pause, ["c", "b"], match="pause of tag 'b'")
        assert "no tag of the list was paused" in str(e)
        assert states() == [("a", "paused"), ("b", "paused"), ("c", "active")]
        e = expect(core.Error, tms.resume, ("a", "c"), match="resume of tag 'c'")
        assert states() == [("a", "paused"), ("b", "paused"), ("c", "active")]
        expect(ValueError, tms.pause, ["c", "c"], match="'c' is listed twice")
        expect(ValueError, tms.pause, ["c", ""], match="non-empty")
        tms.pause([])                                            # nothing to do
        tms.resume(("b", "a"))
        assert [read(p, 2 * MiB) == data[t] for t, p in ptrs.items()] == [True] * 3
        assert tms.paused_tags() == []
        # Memory allocated into a paused tag: the tag is no longer "paused" as a whole.
        tms.pause("c")
        with tms.region("c"):
            extra = core.malloc(MiB)
        assert not tms.is_paused("c") and tms.paused_tags() == []
        tms.resume("c")
        tms.pause("c")
        assert tms.is_paused("c")
        print("done")
    """))
    assert out == "done\n"


def test_get_cpu_backup_of_a_tensor_outside_every_allocation_is_none(run_py):
    pytest.importorskip("torch")
    out = check_ok(run_py("""
        import torch
        with tms.region("w", enable_cpu_backup=True):
            p = core.malloc(MiB)
        tms.pause("w")
        foreign = torch.arange(1000, dtype=torch.float32)
        assert tms.get_cpu_backup(foreign) is None
        assert tms.get_cpu_backup(foreign, zero_copy=True) is None
        print("done")
    """))
    assert out == "done\n"


def test_upstream_region_signature_and_private_names(run_py):
    out = check_ok(run_py("""
        import inspect
        params = list(inspect.signature(tms.region).parameters)
        assert params == ["tag", "enable_cpu_backup", "enable_disk_backup", "cpu_backup_backend"], params
        with tms.region("w", True, False):                       # upstream's positional order
            assert tms._core.get_region() == (True, "w", True, "mmap", False)
        with tms.region("w", False, True):                      # enable_disk_backup, third as upstream
            assert tms._core.get_region() == (True, "w", False, "mmap", True)
        e = expect(ValueError, tms.region("w", True, True).__enter__)
        assert "mutually exclusive" in str(e)
        assert "cpu_backup_backend" in inspect.signature(tms.cuda_graph).parameters
        assert tms._ensure_initialized() is tms._impl and tms._impl._hook_mode == "preload"
        print("done")
    """, load_core=False))
    assert out == "done\n"
