"""The `budget` suite: a backed-up pause under the host backup budget:
`python -m benchmarks budget [--gib G] [--out DIR] [--dry-run]`.

One tag of G GiB (default 8) in 16 tensors with CPU backup (mmap), paused and
resumed in three workers of their own: with no budget (every backup in host
memory), with a budget of half the tag and spilling on (the largest half to disk,
the rest in RAM), and with a budget too small for any of it (all to disk). Each
row: where the bytes went, pause and resume time and GB/s (median of 3 cycles
after a warm-up), every tensor compared bit for bit after each resume. The disk
directory is TMS_BENCH_DISK_DIR (default the temp directory).

--dry-run: the host backend, 64 MiB in the library's own allocations; the figures
mean nothing. Report: budget_<device>.{md,json}.
"""
import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid

from . import report
from .common import GiB, MiB, child_env, run_worker

TITLE = "Host backup budget: a pause that spills to disk, beside all in RAM and all on disk"
CASES = (("ram", None), ("half", 0.5), ("disk", 0.0))


def _gpu_block(tms, total, tensors):
    import torch

    with tms.region(tag="w", enable_cpu_backup=True):
        block = [torch.empty(total // tensors, dtype=torch.uint8, device="cuda") for _ in range(tensors)]
    for t in block:
        t.random_(0, 256)
    torch.cuda.synchronize()
    return block, (lambda: [t.cpu() for t in block]), (lambda want: all(torch.equal(t.cpu(), w)
                                                                         for t, w in zip(block, want)))


def _host_block(tms, total, tensors):
    import ctypes

    with tms.region(tag="w", enable_cpu_backup=True):
        ptrs = [tms.malloc(total // tensors) for _ in range(tensors)]
    for p in ptrs:
        ctypes.memmove(p, os.urandom(total // tensors), total // tensors)
    n = total // tensors
    return ptrs, (lambda: [ctypes.string_at(p, n) for p in ptrs]), (lambda want: all(
        ctypes.string_at(p, n) == w for p, w in zip(ptrs, want)))


def worker(case, total, tensors, disk_dir, dry_run=False, save=None):
    if dry_run:
        os.environ["TMS_BACKEND"] = "host"
    from torch_memory_saver import torch_memory_saver as tms

    tms.set_disk_backup_dir(disk_dir)
    block, snapshot, check = (_host_block if dry_run else _gpu_block)(tms, total, tensors)
    sync = (lambda: None) if dry_run else __import__("torch").cuda.synchronize
    want = snapshot()
    cycles = []
    for c in range(4):
        sync()
        t0 = time.perf_counter()
        tms.pause("w")
        t1 = time.perf_counter()
        rows = [r for r in tms.allocations() if r["tag"] == "w"]
        on_disk = sum(r["size"] for r in rows if r["has_disk_backup"])
        tms.resume("w")
        sync()
        t2 = time.perf_counter()
        cycles.append({"pause_s": t1 - t0, "resume_s": t2 - t1, "disk_bytes": on_disk, "exact": check(want)})
    steady = cycles[1:]
    return {"case": case, "total": total, "budget": tms.host_budget(), "cycles": cycles,
            "pause_s": statistics.median(c["pause_s"] for c in steady),
            "resume_s": statistics.median(c["resume_s"] for c in steady),
            "disk_bytes": steady[-1]["disk_bytes"], "exact": all(c["exact"] for c in cycles)}


def run_row(case, share, args, total):
    env = child_env(args.dry_run, clean=True)
    env["TMS_HOST_BACKUP_LIMIT_NAME"] = f"bench-{uuid.uuid4().hex[:12]}"  # a ledger of its own
    if share is not None:
        env["TMS_HOST_BACKUP_LIMIT"] = str(max(1, int(total * share)))  # 1 byte: nothing fits
        env["TMS_SPILL_TO_DISK"] = "1"
    with tempfile.TemporaryDirectory(prefix="tms-bench-budget-", dir=os.environ.get("TMS_BENCH_DISK_DIR")) as disk_dir, \
            tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        wargs = {"case": case, "total": total, "tensors": 16, "disk_dir": disk_dir, "dry_run": args.dry_run}
        doc, rc, timed_out, tail = run_worker("budget", wargs, out.name, env, timeout=600)
    if rc != 0:
        why = "killed after 600 s" if timed_out else f"exit {rc}"
        return {"case": case, "error": f"{why}: {' / '.join(tail[-8:])[-2000:]}"}
    return doc


def table(rows):
    head = ["case", "budget", "on disk GiB", "in RAM GiB", "pause s", "pause GB/s", "resume s", "resume GB/s",
            "exact"]
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["case"], f"error: {r['error'][:200]}"] + [""] * 7)
            continue
        limit = r["budget"]["limit"]
        out.append([r["case"], f"{limit / GiB:.2f} GiB" if limit else "none",
                    f"{r['disk_bytes'] / GiB:.2f}", f"{(r['total'] - r['disk_bytes']) / GiB:.2f}",
                    f"{r['pause_s']:.3f}", f"{r['total'] / r['pause_s'] / 1e9:.2f}", f"{r['resume_s']:.3f}",
                    f"{r['total'] / r['resume_s'] / 1e9:.2f}", r["exact"]])
    return report.table(head, out, "llrrrrrrl")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks budget", description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=8.0, help="the tag's size (default 8)")
    parser.add_argument("--out", help="output folder (default benchmarks/results; build/bench-dry-run for --dry-run)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: host backend, 64 MiB, plumbing only")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    total = 64 * MiB if args.dry_run else int(args.gib * GiB)
    meta = report.torch_meta(report.collect_meta("budget", argv, args.dry_run), args.dry_run)
    rows = [run_row(case, share, args, total) for case, share in CASES]
    doc = {"meta": meta, "total": total, "rows": rows}
    body = "\n".join([
        f"One tag of {total / GiB:.2f} GiB in 16 tensors with CPU backup (mmap), each case in a worker of its own: "
        "*ram*, no budget; *half*, a budget of half the tag with spilling on (the largest allocations that do not "
        "fit go to disk); *disk*, a budget nothing fits. Median of 3 cycles after a warm-up; *exact*: every "
        f"tensor equal bit for bit after every resume. Disk directory: "
        f"{os.environ.get('TMS_BENCH_DISK_DIR') or tempfile.gettempdir()}.", "", table(rows), ""])
    report.publish(args, meta, doc, TITLE, body)
    return 1 if any("error" in r or not r["exact"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
