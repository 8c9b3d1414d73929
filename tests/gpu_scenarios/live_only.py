"""Live-only backups and disable()'s own memory on the GPU.

engine <where>: a training engine's tag holds 256 MiB of live weights while PyTorch
caches 2 GiB of freed activations; a backed-up pause with live-only on copies at
most 1.1x the live bytes and skips the rest (what it copies and skips adds up to
what the same pause with it off copies), every live byte exact after resume, and
each report releases or maps exactly what the paused allocations hold.
transformer <where>: a transformer's train step (model, AdamW state, activations
freed): the same checks on its parameters and optimizer state.
disable <where>: pause(), disable() (allocate and free 4 GiB inside, nested in
another region), resume(): the library maps what it mapped before the pause and
PyTorch holds no more than before (their own counters).

<where> is "region" (the tag's region) or "init" (preload mode with
TMS_INIT_ENABLE=1 and TMS_INIT_ENABLE_CPU_BACKUP=1: no region; the test sets them).
"""
import contextlib
import sys

import torch

from _common import GiB, MiB, allocations, begin, check, free_bytes, mapped_bytes, mib, say


def where_ctx(tms, where, tag):
    if where == "region":
        return tms.region(tag=tag, enable_cpu_backup=True)
    check(tms.hook_mode == "preload", "init mode is a preload-mode setting")
    return contextlib.nullcontext()


def tag_of(where, tag):
    return tag if where == "region" else None  # init: every allocation is ours, in the default tag


def check_report(r, held, what):
    """r released (pause) or mapped (resume) exactly held: {device: bytes} of the allocations it covers."""
    check(r.devices, f"{what}: the report names no device")
    check(sorted(r.devices) == sorted(held), f"{what}: the report covers devices {sorted(r.devices)}, the "
                                             f"allocations are on {sorted(held)}")
    for device, d in r.devices.items():
        say(f"  {what}: released {mib(d.released_bytes)}, copied {mib(d.copied_bytes)}, skipped "
            f"{mib(d.skipped_bytes)}, {d.seconds * 1e3:.1f} ms")
        check(d.released_bytes == held[device],
              f"{what}: the report says {d.released_bytes} bytes on device {device}, the allocations hold "
              f"{held[device]}")


def cycle(tms, tag, live_only, tensors, what):
    """A pause and resume with live-only on or off: the pause's report; every tensor exact after."""
    expected = [t.cpu() for t in tensors]
    tms.backup_live_only = live_only
    held = {}
    for row in allocations(tag):
        held[row["device"]] = held.get(row["device"], 0) + row["reserved"]
    r = tms.pause(tag)
    check_report(r, held, f"{what} pause (live-only {'on' if live_only else 'off'})")
    back = tms.resume(tag)
    check_report(back, held, f"{what} resume")
    check(back.copied_bytes == r.copied_bytes, f"{what}: resume copied {back.copied_bytes}, pause {r.copied_bytes}")
    for i, (t, e) in enumerate(zip(tensors, expected)):
        check(torch.equal(t.cpu(), e), f"{what}: live tensor {i} differs after resume (live-only {live_only})")
    say(f"  {what}: live-only {'on' if live_only else 'off'}: copied {mib(r.copied_bytes)}, skipped "
        f"{mib(r.skipped_bytes)}")
    return r


def compare(tms, tag, tensors, live, what):
    cycle(tms, tag, True, tensors, what + " (warm-up)")  # first copies, snapshot code paths
    on = cycle(tms, tag, True, tensors, what)
    off = cycle(tms, tag, False, tensors, what)
    say(f"{what}: live {mib(live)}; copied {mib(on.copied_bytes)} vs {mib(off.copied_bytes)}")
    check(on.copied_bytes <= 1.1 * live, f"{what}: copied {mib(on.copied_bytes)} for {mib(live)} live")
    check(on.skipped_bytes > 0 and off.skipped_bytes == 0, f"{what}: skipped {on.skipped_bytes}/{off.skipped_bytes}")
    # What a live-only pause leaves out is all it saves: every byte a full pause copies
    # is either copied or skipped by it, and it skips most of them here.
    check(on.copied_bytes + on.skipped_bytes == off.copied_bytes and on.copied_bytes < off.copied_bytes,
          f"{what}: live-only copied {on.copied_bytes} and skipped {on.skipped_bytes}; the full pause copied "
          f"{off.copied_bytes}")


def engine(tms, where):
    allocated0 = torch.cuda.memory_allocated()
    with where_ctx(tms, where, "train"):
        weights = [torch.randn(64 * MiB // 4, device="cuda") for _ in range(4)]        # 256 MiB live
        acts = [torch.empty(256 * MiB, dtype=torch.uint8, device="cuda") for _ in range(8)]
        for i, a in enumerate(acts):
            a.fill_(i)
        del acts                                                                     # 2 GiB cached, free
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
        torch.cuda.synchronize()
        before = (mapped_bytes(), torch.cuda.memory_reserved())
        tms.pause(tag_of(where, "train"))
        outer = tms.region(tag="other") if nested else contextlib.nullcontext()
        with outer:
            with tms.disable():
                x = torch.empty(4 * GiB, dtype=torch.uint8, device="cuda")
                x.fill_(3)
                torch.cuda.synchronize()
                del x
        tms.resume(tag_of(where, "train"))
        torch.cuda.synchronize()
        after = (mapped_bytes(), torch.cuda.memory_reserved())
        say(f"disable (nested in a region: {nested}): (library maps, PyTorch reserves) {before} before the pause, "
            f"{after} after the resume")
        check(after[0] == before[0] and after[1] <= before[1],
              f"disable: (library maps, PyTorch reserves) went from {before} to {after} across pause, disable, "
              f"resume")
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
