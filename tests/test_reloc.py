"""Preload mode without LD_PRELOAD: the hooks installed by patching the GOT
entries of loaded objects, checked with a stub CUDA runtime and small libraries built
here: loaded before the patch and dlopen'ed after, with lazy binding, full RELRO and
-fno-plt; a bare-name dlopen through a patched dlopen keeps the caller's RUNPATH. The
programs are tests/host_scenarios/reloc.py, and tests/c/reloc_race.c for passes racing
a dlclose on another thread."""
import re

import pytest

import cbuild
from conftest import REPO, cc
from host_scenarios import reloc

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
    # Another party changing page protections during a pass (LD_PRELOAD).
    cc("-shared", "-fPIC", "-O2", "-o", d / "libreloc_mprotect.so", C / "reloc_mprotect.c")
    # Many copies, dlopen'ed one after the other while passes run.
    for i in range(24):
        (d / f"libuser_copy{i}.so").write_bytes((d / "libuser_now.so").read_bytes())
    return d


def test_hooks_reach_objects_loaded_before_and_after(in_child, libs):
    in_child(reloc.before_and_after, str(libs))


def test_hip_names_and_patching_while_other_threads_allocate(in_child, libs):
    in_child(reloc.hip_names_while_others_allocate, str(libs))


@pytest.mark.parametrize("hooks", [False, True])
def test_bare_name_dlopen_keeps_the_callers_runpath(in_child, libs, hooks):
    # Without the hooks the control: the loader finds libinner.so in the caller's RUNPATH.
    in_child(reloc.bare_name_dlopen, str(libs), str(hooks))


def test_a_statically_linked_runtime_is_named(in_child, libs):
    child = in_child.run(reloc.static_runtime, str(libs))
    child.result(stderr_empty=False)
    assert child.stdout.strip() == str(libs / "libstatic_runtime.so")
    assert "libstatic_runtime.so defines cudaMalloc itself" in child.stderr, child.stderr


def test_the_torch_variants_ipc_hooks_installed_beside_the_caller_route_region_memory(in_child, libs):
    in_child(reloc.ipc_hooks_later, str(libs))


def test_reloc_hooks_off_leaves_objects_alone(in_child, libs):
    in_child(reloc.hooks_off, str(libs), env={"TMS_RELOC_HOOKS": "0"})


@pytest.mark.parametrize("change", ["made_writable", "made_read_only"])
def test_a_store_keeps_a_protection_changed_since_the_pass_began(in_child, libs, change):
    # Restoring what a snapshot taken at the pass's start said would undo another
    # patcher's change, or leave a read-only GOT page writable.
    in_child(reloc.protection_changed_during_pass, str(libs), change,
             env={"LD_PRELOAD": libs / "libreloc_mprotect.so"})


def test_malformed_reloc_hooks_is_a_value_error(run_py):
    proc = run_py("import torch_memory_saver", prelude=False, env={"TMS_RELOC_HOOKS": "maybe"})
    assert proc.returncode != 0 and "TMS_RELOC_HOOKS='maybe'" in proc.stderr, proc.stderr


def test_a_dlopen_returns_with_the_new_object_patched(in_child, libs):
    # Another thread keeps running passes meanwhile: a library's allocations in a
    # region, made in C right after its dlopen returned, are the library's.
    in_child(reloc.dlopen_returns_patched, str(libs))


def test_each_patched_object_forwards_to_its_own_runtime(in_child, libs):
    # Two runtimes: a library linked to the second reaches the second, not the
    # first one the hooks saw; after the first is unloaded, nothing calls into it.
    in_child(reloc.own_runtimes, str(libs))


def test_a_tail_call_never_reaches_an_unloaded_runtime(in_child, libs):
    # user_free's `return cudaFree(p)` is a tail call: the hook sees a caller
    # outside every patched object. Once the newest runtime is unloaded, such a
    # call goes to a runtime still loaded, not into unmapped memory.
    in_child(reloc.tail_call_after_dlclose, str(libs))


# The race under ThreadSanitizer (the CMake build test_concurrency.py runs too): the
# options its run needs. The plain build and AddressSanitizer + UndefinedBehaviorSanitizer
# run it under ctest (test_c_suite.py: reloc_race, for two seconds each).
SANITIZERS = {
    "thread": {"TSAN_OPTIONS": f"halt_on_error=1:report_signal_unsafe=0:suppressions={cbuild.C_TESTS / 'tsan.supp'}"},
}


@pytest.mark.parametrize("sanitizer", list(SANITIZERS))
def test_passes_survive_a_dlclose_on_another_thread(libs, tmp_path, sanitizer):
    # One thread dlopens copies of a library through its patched dlopen, each running a
    # pass over every loaded object, while another dlcloses them: a pass reads an
    # object's memory only while the loader keeps it mapped, and every copy is patched
    # when its dlopen returns, however often it was loaded before. A second each.
    cbuild.skip_unless_sanitizer_runs(sanitizer, tmp_path)
    program = cbuild.cmake_build(sanitizer) / "test_reloc_race"
    env = SANITIZERS[sanitizer]
    proc = cbuild.run([program, "--seconds", 1, libs / "libuser_lazy.so"], timeout=120,
                      env=cbuild.tool_env(TMPDIR=tmp_path, **env))
    assert proc.returncode == 0, cbuild.detail(proc)
    assert re.fullmatch(r"reloc_race: [1-9]\d* rounds, ok\n", proc.stdout), cbuild.detail(proc)
    assert proc.stderr == "", cbuild.detail(proc)
