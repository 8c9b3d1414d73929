# Tests the native module: relocation hooks (install_relocation_hooks, relocation_report, preload_method), set_region.
"""Preload mode without LD_PRELOAD (tests/test_reloc.py): the hooks installed by patching
the GOT entries of loaded objects, checked with a stub CUDA runtime and small libraries
the test builds into a directory: every case takes that directory first.

`begin` sets hook_mode "preload", starts the core and loads the stub runtime;
check_routes(lib) checks that a library's cudaMalloc/cudaFree reach the runtime outside
a region and the library inside one."""
import ctypes
import os
import sys
import threading

from _prelude import MiB, core, expect, fill, run_cases, start, tms

D = None     # the directory of the built libraries
STUB = None  # the stub runtime (counts the calls that reach it)


def begin(d):
    global D, STUB
    D = d
    tms.hook_mode = "preload"
    start()
    STUB = ctypes.CDLL(os.path.join(D, "libcudart_stub.so"))


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


def counts():
    """(cudaMalloc calls, cudaFree calls) that reached the stub runtime."""
    return STUB.stub_mallocs(), STUB.stub_frees()


def ours(p):
    return any(r["ptr"] == p for r in tms.allocations())


def check_routes(lib, what):
    m0, f0 = counts()
    p = lib.user_alloc(4096)                           # outside a region: the runtime's
    assert p and counts() == (m0 + 1, f0) and not ours(p), (what, counts())
    assert lib.user_free(p) == 0 and counts() == (m0 + 1, f0 + 1), what
    core().set_region(True, "r", False, "mmap")
    try:
        q = lib.user_alloc(3 * MiB)                    # inside: the library's
    finally:
        core().set_region(False, "default", False, "mmap")
    assert q and ours(q) and counts() == (m0 + 1, f0 + 1), (what, counts())
    fill(q, 3 * MiB)
    tms.pause("r")
    tms.resume("r")
    assert lib.user_free(q) == 0 and not ours(q) and counts() == (m0 + 1, f0 + 1), what   # freed by the core


def before_and_after(d):
    """Objects loaded before the patch (lazy, now, -fno-plt) and one dlopen'ed after it."""
    begin(d)
    native = core()
    early = {k: load(f"libuser_{k}.so") for k in ("lazy", "now", "noplt")}
    before = early["now"].user_alloc(4096)             # allocated before the patch
    assert native.preload_method() is None
    assert counts() == (1, 0)
    native.install_relocation_hooks()
    native.install_relocation_hooks()                  # idempotent
    assert native.preload_method() == "relocation"
    patched, statics = native.relocation_report()
    for k in early:
        assert os.path.join(D, f"libuser_{k}.so") in patched.splitlines(), (k, patched)
    assert statics == ""
    for k, lib in early.items():
        check_routes(lib, k)
    assert early["now"].user_free(before) == 0 and counts()[1] >= 1   # foreign: forwarded to the runtime
    late = load("libuser_late.so")                     # dlopen'ed by ctypes, through the patched dlopen
    assert os.path.join(D, "libuser_late.so") in native.relocation_report()[0].splitlines()
    check_routes(late, "late")
    print("done")


def hip_names_while_others_allocate(d):
    """The patch while two threads churn cudaMalloc/cudaFree; hipMalloc in a region."""
    begin(d)
    native = core()
    lib = load("libuser_lazy.so")
    failures = []

    def churn():
        failures.append(lib.user_churn(200000))        # ctypes releases the GIL: runs during the patch

    threads = [threading.Thread(target=churn) for _ in range(2)]
    for t in threads:
        t.start()
    native.install_relocation_hooks()
    for t in threads:
        t.join()
    assert failures == [0, 0], failures
    m, f = counts()
    assert m == f and m == 400000, (m, f)              # outside regions: all forwarded, none lost
    native.set_region(True, "h", False, "mmap")
    p = lib.user_hip_alloc(2 * MiB)
    native.set_region(False, "default", False, "mmap")
    assert p and ours(p) and counts() == (m, f)        # hipMalloc in a region: the library's
    assert lib.user_hip_free(p) == 0 and not ours(p)
    print("done")


