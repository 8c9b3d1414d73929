"""The `share` suite: pauseable memory mapped by another process:
`python -m benchmarks share [--gib G] [--out DIR] [--dry-run]`.

In each hook mode, in a worker of its own:

- *allocation*: a region's allocate + free of 2 MiB, 64 MiB and 1 GiB, exportable
  (the default) and plain (TMS_SHAREABLE=0), median of 20 (5 for 1 GiB), and the
  device memory each takes;
- *share and open*: share() of a 1 GiB region tensor, and open_shared() of it in a
  spawned child (median of 5 opens, each after the last close);
- *move*: G GiB of weights (default 8) in a backed-up region, 512 MiB tensors, sent
  over a torch.multiprocessing queue to a child that copies them into its own
  tensors: sent as they are (the library's CUDA IPC), against first copied into fresh
  memory outside any region and that sent (the workaround for libraries that cannot
  share region memory), end to end, and the extra device memory the sender needs.

--dry-run: the host backend, share and open of a few MiB through the native layer
(no torch.multiprocessing); the figures mean nothing. Report: share_<device>.{md,json}.
"""
import argparse
import gc
import os
import statistics
import sys
import tempfile
import time

from . import report
from .common import GiB, MiB, child_env, run_worker

TITLE = "Sharing region memory with another process"
SIZES = (2 * MiB, 64 * MiB, GiB)


def _alloc_times(tms, torch, size, reps):
    free0 = torch.cuda.mem_get_info()[0] if torch else None
    times, taken = [], None
    for i in range(reps + 1):
        t0 = time.perf_counter()
        with tms.region("bench"):
            p = tms.malloc(size)
        t1 = time.perf_counter()
        if torch and taken is None:
            taken = free0 - torch.cuda.mem_get_info()[0]
        tms.free(p)
        t2 = time.perf_counter()
        if i:  # the first is a warm-up
            times.append((t1 - t0, t2 - t1))
    return {"size": size, "alloc_us": statistics.median(a for a, _ in times) * 1e6,
            "free_us": statistics.median(f for _, f in times) * 1e6, "device_bytes": taken}


def _receiver(hook_mode, inbox, outbox):
    import torch

    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = hook_mode
    torch.empty(1, device="cuda")
    while True:
        msg = inbox.get()
        if msg[0] == "exit":
            return
        if msg[0] == "open":
            t0 = time.perf_counter()
            x = tms.open_shared(msg[1])
            torch.cuda.synchronize()
            opened = time.perf_counter() - t0
            del x
            gc.collect()
            outbox.put(opened)
        elif msg[0] == "move":  # copies what it is sent into tensors of its own
            own = [torch.empty_like(t) for t in msg[1]]
            for dst, src in zip(own, msg[1]):
                dst.copy_(src)
            torch.cuda.synchronize()
            del msg, own, dst, src  # every reference to what was received: the last one closes its mapping
            gc.collect()
            torch.cuda.ipc_collect()
            outbox.put(time.perf_counter())


def _gpu(hook_mode, gib, alloc_only):
    import torch

    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = hook_mode
    if hook_mode == "preload":
        _ = tms.preload_method
    torch.empty(MiB, device="cuda").fill_(1)
    out = {"alloc": [_alloc_times(tms, torch, s, 5 if s >= GiB else 20) for s in SIZES]}
    if alloc_only:
        return out
    ctx = torch.multiprocessing.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(hook_mode, inbox, outbox), daemon=True)
    proc.start()
    with tms.region("one", enable_cpu_backup=True):
        one = torch.ones(GiB, dtype=torch.uint8, device="cuda")
    shares, opens = [], []
    for _ in range(6):
        t0 = time.perf_counter()
        shared = tms.share(one)
        shares.append(time.perf_counter() - t0)
        inbox.put(("open", shared))
        opens.append(outbox.get(timeout=300))
    out["share_us"] = statistics.median(shares[1:]) * 1e6
    out["open_ms"] = statistics.median(opens[1:]) * 1e3
    del one
    with tms.region("weights", enable_cpu_backup=True):
        weights = [torch.randn(128 * MiB, device="cuda") for _ in range(int(gib * 2))]  # 512 MiB each
    nbytes = sum(w.nbytes for w in weights)
    moves = {}
    for way in ("shared", "copied first", "shared"):
        torch.cuda.synchronize()
        free0 = torch.cuda.mem_get_info()[0]
        t0 = time.perf_counter()
        if way == "shared":
            sent = weights
        else:
            sent = [w.clone() for w in weights]  # outside any region: fresh cudaMalloc'd memory
        torch.cuda.synchronize()
        extra = free0 - torch.cuda.mem_get_info()[0]
        inbox.put(("move", sent))
        done = outbox.get(timeout=600)
        moves.setdefault(way, []).append({"s": done - t0, "extra_bytes": extra})
        del sent
        gc.collect()
        torch.cuda.ipc_collect()
    out["move"] = {"bytes": nbytes, "shared": moves["shared"][-1], "copied_first": moves["copied first"][0]}
    out["pause_after_move_ok"] = tms.pause("weights").released_bytes >= nbytes
    tms.resume("weights")
    inbox.put(("exit",))
    proc.join(timeout=120)
    return out


