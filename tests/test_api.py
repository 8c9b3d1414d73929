"""The Python layer: argument validation, environment parsing, configure_subprocess.

Validation that fails before the native core is touched runs in-process on a
fresh TorchMemorySaver(); anything that loads the core runs in a subprocess.
"""
import os
import subprocess
import sys

import pytest

import torch_memory_saver
from torch_memory_saver import TorchMemorySaver, configure_subprocess
from conftest import HOOK_MODES, MiB, REPO, check_ok, child_env
from host_scenarios import api

# ---- in-process validation (the core is never loaded) ---------------------------


@pytest.fixture
def fresh():
    tms = TorchMemorySaver()
    yield tms
    assert tms._impl is None, "a validation error must not initialise the core"


def enter(cm):
    """Enters a @contextmanager (validation runs on entry) and leaves it."""
    with cm:
        pass


def test_enabled_is_true_read_only_and_does_not_start_the_core(fresh, run_scenario):
    # Upstream's compatibility property: True. Older upstream versions answered
    # False when the hook library was not preloaded; here that case is a clear
    # error at the first region instead, so a process without LD_PRELOAD
    # still reads True, in both hook modes, before any use.
    assert fresh.enabled is True
    with pytest.raises(AttributeError):
        fresh.enabled = False
    out = check_ok(run_scenario("api", "enabled_without_starting_the_core"))
    assert out == "done\n"


@pytest.mark.parametrize("value", ["cuda", "Preload", "", None, 1])
def test_unknown_hook_mode_is_a_value_error(fresh, value):
    with pytest.raises(ValueError, match="hook_mode must be 'preload' or 'torch'") as e:
        fresh.hook_mode = value
    assert repr(value) in str(e.value)
    assert fresh.hook_mode == "preload"


def test_hook_mode_can_change_before_first_use(fresh):
    fresh.hook_mode = "torch"
    fresh.hook_mode = "preload"
    fresh.hook_mode = "torch"
    assert fresh.hook_mode == "torch"


def test_cpu_backup_backend_without_backup_is_a_value_error(fresh):
    for backend in ("pinned", "mmap"):
        with pytest.raises(ValueError, match="needs enable_cpu_backup=True") as e:
            enter(fresh.region("t", cpu_backup_backend=backend))
        assert repr(backend) in str(e.value)


@pytest.mark.parametrize("enable", [True, False])
def test_unknown_cpu_backup_backend_is_a_value_error(fresh, enable):
    with pytest.raises(ValueError, match="cpu_backup_backend must be 'pinned' or 'mmap', got 'disk'"):
        enter(fresh.region("t", enable_cpu_backup=enable, cpu_backup_backend="disk"))


@pytest.mark.parametrize("value", [1, "yes", None])
def test_enable_cpu_backup_must_be_bool(fresh, value):
    with pytest.raises(TypeError, match="enable_cpu_backup must be a bool"):
        enter(fresh.region("t", enable_cpu_backup=value))


@pytest.mark.parametrize("tag,type_name", [(1, "int"), (b"kv", "bytes"), (None, "NoneType"), (["kv"], "list")])
def test_non_str_tag_is_a_type_error(fresh, tag, type_name):
    with pytest.raises(TypeError, match=f"tag must be a str, not {type_name}"):
        enter(fresh.region(tag))
    if tag is not None and not isinstance(tag, list):      # None: every tag; a list: those tags
        for op in (fresh.pause, fresh.resume):
            with pytest.raises(TypeError, match=f"tag must be a str, a list of str or None, not {type_name}"):
                op(tag)
    for op in (fresh.pause, fresh.resume):                 # inside a list only strings
        with pytest.raises(TypeError, match=f"tag in the list must be a str, not {type(tag).__name__}"):
            op(["ok", tag])
    for op in (fresh.is_paused,):
        with pytest.raises(TypeError, match=f"tag must be a str, not {type_name}"):
            op(tag)
    with pytest.raises(TypeError, match=f"tag must be a str, not {type_name}"):
        enter(fresh.cuda_graph(object(), tag=tag))


