"""Section 4: what the library adds where no pause/resume happens.

- alloc_overhead: cost of one allocation that reaches the allocator (cudaMalloc or
  the pluggable allocator), inside a region vs plain PyTorch, in this process's
  hook mode;
- passthrough: cudaMalloc+cudaFree outside any region, called through ctypes. In
  the preloaded process `ctypes.CDLL(None).cudaMalloc` is the preload library's
  hook (it forwards to libcudart); in a process without preload it is libcudart's
  own function, found in the process's maps. The difference is what the preload
  adds to every allocation of code outside regions.
"""
import ctypes
import ctypes.util
import glob
import os
import sys
import time

from .common import MiB, log, median


# ---- allocation overhead ----------------------------------------------------------

def alloc_overhead(env, params, deadline):
    n, size, rounds = int(params["count"]), int(params["bytes"]), int(params["rounds"])
    out = {"allocations_per_round": n, "allocation_bytes": size, "rounds_requested": rounds,
           "note": ("each round allocates fresh tensors that stay alive, so every one reaches the allocator "
                    "(region: a fresh tag/MemPool per round; plain: after torch.cuda.empty_cache())")}
    region_us, plain_us, plain_free_us, counts = [], [], [], []
    for r in range(rounds):
        if r >= 2 and not deadline.allows(3.0):
            out["truncated"] = True
            break
        region_us.append(_region_round(env, f"ao-{r}", n, size, counts))
        a, f = _plain_round(env, n, size)
        plain_us.append(a)
        plain_free_us.append(f)
    out["region_alloc_us"] = region_us
    out["plain_alloc_us"] = plain_us
    out["plain_free_us"] = plain_free_us
    out["region_allocations_seen"] = counts
    out["region_alloc_median_us"] = median(region_us)
    out["plain_alloc_median_us"] = median(plain_us)
    out["plain_free_median_us"] = median(plain_free_us)
    log(f"alloc overhead: region {out['region_alloc_median_us']:.1f} us/alloc, "
        f"plain {out['plain_alloc_median_us']:.1f} us/alloc")
    return out


def _region_round(env, tag, n, size, counts):
    tms = env.tms
    env.sync()
    if env.kind == "cuda":
        torch = env.torch
        with tms.region(tag=tag):
            t0 = time.perf_counter()
            block = [torch.empty(size, dtype=torch.uint8, device=env.device) for _ in range(n)]
            t1 = time.perf_counter()
    else:
        with tms.region(tag=tag):
            t0 = time.perf_counter()
            block = [(tms.malloc(size), size) for _ in range(n)]
            t1 = time.perf_counter()
    counts.append(len(env.tag_allocs(tag)))
    env.dispose(block, tag)
    return (t1 - t0) / n * 1e6


def _plain_round(env, n, size):
    if env.kind == "cuda":
        torch = env.torch
        torch.cuda.empty_cache()
        env.sync()
        t0 = time.perf_counter()
        block = [torch.empty(size, dtype=torch.uint8, device=env.device) for _ in range(n)]
        t1 = time.perf_counter()
        block.clear()
        env.sync()
        t2 = time.perf_counter()
        torch.cuda.empty_cache()
        t3 = time.perf_counter()
    else:  # dry-run stand-in: libc malloc/free
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]
        t0 = time.perf_counter()
        ptrs = [libc.malloc(size) for _ in range(n)]
        t1 = t2 = time.perf_counter()
        for p in ptrs:
            libc.free(p)
        t3 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t3 - t2) / n * 1e6


# ---- preload pass-through ---------------------------------------------------------

def _mapped_cudart():
    """Paths of libcudart mapped into this process (after CUDA init)."""
    found = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(None, 5)
                if len(parts) == 6 and "libcudart" in os.path.basename(parts[5].strip()):
                    path = parts[5].strip()
                    if path not in found and os.path.exists(path):
                        found.append(path)
    except OSError:
        pass
    return found


