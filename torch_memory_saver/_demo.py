"""The walk-through `python -m torch_memory_saver demo` runs: GPU if present, host backend otherwise."""
import ctypes
import importlib
import os
import sys
import time

GiB = 1 << 30
MiB = 1 << 20
# What the demo pauses and resumes: (kv_cache, weights) bytes on a GPU, and on the host backend.
GPU_BYTES = (4 * GiB, 1 * GiB)
HOST_BYTES = (256 * MiB, 256 * MiB)


def _size(n):
    return f"{n // GiB} GiB" if n % GiB == 0 else f"{n // MiB} MiB"


def what_it_does():
    """One line on what the demo moves, for --help and README."""
    return (f"pauses and resumes {_size(sum(GPU_BYTES))} in two tags on a GPU ({_size(sum(HOST_BYTES))} on the "
            f"host backend, where there is none)")


def gpu_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def _row(step, free, ms):
    print(f"| {step:<40} | {free / GiB:>10.2f} | {ms:>9.1f} |")


def _step(step, fn, measure):
    """Runs fn, then prints the memory reading taken after it and its time."""
    t0 = time.perf_counter()
    fn()
    ms = (time.perf_counter() - t0) * 1e3
    _row(step, measure(), ms)


def _gpu_demo(hook_mode):
    import torch

    from . import torch_memory_saver as tms

    tms.hook_mode = hook_mode
    free = lambda: (torch.cuda.synchronize(), torch.cuda.mem_get_info()[0])[1]  # noqa: E731
    print(f"GPU: {torch.cuda.get_device_name()}, hook_mode={hook_mode}\n")
    print(f"| {'step':<40} | free (GiB) | time (ms) |")
    print(f"|{'-' * 42}|-----------:|----------:|")
    _row("start", free(), 0)
    t0 = time.perf_counter()
    kv_bytes, weight_bytes = GPU_BYTES
    with tms.region(tag="kv_cache"):
        kv = torch.empty(kv_bytes, dtype=torch.uint8, device="cuda")
    with tms.region(tag="weights", enable_cpu_backup=True):
        weights = torch.randn(weight_bytes // 4, device="cuda")  # float32
    expected = weights[:1000].cpu()
    _row(f"allocate {_size(kv_bytes)} kv_cache + {_size(weight_bytes)} weights", free(), (time.perf_counter() - t0) * 1e3)
    _step("pause kv_cache (discard)", lambda: tms.pause("kv_cache"), free)
    _step("pause weights (backup to host)", lambda: tms.pause("weights"), free)
    _step("resume weights (restore)", lambda: tms.resume("weights"), free)
    _step("resume kv_cache", lambda: tms.resume("kv_cache"), free)
    same = torch.equal(weights[:1000].cpu(), expected)
    kv.fill_(1)
    print(f"\nweights restored exactly: {same}; kv_cache usable at the same address: {int(kv[-1]) == 1}")
    return 0 if same else 1


def _rss():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _host_demo(hook_mode):
    os.environ["TMS_BACKEND"] = "host"
    from . import torch_memory_saver as tms

    tms.hook_mode = hook_mode
    core = tms._core
    core.use_backend("host")
    size, weight_size = HOST_BYTES
    assert size == weight_size, "the host walk-through fills both tags alike"
    print("No GPU here: the same walk-through on the host backend (VMM emulated on memfd),")
    print("showing this process's resident memory (RSS) instead of free GPU memory.\n")
    print(f"| {'step':<40} | RSS (GiB)  | time (ms) |")
    print(f"|{'-' * 42}|-----------:|----------:|")
    _row("start", _rss(), 0)
    t0 = time.perf_counter()
    with tms.region(tag="kv_cache"):
        kv = core.malloc(size)
    with tms.region(tag="weights", enable_cpu_backup=True):
        weights = core.malloc(size)
    ctypes.memset(kv, 1, size)
    pattern = os.urandom(1 << 20)
    for off in range(0, size, len(pattern)):
        ctypes.memmove(weights + off, pattern, len(pattern))
    _row(f"allocate+touch {_size(size)} kv_cache + {_size(size)} weights", _rss(), (time.perf_counter() - t0) * 1e3)
    _step("pause kv_cache (discard)", lambda: tms.pause("kv_cache"), _rss)
    _step("pause weights (backup to host)", lambda: tms.pause("weights"), _rss)
    _step("resume weights (restore)", lambda: tms.resume("weights"), _rss)
    _step("resume kv_cache", lambda: tms.resume("kv_cache"), _rss)
    same = all(ctypes.string_at(weights + off, len(pattern)) == pattern for off in range(0, size, len(pattern)))
    print(f"\nweights restored exactly: {same}; same addresses: kv=0x{kv:x} weights=0x{weights:x}")
    core.free(kv)
    core.free(weights)
    return 0 if same else 1


def main(hook_mode="preload"):
    if gpu_available():
        return _gpu_demo(hook_mode)
    asked = importlib.import_module("torch_memory_saver._tms_env").env_choice("backend")
    if asked and asked != "host":
        # Asked for a GPU backend: running on the host one instead would answer another question.
        print(f"torch_memory_saver demo: TMS_BACKEND={asked} asks for a GPU, but PyTorch sees none here (or is not "
              f"installed); unset TMS_BACKEND, or set TMS_BACKEND=host, to run the demo on the host backend",
              file=sys.stderr)
        return 1
    return _host_demo(hook_mode)
