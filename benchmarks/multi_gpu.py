"""The `multi_gpu` suite: every GPU of the host pausing at once: `python -m benchmarks multi_gpu [--gib G] [--cycles C]
[--gpus N] [--share-gpu] [--limits-last] [--configs LIST] [--tensor-mib M] [--out DIR] [--dry-run]`.

One process per GPU (CUDA_VISIBLE_DEVICES=i, torch hook mode; with --share-gpu N processes all on GPU 0, a stand-in
for the host side of N GPUs), each holding G GiB of random data in one backed-up region, in tensors of M MiB (512 by
default; PyTorch packs tensors under 10 MiB into shared 20 MiB segments, each one allocation and one backup of the
library's). A barrier starts every pause and every resume in all processes together. Per backup configuration and
cycle it reports each GPU's GB/s and the aggregate (all bytes over the span from the first start to the last end;
the start skew, last start less first, says how much of that span the barrier's release cost), page faults and huge
pages per pause, contents checked after every resume (two checksums of every tensor, taken before the pause), and
every process's exit status.

The host limits are measured in the same run with the same number of processes: fresh-page fill (each process writes
G GiB of new anonymous huge-page memory with as many threads as it would run copy workers, all processes at once,
three times: the bound of a backup that keeps no memory between cycles; the first time apart, as it touches memory
the virtual machine had not backed yet), host copy (the same threads copy the filled memory out in 4 MiB blocks,
each into two buffers of its own in turn, median of 3: the host side of a resume of a non-retained mmap backup,
which copies each block into a pinned staging slot before its DMA) and pinned device->host / host->device copies of
4 GiB on every GPU at once, the median of 5 (the link).

--dry-run: two processes on the host backend, 64 MiB each in 8 MiB allocations, a host memcpy standing in for the
link; the figures mean nothing. Report: multi_gpu_<device>-x<N> (or -<N>procs-on-1).{md,json}.
"""
import ctypes
import multiprocessing as mp
import os
import resource
import sys
import threading
import time

from . import report
from .common import GiB, MiB, copy_threads, import_library, parser
from .cycles import BACKUP_CONFIGS
from .envs import make_env

TENSOR_MIB = 512
LINK_REPS = 5
FILL_REPS = 3
COPY_REPS = 3
COPY_BLOCK = 4 * MiB  # the library's block of a copy to the device (src/backup/transfer.c)
DEFAULT_CONFIGS = "mmap,pinned,mmap_retained"
DRY_RUN = {"gib": 1 / 16, "tensor_mib": 8, "gpus": 2}
LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.mmap.restype, LIBC.memcpy.restype = ctypes.c_void_p, ctypes.c_void_p
LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
LIBC.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]


def _fill_fresh(nbytes, threads):
    """Fresh anonymous memory (MADV_HUGEPAGE) and the threads that will write it:
    (address, threads, unmap)."""
    addr = LIBC.mmap(None, nbytes, 3, 0x22, -1, 0)  # PROT_READ|PROT_WRITE, MAP_PRIVATE|MAP_ANONYMOUS
    if not addr or addr == ctypes.c_void_p(-1).value:
        raise OSError(ctypes.get_errno(), "mmap of the fill buffer failed")
    LIBC.madvise(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes), 14)  # MADV_HUGEPAGE
    part = nbytes // threads
    work = [threading.Thread(target=LIBC.memset, args=(ctypes.c_void_p(addr + i * part), 1, ctypes.c_size_t(part)))
            for i in range(threads)]
    return addr, work, lambda: LIBC.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(nbytes))


def _copy_out(addr, nbytes, buffers):
    """Threads, one per buffer of 2 * COPY_BLOCK bytes (two slots), each copying
    its share of [addr, addr + nbytes) out in COPY_BLOCK pieces, into its two
    slots in turn."""
    part = nbytes // len(buffers)

    def run(start, pair):
        for i, off in enumerate(range(start, start + part, COPY_BLOCK)):
            LIBC.memcpy(pair[i & 1], addr + off, min(COPY_BLOCK, start + part - off))

    pairs = [(ctypes.addressof(b), ctypes.addressof(b) + COPY_BLOCK) for b in buffers]
    return [threading.Thread(target=run, args=(i * part, pair)) for i, pair in enumerate(pairs)]


def _timed(work, barrier, nbytes):
    """Starts the threads together with the other processes: (start, end, bytes)."""
    barrier.wait()
    t0 = time.monotonic()
    for w in work:
        w.start()
    for w in work:
        w.join()
    return (t0, time.monotonic(), nbytes)