def bare_name_dlopen(d, hooks):
    """A bare-name dlopen finds libinner.so in the caller's RUNPATH, with the hooks ("True") or without."""
    begin(d)
    hooks = {"True": True, "False": False}[hooks]
    outer = load("libuser_runpath.so")
    assert not outer.user_open(b"libnothere_tms.so")
    if hooks:
        core().install_relocation_hooks()
    h = outer.user_open(b"libinner.so")                # only in $ORIGIN/sub of the caller
    assert h, "bare-name dlopen lost the caller's RUNPATH"
    inner = load("sub/libinner.so")                    # the same object, already loaded
    if hooks:
        assert os.path.join(D, "sub", "libinner.so") in core().relocation_report()[0].splitlines()
        check_routes(inner, "inner")
    print("done")


def static_runtime(d):
    """Prints the objects that define cudaMalloc themselves (the report's second part)."""
    begin(d)
    ctypes.CDLL(os.path.join(D, "libstatic_runtime.so"))
    core().install_relocation_hooks()
    print(core().relocation_report()[1].strip())


def hooks_off(d):
    """TMS_RELOC_HOOKS=0: installing raises, objects are left alone."""
    begin(d)
    native = core()
    lib = load("libuser_now.so")
    expect(NotImplementedError, native.install_relocation_hooks, match="TMS_RELOC_HOOKS=0")
    assert native.preload_method() is None and native.relocation_report() == ("", "")
    native.set_region(True, "r", False, "mmap")
    p = lib.user_alloc(MiB)
    native.set_region(False, "default", False, "mmap")
    assert p and not ours(p) and counts() == (1, 0)    # the runtime's, untouched
    print("done")


def dlopen_returns_patched(d):
    """Another thread keeps running passes: allocations made in C right after a dlopen
    returned, in a region, are the library's."""
    begin(d)
    native = core()
    outer = load("libuser_now.so")
    outer.user_open_and_alloc.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int,
                                          ctypes.POINTER(ctypes.c_void_p)]
    native.install_relocation_hooks()
    done = threading.Event()

    def passes():
        while not done.is_set():
            native.install_relocation_hooks()

    t = threading.Thread(target=passes)
    t.start()
    missed, made = 0, 0
    try:
        for i in range(24):
            got = (ctypes.c_void_p * 8)()
            native.set_region(True, "r", False, "mmap")
            try:
                path = os.path.join(D, f"libuser_copy{i}.so").encode()
                assert outer.user_open_and_alloc(path, 2 * MiB, 8, got) == 0
            finally:
                native.set_region(False, "default", False, "mmap")
            missed += sum(not ours(p) for p in got)
            made += len(got)
            for p in got:
                outer.user_free(p)
    finally:
        done.set()
        t.join()
    assert missed == 0, f"{missed} of {made} allocations went to the runtime"
    print("done")


def own_runtimes(d):
    """Two runtimes: a library linked to the second reaches the second; after the first is
    unloaded, nothing calls into it."""
    import _ctypes

    begin(d)
    stubs = {k: ctypes.CDLL(os.path.join(D, f"libcudart_{k}.so")) for k in "bc"}

    def counts_of(k):
        return stubs[k].stub_mallocs(), stubs[k].stub_frees()

    c = load("libuser_on_c.so")                        # the first runtime the hooks see
    core().install_relocation_hooks()
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


def tail_call_after_dlclose(d):
    """A tail call (user_free's `return cudaFree(p)`) has a caller outside every patched
    object; after the newest runtime is unloaded it reaches one still loaded."""
    import _ctypes
    begin(d)
    now = load("libuser_now.so")                              # tail calls, on libcudart_stub
    core().install_relocation_hooks()
    lib_d = load("libuser_on_d.so")
    d_stub = ctypes.CDLL(os.path.join(D, "libcudart_d.so"))
    assert lib_d.user_free(lib_d.user_alloc(64)) == 0 and d_stub.stub_frees() == 1
    _ctypes.dlclose(lib_d._handle)
    _ctypes.dlclose(d_stub._handle)
    assert "libcudart_d.so" not in open("/proc/self/maps").read()
    m0, f0 = counts()
    p = now.user_alloc(64)
    assert p and now.user_free(p) == 0 and counts() == (m0 + 1, f0 + 1)
    print("done")


