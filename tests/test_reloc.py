"""Preload mode without LD_PRELOAD (issue 14): the hooks installed by patching the GOT
entries of loaded objects, checked with a stub CUDA runtime and small libraries built
here: loaded before the patch and dlopen'ed after, with lazy binding, full RELRO and
-fno-plt; a bare-name dlopen through a patched dlopen keeps the caller's RUNPATH."""
import textwrap

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


PRELUDE = """
D = sys.argv[1]
tms.hook_mode = "preload"
core = tms._core

def load(name):
    lib = ctypes.CDLL(os.path.join(D, name))
    lib.user_alloc.restype = ctypes.c_void_p
    lib.user_alloc.argtypes = [ctypes.c_size_t]
    lib.user_free.argtypes = [ctypes.c_void_p]
    lib.user_open.restype = ctypes.c_void_p
    lib.user_open.argtypes = [ctypes.c_char_p]
    lib.user_hip_alloc.restype = ctypes.c_void_p
    lib.user_hip_alloc.argtypes = [ctypes.c_size_t]
    lib.user_hip_free.argtypes = [ctypes.c_void_p]
    return lib

stub = ctypes.CDLL(os.path.join(D, "libcudart_stub.so"))
def counts():
    return stub.stub_mallocs(), stub.stub_frees()

def ours(p):
    return any(r["ptr"] == p for r in core.allocations())

def check_routes(lib, what):
    m0, f0 = counts()
    p = lib.user_alloc(4096)                               # outside a region: the runtime's
    assert p and counts() == (m0 + 1, f0) and not ours(p), (what, counts())
    assert lib.user_free(p) == 0 and counts() == (m0 + 1, f0 + 1), what
    core.set_region(True, "r", False, "mmap")
    try:
        q = lib.user_alloc(3 * MiB)                        # inside: the library's
    finally:
        core.set_region(False, "default", False, "mmap")
    assert q and ours(q) and counts() == (m0 + 1, f0 + 1), (what, counts())
    data = fill(q, 3 * MiB)
    tms.pause("r"); tms.resume("r")
    assert lib.user_free(q) == 0 and not ours(q) and counts() == (m0 + 1, f0 + 1), what   # freed by the core
"""


def _run(run_py, body, **kw):
    return run_py(PRELUDE + textwrap.dedent(body), **kw)


def test_hooks_reach_objects_loaded_before_and_after(run_py, libs):
    out = check_ok(_run(run_py, """
        early = {k: load(f"libuser_{k}.so") for k in ("lazy", "now", "noplt")}
        before = early["now"].user_alloc(4096)                 # allocated before the patch
        assert core.preload_method() is None
        assert counts() == (1, 0)
        core.install_relocation_hooks()
        core.install_relocation_hooks()                        # idempotent
        assert core.preload_method() == "relocation"
        patched, statics = core.relocation_report()
        for k in early:
            assert os.path.join(D, f"libuser_{k}.so") in patched.splitlines(), (k, patched)
        assert statics == ""
        for k, lib in early.items():
            check_routes(lib, k)
        assert early["now"].user_free(before) == 0 and counts()[1] >= 1   # foreign: forwarded to the runtime
        late = load("libuser_late.so")                         # dlopen'ed by ctypes, through the patched dlopen
        assert os.path.join(D, "libuser_late.so") in core.relocation_report()[0].splitlines()
        check_routes(late, "late")
        print("done")
    """, load_core=False, args=(libs,)))
    assert out == "done\n"


def test_hip_names_and_patching_while_other_threads_allocate(run_py, libs):
    out = check_ok(_run(run_py, """
        lib = load("libuser_lazy.so")
        failures = []
        def churn():
            failures.append(lib.user_churn(200000))            # ctypes releases the GIL: runs during the patch
        threads = [threading.Thread(target=churn) for _ in range(2)]
        for t in threads:
            t.start()
        core.install_relocation_hooks()
        for t in threads:
            t.join()
        assert failures == [0, 0], failures
        m, f = counts()
        assert m == f and m == 400000, (m, f)                   # outside regions: all forwarded, none lost
        core.set_region(True, "h", False, "mmap")
        p = lib.user_hip_alloc(2 * MiB)
        core.set_region(False, "default", False, "mmap")
        assert p and ours(p) and counts() == (m, f)             # hipMalloc in a region: the library's
        assert lib.user_hip_free(p) == 0 and not ours(p)
        print("done")
    """, load_core=False, args=(libs,)))
    assert out == "done\n"


@pytest.mark.parametrize("hooks", [False, True])
def test_bare_name_dlopen_keeps_the_callers_runpath(run_py, libs, hooks):
    # Without the hooks the control: the loader finds libinner.so in the caller's RUNPATH.
    out = check_ok(_run(run_py, f"""
        outer = load("libuser_runpath.so")
        assert not outer.user_open(b"libnothere_tms.so")
        if {hooks}:
            core.install_relocation_hooks()
        h = outer.user_open(b"libinner.so")                    # only in $ORIGIN/sub of the caller
        assert h, "bare-name dlopen lost the caller's RUNPATH"
        inner = load("sub/libinner.so")                        # the same object, already loaded
        if {hooks}:
            assert os.path.join(D, "sub", "libinner.so") in core.relocation_report()[0].splitlines()
            check_routes(inner, "inner")
        print("done")
    """, load_core=False, args=(libs,)))
    assert out == "done\n"


