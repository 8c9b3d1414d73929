"""The limits of this machine, measured with plain PyTorch (no torch_memory_saver): pinned and pageable host<->device
copies (the link a backup is compared with), the cost of pinning fresh host memory, of first-touching fresh pageable
memory and of cudaHostRegister on it."""
import ctypes
import time

from .common import GiB, log, median


def _gbps(nbytes, seconds):
    return nbytes / seconds / 1e9 if seconds and seconds > 0 else None


def _timed_copies(sync, copy, reps):
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        copy()
        sync()
        times.append(time.perf_counter() - t0)
    return times


def _host_empty_cache(torch):
    """Gives torch's cached pinned blocks back (names differ across versions)."""
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache", "_cuda_host_emptyCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            try:
                fn()
                return name
            except Exception:
                continue
    return None


def limits_gpu(env, nbytes, reps, deadline):
    torch = env.torch
    out = {"bytes": nbytes, "reps": reps, "unit": "GB/s = 1e9 bytes/s"}
    dev = torch.empty(nbytes, dtype=torch.uint8, device=env.device)
    dev.fill_(7)
    # Warm the copy path (first-use costs) with a small pinned copy.
    warm = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    dev[: warm.numel()].copy_(warm, non_blocking=True)
    warm.copy_(dev[: warm.numel()], non_blocking=True)
    env.sync()
    del warm

    log(f"limits: pinning {nbytes / GiB:.0f} GiB (torch.empty(pin_memory=True))")
    t0 = time.perf_counter()
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    out["pin_s"] = time.perf_counter() - t0
    out["pin_gbps"] = _gbps(nbytes, out["pin_s"])

    h2d = _timed_copies(env.sync, lambda: dev.copy_(pinned, non_blocking=True), reps)
    d2h = _timed_copies(env.sync, lambda: pinned.copy_(dev, non_blocking=True), reps)
    out["pinned_h2d_s"], out["pinned_d2h_s"] = h2d, d2h
    out["pinned_h2d_gbps"] = _gbps(nbytes, median(h2d))
    out["pinned_d2h_gbps"] = _gbps(nbytes, median(d2h))
    log(f"limits: pinned H2D {out['pinned_h2d_gbps']:.1f} GB/s, D2H {out['pinned_d2h_gbps']:.1f} GB/s, "
        f"pinning {out['pin_s']:.2f} s")
    pinned = None  # noqa: F841 (releases the pinned block to torch's cache)
    out["host_cache_released_with"] = _host_empty_cache(torch)

    if not deadline.allows(20):
        out["pageable_skipped"] = "time budget"
        return out
    page = torch.empty(nbytes, dtype=torch.uint8)
    t0 = time.perf_counter()
    page.fill_(1)  # first touch of fresh pageable pages (torch's CPU threads)
    out["pageable_first_touch_s"] = time.perf_counter() - t0
    out["pageable_first_touch_gbps"] = _gbps(nbytes, out["pageable_first_touch_s"])
    h2d = _timed_copies(env.sync, lambda: dev.copy_(page), reps)
    d2h = _timed_copies(env.sync, lambda: page.copy_(dev), reps)
    out["pageable_h2d_s"], out["pageable_d2h_s"] = h2d, d2h
    out["pageable_h2d_gbps"] = _gbps(nbytes, median(h2d))
    out["pageable_d2h_gbps"] = _gbps(nbytes, median(d2h))
    log(f"limits: pageable H2D {out['pageable_h2d_gbps']:.1f} GB/s, D2H {out['pageable_d2h_gbps']:.1f} GB/s")

    # cudaHostRegister of already-populated memory: the other way to pin.
    try:
        cudart = torch.cuda.cudart()
        t0 = time.perf_counter()
        rc = cudart.cudaHostRegister(page.data_ptr(), nbytes, 0)
        t1 = time.perf_counter()
        rc = int(getattr(rc, "value", rc))
        if rc == 0:
            out["host_register_s"] = t1 - t0
            reg = _timed_copies(env.sync, lambda: dev.copy_(page, non_blocking=True), 1)
            out["registered_h2d_gbps"] = _gbps(nbytes, reg[0])
            t2 = time.perf_counter()
            urc = cudart.cudaHostUnregister(page.data_ptr())
            out["host_unregister_s"] = time.perf_counter() - t2
            out["host_unregister_rc"] = int(getattr(urc, "value", urc))
        else:
            out["host_register_error"] = f"cudaHostRegister returned {rc}"
    except Exception as e:  # optional figure
        out["host_register_error"] = f"{type(e).__name__}: {e}"
    page = None  # noqa: F841
    return out


def limits_host(env, nbytes, reps, deadline):
    """Dry-run stand-in, the same keys: a first touch for pinning and first touch, host
    memcpy for the copies (no device)."""
    t0 = time.perf_counter()
    a, b = (ctypes.c_char * nbytes)(), (ctypes.c_char * nbytes)()
    ctypes.memset(a, 1, nbytes)
    touch = time.perf_counter() - t0
    out = {"bytes": nbytes, "reps": reps, "stand_in": "host memcpy (dry run, no GPU)", "unit": "GB/s = 1e9 bytes/s",
           "pin_s": touch, "pin_gbps": _gbps(nbytes, touch), "pageable_first_touch_s": touch,
           "pageable_first_touch_gbps": _gbps(nbytes, touch)}
    for kind in ("pinned", "pageable"):
        for d, copy in (("h2d", lambda: ctypes.memmove(b, a, nbytes)), ("d2h", lambda: ctypes.memmove(a, b, nbytes))):
            out[f"{kind}_{d}_s"] = _timed_copies(lambda: None, copy, reps)
            out[f"{kind}_{d}_gbps"] = _gbps(nbytes, median(out[f"{kind}_{d}_s"]))
    return out


def run(env, params, deadline):
    fn = limits_gpu if env.kind == "cuda" else limits_host
    return fn(env, int(params["bytes"]), int(params["reps"]), deadline)