def _link_copies(nbytes, dry_run):
    """[(name, copy)] of the link's two directions: pinned copies of 4 GiB on
    this process's GPU, or (dry run) a host memcpy standing in for them."""
    if dry_run:
        a, b = ctypes.create_string_buffer(nbytes), ctypes.create_string_buffer(nbytes)
        return nbytes, [("d2h", lambda: ctypes.memmove(b, a, nbytes)), ("h2d", lambda: ctypes.memmove(a, b, nbytes))]
    import torch

    n = 4 * GiB
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.copy_(dev)  # warm
    torch.cuda.synchronize()

    def copy(dst, src):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()

    return n, [("d2h", lambda: copy(host, dev)), ("h2d", lambda: copy(dev, host))]


def limits_worker(rank, gpu, gib, dry_run, barrier, results):
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    out = {"rank": rank, "fill": [], "copy": []}
    threads, nbytes = copy_threads(), int(gib * GiB)
    for rep in range(FILL_REPS):  # the first touches memory the virtual machine never backed yet
        addr, work, unmap = _fill_fresh(nbytes, threads)
        out["fill"].append(_timed(work, barrier, nbytes))
        if rep < FILL_REPS - 1:
            unmap()
    buffers = [ctypes.create_string_buffer(2 * COPY_BLOCK) for _ in range(threads)]  # zeroed: resident
    for _ in range(COPY_REPS):
        out["copy"].append(_timed(_copy_out(addr, nbytes, buffers), barrier, nbytes))
    unmap()
    n, link = _link_copies(nbytes, dry_run)
    for name, copy in link:
        out[name] = []
        for _ in range(LINK_REPS):  # the first copies of a process run slower: the median counts
            barrier.wait()
            t0 = time.monotonic()
            copy()
            out[name].append((t0, time.monotonic(), n))
    results.put(out)


def _faults():
    """Minor page faults of the process so far."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _huge_bytes():
    """Bytes of the process's anonymous huge pages now. Reading smaps_rollup
    walks every page table of the process (tens of ms beside a retained
    backup), so never between a barrier and a clock's start."""
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1]) * 1024
    return 0