def test_empty_tag_is_a_value_error(fresh):
    with pytest.raises(ValueError, match="tag must be a non-empty string"):
        enter(fresh.region(""))
    with pytest.raises(ValueError, match="tag must be a non-empty string"):
        fresh.pause("")
    with pytest.raises(ValueError, match="tag must be a non-empty string"):
        fresh.resume("")
    with pytest.raises(ValueError, match="tag must be a non-empty string"):
        enter(fresh.cuda_graph(object(), tag=""))


@pytest.mark.parametrize("value", [-1, -(1 << 40)])
def test_negative_memory_margin_is_a_value_error(fresh, value):
    fresh.memory_margin_bytes = 5
    with pytest.raises(ValueError, match=f"memory_margin_bytes must be >= 0, got {value}"):
        fresh.memory_margin_bytes = value
    assert fresh.memory_margin_bytes == 5


@pytest.mark.parametrize("value,type_name", [(1.5, "float"), ("1", "str"), (True, "bool"), (None, "NoneType")])
def test_non_int_memory_margin_is_a_type_error(fresh, value, type_name):
    with pytest.raises(TypeError, match=f"memory_margin_bytes must be an int, not {type_name}"):
        fresh.memory_margin_bytes = value
    assert fresh.memory_margin_bytes == 0


@pytest.mark.parametrize("value,type_name", [(1, "int"), ("yes", "str"), (None, "NoneType")])
def test_non_bool_retain_cpu_backup_is_a_type_error(fresh, value, type_name):
    with pytest.raises(TypeError, match=f"retain_cpu_backup must be a bool, not {type_name}"):
        fresh.retain_cpu_backup = value
    fresh.retain_cpu_backup = True
    assert fresh.retain_cpu_backup is True


def test_get_cpu_backup_needs_a_tensor(fresh):
    pytest.importorskip("torch")
    with pytest.raises(TypeError, match="get_cpu_backup expects a torch.Tensor, not bytearray"):
        fresh.get_cpu_backup(bytearray(8))


def test_a_misspelt_setting_is_an_attribute_error_naming_the_closest(fresh):
    with pytest.raises(AttributeError, match="no setting 'retain_cpu_backups'; did you mean 'retain_cpu_backup'") as e:
        fresh.retain_cpu_backups = True
    assert "memory_margin_bytes" in str(e.value) and not hasattr(fresh, "retain_cpu_backups")
    with pytest.raises(AttributeError, match="no setting 'hookmode'; did you mean 'hook_mode'"):
        fresh.hookmode = "torch"
    # What frameworks set stays as it was: the settings, private names, a replaced method.
    fresh.hook_mode, fresh.memory_margin_bytes, fresh.retain_cpu_backup, fresh.progress = "torch", 1 << 30, True, True
    fresh._impl_ctor_kwargs = {}
    fresh.pause = lambda tag=None: "replaced"
    assert (fresh.hook_mode, fresh.memory_margin_bytes, fresh.retain_cpu_backup, fresh.pause()) == (
        "torch", 1 << 30, True, "replaced")


def test_a_misspelt_setting_on_the_module_is_an_attribute_error():
    with pytest.raises(AttributeError, match="did you mean 'retain_cpu_backup'"):
        torch_memory_saver.retain_cpu_backups = True
    assert "retain_cpu_backups" not in vars(torch_memory_saver)
    torch_memory_saver.a_name_of_the_caller = 1           # a name close to no setting is the caller's own
    del torch_memory_saver.a_name_of_the_caller


def test_dir_of_the_module_shows_no_imported_modules():
    names = dir(torch_memory_saver)
    assert "sys" not in names and "types" not in names, names


# ---- validation once the core is loaded (subprocess) ----------------------------


def test_hook_mode_cannot_change_after_first_use(run_scenario):
    out = check_ok(run_scenario("api", "hook_mode_after_first_use"))
    assert out == "done\n"


def test_settings_made_before_first_use_reach_the_core(run_scenario):
    out = check_ok(run_scenario("api", "settings_before_first_use"))
    assert out == "done\n"


def test_an_unknown_tag_warns_once_naming_the_tags_used(run_scenario):
    out = check_ok(run_scenario("api", "unknown_tag_warns_once"))
    said = "does nothing: no region or allocation of this process has used it"
    assert out.splitlines() == [
        f"torch_memory_saver: pause of the tag 'wieghts' {said}; did you mean 'weights'? "
        "Tags used here: 'weights', 'kv_cache', 'set_through_the_core'.",
        f"torch_memory_saver: resume of the tag 'kv_cach' {said}; did you mean 'kv_cache'? "
        "Tags used here: 'kv_cache', 'set_through_the_core', 'weights'."], out