def find_cudart():
    """libcudart as PyTorch loaded it; else the usual places."""
    maps = _mapped_cudart()
    if maps:
        return maps[0], "process maps"
    candidates = []
    try:
        import torch

        candidates += glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libcudart.so*"))
    except Exception:
        pass
    for sp in sys.path:
        candidates += sorted(glob.glob(os.path.join(sp, "nvidia", "*", "lib", "libcudart.so*")))
    name = ctypes.util.find_library("cudart")
    if name:
        candidates.append(name)
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            candidates += sorted(glob.glob(os.path.join(root, "lib*", "libcudart.so*")))
    for c in candidates:
        try:
            ctypes.CDLL(c)
            return c, "search"
        except OSError:
            continue
    raise RuntimeError("libcudart not found (not in /proc/self/maps, torch/lib, nvidia/*/lib, ldconfig, CUDA_HOME)")


def _fn_addr(fn):
    return ctypes.cast(fn, ctypes.c_void_p).value


def _bind(lib):
    malloc = lib.cudaMalloc
    malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
    malloc.restype = ctypes.c_int
    free = lib.cudaFree
    free.argtypes = [ctypes.c_void_p]
    free.restype = ctypes.c_int
    return malloc, free


def _pairs_ns(paths, size, iters, batches):
    """ns per cudaMalloc+cudaFree pair for each {label: (malloc, free)}, batches
    interleaved so that the paths see the same conditions."""
    p = ctypes.c_void_p()
    pp = ctypes.byref(p)
    rcs = {}
    for label, (malloc, free) in paths.items():
        rc = malloc(pp, size)
        rcs[label] = [rc, free(p)]
        for _ in range(min(iters, 200)):  # warm caches, lazy binding, driver pools
            malloc(pp, size)
            free(p)
    per = {label: [] for label in paths}
    for _ in range(batches):
        for label, (malloc, free) in paths.items():
            t0 = time.perf_counter_ns()
            for _ in range(iters):
                malloc(pp, size)
                free(p)
            per[label].append((time.perf_counter_ns() - t0) / iters)
    return per, rcs


