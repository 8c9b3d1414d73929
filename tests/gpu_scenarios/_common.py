"""Helpers shared by the GPU scenarios (imported as `_common`: scenarios run by file path).

Memory checks count what the library did, never the device's free memory: a pause's
or resume's report says how many bytes it released or mapped (the core adds up each
allocation's unmap and release, or create and map, as the driver confirmed them), and
the allocation table (torch_memory_saver._core.allocations()) how many each tag holds,
so the two must agree exactly. Free memory (torch.cuda.mem_get_info) is the whole
device's: a copy stream the library creates on first use, PyTorch's cache, the CUDA
context's own growth or another process move it by megabytes at any moment. PyTorch's
own counters (torch.cuda.memory_reserved) are exact for what PyTorch holds.
"""
import torch

from torch_memory_saver import torch_memory_saver as tms

MiB = 1 << 20
GiB = 1 << 30
HOOK_MODES = ("preload", "torch")
def say(msg):
    print(msg, flush=True)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


def mib(n):
    return f"{n / MiB:.1f} MiB"


def begin(name, hook_mode):
    """Chooses the hook mode before any other use of the library and seeds the RNGs.
    Touches no device memory: a scenario's first CUDA work is its own."""
    check(hook_mode in HOOK_MODES, f"hook mode must be one of {HOOK_MODES}, got {hook_mode!r}")
    check(torch.cuda.is_available(), "this scenario needs a CUDA GPU")
    tms.hook_mode = hook_mode
    torch.manual_seed(20240611)
    say(f"== {name}: hook_mode={hook_mode}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
        f"{torch.cuda.device_count()} device(s)")
    if hook_mode == "preload":
        import os

        want = os.environ.get("TMS_TEST_PRELOAD_METHOD", "ld_preload")
        method = tms.preload_method  # installs the relocation hooks when not preloaded
        check(method == want, f"hook_mode='preload' reaches the hooks by {method!r}, expected {want!r} "
                              f"(LD_PRELOAD={os.environ.get('LD_PRELOAD')!r})")
        say(f"preload method: {method}")
    return tms


def core():
    """The native module in use (torch_memory_saver._tms_<hook_mode>)."""
    return tms._core


def check_installed():
    """The compatibility scenarios run against the installed package: the harness
    names its site directory in COMPAT_SITE."""
    import os

    import torch_memory_saver

    site = os.environ.get("COMPAT_SITE")
    check(site, "COMPAT_SITE is not set: run this scenario through tests/test_gpu.py")
    check(torch_memory_saver.__file__.startswith(site + os.sep),
          f"torch_memory_saver imported from {torch_memory_saver.__file__}, not the installed copy in {site}")
    say(f"installed package: {torch_memory_saver.__file__}")


def rss_bytes():
    """This process's resident set size (VmRSS), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def free_bytes(device=None):
    """Free memory of a device (default: the current one) once its queued work is done."""
    device = torch.cuda.current_device() if device is None else device
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0]


# ---- the library's allocation table --------------------------------------------

def allocations(tag=None, device=None):
    return [r for r in core().allocations()
            if (tag is None or r["tag"] == tag) and (device is None or r["device"] == device)]


def tag_bytes(tag, device=None):
    """Bytes of device memory the library's allocations of `tag` occupy when mapped."""
    return sum(r["reserved"] for r in allocations(tag, device))


def owner(x):
    """The allocation-table row holding tensor (or pointer) x, or None."""
    ptr = x if isinstance(x, int) else x.data_ptr()
    for r in core().allocations():
        if r["ptr"] <= ptr < r["ptr"] + r["reserved"]:
            return r
    return None


def check_owned(t, tag, what, device=None):
    row = owner(t)
    check(row is not None, f"{what} (0x{t.data_ptr():x}) is not a torch_memory_saver allocation")
    check(row["tag"] == tag, f"{what} belongs to tag {row['tag']!r}, expected {tag!r}")
    if device is not None:
        check(row["device"] == device, f"{what} is recorded on device {row['device']}, expected {device}")
    return row


def check_states(tag, state):
    rows = allocations(tag)
    check(rows, f"tag {tag!r} has no allocations")
    wrong = [r for r in rows if r["state"] != state]
    check(not wrong, f"tag {tag!r}: {len(wrong)} of {len(rows)} allocations are not {state}: {wrong}")


# ---- what a pause or resume did --------------------------------------------------

def _reported(report, op, device):
    check(report is not None and getattr(report, "op", None) == op, f"expected the Report of a {op}, got {report!r}")
    if device is None:
        return report.released_bytes
    return report.devices[device].released_bytes if device in report.devices else 0


def check_released(report, nbytes, what, device=None):
    """A pause's report says it released exactly nbytes (on `device`, or on every device):
    what the allocations it paused held."""
    got = _reported(report, "pause", device)
    say(f"  {what}: released {mib(got)} (the allocations hold {mib(nbytes)})")
    check(nbytes > 0, f"{what}: nothing to release (0 bytes)")
    check(got == nbytes, f"{what}: the pause released {got} bytes, the allocations hold {nbytes} ({report!r})")