def test_without_torch_the_calls_that_need_it_say_so(run_py):
    # torch absent (None in sys.modules: its import raises ImportError, as when it is not installed).
    out = check_ok(run_py("""
        import sys
        sys.modules["torch"] = None
        from torch_memory_saver import torch_memory_saver as tms
        calls = {"get_cpu_backup": lambda: tms.get_cpu_backup(b"x"), "share": lambda: tms.share(123),
                 "open_shared": lambda: tms.open_shared(1), "cuda_graph": lambda: tms.cuda_graph(object()).__enter__()}
        for name, call in calls.items():
            try:
                call()
            except Exception as e:
                print(name, type(e).__name__, e)
        """, prelude=False))
    lines = out.splitlines()
    assert lines[:3] == ["get_cpu_backup TypeError torch_memory_saver: get_cpu_backup expects a torch.Tensor, not bytes",
                         "share TypeError torch_memory_saver: share expects a torch.Tensor, not int",
                         "open_shared TypeError torch_memory_saver: open_shared expects what share() returned, not int"]
    assert lines[3].startswith("cuda_graph ImportError torch_memory_saver: cuda_graph needs PyTorch, which cannot be "
                               "imported here") and lines[3].endswith("pip install torch (>= 2.3)"), out


def test_a_nested_region_of_the_same_tag_with_another_backup_is_refused(run_scenario):
    out = check_ok(run_scenario("api", "nested_region_with_another_policy"))
    inside = "a tag has one backup policy; give the inner block another tag, or the outer one's settings"
    assert out.splitlines() == [
        f"torch_memory_saver: region(tag='w') with no backup inside a region of the same tag with CPU backup (mmap): "
        f"{inside}",
        f"torch_memory_saver: region(tag='w') with CPU backup (pinned) inside a region of the same tag with CPU backup "
        f"(mmap): {inside}",
        f"torch_memory_saver: region(tag='w') with disk backup inside a region of the same tag with CPU backup (mmap): "
        f"{inside}"], out


def test_memory_report_in_a_fresh_process_reports_the_current_device(run_scenario):
    assert check_ok(run_scenario("api", "memory_report_in_a_fresh_process")) == "done\n"


def test_a_report_shows_its_devices_as_the_dict_they_are(run_scenario):
    assert check_ok(run_scenario("api", "report_repr")) == "done\n"


@pytest.mark.parametrize("value", ["HOST", "Host"])
def test_the_backend_name_is_read_in_any_case(run_py, value):
    assert check_ok(run_py("print(core.backend())", backend=value)) == "host\n"


def test_errors_give_huge_byte_counts_in_gib_too(in_child):
    out = in_child(api.huge_byte_count_in_gib)
    assert ("allocation of 68719476736 bytes (64.00 GiB) (tag 'w', device 0) would leave 0 of 17179869184 free bytes "
            "(16.00 GiB), below memory_margin_bytes=16106127360 (15.00 GiB)") in out, out


def test_native_argument_errors(run_scenario):
    out = check_ok(run_scenario("api", "native_argument_errors"))
    assert out == "done\n"


_MALFORMED = [
    ("TMS_INIT_ENABLE", "maybe"),
    ("TMS_INIT_ENABLE_CPU_BACKUP", "2"),
    ("TMS_RETAIN_CPU_BACKUP", "sure"),
    ("TMS_INIT_CPU_BACKUP_BACKEND", "disk"),
    ("TMS_CHUNK_BYTES", "lots"),
    ("TMS_CHUNK_BYTES", "-4MiB"),
    ("TMS_CHUNK_BYTES", "4TiB"),
    ("TMS_CHUNK_BYTES", "18446744073709551615"),   # wrapped to 0 when rounded: SIGFPE at first allocation
    ("TMS_CHUNK_BYTES", "2048GiB"),                # above the 1 TiB bound
    ("TMS_PROGRESS", "on"),
    ("TMS_HOST_BACKUP_LIMIT", "0"),
    ("TMS_HOST_BACKUP_LIMIT", "101%"),
    ("TMS_HOST_BACKUP_LIMIT", "lots"),
    ("TMS_HOST_BACKUP_LIMIT_NAME", "../etc"),
    ("TMS_HOST_BACKUP_LIMIT_NAME", "a" * 65),
    ("TMS_SPILL_TO_DISK", "maybe"),
]


