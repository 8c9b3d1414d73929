"""skip_unchanged on the GPU: the kernel's fingerprints are the CPU's computation of the
same function (fingerprint_bytes); one byte changed between cycles (the first, a middle
and the last byte of a chunk; written by a kernel, by the driver's memset, by another
process through share()) makes the next pause copy that chunk alone and the resume
restore it exactly; an unchanged 8 GiB pauses without copying and restores exactly."""
import ctypes
import gc
import sys
import time

import torch

from _common import MiB, begin, check, core, say

CHUNK = 2 * MiB
GiB = 1 << 30


def writer(hook_mode, handle, offset, value, done):
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = hook_mode
    x = tms.open_shared(handle)
    x[offset] = value
    torch.cuda.synchronize()
    del x
    gc.collect()
    torch.cuda.synchronize()
    done.put("written")


def driver_memset(ptr, value):
    cu = ctypes.CDLL("libcuda.so.1")
    check(cu.cuMemsetD8_v2(ctypes.c_ulonglong(ptr), ctypes.c_ubyte(value), ctypes.c_size_t(1)) == 0, "cuMemsetD8 failed")
    check(cu.cuCtxSynchronize() == 0, "cuCtxSynchronize failed")


def cycle(tms, tag, copied, unchanged, what):
    r = tms.pause(tag)
    check(r.why_not_skipped is None, f"{what}: copied whole: {r.why_not_skipped}")
    check((r.copied_bytes, r.unchanged_bytes) == (copied, unchanged),
          f"{what}: copied {r.copied_bytes} and found {r.unchanged_bytes} unchanged, expected {copied} and {unchanged}")
    tms.resume(tag)
    return r


def main(hook_mode):
    tms = begin("skip_unchanged", hook_mode)
    device = torch.cuda.current_device()

    with tms.region("fp"):
        x = torch.randint(0, 256, (4 * CHUNK,), dtype=torch.uint8, device="cuda")
    check(x.data_ptr() % CHUNK == 0, "the test tensor does not start a chunk")
    torch.cuda.synchronize()
    on_gpu = core().fingerprint(device, x.data_ptr(), 4)
    on_cpu = core().fingerprint_bytes(x.cpu().numpy().tobytes(), CHUNK)
    check(on_gpu == on_cpu, "the kernel's fingerprints differ from the CPU's computation of them")
    check(len(set(on_gpu)) == 4, "four random chunks gave equal fingerprints")
    say("the kernel's fingerprints of 4 random chunks equal the CPU's")

    with tms.region("w", enable_cpu_backup=True, skip_unchanged=True):
        w = torch.randint(0, 256, (32 * CHUNK,), dtype=torch.uint8, device="cuda")
    size = w.numel()
    expected = w.cpu()
    cycle(tms, "w", size, 0, "first pause")
    check(torch.equal(w.cpu(), expected), "contents after the first cycle")
    cycle(tms, "w", 0, size, "unchanged")
    check(torch.equal(w.cpu(), expected), "contents after an unchanged cycle")

    ctx = torch.multiprocessing.get_context("spawn")
    edits = [("a kernel, first byte of chunk 5", 5 * CHUNK), ("the driver's memset, a middle byte of chunk 9",
                                                              9 * CHUNK + CHUNK // 2 + 3),
             ("another process through share(), last byte of chunk 20", 21 * CHUNK - 1)]
    for what, offset in edits:
        value = (int(expected[offset]) + 1) % 256
        if "kernel" in what:
            w[offset] += 1
        elif "memset" in what:
            driver_memset(w.data_ptr() + offset, value)
        else:
            done = ctx.Queue()
            proc = ctx.Process(target=writer, args=(hook_mode, tms.share(w), offset, value, done))
            proc.start()
            check(done.get(timeout=300) == "written", "the other process did not write")
            proc.join(timeout=120)
            check(proc.exitcode == 0, f"the other process exited with {proc.exitcode}")
        torch.cuda.synchronize()
        expected[offset] = value
        cycle(tms, "w", CHUNK, size - CHUNK, what)
        check(torch.equal(w.cpu(), expected), f"{what}: contents after the cycle")
        say(f"one byte by {what}: that chunk alone copied, restored exactly")

    free = torch.cuda.mem_get_info()[0]
    if hook_mode != "torch":  # the hook mode has no part in a pause of memory already made: once is enough
        say("8 GiB unchanged: run in torch mode only")
    elif free < 10 * GiB:
        say(f"8 GiB unchanged: skipped, {free / GiB:.1f} GiB free")
    else:
        with tms.region("big", enable_cpu_backup=True, skip_unchanged=True):
            big = [torch.randint(-2**31, 2**31 - 1, (GiB // 4,), dtype=torch.int32, device="cuda") for _ in range(8)]
        want = [t.cpu() for t in big]
        cycle(tms, "big", 8 * GiB, 0, "8 GiB, first pause")
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = cycle(tms, "big", 0, 8 * GiB, "8 GiB unchanged")
        say(f"8 GiB unchanged: pause {r.seconds * 1e3:.1f} ms (fingerprints {r.fingerprint_seconds * 1e3:.1f} ms), "
            f"cycle {(time.perf_counter() - t0) * 1e3:.1f} ms")
        check(all(torch.equal(t.cpu(), e) for t, e in zip(big, want)), "8 GiB: contents after the unchanged cycle")
        say("8 GiB unchanged: nothing copied, restored exactly")
    say("OK")


if __name__ == "__main__":
    main(sys.argv[1])
