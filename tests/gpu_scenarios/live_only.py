"""Live-only backups and disable()'s own memory on the GPU.

engine <where>: a training engine's tag holds 1 GiB of live weights while PyTorch
caches 8 GiB of freed activations; a backed-up pause with live-only on copies
at most 1.1x the live bytes in at most 0.2x the time of the same pause with it
off, every live byte exact after resume, and each report's released bytes equal
the driver's change in free memory within 2 MiB.
transformer <where>: a transformer's train step (model, AdamW state, activations
freed): the same checks on its parameters and optimizer state.
disable <where>: pause(), disable() (allocate and free 4 GiB inside, nested in
another region), resume(): the device memory in use equals its value before the
pause within 50 MiB.

<where> is "region" (the tag's region) or "init" (preload mode with
TMS_INIT_ENABLE=1 and TMS_INIT_ENABLE_CPU_BACKUP=1: no region; the test sets them).
"""
import contextlib
import sys
import time

import torch

from _common import GiB, MiB, begin, check, free_bytes, mib, rss_bytes, say

SLACK_REPORT = 2 * MiB
SLACK_DISABLE = 50 * MiB


def used():
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return total - free


def where_ctx(tms, where, tag):
    if where == "region":
        return tms.region(tag=tag, enable_cpu_backup=True)
    check(tms.hook_mode == "preload", "init mode is a preload-mode setting")
    return contextlib.nullcontext()


def tag_of(where, tag):
    return tag if where == "region" else None  # init: every allocation is ours, in the default tag


def check_report(r, what, strict=True):
    check(r.devices, f"{what}: the report names no device")
    for d in r.devices.values():
        change = d.free_after - d.free_before if r.op == "pause" else d.free_before - d.free_after
        say(f"  {what}: released {mib(d.released_bytes)}, copied {mib(d.copied_bytes)}, skipped "
            f"{mib(d.skipped_bytes)}, driver's free memory changed by {mib(change)}, {d.seconds * 1e3:.1f} ms")
        # A process's first backed-up copy also starts the copy workers' streams,
        # which take device memory of their own: only later calls compare.
        check(not strict or abs(change - d.released_bytes) <= SLACK_REPORT,
              f"{what}: report says {d.released_bytes} bytes, the driver's free memory changed by {change}")


def cycle(tms, tag, live_only, tensors, what, strict=True):
    """A pause and resume with live-only on or off: (wall seconds of the pause,
    its report, host RSS growth over the pause); every tensor exact after."""
    expected = [t.cpu() for t in tensors]
    tms.backup_live_only = live_only
    torch.cuda.synchronize()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    r = tms.pause(tag, measure_free=True)
    seconds = time.perf_counter() - t0
    rss1 = rss_bytes()
    check_report(r, f"{what} pause (live-only {'on' if live_only else 'off'})", strict)
    back = tms.resume(tag, measure_free=True)
    check_report(back, f"{what} resume", strict)
    check(back.copied_bytes == r.copied_bytes, f"{what}: resume copied {back.copied_bytes}, pause {r.copied_bytes}")
    for i, (t, e) in enumerate(zip(tensors, expected)):
        check(torch.equal(t.cpu(), e), f"{what}: live tensor {i} differs after resume (live-only {live_only})")
    say(f"  {what}: live-only {'on' if live_only else 'off'}: pause {seconds * 1e3:.1f} ms, copied "
        f"{mib(r.copied_bytes)}, host RSS +{mib(rss1 - rss0)}")
    return seconds, r, rss1 - rss0


def compare(tms, tag, tensors, live, what):
    cycle(tms, tag, True, tensors, what + " (warm-up)", strict=False)  # first copies, snapshot code paths
    on_s, on, on_rss = cycle(tms, tag, True, tensors, what)
    off_s, off, off_rss = cycle(tms, tag, False, tensors, what)
    say(f"{what}: live {mib(live)}; copied {mib(on.copied_bytes)} vs {mib(off.copied_bytes)}; pause "
        f"{on_s * 1e3:.1f} vs {off_s * 1e3:.1f} ms ({on_s / off_s:.2f}x); RSS +{mib(on_rss)} vs +{mib(off_rss)}")
    check(on.copied_bytes <= 1.1 * live, f"{what}: copied {mib(on.copied_bytes)} for {mib(live)} live")
    check(on.skipped_bytes > 0 and off.skipped_bytes == 0, f"{what}: skipped {on.skipped_bytes}/{off.skipped_bytes}")
    # The bytes above are the outcome; this only catches a live-only pause that costs what a
    # full one does (its fixed costs keep its time well above the ratio of the bytes).
    check(on_s <= 0.5 * off_s, f"{what}: the live-only pause took {on_s:.3f} s, {on_s / off_s:.2f}x of {off_s:.3f} s")


