"""The `node` suite: one process per GPU on every GPU of the host, as RL and serving
stacks run, pausing and resuming together through torch_memory_saver.distributed:
`python -m benchmarks node [--weights-gib W] [--kv-gib K] [--cycles C]
[--retained-cycles R] [--hook-mode torch|preload] [--gpus N] [--out DIR] [--dry-run]`.

Every process sees every GPU and calls torch.cuda.set_device(rank), joins a
torch.distributed group over NCCL, and holds W GiB of random weights in a backed-up
tag (mmap, in 512 MiB tensors) and K GiB of KV cache in a discarded one. Each cycle
is one group pause of both tags and one group resume, every rank timing its own
call (CLOCK_MONOTONIC is one clock for the host): the first cycle's pause (fresh
host memory), C - 1 later ones, then R cycles with retained backups (the first of
them fills fresh memory once more; the rest reuse it). Weights are checked after
every resume (two checksums of every tensor).

In the same run: the host's fresh-page fill and host copy, measured by as many
processes and threads as the library runs, all at once (multi_gpu's limits), the
ceiling of a first pause; and the same worker alone on GPU 0, whose retained
pause and resume are the single-GPU figures every GPU at once is compared with.
Each process finally reports the contexts it holds on GPUs other than its own
(cuDevicePrimaryCtxGetState) and the device memory nvidia-smi counts for it there:
both must be 0.

--dry-run: two processes on the host backend (each on an emulated device of its
own), gloo, 64 MiB each; the figures mean nothing.
Report: node_<device>-x<N>.{md,json,png}.
"""
import argparse
import os
import sys
import time

from . import report
from .common import GiB, MiB, REPO, pyplot, save_png
from .multi_gpu import _limits, _rates, _run, _threads

TENSOR = 512 * MiB
DRY_RUN = {"weights_gib": 1 / 32, "kv_gib": 1 / 32, "gpus": 2}


def _primary_context(device):
    import ctypes

    cuda = ctypes.CDLL("libcuda.so.1")
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    if cuda.cuDeviceGet(ctypes.byref(dev), device) or cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags),
                                                                                       ctypes.byref(active)):
        return None
    return bool(active.value)