@pytest.mark.parametrize("var,value", _MALFORMED, ids=[f"{v}={x}" for v, x in _MALFORMED])
def test_malformed_env_raises_value_error_at_import_naming_variable_and_value(run_scenario, var, value):
    out = check_ok(run_scenario("import_env", "package_and_variants", var, value, env={var: value}))
    assert out == "done\n"


def test_chunk_bytes_at_its_bound_allocates(run_scenario):
    out = check_ok(run_scenario("api", "chunk_bytes_at_its_bound", env={"TMS_CHUNK_BYTES": str(1 << 40)}))
    assert out == f"{1 << 40}\n"


@pytest.mark.parametrize("var,value,key,expected", [
    ("TMS_CHUNK_BYTES", "67108864", "chunk_bytes", 64 * MiB),
    ("TMS_CHUNK_BYTES", "64MiB", "chunk_bytes", 64 * MiB),
    ("TMS_CHUNK_BYTES", "1g", "chunk_bytes", 1 << 30),
    ("TMS_INIT_CPU_BACKUP_BACKEND", "pinned", "init_cpu_backup_backend", "pinned"),
    ("TMS_RETAIN_CPU_BACKUP", "YES", "retain_cpu_backup", True),
    ("TMS_INIT_ENABLE", "FALSE", "init_enable", False),
])
def test_well_formed_env_values_parse(run_scenario, var, value, key, expected):
    out = check_ok(run_scenario("api", "env_value_parses", key, repr(expected), env={var: value}))
    assert out == "done\n"


# ---- configure_subprocess -------------------------------------------------------


def _entries(value):
    return value.replace(":", " ").split()


@pytest.fixture
def other_lib():
    """An existing file to stand for another LD_PRELOAD entry (stdbuf's library if present)."""
    for path in ("/usr/libexec/coreutils/libstdbuf.so", "/usr/lib/x86_64-linux-gnu/coreutils/libstdbuf.so",
                 "/usr/lib/coreutils/libstdbuf.so", "/usr/lib/x86_64-linux-gnu/libstdbuf.so"):
        if os.path.exists(path):
            return path
    return os.path.realpath(sys.executable)


@pytest.fixture
def preload_lib(built_libs):
    return os.path.realpath(built_libs["preload"])


@pytest.mark.parametrize("cm", [configure_subprocess, torch_memory_saver.torch_memory_saver.configure_subprocess],
                         ids=["module", "singleton"])
def test_configure_subprocess_without_previous_value(monkeypatch, preload_lib, cm):
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    with cm():
        assert _entries(os.environ["LD_PRELOAD"]) == [preload_lib]
    assert "LD_PRELOAD" not in os.environ


def test_configure_subprocess_puts_itself_first_and_keeps_others(monkeypatch, preload_lib, other_lib):
    previous = f"{other_lib} /nonexistent/libfoo.so"
    monkeypatch.setenv("LD_PRELOAD", previous)
    with configure_subprocess():
        assert _entries(os.environ["LD_PRELOAD"]) == [preload_lib, other_lib, "/nonexistent/libfoo.so"]
    assert os.environ["LD_PRELOAD"] == previous


def test_configure_subprocess_does_not_duplicate_itself(monkeypatch, tmp_path, preload_lib, other_lib):
    link = tmp_path / "alias.so"
    link.symlink_to(preload_lib)
    previous = f"{other_lib}:{link}:{preload_lib}"        # ours twice, once through a symlink, ':' separated
    monkeypatch.setenv("LD_PRELOAD", previous)
    with configure_subprocess():
        entries = _entries(os.environ["LD_PRELOAD"])
        assert entries == [preload_lib, other_lib], entries
        with configure_subprocess():                       # nested: still one copy
            assert _entries(os.environ["LD_PRELOAD"]) == [preload_lib, other_lib]
        assert _entries(os.environ["LD_PRELOAD"]) == [preload_lib, other_lib]
    assert os.environ["LD_PRELOAD"] == previous