def test_a_statically_linked_runtime_is_named(run_py, libs):
    proc = _run(run_py, """
        ctypes.CDLL(os.path.join(D, "libstatic_runtime.so"))
        core.install_relocation_hooks()
        print(core.relocation_report()[1].strip())
    """, load_core=False, args=(libs,))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(libs / "libstatic_runtime.so")
    assert "libstatic_runtime.so defines cudaMalloc itself" in proc.stderr, proc.stderr


def test_reloc_hooks_off_leaves_objects_alone(run_py, libs):
    out = check_ok(_run(run_py, """
        lib = load("libuser_now.so")
        expect(NotImplementedError, core.install_relocation_hooks, match="TMS_RELOC_HOOKS=0")
        assert core.preload_method() is None and core.relocation_report() == ("", "")
        core.set_region(True, "r", False, "mmap")
        p = lib.user_alloc(MiB)
        core.set_region(False, "default", False, "mmap")
        assert p and not ours(p) and counts() == (1, 0)          # the runtime's, untouched
        print("done")
    """, load_core=False, args=(libs,), env={"TMS_RELOC_HOOKS": "0"}))
    assert out == "done\n"


def test_malformed_reloc_hooks_is_a_value_error(run_py):
    proc = run_py("import torch_memory_saver", prelude=False, env={"TMS_RELOC_HOOKS": "maybe"})
    assert proc.returncode != 0 and "TMS_RELOC_HOOKS='maybe'" in proc.stderr, proc.stderr


def test_a_dlopen_returns_with_the_new_object_patched(run_py, libs):
    # Another thread keeps running passes meanwhile: a library's allocations in a
    # region, made in C right after its dlopen returned, are the library's.
    out = check_ok(_run(run_py, """
        outer = load("libuser_now.so")
        outer.user_open_and_alloc.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
                                              ctypes.POINTER(ctypes.c_void_p)]
        core.install_relocation_hooks()
        done = threading.Event()
        def passes():
            while not done.is_set():
                core.install_relocation_hooks()
        t = threading.Thread(target=passes)
        t.start()
        missed, made = 0, 0
        try:
            for i in range(24):
                got = (ctypes.c_void_p * 8)()
                core.set_region(True, "r", False, "mmap")
                try:
                    assert outer.user_open_and_alloc(os.path.join(D, f"libuser_copy{i}.so").encode(), 2 * MiB, 8, got) == 0
                finally:
                    core.set_region(False, "default", False, "mmap")
                missed += sum(not ours(p) for p in got)
                made += len(got)
                for p in got:
                    outer.user_free(p)
        finally:
            done.set()
            t.join()
        assert missed == 0, f"{missed} of {made} allocations went to the runtime"
        print("done")
    """, load_core=False, args=(libs,)))
    assert out == "done\n"


def test_each_patched_object_forwards_to_its_own_runtime(run_py, libs):
    # Two runtimes: a library linked to the second reaches the second, not the
    # first one the hooks saw; after the first is unloaded, nothing calls into it.
    out = check_ok(_run(run_py, """
        import _ctypes
        stubs = {k: ctypes.CDLL(os.path.join(D, f"libcudart_{k}.so")) for k in "bc"}
        def counts_of(k):
            return stubs[k].stub_mallocs(), stubs[k].stub_frees()

        c = load("libuser_on_c.so")                              # the first runtime the hooks see
        core.install_relocation_hooks()
        p = c.user_alloc(64)
        assert counts_of("c") == (1, 0) and c.user_free(p) == 0 and counts_of("c") == (1, 1)
        b = load("libuser_on_b.so")
        p = b.user_alloc(64)
        assert counts_of("b") == (1, 0) and counts_of("c") == (1, 1), (counts_of("b"), counts_of("c"))
        assert b.user_free(p) == 0 and counts_of("b") == (1, 1)

        # Unload c and its runtime; a library on a third runtime still reaches its own.
        _ctypes.dlclose(c._handle)
        _ctypes.dlclose(stubs.pop("c")._handle)
        maps = open("/proc/self/maps").read()
        assert "libcudart_c.so" not in maps and "libuser_on_c.so" not in maps
        d = load("libuser_on_d.so")
        stubs["d"] = ctypes.CDLL(os.path.join(D, "libcudart_d.so"))
        p = d.user_alloc(64)
        assert counts_of("d") == (1, 0) and d.user_free(p) == 0 and counts_of("d") == (1, 1)
        print("done")
    """, load_core=False, args=(libs,)))
    assert out == "done\n"


def test_a_tail_call_never_reaches_an_unloaded_runtime(run_py, libs):
    # user_free's `return cudaFree(p)` is a tail call: the hook sees a caller
    # outside every patched object. Once the newest runtime is unloaded, such a
    # call goes to a runtime still loaded, not into unmapped memory.
    out = check_ok(_run(run_py, """
        import _ctypes
        now = load("libuser_now.so")                              # tail calls, on libcudart_stub
        core.install_relocation_hooks()
        d = load("libuser_on_d.so")
        d_stub = ctypes.CDLL(os.path.join(D, "libcudart_d.so"))
        assert d.user_free(d.user_alloc(64)) == 0 and d_stub.stub_frees() == 1
        _ctypes.dlclose(d._handle)
        _ctypes.dlclose(d_stub._handle)
        assert "libcudart_d.so" not in open("/proc/self/maps").read()
        m0, f0 = counts()
        p = now.user_alloc(64)
        assert p and now.user_free(p) == 0 and counts() == (m0 + 1, f0 + 1)
        print("done")
    """, load_core=False, args=(libs,)))
    assert out == "done\n"
