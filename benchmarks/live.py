"""The `live` suite: live-only backups against whole-allocation backups:
`python -m benchmarks live [--cached-gib G] [--out DIR] [--dry-run]`.

Shapes, each in a worker of its own, in both hook modes (torch mode in the
tag's region; preload mode with TMS_INIT_ENABLE=1 and
TMS_INIT_ENABLE_CPU_BACKUP=1, every allocation the library's): *engine*, 1 GiB of
live weights while PyTorch caches G GiB of freed activations (default 8);
*transformer*, a train step of an 8-layer transformer with AdamW (activations
freed). Each pauses and resumes its tag with CPU backup, live-only on then off:
bytes copied and skipped, pause and resume time, host RSS growth over the pause,
and every live tensor compared bit for bit after each resume.

*cost*: learning the live ranges (one allocator snapshot) with 10, 1,000 and
10,000 live blocks beside G GiB of free cached memory, against the pause time it
saves (the same pause with live-only off, less with it on).

--dry-run: the host backend, the library's own allocations standing in for
PyTorch's blocks and the free ranges given by hand; the figures mean nothing.
Report: live_<device>.{md,json}.
"""
import argparse
import os
import sys
import tempfile
import time

from . import report
from .common import GiB, MiB, child_env, rss_bytes, run_worker

TITLE = "Live-only backups: what a backed-up pause copies, and what it costs to know"
SHAPES = ("engine", "transformer")
MODES = (("torch", "region"), ("preload", "init"))
BLOCK_COUNTS = (10, 1000, 10000)


def _cycle(tms, tag, live_only, tensors, exact):
    import torch

    expected = [t.cpu() for t in tensors] if exact else None
    tms.backup_live_only = live_only
    torch.cuda.synchronize()
    rss0 = rss_bytes()
    t0 = time.perf_counter()
    r = tms.pause(tag)
    t1 = time.perf_counter()
    rss1 = rss_bytes()
    tms.resume(tag)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    same = None if expected is None else all(torch.equal(t.cpu(), e) for t, e in zip(tensors, expected))
    return {"live_only": live_only, "pause_ms": (t1 - t0) * 1e3, "resume_ms": (t2 - t1) * 1e3,
            "copied": r.copied_bytes, "skipped": r.skipped_bytes, "rss_growth": rss1 - rss0, "exact": same}