def _smi_bytes_by_pid():
    """{pid: {gpu index: bytes}} of every compute process nvidia-smi lists."""
    import subprocess

    def query(what, fields):
        p = subprocess.run(["nvidia-smi", f"--query-{what}={fields}", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True, timeout=60)
        return [[x.strip() for x in line.split(",")] for line in p.stdout.splitlines() if line.strip()]

    try:
        index = {uuid: int(i) for i, uuid in query("gpu", "index,uuid")}
        out = {}
        for pid, uuid, mib in query("compute-apps", "pid,gpu_uuid,used_memory"):
            out.setdefault(int(pid), {})[index[uuid]] = int(mib) * MiB
        return out
    except (OSError, ValueError, KeyError, subprocess.TimeoutExpired):
        return None


def node_worker(rank, gpu, world, port, weights_gib, kv_gib, cycles, retained_cycles, hook_mode, dry_run, barrier,
                results):
    """One rank: the group's cycles; puts its spans, reports and checks on results."""
    sys.path.insert(0, REPO)
    if dry_run:
        os.environ["TMS_HOST_CURRENT_DEVICE"] = str(gpu)
    import torch
    import torch.distributed as dist

    from torch_memory_saver import distributed as tmsd

    from .envs import make_env

    if not dry_run:
        torch.cuda.set_device(gpu)
    env = make_env(hook_mode, dry_run)
    tms = env.tms
    init = {"init_method": f"tcp://127.0.0.1:{port}", "rank": rank, "world_size": world}
    if dry_run:
        dist.init_process_group("gloo", **init)
    else:
        dist.init_process_group("nccl", device_id=torch.device("cuda", gpu), **init)
    weights = int(weights_gib * GiB)
    tensor = min(TENSOR, weights)
    count = max(1, weights // tensor)
    block = env.alloc("weights", [tensor] * count, backup=True, backend="mmap")
    kv = env.alloc("kv", [int(kv_gib * GiB)])
    out = {"rank": rank, "gpu": gpu, "bytes": tensor * count, "cycles": [], "pid": os.getpid()}
    for c in range(cycles + retained_cycles):
        tms.retain_cpu_backup = c >= cycles
        env.fill_random(block, rank * 1000 + c)
        sums = env.snapshot(block, keep_copy=False)
        env.sync()
        dist.barrier()
        barrier.wait()  # every rank's clock starts together, outside the group's own agreement
        t0 = time.monotonic()
        paused = tmsd.pause(["weights", "kv"])[rank]
        t1 = time.monotonic()
        barrier.wait()
        t2 = time.monotonic()
        resumed = tmsd.resume(["weights", "kv"])[rank]
        env.sync()
        t3 = time.monotonic()
        out["cycles"].append({"pause": (t0, t1), "resume": (t2, t3), "verified": env.verify(block, sums),
                              "retained": c >= cycles, "pause_copied": paused.copied_bytes,
                              "pause_seconds": paused.seconds, "resume_copied": resumed.copied_bytes,
                              "resume_seconds": resumed.seconds, "released": paused.released_bytes})
        barrier.wait()
    del kv
    if dry_run:
        out["other_contexts"] = [d for d in range(2) if d != gpu and tms._core.device_active(d)]
    else:
        out["other_contexts"] = [d for d in range(torch.cuda.device_count())
                                 if d != gpu and _primary_context(d)]
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    if rank == 0 and not dry_run:
        smi = _smi_bytes_by_pid()
        out["smi_other_gpu_bytes"] = None if smi is None else {
            r: sum(b for d, b in smi.get(pid, {}).items() if d != r) for r, pid in enumerate(pids)}
    dist.barrier()
    dist.destroy_process_group()
    results.put(out)


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _phase(res, pick, op):
    """Per-GPU and aggregate GB/s of the cycles pick(i) chose, for op: the median cycle's."""
    chosen = [i for i in range(len(res[0]["cycles"])) if pick(i, res[0]["cycles"][i])]
    if not chosen:
        return None
    rows = []
    for i in chosen:
        spans = [(*r["cycles"][i][op], r["bytes"]) for r in res]
        per, agg = _rates(spans)
        rows.append({"cycle": i, "per_gpu": per, "aggregate": agg,
                     "skew_s": max(s[0] for s in spans) - min(s[0] for s in spans)})
    rows.sort(key=lambda x: x["aggregate"])
    mid = rows[len(rows) // 2]
    return dict(mid, cycles=chosen, min_per_gpu=min(min(x["per_gpu"]) for x in rows))


def _summary(res, cycles):
    return {
        "first_pause": _phase(res, lambda i, c: i == 0, "pause"),
        "later_pauses": _phase(res, lambda i, c: 0 < i < cycles, "pause"),
        "retained_pauses": _phase(res, lambda i, c: c["retained"] and i > cycles, "pause"),
        "resumes": _phase(res, lambda i, c: not c["retained"], "resume"),
        "retained_resumes": _phase(res, lambda i, c: c["retained"], "resume"),
        "verified": all(c["verified"] for r in res for c in r["cycles"]),
        "other_contexts": {r["rank"]: r["other_contexts"] for r in res},
        "smi_other_gpu_bytes": res[0].get("smi_other_gpu_bytes"),
    }


def _group(n, args, dry_run):
    """Runs n ranks, rank r on GPU r: (their results, their exit codes)."""
    return _run(node_worker, (n, _free_port(), args.weights_gib, args.kv_gib, args.cycles, args.retained_cycles,
                              args.hook_mode, dry_run), n)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks node", description=__doc__.split("\n\n")[0])
    ap.add_argument("--weights-gib", type=float, default=None, help="backed-up weights per GPU (default 16)")
    ap.add_argument("--kv-gib", type=float, default=None, help="discarded KV cache per GPU (default 8)")
    ap.add_argument("--cycles", type=int, default=3, help="cycles without retained backups (default 3)")
    ap.add_argument("--retained-cycles", type=int, default=3, help="cycles with retained backups (default 3)")
    ap.add_argument("--hook-mode", choices=("torch", "preload"), default="torch")
    ap.add_argument("--gpus", type=int, default=0, help="processes, one per GPU (default: every GPU)")
    ap.add_argument("--out", help="output folder (default benchmarks/results; build/bench-dry-run for --dry-run)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: host backend, gloo, tiny sizes, plumbing only")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    for key in ("weights_gib", "kv_gib"):
        if getattr(args, key) is None:
            setattr(args, key, DRY_RUN[key] if args.dry_run else {"weights_gib": 16, "kv_gib": 8}[key])
    if args.cycles < 2 or args.retained_cycles < 2:
        return "--cycles and --retained-cycles must be at least 2 (a first cycle and a later one)"
    meta = report.collect_meta("node", argv, args.dry_run)
    if args.dry_run:
        os.environ["TMS_BACKEND"] = "host"  # the spawned processes inherit it
        n = args.gpus or DRY_RUN["gpus"]
    else:
        import torch

        n = args.gpus or torch.cuda.device_count()
        if n < 1 or n > torch.cuda.device_count():
            return f"{n} processes, {torch.cuda.device_count()} GPUs: one process per GPU"
        meta["device_name"] = torch.cuda.get_device_name(0)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    r = {"meta": meta, "gpus": n, "weights_gib": args.weights_gib, "kv_gib": args.kv_gib, "cycles": args.cycles,
         "retained_cycles": args.retained_cycles, "hook_mode": args.hook_mode,
         "group_backend": "gloo" if args.dry_run else "nccl",
         "copy_threads_per_process": _threads(), "cpus": os.cpu_count()}
    _limits(r, args.weights_gib, n, args.dry_run, args.dry_run)
    alone, codes_alone = _group(1, args, args.dry_run)
    r["alone_exit_codes"] = codes_alone
    r["alone"] = _summary(alone, args.cycles) if len(alone) == 1 else None
    res, codes = _group(n, args, args.dry_run)
    r["exit_codes"] = codes
    r["together"] = _summary(res, args.cycles) if len(res) == n else None
    r["ratios"] = _ratios(r)
    md = report.write(report.out_dir(args.out, args.dry_run), report.name(meta, f"x{n}"), r,
                      f"{n} GPUs, one process each, pausing together over torch.distributed",
                      lambda images: _markdown(r) + "".join(f"\n![per-GPU GB/s]({f})\n" for f in images.values()),
                      lambda out, stem: _plot(r, out, stem))
    print(open(md).read())
    print("written:", md)
    ok = r["together"] and r["together"]["verified"] and all(c == 0 for c in codes + codes_alone)
    return 0 if ok else 1


def _ratios(r):
    """The targets' ratios: first pause (aggregate) over the concurrent fill; every
    GPU's retained pause and resume over the single-GPU retained figure."""
    t, a = r.get("together"), r.get("alone")
    if not t or not a:
        return {}
    out = {}
    fill = r.get("limit_fill", {}).get("aggregate")
    if fill and t["first_pause"]:
        out["first_pause_over_fill"] = t["first_pause"]["aggregate"] / fill
    single = a["retained_pauses"] and a["retained_pauses"]["per_gpu"][0]
    if single and t["retained_pauses"]:
        out["retained_pause_over_single"] = t["retained_pauses"]["min_per_gpu"] / single
    single_resume = a["retained_resumes"] and a["retained_resumes"]["per_gpu"][0]
    for key in ("resumes", "retained_resumes"):
        if single_resume and t[key]:
            out[f"{key}_over_single"] = t[key]["min_per_gpu"] / single_resume
    return out


def _fmt(x):
    return "–" if x is None else f"{x:.1f}"


def _markdown(r):
    lines = [f"{r['weights_gib']:g} GiB of backed-up weights (mmap) and {r['kv_gib']:g} GiB of discarded KV cache "
             f"per GPU, {r['hook_mode']} hook mode, a {r['group_backend']} group, {r['copy_threads_per_process']} copy threads per "
             f"process, {r['cpus']} CPUs; {r['cycles']} cycles, then {r['retained_cycles']} with retained backups.",
             ""]
    if "limit_fill" in r:
        rows = [[name, " / ".join(map(_fmt, r[f"limit_{key}"]["per_gpu"])), _fmt(r[f"limit_{key}"]["aggregate"])]
                for key, name in (("fill_first", "fresh-page fill, first touch"),
                                  ("fill", "fresh-page fill, again (median)"), ("copy", "host copy (median)"),
                                  ("d2h", "pinned device→host"), ("h2d", "pinned host→device"))
                if f"limit_{key}" in r]
        lines += [report.table(["host limit, all processes at once", "per GPU GB/s", "aggregate GB/s"], rows), ""]
    head = ["phase", "alone GB/s", "together, per GPU GB/s", "together, aggregate GB/s", "start skew ms"]
    rows = []
    for key, name in (("first_pause", "first pause"), ("later_pauses", "later pauses (median)"),
                      ("retained_pauses", "retained pauses (median)"), ("resumes", "resumes (median)"),
                      ("retained_resumes", "retained resumes (median)")):
        a = (r.get("alone") or {}).get(key)
        t = (r.get("together") or {}).get(key)
        rows.append([name, _fmt(a and a["per_gpu"][0]), " / ".join(map(_fmt, t["per_gpu"])) if t else "–",
                     _fmt(t and t["aggregate"]), _fmt(t and t["skew_s"] * 1e3)])
    lines += [report.table(head, rows, "lrrrr"), ""]
    ratio_names = {"first_pause_over_fill": "first pause, aggregate ÷ concurrent fill (target ≥ 0.9)",
                   "retained_pause_over_single": "retained pause, slowest GPU ÷ alone (target ≥ 0.8)",
                   "resumes_over_single": "resume, slowest GPU ÷ retained resume alone (target ≥ 0.8)",
                   "retained_resumes_over_single": "retained resume, slowest GPU ÷ alone (target ≥ 0.8)"}
    if r.get("ratios"):
        lines += [report.table(["ratio", "value"], [[ratio_names[k], f"{v:.2f}"] for k, v in r["ratios"].items()]),
                  ""]
    t = r.get("together") or {}
    lines.append(f"Contents exact after every resume: {t.get('verified')}. Exit codes: alone "
                 f"{r.get('alone_exit_codes')}, together {r.get('exit_codes')}. Contexts on other GPUs, per rank: "
                 f"{t.get('other_contexts')}; device memory nvidia-smi counts on other GPUs, per rank: "
                 f"{t.get('smi_other_gpu_bytes')}.")
    return "\n".join(lines) + "\n"


def _plot(r, out, stem):
    plt = pyplot()
    t, a = r.get("together"), r.get("alone")
    if plt is None or not t:
        return {}
    keys = [k for k in ("first_pause", "later_pauses", "retained_pauses", "resumes", "retained_resumes") if t.get(k)]
    fig, ax = plt.subplots(figsize=(8, 4.6))
    width = 0.8 / (r["gpus"] + 1)
    for g in range(r["gpus"]):
        ax.bar([i + g * width for i in range(len(keys))], [t[k]["per_gpu"][g] for k in keys], width,
               label=f"GPU {g}, together")
    if a:
        ax.bar([i + r["gpus"] * width for i in range(len(keys))],
               [(a.get(k) or {"per_gpu": [0]})["per_gpu"][0] for k in keys], width, label="GPU 0 alone")
    fill = r.get("limit_fill")
    if fill:
        ax.axhline(fill["aggregate"] / r["gpus"], color="k", ls=":", lw=1,
                   label=f"concurrent fill per GPU {fill['aggregate'] / r['gpus']:.1f}")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
    ax.set_xticklabels([k.replace("_", "\n") for k in keys], fontsize=8)
    ax.set_ylabel("GB/s per GPU")
    ax.set_title(f"{r['gpus']} × {r['meta'].get('device_name')}: pausing together, {r['weights_gib']:g} GiB each")
    ax.legend(fontsize=7)
    save_png(plt, fig, os.path.join(out, stem + ".png"))
    return {"plot": stem + ".png"}


if __name__ == "__main__":
    sys.exit(main())
