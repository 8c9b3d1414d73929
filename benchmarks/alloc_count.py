"""The `alloc_count` suite: pause/resume cost per allocation against the raw
driver loop: `python -m benchmarks alloc_count [--counts 1,10,100,1000,10000]
[--cycles C] [--idle-us U] [--beside N] [--out DIR] [--dry-run]`.

A worker process per n (torch hook mode) holds n allocations of 2 MiB in one tag
(2n tensors of 1 MiB: PyTorch packs two in each 2 MiB segment) and times
pause(tag)/resume(tag): the wall time of the Python call and the time the core
itself counts (stats' pause_ns/resume_ns), so what the binding and Python add
shows apart. Between cycles the first and the last allocation are written (the
memory works). vmm_floor.c runs the same driver calls, and the same writes
(--touch), for the same shapes in the same run; the ratio to it is the target
(<= 1.2x). It runs again with --shuffle: the driver's cost of a scattered order.
Inside each worker the floor also holds n allocations of its own and runs one
cycle beside each of the library's, first and second in turn (floor.Paired):
the same process, context and idle time before the call, which all move the
driver's cost of one allocation. --beside N keeps N more allocations of another
tag live in each worker: a pause of one tag should not cost more for what other
tags hold. After the cycles each worker also times allocation_at() of an
address 4 KiB inside each tensor (the lookup that get_cpu_backup of a tensor
inside a segment makes), three passes.

--dry-run: host backend, up to 100 allocations and no floor, for the plumbing only.
Report: alloc_count_<device>[-idle<U>us][-beside<N>].{md,json,png}.
"""
import argparse
import os
import sys
import tempfile
import time

from . import floor, report
from .common import MiB, child_env, median, pyplot, run_worker, save_png, spin

ALLOC_BYTES = 2 * MiB
TITLE = "Pause/resume per allocation vs the driver floor"


def worker(counts, cycles, warmup, dry_run, floor_lib=None, idle_s=0.0, beside=0, save=None):
    """Runs in the worker process: {count: point}. With floor_lib, the floor
    holds as many allocations of its own in this process and runs a cycle
    beside each of the library's (floor.Beside), first and second in turn."""
    from .envs import GpuEnv, HostEnv

    env = HostEnv("torch") if dry_run else GpuEnv("torch")
    others = env.alloc_granules("beside", beside) if beside else None
    points = []
    for n in counts:
        tag = f"count-{n}"
        t0 = time.perf_counter()
        block = env.alloc_granules(tag, n)
        point = {"requested": n, "alloc_s": time.perf_counter() - t0, "allocations": len(env.tag_allocs(tag))}
        for key in ("pause", "resume", "pause_core", "resume_core"):
            point[key] = []
        paired = floor.Beside(floor_lib, point["allocations"], ALLOC_BYTES)
        for c in range(warmup + cycles):
            if c % 2 == 0:
                fp = paired.cycle(c, idle_s)
            before = env.tag_stats(tag)
            env.touch(block, c)  # ends in a synchronize, as the floor's cycle starts
            spin(idle_s)
            t0 = time.perf_counter()
            env.tms.pause(tag)
            t1 = time.perf_counter()
            env.tms.resume(tag)
            t2 = time.perf_counter()
            after = env.tag_stats(tag)
            if c % 2 == 1:
                fp = paired.cycle(c, idle_s)
            if c >= warmup:
                point["pause"].append(t1 - t0)
                point["resume"].append(t2 - t1)
                point["pause_core"].append((after["pause_ns"] - before["pause_ns"]) * 1e-9)
                point["resume_core"].append((after["resume_ns"] - before["resume_ns"]) * 1e-9)
                if fp is not None:
                    paired.times.append(fp)
        paired.close()
        point["pause_paired"] = [p for p, _ in paired.times]
        point["resume_paired"] = [r for _, r in paired.times]
        if paired.error:  # e.g. no room for a second set: the library's figures still count
            point["paired_error"] = paired.error
        point["lookup_s"] = _interior_lookups(env, block)
        point["tensors"] = len(env.addresses(block))
        env.dispose(block, tag)
        points.append(point)
        print(f"alloc_count: {point['allocations']} allocations: pause {median(point['pause']) * 1e3:.3f} ms, "
              f"resume {median(point['resume']) * 1e3:.3f} ms", file=sys.stderr, flush=True)
    beside_allocations = len(env.tag_allocs("beside")) if others else 0
    if others:
        env.dispose(others, "beside")
    return {"points": points, "env": env.info(), "beside": beside_allocations}