def backup_worker(rank, gpu, config, gib, cycles, tensor_mib, dry_run, barrier, results):
    os.environ["CUDA_VISIBLE_DEVICES"] = str(gpu)
    import_library(None)
    env = make_env("torch", dry_run)
    tms = env.tms
    backend, retain = BACKUP_CONFIGS[config]
    tms.retain_cpu_backup = retain
    if bool(tms.retain_cpu_backup) != retain:
        raise RuntimeError(f"retain_cpu_backup = {retain} did not take: reads {tms.retain_cpu_backup!r}")
    tensor = int(tensor_mib * MiB) // 8 * 8
    count = max(1, int(gib * GiB) // tensor)
    block = env.alloc("mg", [tensor] * count, backup=True, backend=backend)
    out = {"rank": rank, "bytes": count * tensor, "cycles": []}
    for c in range(cycles):
        env.fill_random(block, rank * 1000 + c)
        sums = env.snapshot(block, keep_copy=False)
        env.sync()
        faults0 = _faults()  # before the barrier: nothing may stand between it and the clock's start
        barrier.wait()
        t0 = time.monotonic()
        tms.pause("mg")
        t1 = time.monotonic()
        faults1, t_walk = _faults(), time.monotonic()
        huge = _huge_bytes()
        walk = time.monotonic() - t_walk
        barrier.wait()
        t2 = time.monotonic()
        tms.resume("mg")
        env.sync()
        t3 = time.monotonic()
        barrier.wait()
        out["cycles"].append({"pause": (t0, t1), "resume": (t2, t3), "verified": env.verify(block, sums),
                              "pause_faults": faults1 - faults0, "huge_bytes_paused": huge, "smaps_walk_s": walk})
    results.put(out)


def _run(target, args, n, share_gpu=False):
    """Runs target in n processes, rank r on GPU r (every one on GPU 0 with
    share_gpu); returns (their results by rank, their exit codes)."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=target, args=(rank, 0 if share_gpu else rank, *args, barrier, results))
             for rank in range(n)]
    for p in procs:
        p.start()
    got = []
    deadline = time.monotonic() + 600
    while len(got) < n and time.monotonic() < deadline:
        try:
            got.append(results.get(timeout=5))
        except Exception:
            if all(p.exitcode is not None for p in procs):
                break
    for p in procs:
        p.join(timeout=60)
    return sorted(got, key=lambda r: r["rank"]), [p.exitcode for p in procs]


def _rates(spans):
    """(per-process GB/s list, aggregate GB/s) of [(start, end, bytes)]."""
    per = [b / (t1 - t0) / 1e9 for t0, t1, b in spans]
    agg = sum(b for _, _, b in spans) / (max(t1 for _, t1, _ in spans) - min(t0 for t0, _, _ in spans)) / 1e9
    return per, agg


def _cycle(res, c):
    """Cycle c of every process's results, summed up: rates, spans, start skew, checks."""
    cyc = {"verified": all(r["cycles"][c]["verified"] for r in res),
           "pause_faults": [r["cycles"][c]["pause_faults"] for r in res],
           "huge_bytes_paused": [r["cycles"][c]["huge_bytes_paused"] for r in res],
           "smaps_walk_s": [r["cycles"][c].get("smaps_walk_s") for r in res]}
    for op in ("pause", "resume"):
        spans = [r["cycles"][c][op] for r in res]
        per, agg = _rates([(*span, r["bytes"]) for span, r in zip(spans, res)])
        cyc[op] = {"per_gpu": per, "aggregate": agg, "spans": spans,
                   "start_skew_s": max(t0 for t0, _ in spans) - min(t0 for t0, _ in spans)}
    return cyc


def main(argv=None):
    ap = parser("multi_gpu", __doc__, "no GPU: processes on the host backend, tiny sizes, plumbing only")
    ap.add_argument("--gib", type=float, default=None, help="backed-up data per process (default 24)")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--gpus", type=int, default=0, help="processes (default: every GPU)")
    ap.add_argument("--share-gpu", action="store_true",
                    help="every process on GPU 0: the host side (cores, fresh pages) shared as by N GPUs, "
                         "the link shared too")
    ap.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"of {','.join(BACKUP_CONFIGS)}")
    ap.add_argument("--tensor-mib", type=float, default=None,
                    help=f"size of each tensor (default {TENSOR_MIB}): small ones make many backups")
    ap.add_argument("--limits-last", action="store_true",
                    help="measure the host limits after the backups, so the first pause is the first touch")
    args = ap.parse_args(argv := sys.argv[1:] if argv is None else argv)
    dry = DRY_RUN if args.dry_run else {"gib": 24, "tensor_mib": TENSOR_MIB, "gpus": 0}
    gib = dry["gib"] if args.gib is None else args.gib
    tensor_mib = dry["tensor_mib"] if args.tensor_mib is None else args.tensor_mib
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in BACKUP_CONFIGS]
    if unknown:
        return f"unknown configuration {unknown[0]!r}: one of {', '.join(BACKUP_CONFIGS)}"
    meta = report.collect_meta("multi_gpu", argv, args.dry_run)
    if args.dry_run:
        os.environ["TMS_BACKEND"] = "host"  # the spawned processes inherit it
        n, share_gpu = args.gpus or dry["gpus"], True
    else:
        import torch

        n, share_gpu = args.gpus or torch.cuda.device_count(), args.share_gpu
        if n < 1:
            return "no GPU"
        if n > torch.cuda.device_count() and not share_gpu:
            return f"{n} processes, {torch.cuda.device_count()} GPUs: pass --share-gpu to put them all on GPU 0"
        meta["device_name"] = torch.cuda.get_device_name(0)
    r = {"meta": meta, "gpus": n, "share_gpu": share_gpu, "gib_per_gpu": gib, "cycles": args.cycles,
         "tensor_mib": tensor_mib, "copy_threads_per_process": copy_threads(), "cpus": os.cpu_count(),
         "limits_last": args.limits_last}
    if not args.limits_last:
        _limits(r, gib, n, share_gpu, args.dry_run)
    rows = []
    for config in configs:
        res, codes = _run(backup_worker, (config, gib, args.cycles, tensor_mib, args.dry_run), n, share_gpu)
        cycles = [_cycle(res, c) for c in range(args.cycles)] if len(res) == n else []
        rows.append({"config": config, "exit_codes": codes, "cycles": cycles})
        print(f"{config}: exit codes {codes}, {len(cycles)} cycles", flush=True)
    r["rows"] = rows
    if args.limits_last:
        _limits(r, gib, n, share_gpu, args.dry_run)
    title = (f"{n} processes on one GPU" if share_gpu else f"{n} GPUs") + " pausing together"
    report.publish(args, r, title, _markdown(r), variant=f"{n}procs-on-1" if share_gpu else f"x{n}")
    return 0