def _engine(torch, cached_gib):
    weights = [torch.randn(64 * MiB // 4, device="cuda") for _ in range(16)]
    acts = [torch.empty(256 * MiB, dtype=torch.uint8, device="cuda") for _ in range(int(cached_gib * 4))]
    for a in acts:
        a.fill_(1)
    del acts
    return weights


def _transformer(torch, cached_gib):
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
    tensors = [p.data for p in model.parameters()] + [x]
    return tensors + [v for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.is_cuda]


def _cost(torch, tms, blocks, cached_gib):
    """blocks live 64 KiB tensors and cached_gib of free cached memory; the
    snapshot's time, and the pause time live-only saves."""
    from torch_memory_saver import _live

    live = [torch.empty(64 * 1024, dtype=torch.uint8, device="cuda") for _ in range(blocks)]
    acts = [torch.empty(256 * MiB, dtype=torch.uint8, device="cuda") for _ in range(int(cached_gib * 4))]
    del acts
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        _live.free_spans()
        times.append(time.perf_counter() - t0)
    return live, sorted(times)[len(times) // 2] * 1e3


def _gpu_row(kind, hook_mode, where, cached_gib, blocks):
    import torch

    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = hook_mode
    if hook_mode == "preload":
        _ = tms.preload_method
    torch.empty(MiB, device="cuda").fill_(1)
    tag = "train" if where == "region" else None
    allocated0 = torch.cuda.memory_allocated()
    region = tms.region(tag="train", enable_cpu_backup=True) if where == "region" else None
    if region:
        region.__enter__()
    try:
        snapshot_ms = None
        if kind == "cost":
            tensors, snapshot_ms = _cost(torch, tms, blocks, cached_gib)
        else:
            tensors = {"engine": _engine, "transformer": _transformer}[kind](torch, cached_gib)
    finally:
        if region:
            region.__exit__(None, None, None)
    live = torch.cuda.memory_allocated() - allocated0
    exact = kind != "cost"
    _cycle(tms, tag, True, tensors, False)  # warm-up: first backups, snapshot code paths
    cycles = [_cycle(tms, tag, True, tensors, exact), _cycle(tms, tag, False, tensors, exact)]
    return {"kind": kind, "hook_mode": hook_mode, "where": where, "blocks": blocks, "live_bytes": live,
            "reserved": torch.cuda.memory_reserved(), "snapshot_ms": snapshot_ms, "cycles": cycles}


def _host_row(kind, hook_mode, where, cached_gib, blocks):
    """The dry run: allocations of the library, half of each given as free."""
    import ctypes
    from array import array

    os.environ["TMS_BACKEND"] = "host"
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = hook_mode
    n, size = min(blocks or 4, 16), 4 * MiB  # a few: the plumbing, not the figures
    with tms.region(tag="train", enable_cpu_backup=True):
        ptrs = [tms.malloc(size) for _ in range(n)]
    for p in ptrs:
        ctypes.memset(p, 7, size)
    cycles = []
    for live_only in (True, False):
        skip = array("Q", [x for p in sorted(ptrs) for x in (p + size // 2, size // 2)]).tobytes() if live_only else None
        rss0 = rss_bytes()
        t0 = time.perf_counter()
        r = tms._core.pause("train", skip)
        t1 = time.perf_counter()
        rss1 = rss_bytes()
        tms._core.resume("train")
        t2 = time.perf_counter()
        exact = all(ctypes.string_at(p, size // 2) == b"\7" * (size // 2) for p in ptrs)
        cycles.append({"live_only": live_only, "pause_ms": (t1 - t0) * 1e3, "resume_ms": (t2 - t1) * 1e3,
                       "copied": r["devices"][0]["copied"], "skipped": r["devices"][0]["skipped"],
                       "rss_growth": rss1 - rss0, "exact": exact})
    return {"kind": kind, "hook_mode": hook_mode, "where": where, "blocks": blocks, "live_bytes": n * size // 2,
            "reserved": n * size, "snapshot_ms": 0.0 if kind == "cost" else None, "cycles": cycles}


def worker(kind, hook_mode, where, cached_gib, blocks=None, dry_run=False, save=None):
    row = _host_row if dry_run else _gpu_row
    return row(kind, hook_mode, where, cached_gib, blocks)


def run_row(kind, hook_mode, where, args, blocks=None):
    env = child_env(args.dry_run, clean=True)
    if where == "init":
        env.update({"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"})
    wargs = {"kind": kind, "hook_mode": hook_mode, "where": where, "cached_gib": args.cached_gib, "blocks": blocks,
             "dry_run": args.dry_run}
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        doc, rc, timed_out, tail = run_worker("live", wargs, out.name, env, timeout=600, preload=hook_mode == "preload")
    if rc != 0:
        why = "killed after 600 s" if timed_out else f"exit {rc}"
        return {"kind": kind, "hook_mode": hook_mode, "where": where, "blocks": blocks,
                "error": f"{why}: {' / '.join(tail[-8:])[-2000:]}"}
    return doc


def _mode(r):
    return f"{r['hook_mode']} ({'region' if r['where'] == 'region' else 'TMS_INIT_ENABLE'})"


def shape_table(rows):
    def gib(n):
        return f"{n / GiB:.2f}"

    head = ["shape", "hook mode", "live GiB", "live-only", "copied GiB", "skipped GiB", "copied / live", "pause ms",
            "resume ms", "host RSS growth GiB", "exact"]
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["kind"], _mode(r), f"error: {r['error'][:200]}"] + [""] * 8)
            continue
        for c in r["cycles"]:
            out.append([r["kind"], _mode(r), gib(r["live_bytes"]), "on" if c["live_only"] else "off",
                        gib(c["copied"]), gib(c["skipped"]), f"{c['copied'] / max(r['live_bytes'], 1):.2f}×",
                        f"{c['pause_ms']:.1f}", f"{c['resume_ms']:.1f}", gib(c["rss_growth"]), c["exact"]])
        on, off = r["cycles"]
        out.append([r["kind"], _mode(r), "", "on / off", "", "", "", f"{on['pause_ms'] / off['pause_ms']:.2f}×",
                    f"{on['resume_ms'] / off['resume_ms']:.2f}×", "", ""])
    return report.table(head, out, "llrlrrrrrrl")


def cost_table(rows):
    head = ["live blocks", "snapshot ms", "pause ms live-only on", "pause ms off", "saved ms", "snapshot / saved"]
    out = []
    for r in rows:
        if "error" in r:
            out.append([r["blocks"], f"error: {r['error'][:200]}"] + [""] * 4)
            continue
        on, off = r["cycles"]
        saved = off["pause_ms"] - on["pause_ms"]
        out.append([r["blocks"], f"{r['snapshot_ms']:.2f}", f"{on['pause_ms']:.1f}", f"{off['pause_ms']:.1f}",
                    f"{saved:.1f}", f"{r['snapshot_ms'] / saved:.1%}" if saved > 0 else "-"])
    return report.table(head, out)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks live", description=__doc__.split("\n\n")[0])
    parser.add_argument("--cached-gib", type=float, default=8.0, help="free cached memory beside the live (default 8)")
    parser.add_argument("--out", help="output folder (default benchmarks/results; build/bench-dry-run for --dry-run)")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: host backend, plumbing only")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    meta = report.torch_meta(report.collect_meta("live", argv, args.dry_run), args.dry_run)
    shapes = [run_row(kind, mode, where, args) for kind in SHAPES for mode, where in MODES]
    costs = [run_row("cost", "torch", "region", args, blocks) for blocks in BLOCK_COUNTS]
    doc = {"meta": meta, "cached_gib": args.cached_gib, "shapes": shapes, "costs": costs}
    body = "\n".join([
        f"Each row pauses and resumes one tag with CPU backup (mmap backend), live-only on, then off, in a worker "
        f"of its own after a warm-up cycle. *engine*: 1 GiB of weights live while {args.cached_gib:g} GiB of freed "
        "activations stay cached; *transformer*: an 8-layer d=1024 transformer after two AdamW steps, gradients "
        "and activations freed. *exact*: every live tensor equal bit for bit after resume. Host RSS growth is "
        "measured over the pause (the backup's resident pages).", "",
        shape_table(shapes), "",
        "## The cost of knowing the live ranges", "",
        f"One allocator snapshot (torch.cuda.memory_snapshot, median of 5) with that many live 64 KiB blocks in "
        f"the tag beside {args.cached_gib:g} GiB of free cached memory, against the pause time live-only saves.", "",
        cost_table(costs), ""])
    report.publish(args, meta, doc, TITLE, body)
    bad = [r for r in shapes + costs if "error" in r or any(c["exact"] is False for c in r.get("cycles", []))]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