def _mapping_of(addr):
    """(start, end, perms) of the mapping holding addr, from /proc/self/maps now."""
    with open("/proc/self/maps") as f:
        for line in f:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return lo, hi, perms
    raise AssertionError(f"nothing maps {addr:#x}")


def _got_slot(path, value):
    """The address of the pointer-sized word holding value in the mappings of the object at path."""
    with open("/proc/self/maps") as f:
        spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in f
                 if line.rstrip().endswith(path) and line.split()[1].startswith("r")]
    for lo, hi in spans:
        words = (ctypes.c_uint64 * ((hi - lo) // 8)).from_address(lo)
        for i, w in enumerate(words):
            if w == value:
                return lo + 8 * i
    raise AssertionError(f"no word {value:#x} in {path}")


def protection_changed_during_pass(d, change):
    """Another party changes the protection of a library's GOT page after the pass began
    and before the pass stores into it (tests/c/reloc_mprotect.c, on LD_PRELOAD): the
    store keeps that change, whether it made the page writable or read-only again."""
    begin(d)
    load("libuser_lazy.so")                            # patched before the next one
    lib = load("libuser_now.so")                       # full RELRO: its GOT is read-only
    path = os.path.join(D, "libuser_now.so")
    slot = _got_slot(path, ctypes.cast(STUB.cudaMalloc, ctypes.c_void_p).value)
    page = slot & ~(os.sysconf("SC_PAGESIZE") - 1)
    assert _mapping_of(slot)[2].startswith("r--"), _mapping_of(slot)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    other = ctypes.CDLL(os.environ["LD_PRELOAD"])
    other.reloc_mprotect_arm.argtypes = [ctypes.c_void_p, ctypes.c_int]
    if change == "made_writable":                      # as another patcher starting its store
        other.reloc_mprotect_arm(page, 3)              # PROT_READ | PROT_WRITE
        want = "rw-"
    else:                                              # writable when the pass began, read-only again since
        assert libc.mprotect(page, os.sysconf("SC_PAGESIZE"), 3) == 0, ctypes.get_errno()
        other.reloc_mprotect_arm(page, 1)              # PROT_READ
        want = "r--"
    core().install_relocation_hooks()
    assert other.reloc_mprotect_fired_first() == 1     # the change came before the store into that page
    assert _mapping_of(slot)[2].startswith(want), (change, _mapping_of(slot))
    check_routes(lib, change)                          # and the store happened
    print("done")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)


def ipc_hooks_later(d):
    """The torch variant's IPC hooks installed beside the caller: install_ipc_hooks()
    waits for that walk, after which a library's cudaIpcGetMemHandle of region memory
    is the library's handle and of other memory the runtime's; a child forked after it
    installs again without waiting for a thread it does not have."""
    global D, STUB
    D = d
    tms.hook_mode = "torch"
    start()
    STUB = ctypes.CDLL(os.path.join(D, "libcudart_stub.so"))
    lib = ctypes.CDLL(os.path.join(D, "libuser_now.so"))
    lib.user_ipc_get.argtypes = [ctypes.c_char_p, ctypes.c_void_p]
    handle = ctypes.create_string_buffer(64)
    with tms.region("ipc"):
        p = core().malloc(2 * MiB)
    assert lib.user_ipc_get(handle, p) == 0 and handle.raw == b"\xab" * 64 and STUB.stub_ipc_gets() == 1
    core().install_ipc_hooks_later()
    core().install_ipc_hooks_later()   # once: the second asks nothing
    core().install_ipc_hooks()         # waits for the walk begun beside
    assert lib.user_ipc_get(handle, p) == 0 and handle.raw[:8] == b"TMSSHR01", handle.raw[:8]
    assert STUB.stub_ipc_gets() == 1, "region memory's handle came from the runtime"
    other = ctypes.create_string_buffer(4096)
    assert lib.user_ipc_get(handle, ctypes.addressof(other)) == 0 and handle.raw == b"\xab" * 64
    assert STUB.stub_ipc_gets() == 2, "other memory's handle did not come from the runtime"
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            core().install_ipc_hooks()
            code = 0 if lib.user_ipc_get(handle, ctypes.addressof(other)) == 0 else 2
        finally:
            os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0, "the forked child could not install the hooks"
    core().free(p)