def engine(tms, where):
    allocated0 = torch.cuda.memory_allocated()
    with where_ctx(tms, where, "train"):
        weights = [torch.randn(64 * MiB // 4, device="cuda") for _ in range(16)]       # 1 GiB live
        acts = [torch.empty(256 * MiB, dtype=torch.uint8, device="cuda") for _ in range(32)]
        for i, a in enumerate(acts):
            a.fill_(i)
        del acts                                                                     # 8 GiB cached, free
    live = torch.cuda.memory_allocated() - allocated0
    say(f"engine: {mib(live)} live, {mib(torch.cuda.memory_reserved())} reserved by PyTorch")
    compare(tms, tag_of(where, "train"), weights, live, "engine")


def transformer(tms, where):
    allocated0 = torch.cuda.memory_allocated()
    with where_ctx(tms, where, "train"):
        layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True)
        model = torch.nn.TransformerEncoder(layer, 8).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randn(32, 512, 1024, device="cuda")
        for _ in range(2):
            loss = model(x).float().pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        del loss
    torch.cuda.synchronize()
    tensors = [p.data for p in model.parameters()] + [x]
    tensors += [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.is_cuda]
    live = torch.cuda.memory_allocated() - allocated0
    say(f"transformer: {len(tensors)} live tensors, {mib(live)} live, {mib(torch.cuda.memory_reserved())} reserved")
    compare(tms, tag_of(where, "train"), tensors, live, "transformer")


def disable(tms, where):
    with where_ctx(tms, where, "train"):
        weights = torch.randn(256 * MiB // 4, device="cuda")
        acts = [torch.empty(256 * MiB, dtype=torch.uint8, device="cuda") for _ in range(8)]
        del acts                                                                     # 2 GiB cached, free
    expected = weights.cpu()
    for nested in (False, True):
        before = used()
        tms.pause(tag_of(where, "train"))
        outer = tms.region(tag="other") if nested else contextlib.nullcontext()
        with outer:
            with tms.disable():
                x = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
                x.fill_(3)
                torch.cuda.synchronize()
                del x
        tms.resume(tag_of(where, "train"))
        after = used()
        say(f"disable (nested in a region: {nested}): in use {mib(before)} before the pause, {mib(after)} after "
            f"the resume")
        check(abs(after - before) <= SLACK_DISABLE,
              f"disable: device memory in use went from {mib(before)} to {mib(after)} across pause, disable, resume")
        check(torch.equal(weights.cpu(), expected), "disable: weights differ after resume")


def cdll_runtime(tms, where):
    """Upstream's test shape: cdll.cudaHostGetFlags on a pinned backup's pointer
    succeeds while paused; after resume the backup is gone and the runtime says
    so (cdll.cudaGetLastError clears the error)."""
    import ctypes

    with tms.region(tag="pinned", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        x = torch.randn(64 * MiB // 4, device="cuda")
    tms.pause("pinned")
    cdll = tms._impl._binary_wrapper.cdll
    ptr = cdll.tms_get_cpu_backup_pointer(ctypes.cast(x.data_ptr(), ctypes.POINTER(ctypes.c_uint8)), x.nbytes)
    check(bool(ptr), "no backup pointer while paused")
    get_flags = cdll.cudaHostGetFlags
    get_flags.argtypes, get_flags.restype = [ctypes.POINTER(ctypes.c_uint), ctypes.c_void_p], ctypes.c_int
    flags = ctypes.c_uint(0)
    check(get_flags(ctypes.byref(flags), ctypes.cast(ptr, ctypes.c_void_p)) == 0, "the pinned backup is not page-locked")
    address = ctypes.cast(ptr, ctypes.c_void_p).value
    tms.resume("pinned")
    status = get_flags(ctypes.byref(flags), address)
    check(status != 0, "cudaHostGetFlags still finds the backup after resume")
    cdll.cudaGetLastError.restype = ctypes.c_int
    cdll.cudaGetLastError()
    say(f"cdll.cudaHostGetFlags: 0 while paused, {status} after resume ({where})")


def main(hook_mode, case, where):
    tms = begin(f"live_only {case} {where}", hook_mode)
    torch.empty(MiB, dtype=torch.uint8, device="cuda").fill_(1)
    free_bytes()
    {"engine": engine, "transformer": transformer, "disable": disable, "cdll": cdll_runtime}[case](tms, where)
    print("OK")


if __name__ == "__main__":
    main(*sys.argv[1:])
