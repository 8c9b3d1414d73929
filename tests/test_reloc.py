"""Preload mode without LD_PRELOAD (issue 14): the hooks installed by patching the GOT
entries of loaded objects, checked with a stub CUDA runtime and small libraries built
here: loaded before the patch and dlopen'ed after, with lazy binding, full RELRO and
-fno-plt; a bare-name dlopen through a patched dlopen keeps the caller's RUNPATH. The
programs are tests/host_scenarios/reloc.py."""
import pytest

from conftest import REPO, cc, check_ok

C = REPO / "tests" / "c"
VARIANTS = {  # name: extra flags
    "lazy": [],
    "now": ["-Wl,-z,relro,-z,now"],
    "noplt": ["-fno-plt", "-Wl,-z,relro,-z,now"],
    "late": ["-Wl,-z,relro,-z,now"],
}


@pytest.fixture(scope="module")
def libs(tmp_path_factory):
    d = tmp_path_factory.mktemp("reloc")
    cc("-shared", "-fPIC", "-O2", "-o", d / "libcudart_stub.so", C / "reloc_runtime_stub.c")
    for name, flags in VARIANTS.items():
        cc("-shared", "-fPIC", "-O2", *flags, "-o", d / f"libuser_{name}.so", C / "reloc_user.c",
            f"-L{d}", "-lcudart_stub", f"-Wl,-rpath,{d}", "-ldl")
    (d / "sub").mkdir()
    cc("-shared", "-fPIC", "-O2", "-Wl,-z,relro,-z,now", "-o", d / "sub" / "libinner.so", C / "reloc_user.c",
        f"-L{d}", "-lcudart_stub", f"-Wl,-rpath,{d}", "-ldl")
    cc("-shared", "-fPIC", "-O2", "-Wl,--enable-new-dtags,-rpath,$ORIGIN/sub", "-o", d / "libuser_runpath.so",
        C / "reloc_user.c", f"-L{d}", "-lcudart_stub", f"-Wl,-rpath,{d}", "-ldl")
    # A library with the runtime linked in: it defines cudaMalloc itself.
    cc("-shared", "-fPIC", "-O2", "-o", d / "libstatic_runtime.so", C / "reloc_runtime_stub.c")
    # Runtimes of their own (a second CUDA runtime in the process), each with a user
    # library that calls it without tail calls (the hook knows its caller by the
    # return address).
    for k in ("b", "c", "d"):
        cc("-shared", "-fPIC", "-O2", f"-Wl,-soname,libcudart_{k}.so", "-o", d / f"libcudart_{k}.so",
           C / "reloc_runtime_stub.c")
        cc("-shared", "-fPIC", "-O2", "-fno-optimize-sibling-calls", "-o", d / f"libuser_on_{k}.so", C / "reloc_user.c",
           f"-L{d}", f"-lcudart_{k}", f"-Wl,-rpath,{d}", "-ldl")
    # Many copies, dlopen'ed one after the other while passes run.
    for i in range(24):
        (d / f"libuser_copy{i}.so").write_bytes((d / "libuser_now.so").read_bytes())
    return d


def test_hooks_reach_objects_loaded_before_and_after(run_scenario, libs):
    out = check_ok(run_scenario("reloc", "before_and_after", libs))
    assert out == "done\n"


def test_hip_names_and_patching_while_other_threads_allocate(run_scenario, libs):
    out = check_ok(run_scenario("reloc", "hip_names_while_others_allocate", libs))
    assert out == "done\n"


@pytest.mark.parametrize("hooks", [False, True])
def test_bare_name_dlopen_keeps_the_callers_runpath(run_scenario, libs, hooks):
    # Without the hooks the control: the loader finds libinner.so in the caller's RUNPATH.
    out = check_ok(run_scenario("reloc", "bare_name_dlopen", libs, hooks))
    assert out == "done\n"


def test_a_statically_linked_runtime_is_named(run_scenario, libs):
    proc = run_scenario("reloc", "static_runtime", libs)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(libs / "libstatic_runtime.so")
    assert "libstatic_runtime.so defines cudaMalloc itself" in proc.stderr, proc.stderr


def test_reloc_hooks_off_leaves_objects_alone(run_scenario, libs):
    out = check_ok(run_scenario("reloc", "hooks_off", libs, env={"TMS_RELOC_HOOKS": "0"}))
    assert out == "done\n"


def test_malformed_reloc_hooks_is_a_value_error(run_py):
    proc = run_py("import torch_memory_saver", prelude=False, env={"TMS_RELOC_HOOKS": "maybe"})
    assert proc.returncode != 0 and "TMS_RELOC_HOOKS='maybe'" in proc.stderr, proc.stderr


def test_a_dlopen_returns_with_the_new_object_patched(run_scenario, libs):
    # Another thread keeps running passes meanwhile: a library's allocations in a
    # region, made in C right after its dlopen returned, are the library's.
    out = check_ok(run_scenario("reloc", "dlopen_returns_patched", libs))
    assert out == "done\n"


def test_each_patched_object_forwards_to_its_own_runtime(run_scenario, libs):
    # Two runtimes: a library linked to the second reaches the second, not the
    # first one the hooks saw; after the first is unloaded, nothing calls into it.
    out = check_ok(run_scenario("reloc", "own_runtimes", libs))
    assert out == "done\n"


def test_a_tail_call_never_reaches_an_unloaded_runtime(run_scenario, libs):
    # user_free's `return cudaFree(p)` is a tail call: the hook sees a caller
    # outside every patched object. Once the newest runtime is unloaded, such a
    # call goes to a runtime still loaded, not into unmapped memory.
    out = check_ok(run_scenario("reloc", "tail_call_after_dlclose", libs))
    assert out == "done\n"