def _interior_lookups(env, block, passes=3):
    """Seconds per allocation_at() of an address inside each tensor, per pass.
    The lookup has no public call of its own (get_cpu_backup makes it, then
    copies), so it is timed on the native module."""
    inside = [p + 4096 for p in env.addresses(block)]
    at = env.tms._core.allocation_at
    per_pass = []
    for _ in range(passes):
        t0 = time.perf_counter()
        found = sum(at(p) is not None for p in inside)
        per_pass.append((time.perf_counter() - t0) / max(1, len(inside)))
        if found != len(inside):
            raise RuntimeError(f"allocation_at found {found} of {len(inside)} addresses inside live tensors")
    return per_pass


def _floor(counts, cycles, warmup, options=()):
    exe, _ = floor.build()
    doc = floor.run(exe, [f"{n}x2M" for n in counts], cycles, warmup, timeout=600, options=options)
    by_count = {}
    for shape in doc.get("shapes", []):
        if not shape.get("error"):
            by_count[int(shape["count"])] = shape
    return doc, by_count


def _floor_median(shape, op):
    for key in (f"{op}_median_s", f"{op}_s"):
        v = shape.get(key)
        if isinstance(v, list):
            return median(v)
        if v is not None:
            return v
    return None


def _markdown(r):
    lines = ["Torch hook mode, allocations of 2 MiB, "
             f"median of {r['cycles']} cycles after {r['warmup']} warm-up, "
             f"{r.get('idle_us', 0):g} µs of device idle (a spin) before each timed call"
             + (f", {r['beside']} allocations of another tag live beside the measured one" if r.get("beside") else "")
             + ". "
             "`core` is the time the core counts "
             "(stats pause_ns/resume_ns); `call` is the Python call's wall time; the floor is vmm_floor.c "
             "(cuMemUnmap+cuMemRelease / cuMemCreate+cuMemMap+cuMemSetAccess per allocation, the same memory "
             "written between cycles) in the same run. "
             "`shuffled` is the same floor visiting the allocations in a fixed random order (vmm_floor --shuffle). "
             "`paired` is the same floor loop on as many allocations of its own inside the worker process, "
             "one cycle of it beside each cycle of the library, first and second in turn (floor.Paired): "
             "PyTorch loaded, its primary context, the same idle time before each call. "
             "Target: call <= 1.2x floor.", ""]
    per_op = ["call ms", "core ms", "floor ms", "paired ms", "shuffled ms", "call/floor", "call/paired",
              "µs/alloc (call)"]
    head = ["allocations"] + [f"{op} {c}" if c in ("call ms", "core ms") else c for op in ("pause", "resume")
                              for c in per_op]
    rows = []
    for p in r["points"]:
        cells = [str(p["allocations"])]
        for op in ("pause", "resume"):
            call, core, fl = median(p[op]), median(p[op + "_core"]), p.get(op + "_floor_s")
            shuffled, paired = p.get(op + "_floor_shuffled_s"), p.get(op + "_floor_paired_s")
            cells += [f"{call * 1e3:.3f}", f"{core * 1e3:.3f}", f"{fl * 1e3:.3f}" if fl else "-",
                      f"{paired * 1e3:.3f}" if paired else "-", f"{shuffled * 1e3:.3f}" if shuffled else "-",
                      f"{call / fl:.2f}×" if fl else "-", f"{call / paired:.2f}×" if paired else "-",
                      f"{call / max(1, p['allocations']) * 1e6:.1f}"]
        rows.append(cells)
    lines += [report.table(head, rows, "r" * len(head)), "",
              "`allocation_at()` of an address 4 KiB inside each tensor (what `get_cpu_backup` of a tensor "
              "inside a segment looks up), per lookup, after the cycles:", ""]
    rows = [[p["allocations"], p.get("tensors", "-"), f"{p['lookup_s'][0] * 1e6:.2f}",
             ", ".join(f"{t * 1e6:.2f}" for t in p["lookup_s"][1:])] for p in r["points"] if p.get("lookup_s")]
    lines.append(report.table(["allocations", "tensors looked up", "first pass µs", "later passes µs"], rows, "rrrr"))
    return "\n".join(lines) + "\n"


