"""The `fragmentation` suite: one region's churn with and without PyTorch's
expandable segments: `python -m benchmarks fragmentation [--steps N]
[--live-gib G] [--seed S] [--out DIR] [--dry-run]`.

One worker process per (churn, hook mode, expandable segments on/off) runs the
same seeded churn inside one region: each step allocates a tensor of log-uniform
size from 1 MiB to 512 MiB (while under --live-gib live); the "steady" churn
then frees a random live one with probability 0.45, the "bursty" one a random
30 % of the live ones with probability 0.3. It then reports what the region
costs: live tensor bytes, PyTorch's reserved bytes, the bytes the library
holds for the tag, device memory taken since the start; and what a pause of
the tag gives back (free memory gained / tag bytes) and how long pause and
resume take.

--dry-run: 100 steps of the same churn on the host backend under a live cap of
64 MiB, the library's own allocations standing in for tensors (no PyTorch
allocator: its reserved bytes are not known) and the process's resident memory
for the device's; the figures mean nothing.
Report: fragmentation_<device>.{md,json}.
"""
import argparse
import os
import sys
import tempfile
import time

from . import report
from .common import GiB, child_env, rss_bytes, run_worker

PATTERNS = ("steady", "bursty")
TITLE = "Fragmentation: one region's churn with and without expandable segments"


class _Gpu:
    """Tensors on the GPU; free() is the device's free memory."""

    def __init__(self, tms, hook_mode):
        import torch

        self.torch = torch
        if hook_mode == "preload":
            _ = tms.preload_method  # hooks in place before the first CUDA allocation
        torch.cuda.init()
        torch.cuda.synchronize()

    def alloc(self, n):
        return self.torch.empty(n, dtype=self.torch.uint8, device="cuda")

    def drop(self, item):
        return item[1]  # the tensor goes with the item

    def settle(self):
        self.torch.cuda.synchronize()

    def free(self):
        return self.torch.cuda.mem_get_info()[0]

    def reserved(self):
        return self.torch.cuda.memory_reserved()


class _Host:
    """The library's host-backend allocations, written through so they are
    resident; free() is minus this process's resident memory, so that the
    same differences read as memory taken and given back."""

    def __init__(self, tms):
        self.tms = tms

    def alloc(self, n):
        import ctypes

        p = self.tms.malloc(n)
        ctypes.memset(p, 1, n)
        return p

    def drop(self, item):
        self.tms.free(item[0])
        return item[1]

    def settle(self):
        pass

    def free(self):
        return -rss_bytes()

    def reserved(self):
        return None


def worker(hook_mode, pattern, steps, live_gib, seed, dry_run=False, save=None):
    import random

    if dry_run:
        os.environ["TMS_BACKEND"] = "host"
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = hook_mode
    mem = _Host(tms) if dry_run else _Gpu(tms, hook_mode)
    free0 = mem.free()
    rng = random.Random(seed)
    live, live_bytes = [], 0
    with tms.region(tag="frag"):
        for _ in range(steps):
            n = int(2 ** rng.uniform(20, 29))  # 1 MiB .. 512 MiB
            if live_bytes + n <= live_gib * GiB:
                live.append((mem.alloc(n), n))
                live_bytes += n
            if pattern == "steady" and live and rng.random() < 0.45:
                live_bytes -= mem.drop(live.pop(rng.randrange(len(live))))
            elif pattern == "bursty" and rng.random() < 0.3:
                for i in sorted(rng.sample(range(len(live)), k=int(len(live) * 0.3)), reverse=True):
                    live_bytes -= mem.drop(live.pop(i))
    mem.settle()
    rows = [r for r in tms.allocations() if r["tag"] == "frag"]
    tag_bytes = sum(r["reserved"] for r in rows)
    used = free0 - mem.free()
    reserved = mem.reserved()
    before = mem.free()
    t0 = time.perf_counter()
    tms.pause("frag")
    t1 = time.perf_counter()
    freed = mem.free() - before
    tms.resume("frag")
    t2 = time.perf_counter()
    if dry_run:
        for item in live:
            mem.drop(item)
    return {
        "hook_mode": hook_mode, "pattern": pattern,
        "expandable": "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "live_tensors": len(live), "live_bytes": live_bytes, "torch_reserved": reserved, "tag_bytes": tag_bytes,
        "allocations": len(rows), "adopted": sum(1 for r in rows if r["adopted"]), "device_used": used,
        "freed_by_pause": freed, "pause_ms": (t1 - t0) * 1e3, "resume_ms": (t2 - t1) * 1e3,
    }