def test_configure_subprocess_restores_after_an_exception(monkeypatch, other_lib):
    monkeypatch.setenv("LD_PRELOAD", other_lib)
    with pytest.raises(KeyError):
        with configure_subprocess():
            raise KeyError("boom")
    assert os.environ["LD_PRELOAD"] == other_lib
    monkeypatch.delenv("LD_PRELOAD")
    with pytest.raises(KeyError):
        with configure_subprocess():
            raise KeyError("boom")
    assert "LD_PRELOAD" not in os.environ


_CHILD = (
    "import os, torch_memory_saver._tms_preload as c; "
    "print(os.environ.get('LD_PRELOAD', '')); print(c.preload_active())"
)


def test_child_started_inside_configure_subprocess_has_the_hook(monkeypatch, preload_lib, other_lib):
    for k, v in child_env(backend="host").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("LD_PRELOAD", other_lib)
    with configure_subprocess():
        proc = subprocess.run([sys.executable, "-c", _CHILD], cwd=REPO, capture_output=True, text=True, timeout=60)
    out = check_ok(proc).splitlines()
    assert _entries(out[0]) == [preload_lib, other_lib]
    assert out[1] == str((True, preload_lib))               # this library's cudaMalloc wins


def test_without_ld_preload_the_hook_is_not_active(run_py):
    out = check_ok(run_py(_CHILD, prelude=False)).splitlines()
    assert out == ["", "(False, None)"]


def test_torch_variant_has_no_allocator_hook(run_scenario, preload_lib):
    # Only the preload variant defines cudaMalloc/cudaFree and can report on
    # them; the torch variant is reached through the pluggable allocator only.
    out = check_ok(run_scenario("api", "torch_variant_has_no_allocator_hook", env={"LD_PRELOAD": preload_lib}))
    assert out == "done\n"


# ---- the public surface: one exception type, typed, documented ------------

def test_both_variants_raise_the_one_public_error(run_scenario):
    out = check_ok(run_scenario("api", "one_public_error"))
    assert out == "done\n"


def _stub_names(path):
    import ast

    tree = ast.parse(path.read_text())
    names = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    names |= {t.id for n in tree.body if isinstance(n, ast.AnnAssign) for t in [n.target] if not t.id.startswith("_")}
    names |= {a.asname for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names if a.asname}
    return names


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_stubs_declare_exactly_the_native_members(mode, built_libs):
    import importlib

    module = importlib.import_module(f"torch_memory_saver._tms_{mode}")
    public = {n for n in dir(module) if not n.startswith("_")}
    declared = _stub_names(REPO / "torch_memory_saver" / f"_tms_{mode}.pyi")
    # The settings' get_<name> / set_<name> are made from the C table: the stub's
    # __getattr__ stands for them, and for nothing else.
    run = {row["name"] for row in importlib.import_module("torch_memory_saver._tms_env").settings() if row["run"]}
    accessors = {f"{op}_{name}" for name in run for op in ("get", "set")}
    assert "__getattr__" in declared and accessors <= public, sorted(accessors - public)
    declared = (declared - {"__getattr__"}) | accessors
    assert declared == public, (sorted(declared - public), sorted(public - declared))
    assert (REPO / "torch_memory_saver" / "py.typed").is_file()


def test_every_public_member_is_documented():
    missing = [name for name in dir(TorchMemorySaver) if not name.startswith("_")
               and not (getattr(TorchMemorySaver, name).__doc__ or "").strip()]
    assert missing == [], missing
    for name in ("Error", "OutOfMemoryError", "configure_subprocess", "stats", "memory_summary"):
        assert (getattr(torch_memory_saver, name).__doc__ or "").strip(), name


def test_public_malloc_and_free_on_the_host_backend(run_scenario):
    out = check_ok(run_scenario("api", "public_malloc_and_free"))
    assert out == "done\n"


@pytest.mark.parametrize("argv0,prog", [("/venv/bin/torch-memory-saver", "torch-memory-saver"),
                                        ("/x/torch_memory_saver/__main__.py", "python -m torch_memory_saver")])
def test_help_names_the_command_it_was_started_as(run_scenario, argv0, prog):
    out = check_ok(run_scenario("api", "help_as", argv0))
    assert out.startswith(f"usage: {prog} "), out