def _plot(r, out, stem):
    """Microseconds per allocation vs count, library and floor: {"plot": PNG file name}, or {}."""
    plt = pyplot()
    pts = [p for p in r["points"] if p.get("pause_floor_s")]
    if plt is None or not pts:
        return {}
    xs = [p["allocations"] for p in pts]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for op, marker in (("pause", "o"), ("resume", "s")):
        for key, style, name in (("", "-", "library (call)"), ("_floor_s", "--", "driver floor"),
                                 ("_floor_paired_s", "-.", "driver floor, paired in the same process"),
                                 ("_floor_shuffled_s", ":", "driver floor, scattered order")):
            xy = [(x, median(p[op]) if not key else p.get(op + key)) for x, p in zip(xs, pts)]
            xy = [(x, t / max(1, x) * 1e6) for x, t in xy if t]  # a shape the floor could not run: left out
            if xy:
                ax.plot([x for x, _ in xy], [y for _, y in xy], marker + style, label=f"{op}: {name}")
    ax.set_xscale("log")
    ax.set_xlabel("allocations (2 MiB each)")
    ax.set_ylabel("µs per allocation")
    ax.set_title(f"{TITLE}\n{r['meta']['device_name']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    save_png(plt, fig, os.path.join(out, stem + ".png"))
    return {"plot": stem + ".png"}


def _run_worker(counts, cycles, warmup, dry_run, floor_lib=None, idle_us=0.0, beside=0):
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        args = {"counts": counts, "cycles": cycles, "warmup": warmup, "dry_run": dry_run, "floor_lib": floor_lib,
                "idle_s": idle_us * 1e-6, "beside": beside}
        doc, rc, _, _ = run_worker("alloc_count", args, out.name, child_env(dry_run))
    if rc != 0:
        raise RuntimeError(f"alloc_count worker for {counts} exited {rc}")
    return doc


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks alloc_count", description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", help="allocation counts, one worker each (default 1,10,100,1000,10000; "
                                     "1,10,100 for --dry-run)")
    ap.add_argument("--cycles", type=int, default=8, help="even: the paired floor goes first in half of them")
    # The driver's unmap in a fresh PyTorch process takes a few cycles to settle.
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--idle-us", type=float, default=0.0,
                    help="after the synchronize that ends each cycle's writes, spin this long with the device idle "
                         "before the timed calls (library and paired floor alike)")
    ap.add_argument("--beside", type=int, default=0,
                    help="allocations of 2 MiB in another tag, live while each count is measured")
    ap.add_argument("--out", help="output folder (default benchmarks/results; build/bench-dry-run for --dry-run)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: host backend, no floor, plumbing only")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    counts = [int(c) for c in (args.counts or ("1,10,100" if args.dry_run else "1,10,100,1000,10000")).split(",")
              if c]
    meta = report.collect_meta("alloc_count", argv, args.dry_run)
    r = {"meta": meta, "cycles": args.cycles, "warmup": args.warmup, "idle_us": args.idle_us}
    # A process per count, as the floor frees each shape's reservations before
    # the next: the driver's cost depends on what else the process holds.
    floor_lib = None if args.dry_run else floor.build(library=True)[0]
    runs = [_run_worker([n], args.cycles, args.warmup, args.dry_run, floor_lib, args.idle_us, args.beside)
            for n in counts]
    meta.setdefault("device_name", runs[0]["env"]["device_name"])
    r["beside"] = min(run.get("beside", 0) for run in runs)
    r["points"] = [run["points"][0] for run in runs]
    if not args.dry_run:
        idle = ("--idle-us", str(args.idle_us))
        r["floor"], by_count = _floor(counts, args.cycles, args.warmup, ("--touch", *idle))
        r["floor_shuffled"], shuffled = _floor(counts, args.cycles, args.warmup, ("--touch", "--shuffle", *idle))
        for p in r["points"]:
            for op in ("pause", "resume"):
                for key, shapes in (("_floor_s", by_count), ("_floor_shuffled_s", shuffled)):
                    shape = shapes.get(p["allocations"])
                    p[op + key] = _floor_median(shape, op) if shape else None
                p[op + "_floor_paired_s"] = median(p[op + "_paired"]) if p.get(op + "_paired") else None
    variant = "-".join(v for v in (f"idle{args.idle_us:g}us" if args.idle_us else "",
                                   f"beside{args.beside}" if args.beside else "") if v)
    md = report.write(report.out_dir(args.out, args.dry_run), report.name(meta, variant), r, TITLE,
                      lambda images: _markdown(r) + "".join(f"\n![per-allocation cost vs the driver floor]({f})\n"
                                                            for f in images.values()),
                      lambda out, stem: _plot(r, out, stem))
    print(open(md).read())
    print("written:", md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