def run_row(hook_mode, pattern, expandable, args):
    """One row in a worker of its own, with only its own settings: none of
    this process's TMS_* or allocator configuration reaches it."""
    env = child_env(args.dry_run, clean=True)
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    wargs = {"hook_mode": hook_mode, "pattern": pattern, "steps": args.steps, "live_gib": args.live_gib,
             "seed": args.seed, "dry_run": args.dry_run}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        doc, rc, timed_out, tail = run_worker("fragmentation", wargs, out.name, env, timeout=600,
                                              preload=hook_mode == "preload")
    if rc != 0:
        why = "killed after 600 s" if timed_out else f"exit {rc}"
        return {"hook_mode": hook_mode, "pattern": pattern, "expandable": expandable,
                "error": f"{why}: {' / '.join(tail[-8:])[-2000:]}"}
    return doc


def table(results):
    def gib(n):
        return "-" if n is None else f"{n / GiB:.2f}"

    def per_live(r):
        return "-" if r["torch_reserved"] is None else f"{r['torch_reserved'] / max(r['live_bytes'], 1):.2f}×"

    head = ["churn", "hook mode", "expandable segments", "live tensors", "live GiB", "PyTorch reserved GiB",
            "tag GiB (allocations, adopted)", "reserved / live", "pause frees (of tag)", "pause ms", "resume ms"]
    rows = []
    for r in results:
        cells = [r["pattern"], r["hook_mode"], "on" if r["expandable"] else "off"]
        if "error" in r:
            rows.append(cells + [f"error: {r['error'][:200]}"] + [""] * 7)
            continue
        rows.append(cells + [r["live_tensors"], gib(r["live_bytes"]), gib(r["torch_reserved"]),
                             f"{gib(r['tag_bytes'])} ({r['allocations']}, {r['adopted']})", per_live(r),
                             f"{r['freed_by_pause'] / max(r['tag_bytes'], 1):.1%}", f"{r['pause_ms']:.1f}",
                             f"{r['resume_ms']:.1f}"])
    return report.table(head, rows, "lllrrrrrrrr")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks fragmentation",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=None, help="churn steps (default 400; 100 for --dry-run)")
    parser.add_argument("--live-gib", type=float, default=None, help="live cap (default 24; 1/16 for --dry-run)")
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--out", help="output folder (default benchmarks/results; build/bench-dry-run for --dry-run)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: host backend, 64 MiB live, plumbing only")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.live_gib is None:
        args.live_gib = 1 / 16 if args.dry_run else 24
    if args.steps is None:
        args.steps = 100 if args.dry_run else 400
    meta = report.torch_meta(report.collect_meta("fragmentation", argv, args.dry_run), args.dry_run)
    rows = [run_row(mode, pattern, expandable, args)
            for pattern in PATTERNS for mode in ("preload", "torch") for expandable in (False, True)]
    doc = {"meta": meta, "steps": args.steps, "live_gib": args.live_gib, "seed": args.seed, "rows": rows}
    body = "\n".join([
        "Same seeded sequence in every row of a churn: each step allocates a tensor of 1 MiB to 512 MiB "
        "(log-uniform) while under the live cap; *steady* then frees a random live tensor with probability 0.45, "
        "*bursty* frees a random 30 % of the live ones with probability 0.3. *reserved / live*: PyTorch's "
        "reserved bytes per live tensor byte (fragmentation). *pause frees*: device memory a pause of the "
        "tag gave back, as a share of the bytes the library held for it.", "",
        table(rows), ""])
    report.publish(args, meta, doc, TITLE, body)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