def _limits(report, gib, n, share_gpu, dry_run):
    lim, codes = _run(limits_worker, (gib, dry_run), n, share_gpu)
    report["limits_exit_codes"] = codes
    if len(lim) == n:
        for key in ("fill", "copy", "d2h", "h2d"):
            reps = [_rates([r[key][i] for r in lim]) for i in range(len(lim[0][key]))]
            if key == "fill":  # the first touch apart: later pauses reuse memory the VM backs already
                report["limit_fill_first"] = {"per_gpu": reps[0][0], "aggregate": reps[0][1]}
                reps = reps[1:]
            per, agg = sorted(reps, key=lambda x: x[1])[len(reps) // 2]
            report[f"limit_{key}"] = {"per_gpu": per, "aggregate": agg}


def _markdown(r):
    def fmt(x):
        return f"{x:.1f}"

    lines = [f"{r['gib_per_gpu']} GiB per GPU in {r.get('tensor_mib', TENSOR_MIB):g} MiB tensors, {r['cycles']} "
             f"cycles, {r['copy_threads_per_process']} copy threads per process, {r['cpus']} CPUs.", ""]
    if r.get("limits_last"):
        lines += ["Host limits measured after the backups: the first pause is this VM's first touch of that memory.",
                  ""]
    if "limit_fill" in r:
        rows = [[name, " / ".join(map(fmt, r[f"limit_{key}"]["per_gpu"])), fmt(r[f"limit_{key}"]["aggregate"])]
                for key, name in (("fill_first", "fresh-page fill, first touch of the process"),
                                  ("fill", "fresh-page fill, again (median of the next 2)"),
                                  ("copy", f"host copy out of filled memory, {COPY_BLOCK // MiB} MiB blocks "
                                           f"(median of {COPY_REPS})"),
                                  ("d2h", "pinned device→host"), ("h2d", "pinned host→device"))
                if f"limit_{key}" in r]
        lines += [report.table(["host limit, all processes at once", "per GPU GB/s", "aggregate GB/s"], rows), ""]
    head = ["backup", "cycle", "pause per GPU GB/s", "pause aggregate (× limit)", "resume per GPU GB/s",
            "resume aggregate (× limit)", "start skew pause / resume ms", "page faults in pause, per GPU",
            "anon huge pages after pause GiB", "contents", "exit codes"]
    rows = []
    for row in r["rows"]:
        retained = row["config"].endswith("retained")
        for i, cyc in enumerate(row["cycles"]):
            cells = []
            # A resume of a non-retained mmap backup copies it into the staging first.
            resume_keys = ("h2d", "copy") if row["config"] == "mmap" else ("h2d",)
            for op, lim_keys in (("pause", ("d2h" if retained else "fill",)), ("resume", resume_keys)):
                agg = cyc[op]["aggregate"]
                ratios = [f"{agg / lim:.2f}× {key}" for key in lim_keys
                          for lim in [r.get(f"limit_{key}", {}).get("aggregate")] if lim]
                ratio = f" ({', '.join(ratios)})" if ratios else ""
                cells += [" / ".join(map(fmt, cyc[op]["per_gpu"])), fmt(agg) + ratio]
            skews = [cyc[op].get("start_skew_s") for op in ("pause", "resume")]
            cells.append(" / ".join("–" if x is None else f"{x * 1e3:.1f}" for x in skews))
            cells += [" / ".join(str(x) for x in cyc.get("pause_faults", [])),
                      " / ".join(f"{x / GiB:.1f}" for x in cyc.get("huge_bytes_paused", []))]
            rows.append([row["config"], "first" if i == 0 else i + 1, *cells,
                         "exact" if cyc["verified"] else "MISMATCH", row["exit_codes"]])
        if not row["cycles"]:
            rows.append([row["config"], "failed", *[""] * 8, row["exit_codes"]])
    lines += [report.table(head, rows, "llrrrrrrrll"), ""]
    lines.append("Pause of a non-retained backup is bound by the fresh-page fill; a retained one by the link. A resume "
                 "from page-locked memory (pinned, or retained) is bound by the link; one of a non-retained mmap "
                 "backup also by the host copy into the staging, the lower of the two.")
    walks = [w for row in r["rows"] for cyc in row["cycles"] for w in cyc.get("smaps_walk_s", []) if w is not None]
    if walks:
        lines += ["", f"Counting the huge pages (a read of /proc/self/smaps_rollup) took {min(walks) * 1e3:.1f}–"
                      f"{max(walks) * 1e3:.1f} ms per process after a pause, outside every clock."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
