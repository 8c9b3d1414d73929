"""The `alloc_count` suite: pause/resume cost per allocation against the raw driver loop: `python -m benchmarks
alloc_count [--counts 1,10,100,1000,10000] [--cycles C] [--idle-us U] [--beside N] [--out DIR] [--dry-run]`.

A worker process per n (torch hook mode) holds n allocations of 2 MiB in one tag (2n tensors of 1 MiB: PyTorch packs
two in each 2 MiB segment) and times pause(tag)/resume(tag): the Python call's wall time and the time the core
counts (stats' pause_ns/resume_ns), writing the first and last allocation between cycles. vmm_floor.c runs the same
driver calls for the same shapes in a process of its own (then --shuffle'd), and inside each worker beside each of
the library's cycles, in turn (floor.Paired: the same process, context and idle time). --beside N keeps N more
allocations of another tag live. Each worker then times allocation_at() 4 KiB inside each tensor (what
get_cpu_backup looks up), three passes.

--dry-run: host backend, up to 100 allocations and no floor, for the plumbing only. Report:
alloc_count_<device>[-idle<U>us][-beside<N>].{md,json}.
"""
import sys
import time

from . import floor, report
from .common import MiB, child_env, median, parser, run_row, spin
from .envs import make_env

ALLOC_BYTES = 2 * MiB
TITLE = "Pause/resume per allocation vs the driver floor"


def worker(counts, cycles, warmup, dry_run, floor_lib=None, idle_s=0.0, beside=0, save=None):
    """Runs in the worker process: {count: point}. With floor_lib, the floor
    holds as many allocations of its own in this process and runs a cycle
    beside each of the library's (floor.Beside), first and second in turn."""
    env = make_env("torch", dry_run)
    others = env.alloc_granules("beside", beside) if beside else None
    points = []
    for n in counts:
        tag = f"count-{n}"
        t0 = time.perf_counter()
        block = env.alloc_granules(tag, n)
        point = {"requested": n, "alloc_s": time.perf_counter() - t0, "allocations": len(env.tag_allocs(tag)),
                 "pause": [], "resume": [], "pause_core": [], "resume_core": []}
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
    """vmm_floor in a process of its own: (its document, {count: the shape's medians})."""
    doc = floor.run(floor.build()[0], [f"{n}x2M" for n in counts], cycles, warmup, timeout=600, options=options)
    return doc, {int(s["count"]): s for s in doc.get("shapes", []) if not s.get("error")}


def _markdown(r):
    lines = [f"Torch hook mode, allocations of 2 MiB, median of {r['cycles']} cycles after {r['warmup']} warm-up, "
             f"{r.get('idle_us', 0):g} µs of device idle (a spin) before each timed call"
             + (f", {r['beside']} allocations of another tag live beside the measured one" if r.get("beside") else "")
             + ". `core` is the time the core counts (stats pause_ns/resume_ns); `call` is the Python call's wall "
             "time; the floor is vmm_floor.c (cuMemUnmap+cuMemRelease / cuMemCreate+cuMemMap+cuMemSetAccess per "
             "allocation, the same memory written between cycles) in the same run. `shuffled` is the same floor "
             "visiting the allocations in a fixed random order (vmm_floor --shuffle). `paired` is the same floor loop "
             "on as many allocations of its own inside the worker process, one cycle of it beside each cycle of the "
             "library, first and second in turn (floor.Paired): PyTorch loaded, its primary context, the same idle "
             "time before each call. Target: call <= 1.2x floor.", ""]
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


def main(argv=None):
    ap = parser("alloc_count", __doc__, "no GPU: host backend, no floor, plumbing only")
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
    args = ap.parse_args(argv := sys.argv[1:] if argv is None else argv)
    counts = [int(c) for c in (args.counts or ("1,10,100" if args.dry_run else "1,10,100,1000,10000")).split(",") if c]
    meta = report.collect_meta("alloc_count", argv, args.dry_run)
    r = {"meta": meta, "cycles": args.cycles, "warmup": args.warmup, "idle_us": args.idle_us}
    # A process per count, as the floor frees each shape's reservations before
    # the next: the driver's cost depends on what else the process holds.
    floor_lib = None if args.dry_run else floor.build(library=True)[0]
    runs = []
    for n in counts:
        wargs = {"counts": [n], "cycles": args.cycles, "warmup": args.warmup, "dry_run": args.dry_run,
                 "floor_lib": floor_lib, "idle_s": args.idle_us * 1e-6, "beside": args.beside}
        runs.append(run_row("alloc_count", wargs, child_env(args.dry_run), {}, timeout=None))
        if "error" in runs[-1]:
            raise RuntimeError(f"alloc_count worker for {n} allocations: {runs[-1]['error']}")
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
                    p[op + key] = shapes.get(p["allocations"], {}).get(f"{op}_median_s")
                p[op + "_floor_paired_s"] = median(p[op + "_paired"]) if p.get(op + "_paired") else None
    variant = "-".join(v for v in (f"idle{args.idle_us:g}us" if args.idle_us else "",
                                   f"beside{args.beside}" if args.beside else "") if v)
    report.publish(args, r, TITLE, _markdown(r), variant=variant)
    return 0


if __name__ == "__main__":
    sys.exit(main())