def passthrough(env, params, deadline):
    """In the preload process: through the hook (ctypes.CDLL(None), i.e. what any
    library calling cudaMalloc gets) and, interleaved in the same process, libcudart's
    own functions (dlsym on its handle bypasses the hook). In a process without
    preload: libcudart's functions only, for the cross-process comparison."""
    mode = env.mode
    out = {"mode": mode}
    if env.kind != "cuda" and mode == "preload":
        # Dry run: PyTorch did not load libcudart; load it into the global scope
        # as PyTorch does, so the hook can forward to it.
        ctypes.CDLL(find_cudart()[0], mode=ctypes.RTLD_GLOBAL)
    cudart_path, how = find_cudart()
    cudart = ctypes.CDLL(cudart_path)
    out["cudart"] = cudart_path
    out["cudart_found_by"] = how
    paths = {}
    if mode == "preload":
        preload = os.environ.get("LD_PRELOAD", "").replace(":", " ").split()
        ours = [e for e in preload if "_tms_preload" in os.path.basename(e)]
        if not ours:
            raise RuntimeError(f"LD_PRELOAD does not hold the preload library: {os.environ.get('LD_PRELOAD')!r}")
        hooked = _bind(ctypes.CDLL(None))
        out["library"] = ours[0]
        out["resolves_to_hook"] = _fn_addr(hooked[0]) == _fn_addr(ctypes.CDLL(ours[0]).cudaMalloc)
        if not out["resolves_to_hook"]:
            raise RuntimeError("ctypes.CDLL(None).cudaMalloc is not the preload library's hook")
        paths["hook"] = hooked
        try:
            out["core_allocations_alive"] = len(env.tms.allocations())
        except Exception:
            pass
    paths["direct"] = _bind(cudart)
    if mode == "preload" and _fn_addr(paths["direct"][0]) == _fn_addr(paths["hook"][0]):
        raise RuntimeError(f"dlsym on {cudart_path} returned the hook, not libcudart's cudaMalloc")

    libc = ctypes.CDLL(None)
    labs = libc.labs
    labs.argtypes = [ctypes.c_long]
    labs.restype = ctypes.c_long
    k = int(params["null_iters"])
    t0 = time.perf_counter_ns()
    for _ in range(k):
        labs(-1)
        labs(-1)
    out["ctypes_two_calls_ns"] = (time.perf_counter_ns() - t0) / k

    batches = int(params["batches"])
    variants = (("null", 0, int(params["null_iters"])), ("2MiB", 2 * MiB, int(params["alloc_iters"])))
    try:
        for name, size, iters in variants:
            if not deadline.allows(2.0 * len(paths)):
                out[f"{name}_skipped"] = "time budget"
                continue
            per, rcs = _pairs_ns(paths, size, iters, batches)
            main = "hook" if mode == "preload" else "direct"
            out[f"{name}_bytes"] = size
            out[f"{name}_iters"] = iters
            out[f"{name}_first_rc"] = rcs
            out[f"{name}_pair_ns"] = per[main]
            out[f"{name}_pair_median_ns"] = median(per[main])
            if mode == "preload":
                out[f"{name}_direct_pair_ns"] = per["direct"]
                out[f"{name}_direct_pair_median_ns"] = median(per["direct"])
            if env.kind == "cuda" and size and any(rc != [0, 0] for rc in rcs.values()):
                raise RuntimeError(f"cudaMalloc({size})/cudaFree returned {rcs} (hook: {out.get('library')}, "
                                   f"direct: {cudart_path})")
            msg = f"passthrough {mode} {name}: {out[f'{name}_pair_median_ns']:.0f} ns per cudaMalloc+cudaFree"
            if mode == "preload":
                msg += f" (libcudart directly in this process: {out[f'{name}_direct_pair_median_ns']:.0f} ns)"
            log(msg)
    finally:
        # A failed call (e.g. cudaMalloc of 0 bytes, if the runtime refuses it)
        # would leave an error that PyTorch's next launch check reports: clear it.
        out["last_error_cleared"] = _clear_last_error(cudart)
    return out


def _clear_last_error(lib):
    try:
        fn = lib.cudaGetLastError
        fn.restype = ctypes.c_int
        fn.argtypes = []
        return fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"


# ---- pass-through during a pause ---------------------------------------------------

def _percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None


def _latency_summary(samples_ns):
    return {"samples": len(samples_ns), "p50_us": _percentile(samples_ns, 0.50) / 1e3 if samples_ns else None,
            "p99_us": _percentile(samples_ns, 0.99) / 1e3 if samples_ns else None,
            "max_us": max(samples_ns) / 1e3 if samples_ns else None}