def check_taken(report, nbytes, what, device=None):
    """A resume's report says it mapped back exactly nbytes (on `device`, or on every device)."""
    got = _reported(report, "resume", device)
    say(f"  {what}: mapped {mib(got)} (the allocations hold {mib(nbytes)})")
    check(nbytes > 0, f"{what}: nothing to map back (0 bytes)")
    check(got == nbytes, f"{what}: the resume mapped {got} bytes, the allocations hold {nbytes} ({report!r})")


def mapped_bytes(device=None):
    """Bytes of device memory the library's allocations hold mapped now (stats() counters)."""
    return sum(r["bytes_mapped"] for r in core().stats() if device is None or r["device"] == device)


# ---- tensors --------------------------------------------------------------------

def random_tensor(numel, dtype, device="cuda"):
    """Random (not constant) values over the dtype's range."""
    if dtype == torch.bool:
        return torch.rand(numel, device=device) > 0.5
    if dtype.is_floating_point:
        return torch.randn(numel, dtype=dtype, device=device)
    low, high = {torch.uint8: (0, 256), torch.int16: (-2**15, 2**15 - 1),
                 torch.int32: (-2**31, 2**31 - 1), torch.int64: (-2**62, 2**62)}[dtype]
    return torch.randint(low, high, (numel,), dtype=dtype, device=device)


def check_equal(actual, expected, what):
    """actual (any device) equals the CPU tensor expected: same dtype, shape, every element."""
    got = actual.cpu()
    check(got.dtype == expected.dtype, f"{what}: dtype {got.dtype}, expected {expected.dtype}")
    check(got.shape == expected.shape, f"{what}: shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    if not torch.equal(got, expected):
        wrong = int((got != expected).sum())
        raise AssertionError(f"{what}: {wrong} of {expected.numel()} elements differ from the expected contents")


def check_filled(t, value, what):
    """Every element of t equals value (t is written with fill_ by the caller)."""
    lo, hi = t.min().item(), t.max().item()
    check(lo == value and hi == value, f"{what}: expected every element == {value}, found min {lo}, max {hi}")


def expect_error(exc_type, fn, *fragments):
    """fn() raises exc_type whose message contains every fragment; returns the exception."""
    try:
        fn()
    except exc_type as e:
        for fragment in fragments:
            check(fragment in str(e), f"{exc_type.__name__} message lacks {fragment!r}: {e}")
        say(f"  raised as expected: {type(e).__module__}.{type(e).__name__}: {e}")
        return e
    raise AssertionError(f"expected {exc_type.__name__} containing {fragments}, nothing was raised")


# ---- disable() ------------------------------------------------------------------

def check_disable_gives_memory_back(tms, what, nbytes):
    """Allocates and frees nbytes under disable(): when the block ends, the segment that
    held it is no longer PyTorch's and PyTorch holds no more than before (its own
    counters), and the tensor was never the library's."""
    before = torch.cuda.memory_reserved()
    with tms.disable():
        t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        t.fill_(9)
        check(owner(t) is None, f"disable() {what}: a tensor allocated inside is pauseable")
        ptr = t.data_ptr()
        del t
    torch.cuda.synchronize()
    after = torch.cuda.memory_reserved()
    kept = [s for s in torch.cuda.memory_snapshot() if s["address"] <= ptr < s["address"] + s["total_size"]]
    say(f"  disable() {what}: PyTorch reserves {mib(after - before)} more after {mib(nbytes)} in and out")
    check(not kept, f"disable() {what}: the segment of the block's tensor is still PyTorch's after the block: {kept}")
    check(after <= before, f"disable() {what}: PyTorch reserves {mib(after - before)} more after the block "
                           f"({mib(nbytes)} allocated and freed)")


# ---- raw cudaMalloc, as C++ extensions (DeepEP, NCCL buffers) call it ----------------

def raw_cuda_malloc(nbytes):
    """cudaMalloc looked up in the process's global scope, as a C++ library calls it
    (in preload mode: the library's hook, which forwards outside regions)."""
    import ctypes

    ptr = ctypes.c_void_p()
    rc = ctypes.CDLL(None).cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(nbytes))
    check(rc == 0 and ptr.value, f"cudaMalloc({nbytes}) returned {rc}")
    return ptr.value


def raw_cuda_free(ptr):
    import ctypes

    rc = ctypes.CDLL(None).cudaFree(ctypes.c_void_p(ptr))
    check(rc == 0, f"cudaFree(0x{ptr:x}) returned {rc}")


class _CudaArray:
    def __init__(self, ptr, nbytes):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


def raw_tensor(ptr, nbytes):
    """A uint8 tensor over device memory torch did not allocate."""
    return torch.as_tensor(_CudaArray(ptr, nbytes), device="cuda")


# ---- a computation for CUDA graphs ---------------------------------------------

def graph_body(x):
    """Elementwise work whose intermediates are each as large as x (two live at
    the peak); returns a small strided sample of the result. Elementwise kernels
    give bit-identical results eagerly and in a graph replay."""
    y = x * 2
    y = y + 1
    z = y.sin()
    return z[::4096].clone()


def warm_up(fn, *args):
    """Runs fn on a side stream before capture, as torch.cuda.graph recommends."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