def _host(hook_mode, gib, alloc_only):
    """The dry run: share and open of a few MiB on the host backend, the receiver a child process."""
    import ctypes
    import pickle
    import subprocess

    os.environ["TMS_BACKEND"] = "host"
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = hook_mode
    out = {"alloc": [_alloc_times(tms, None, s, 3) for s in SIZES[:2]]}
    if alloc_only:
        return out
    import torch

    with tms.region("one"):
        p = tms.malloc(4 * MiB)
    ctypes.memset(p, 7, 4 * MiB)
    tensor = torch.frombuffer((ctypes.c_char * (4 * MiB)).from_address(p), dtype=torch.uint8)
    t0 = time.perf_counter()
    shared = tms.share(tensor)
    out["share_us"] = (time.perf_counter() - t0) * 1e6
    code = ("import pickle, sys, time\nfrom torch_memory_saver import torch_memory_saver as tms\n"
            "shared = pickle.load(sys.stdin.buffer)\nt0 = time.perf_counter()\nx = tms.open_shared(shared)\n"
            "opened = time.perf_counter() - t0\nassert int(x.sum()) == 7 * x.numel()\nprint(opened)\n")
    proc = subprocess.run([sys.executable, "-c", code], input=pickle.dumps(shared), capture_output=True,
                          env=dict(os.environ), timeout=120)
    out["open_ms"] = float(proc.stdout.decode().strip() or "nan") * 1e3
    out["move"] = None
    out["pause_after_move_ok"] = tms.pause("one").released_bytes == 4 * MiB
    return out


def worker(hook_mode, gib, shareable=True, dry_run=False, save=None):
    doc = (_host if dry_run else _gpu)(hook_mode, gib, not shareable)
    doc["hook_mode"] = hook_mode
    return doc


def run_mode(hook_mode, shareable, args):
    env = child_env(args.dry_run, clean=True)
    env["TMS_SHAREABLE"] = "1" if shareable else "0"
    wargs = {"hook_mode": hook_mode, "gib": args.gib, "shareable": shareable, "dry_run": args.dry_run}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        doc, rc, timed_out, tail = run_worker("share", wargs, out.name, env, timeout=900,
                                              preload=hook_mode == "preload")
    if rc != 0 or doc is None:
        why = "killed after 900 s" if timed_out else f"exit {rc}"
        return {"hook_mode": hook_mode, "shareable": shareable, "error": f"{why}: {' / '.join(tail[-8:])[-2000:]}"}
    doc["shareable"] = shareable
    return doc


def alloc_table(rows):
    head = ["hook mode", "size", "alloc µs exportable", "alloc µs plain", "free µs exportable", "free µs plain",
            "device bytes exportable", "device bytes plain"]
    out = []
    for mode in ("torch", "preload"):
        ex = next((r for r in rows if r["hook_mode"] == mode and r["shareable"] and "error" not in r), None)
        pl = next((r for r in rows if r["hook_mode"] == mode and not r["shareable"] and "error" not in r), None)
        if not ex or not pl:
            out.append([mode, "error"] + [""] * 6)
            continue
        for a, b in zip(ex["alloc"], pl["alloc"]):
            out.append([mode, f"{a['size'] // MiB} MiB", f"{a['alloc_us']:.0f}", f"{b['alloc_us']:.0f}",
                        f"{a['free_us']:.0f}", f"{b['free_us']:.0f}", a["device_bytes"] or "-", b["device_bytes"] or "-"])
    return report.table(head, out, "llrrrrrr")


def move_table(rows):
    head = ["hook mode", "share µs (1 GiB)", "open ms (1 GiB)", "move GiB", "shared s", "copied first s",
            "shared GB/s", "copied first GB/s", "sender's extra GiB, copied first", "pause after"]
    out = []
    for r in rows:
        if not r["shareable"]:
            continue
        if "error" in r:
            out.append([r["hook_mode"], f"error: {r['error'][:200]}"] + [""] * 8)
            continue
        m = r["move"]
        if not m:
            out.append([r["hook_mode"], f"{r['share_us']:.0f}", f"{r['open_ms']:.2f}"] + ["-"] * 6 +
                       [r["pause_after_move_ok"]])
            continue
        s, c = m["shared"], m["copied_first"]
        out.append([r["hook_mode"], f"{r['share_us']:.0f}", f"{r['open_ms']:.2f}", f"{m['bytes'] / GiB:.1f}",
                    f"{s['s']:.3f}", f"{c['s']:.3f}", f"{m['bytes'] / s['s'] / 1e9:.1f}",
                    f"{m['bytes'] / c['s'] / 1e9:.1f}", f"{c['extra_bytes'] / GiB:.2f}", r["pause_after_move_ok"]])
    return report.table(head, out, "lrrrrrrrrl")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks share", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0, help="weights moved from one process to another (default 8)")
    parser.add_argument("--out", help="output folder (default benchmarks/results; build/bench-dry-run for --dry-run)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: host backend, plumbing only")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    meta = report.torch_meta(report.collect_meta("share", argv, args.dry_run), args.dry_run)
    # The dry run checks the plumbing: one hook mode is enough there.
    modes = ("torch",) if args.dry_run else ("torch", "preload")
    rows = [run_mode(mode, shareable, args) for mode in modes for shareable in (True, False)]
    doc = {"meta": meta, "gib": args.gib, "rows": rows}
    body = "\n".join([
        "## What exportable memory costs", "",
        "A region's allocate and free through the library, exportable (a POSIX file descriptor handle type, the "
        "default) beside plain (TMS_SHAREABLE=0), and the device memory one allocation takes.", "",
        alloc_table(rows), "",
        "## Share, open, and moving weights to another process", "",
        f"share() of a 1 GiB region tensor and open_shared() of it in a spawned child; then {args.gib:g} GiB of "
        "weights (512 MiB tensors of a backed-up region) sent over a torch.multiprocessing queue to a child that "
        "copies them into tensors of its own, end to end: sent as they are, against first copied into fresh "
        "memory outside any region and that sent. *pause after*: the region then pauses and frees all its bytes.",
        "", move_table(rows), ""])
    report.publish(args, meta, doc, TITLE, body)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