def contention(env, params, deadline):
    """Latency of calls on a second thread, idle and while the main thread
    pauses params['bytes'] with backup. With the table lock spanning a pause,
    any call that took it would wait for the whole pause.

    - pair: cudaMalloc+cudaFree of 2 MiB outside any region, through the hook
      and through libcudart's own functions, interleaved: the hook's cost is
      the difference (during the copies CUDA's own pair is slow: its
      cudaFree waits for the device);
    - foreign free: cudaFree of a host address (neither the library's nor
      CUDA's), through the hook and directly: the hook's lookup takes the table
      lock, and CUDA answers at once with an error (per-thread, cleared);
    - stats(): the library's counters, from Python."""
    if env.mode != "preload":
        raise RuntimeError("contention runs in the preload process (the hook is what it measures)")
    if env.kind != "cuda":
        ctypes.CDLL(find_cudart()[0], mode=ctypes.RTLD_GLOBAL)  # dry run: something to forward to
    import threading

    cudart = ctypes.CDLL(find_cudart()[0])
    hook_malloc, hook_free = _bind(ctypes.CDLL(None))
    direct_malloc, direct_free = _bind(cudart)
    size = 2 * MiB
    foreign = ctypes.create_string_buffer(4096)
    foreign_ptr = ctypes.cast(foreign, ctypes.c_void_p)
    p = ctypes.c_void_p()
    pp = ctypes.byref(p)
    ops = {
        "pair_hook": lambda: (hook_malloc(pp, size), hook_free(p)),
        "pair_direct": lambda: (direct_malloc(pp, size), direct_free(p)),
        "foreign_free_hook": lambda: hook_free(foreign_ptr),
        "foreign_free_direct": lambda: direct_free(foreign_ptr),
        "stats": env.tms.stats,
    }
    total, ntensors, cycles = int(params["bytes"]), int(params["tensors"]), int(params["cycles"])
    tag = "contention"
    block = env.alloc(tag, [total // ntensors] * ntensors, backup=True, backend="mmap")
    env.fill_random(block, 3)
    env.sync()
    out = {"bytes": total, "tensors": ntensors, "pair_bytes": size, "unit": "µs per call"}
    pair_rcs = set()

    # The pair (milliseconds during the copies) and the short calls are sampled in
    # separate windows: a short call right after a long blocking one pays for the
    # thread's wake-up, which is not the call's cost. Order alternates each round.
    groups = [["foreign_free_hook", "foreign_free_direct", "stats"], ["pair_hook", "pair_direct"]]

    def sample(stop, labels, into):
        order = list(labels)
        while not stop.is_set():
            for label in order:
                t0 = time.perf_counter_ns()
                r = ops[label]()
                into[label].append((t0, time.perf_counter_ns() - t0))
                if label.startswith("pair"):
                    pair_rcs.add(tuple(r))
            order.reverse()

    def run(window_fn, acc):
        for labels in groups:
            into = {label: [] for label in labels}
            stop = threading.Event()
            t = threading.Thread(target=sample, args=(stop, labels, into))
            t.start()
            time.sleep(0.05)  # the sampler is running before the window opens
            start, end = window_fn()
            stop.set()
            t.join()
            for label in labels:
                acc[label] += [d for s, d in into[label] if start <= s and s + d <= end]
            if window_fn.__name__ == "pause_window":
                env.tms.resume(tag)
                env.sync()

    idle = {label: [] for label in ops}
    during = {label: [] for label in ops}
    pause_s = []

    def idle_window():
        t0 = time.perf_counter_ns()
        time.sleep(0.25)
        return t0, time.perf_counter_ns()

    def pause_window():
        t0 = time.perf_counter_ns()
        env.tms.pause(tag)
        t1 = time.perf_counter_ns()
        pause_s.append((t1 - t0) / 1e9)
        return t0, t1

    try:
        for c in range(cycles):
            if c and not deadline.allows(6 * pause_s[-1] + 5):
                out["truncated"] = True
                break
            run(idle_window, idle)
            run(pause_window, during)
    finally:
        out["last_error_cleared"] = _clear_last_error(cudart)
        env.dispose(block, tag)
    out["pause_s"] = pause_s
    out["pause_gbps"] = [total / s / 1e9 for s in pause_s]
    out["pair_return_codes"] = sorted(pair_rcs)
    for label in ops:
        out[f"idle_{label}"] = _latency_summary(idle[label])
        out[f"during_pause_{label}"] = _latency_summary(during[label])
    if env.kind == "cuda" and any(rc != (0, 0) for rc in pair_rcs):
        raise RuntimeError(f"cudaMalloc/cudaFree of {size} bytes returned {sorted(pair_rcs)}")
    d = {k: out[f"during_pause_{k}"]["p99_us"] for k in ops}
    log(f"contention: during a {total / 2**30:.1f} GiB backed-up pause ({median(pause_s) * 1e3:.0f} ms), p99 µs: "
        + ", ".join(f"{k} {v:.1f}" for k, v in d.items()))
    return out
