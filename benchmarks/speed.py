"""The `speed` suite: the rows a user compares with the upstream library, side by side with it in one run: `python -m
benchmarks speed [--upstream DIR] [--before DIR] [--gib G] [--gap S] [--cycles N] [--out DIR] [--dry-run]`.

Each library (this checkout; --upstream: the torch_memory_saver unpacked in DIR; --before: an earlier checkout,
built in place) runs in three fresh workers: torch mode, preload mode (under its own configure_subprocess()) and
preload mode with TMS_INIT_ENABLE=1 TMS_INIT_ENABLE_CPU_BACKUP=1 (how slime and AReaL run); a fourth measures the
link. Rows: the first backed-up region and pause (1 GiB, beside plain PyTorch; once a process, so N - 1 more
workers do only that, started together, measuring one at a time once all are ready); allocate + fill of 16 x 512 MiB
in a backed-up region, one without backup and plain PyTorch, in turns, given back between; discard pause and resume
(1 x 8 GiB, 64 x 128 MiB, medians of 11); `mmap` and `pinned` backups and retained ones (G GiB in 16 tensors: the
first cycle, N right after a resume, one after S s idle); skip_unchanged (ours: nothing, 1 % of the chunks, all
changed); checked restores (ours: verify_restore on and off in turns; 100 GiB discarded, restored as none, zero,
poison); a Llama-shaped model's and KV cache's resume beside the same bytes in 512 MiB tensors. Millisecond rows:
medians of N (--cycles, default 9) or more; the driver's own calls (vmm_floor.c) cycled beside the discard and
allocation rows. Contents are compared after every resume. --dry-run: the host backend, this library only, tiny
sizes, N 3. Report: speed_<device>.{md,json,png}.
"""
import concurrent.futures
import fcntl
import inspect
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

from . import floor, report
from .common import GiB, MiB, REPO, Deadline, child_env, import_library, median, parser, pyplot, run_row, save_png

TITLE = "Side by side with the upstream library: the rows where it used to lead"
WORKERS = (("torch", False), ("preload", False), ("preload", True))  # (hook mode, preload-init)
LLAMA = {"hidden": 2048, "intermediate": 8192, "layers": 16, "vocab": 128256, "kv_heads": 8, "head_dim": 64}


def _sizes(dry_run, gib):
    if dry_run:
        return {"first": 8 * MiB, "latency": [(1, 64 * MiB), (8, 8 * MiB)], "backup": 32 * MiB,
                "model": [1 * MiB + 4096 * k for k in range(24)], "kv": [2 * MiB] * 8, "bulk_tensor": 16 * MiB,
                "cycles": 3, "fill": 16 * MiB, "alloc": [4 * MiB] * 4}
    h, i, layers, v = LLAMA["hidden"], LLAMA["intermediate"], LLAMA["layers"], LLAMA["vocab"]
    kv = LLAMA["kv_heads"] * LLAMA["head_dim"]
    per_layer = [h * h, h * kv, h * kv, h * h, h * i, h * i, i * h, h, h]  # q k v o gate up down, two norms
    model = [v * h * 2] + [n * 2 for _ in range(layers) for n in per_layer] + [h * 2]  # bf16
    cache = [8192 * kv * 2] * (2 * layers)  # a static cache of 8192 tokens, k and v per layer
    return {"first": GiB, "latency": [(1, 8 * GiB), (64, 128 * MiB)], "backup": int(gib * GiB), "model": model,
            "kv": cache, "bulk_tensor": 512 * MiB, "cycles": 11,  # the driver's own times spread: medians of 11
            "fill": 100 * GiB, "alloc": [512 * MiB] * 16}


# ---- the worker's side ---------------------------------------------------------------

def _timed(sync, fn):
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def _first_region(env, tms, size, init, dispose=True):
    """Plain allocation + fill, then the same in the first backed-up region; then that tag's first pause and resume. In
    preload-init mode every allocation is backed up already: the first pause is of all of them."""
    out, plain, block = {"bytes": size}, [], []
    out["plain_s"] = _timed(env.sync, lambda: (plain.extend(_plain_alloc(env, [size])), env.fill_random(plain, 1)))
    if init:
        out["region_s"], block = out["plain_s"], plain  # the plain allocation is the backed-up one here
        pause, resume = (lambda: tms.pause()), (lambda: tms.resume())
    else:
        out["region_s"] = _timed(env.sync, lambda: (block.extend(env.alloc("first", [size], backup=True)),
                                                    env.fill_random(block, 2)))
        plain.clear()
        pause, resume = (lambda: tms.pause("first")), (lambda: tms.resume("first"))
    snap = env.snapshot(block, False)
    out["first_pause_s"], out["first_resume_s"] = _timed(env.sync, pause), _timed(env.sync, resume)
    out["exact"] = bool(env.verify(block, snap))
    if dispose and not init:
        env.dispose(block, "first")
    return out, block


def _plain_alloc(env, sizes):
    if env.kind == "host":  # the dry run's stand-in: memory of a region without backup
        return env.alloc("plain", sizes)
    return [env.torch.empty(n, dtype=env.torch.uint8, device=env.device) for n in sizes]


def _latency(env, tms, shapes, cycles, floor_lib):
    """Discard pause and resume of each shape, the driver's own loop on as many allocations cycled beside each cycle,
    before or after it in turn (floor.Beside: the same process, driver state and idle time)."""
    rows = []
    for count, size in shapes:
        tag, pauses, resumes, beside = f"lat{count}", [], [], floor.Beside(floor_lib, count, size)
        block = env.alloc(tag, [size] * count)
        for c in range(cycles + 1):
            f = beside.cycle(c) if c % 2 else None
            p = _timed(env.sync, lambda: tms.pause(tag))
            r = _timed(env.sync, lambda: tms.resume(tag))
            f = beside.cycle(c) if c % 2 == 0 else f
            if c:  # the first is a warm-up
                pauses, resumes, beside.times = pauses + [p], resumes + [r], beside.times + ([f] if f else [])
        beside.close()
        env.dispose(block, tag)
        rows.append({"tensors": count, "tensor_bytes": size, "pause_s": statistics.median(pauses),
                     "resume_s": statistics.median(resumes), "pauses_s": pauses, "resumes_s": resumes,
                     "floor": {"times": beside.times, "error": beside.error}})
    return rows


def _give_back(env, tms, block, tag):
    """Frees a block to the driver. PyTorch keeps a region's freed segments in the tag's MemPool and neither library
    has a call that drops one, so the library's pools of the tag are dropped: PyTorch then frees their segments
    through the library. Not inside a region (PyTorch asserts while a pool is in use), but with the C ABI's region
    flag that frameworks set (upstream's torch mode frees only inside a region)."""
    if env.kind == "host" or tag is None:
        env.dispose(block, tag, pause=False)
        return env.kind == "host" or env.torch.cuda.empty_cache()
    block.clear()
    impl = tms._impl
    pools, cdll = impl._pools if hasattr(impl, "_pools") else impl._mem_pools, impl._binary_wrapper.cdll  # ours, theirs
    was = cdll.tms_get_interesting_region()
    cdll.tms_set_interesting_region(True)
    for key in [k for k in pools if k[0] == tag]:
        del pools[key]
    cdll.tms_set_interesting_region(was)
    env.sync()


def _alloc(env, tms, sizes, cycles, floor_lib):
    """Allocate + fill of `sizes` in a backed-up region, in a region without backup and with plain PyTorch, in turns
    each cycle, each block given back to the driver before the next; the first cycle is a warm-up (so none is the
    process's first region). Beside them the driver's create + map of as many handles (the paired floor's resume)."""
    out, beside = {"tensors": len(sizes), "tensor_bytes": sizes[0]}, floor.Beside(floor_lib, len(sizes), sizes[0])
    free = env.free_bytes()
    for c in range(cycles + 1):
        if free and env.free_bytes() < free - 2 * GiB:  # a library that kept what it was given back
            raise RuntimeError(f"{(free - env.free_bytes()) / GiB:.1f} GiB not given back after {c} cycles")
        f = beside.cycle(c)
        for way, tag in (("backed", "alloc-backed"), ("region", "alloc"), ("plain", None)):
            block = []
            a = _timed(env.sync, lambda: block.extend(
                _plain_alloc(env, sizes) if tag is None else env.alloc(tag, sizes, backup=way == "backed")))
            fill = _timed(env.sync, lambda: env.memset(block, c))
            _give_back(env, tms, block, tag)
            out.setdefault(way, []).extend([(a, fill)] if c else [])
        beside.times += [f] if c and f else []
    beside.close()
    return dict(out, floor={"times": beside.times, "error": beside.error})


def _cycle(env, tms, tag, block, snap):
    p, r = _timed(env.sync, lambda: tms.pause(tag)), _timed(env.sync, lambda: tms.resume(tag))
    return p, r, bool(env.verify(block, snap))


def _filled(env, tag, sizes, seed, **kw):
    """A backed-up block of random contents, and its checksums."""
    block = env.alloc(tag, sizes, backup=True, **kw)
    env.fill_random(block, seed)
    return block, env.snapshot(block, False)


def _kinds(env, tms, total):
    out = {}
    for kind in ("mmap", "pinned"):
        tag = f"kind-{kind}"
        block, snap = _filled(env, tag, [total // 16] * 16, 3, backend=kind)
        cycles = [_cycle(env, tms, tag, block, snap) for _ in range(2)]
        env.dispose(block, tag)
        out[kind] = {"bytes": total // 16 * 16, "pause_s": [c[0] for c in cycles], "resume_s": [c[1] for c in cycles],
                     "exact": all(c[2] for c in cycles)}
    return out


def _retained(env, tms, total, gap_s, cycles):
    tms.retain_cpu_backup, tag = True, "retained"
    block, snap = _filled(env, tag, [total // 16] * 16, 4)
    first = _cycle(env, tms, tag, block, snap)
    no_gap = [_cycle(env, tms, tag, block, snap) for _ in range(cycles)]  # each pause right after a resume
    time.sleep(gap_s)  # an idle gap: the library may finish background work (a benchmark, not a test)
    gap = _cycle(env, tms, tag, block, snap)
    env.dispose(block, tag)
    tms.retain_cpu_backup = False
    return {"bytes": total // 16 * 16, "gap_s": gap_s, "first": first[:2], "no_gap_pause_s": [c[0] for c in no_gap],
            "no_gap_resume_s": [c[1] for c in no_gap], "gap": gap[:2],
            "exact": first[2] and gap[2] and all(c[2] for c in no_gap)}


def _skip(env, tms, total, cycles):
    """skip_unchanged (this library only): pauses of G GiB in 16 tensors with nothing, one byte in 1 %
    of the 2 MiB chunks and every byte changed since the last; (seconds, copied, fingerprint s) each."""
    if "skip_unchanged" not in inspect.signature(tms.region).parameters:
        return None
    (block, snap), rnd, n = _filled(env, "skip", [total // 16] * 16, 7, skip=True), random.Random(7), total // (2 * MiB)
    out = {"bytes": total // 16 * 16, "exact": True}
    _cycle(env, tms, "skip", block, snap)  # the first pause copies all and records
    for case, change in (("unchanged", None), ("1 % changed", lambda c: env.poke(block, [
            rnd.randrange(n) * 2 * MiB for _ in range(max(1, n // 100))])), ("all changed", lambda c: env.fill_random(block, c))):
        out[case] = []
        for c in range(cycles):
            if change:
                change(100 + c)
                snap = env.snapshot(block, False)
            r = []
            t = _timed(env.sync, lambda: r.append(tms.pause("skip")))
            out[case].append((t, r[0].copied_bytes, r[0].fingerprint_seconds, r[0].why_not_skipped))
            tms.resume("skip")
            out["exact"] &= bool(env.verify(block, snap))
    env.dispose(block, "skip")
    return out


def _integrity(env, tms, total, big, cycles, gap_s):
    """Checked restores (this library only): G GiB backed up in 16 tensors and retained (the copies at
    the link's speed, where a cost shows most), paused and resumed with verify_restore on and off in
    turns; then a discarded tag of `big` bytes in 2 GiB tensors resumed with restore none, zero and
    poison (each resume after an idle gap, so that the driver has cleaned what the pause freed),
    beside a plain device fill of the same tensors."""
    if "restore" not in inspect.signature(tms.region).parameters:
        return None
    tag, tms.retain_cpu_backup = "verify", True
    block, snap = _filled(env, tag, [total // 16] * 16, 8)
    out = {"bytes": total // 16 * 16, "exact": True, **{k: {"pause_s": [], "resume_s": [], "verified": []}
                                                        for k in ("on", "off")}}
    _cycle(env, tms, tag, block, snap)  # the first pause makes the backups
    for _ in range(cycles):
        for setting in ("on", "off"):
            tms.verify_restore = setting == "on"
            r, o = [], out[setting]
            o["pause_s"].append(_timed(env.sync, lambda: tms.pause(tag)))
            o["resume_s"].append(_timed(env.sync, lambda: r.append(tms.resume(tag))))
            o["verified"].append(r[0].verified_bytes)
            out["exact"] &= bool(env.verify(block, snap))
    tms.verify_restore = True
    env.dispose(block, tag)
    tms.retain_cpu_backup, piece = False, min(2 * GiB, big)
    n = max(1, big // piece)
    out["fill_bytes"] = n * piece
    for mode in ("none", "zero", "poison"):
        blk = env.alloc(f"fill-{mode}", [piece] * n, restore=mode)
        env.memset(blk, 7)
        resumes = []
        for _ in range(cycles):
            tms.pause(f"fill-{mode}")
            time.sleep(gap_s)  # the driver cleans what the pause freed (a benchmark, not a test)
            resumes.append(_timed(env.sync, lambda: tms.resume(f"fill-{mode}")))
            if mode != "none":
                out["exact"] &= env.holds_only(blk, 0 if mode == "zero" else 0xFF)
        if mode == "none":
            out["memset_s"] = [_timed(env.sync, lambda: env.memset(blk, 0)) for _ in range(cycles)]
        out[f"resume_{mode}_s"] = resumes
        env.dispose(blk, f"fill-{mode}")
    return out


def _model(env, tms, model, kv, bulk_tensor, cycles):
    (weights, snap), cache, rows = _filled(env, "model", model, 5), env.alloc("kv", kv), []
    for _ in range(cycles):
        pause = _timed(env.sync, lambda: (tms.pause("model"), tms.pause("kv")))
        resume_model = _timed(env.sync, lambda: tms.resume("model"))
        resume_kv = _timed(env.sync, lambda: tms.resume("kv"))
        rows.append({"pause_s": pause, "resume_model_s": resume_model, "resume_kv_s": resume_kv,
                     "exact": bool(env.verify(weights, snap))})
    allocations = len(env.tag_allocs("model")) if hasattr(env.tms, "allocations") else None
    env.dispose(cache, "kv")
    env.dispose(weights, "model")
    total = sum(model)
    n = max(1, total // bulk_tensor)
    bulk, bsnap = _filled(env, "bulk", [total // n] * n, 6)
    bulk_rows = [_cycle(env, tms, "bulk", bulk, bsnap) for _ in range(3)]  # GB/s rows only; upstream's are slow
    env.dispose(bulk, "bulk")
    return {"weights_bytes": total, "tensors": len(model), "allocations": allocations, "kv_bytes": sum(kv),
            "cycles": rows, "bulk_bytes": total // n * n, "bulk_tensors": n,
            "bulk_pause_s": [c[0] for c in bulk_rows], "bulk_resume_s": [c[1] for c in bulk_rows],
            "exact": all(r["exact"] for r in rows) and all(c[2] for c in bulk_rows)}


def _take_turn(turn):
    """A first-region-only worker's turn: once the others it started with are ready too (none still importing), the
    lock that lets one measure at a time, held until this process has exited."""
    (folder, n), until = turn, time.time() + 60  # a worker that does not come holds the others a minute at most
    open(os.path.join(folder, f"ready-{os.getpid()}"), "w").close()
    while sum(f.startswith("ready-") for f in os.listdir(folder)) < n and time.time() < until:
        time.sleep(0.01)
    fcntl.flock(os.open(os.path.join(folder, "lock"), os.O_CREAT | os.O_RDWR), fcntl.LOCK_EX)
    time.sleep(0.2)  # the driver tidies up after the process that measured before


def worker(library, mode, init, gib, gap_s, dry_run=False, save=None, sections=None, cycles=9, floor_lib=None,
           turn=None):
    """One process: every row for one library in one hook mode (library None: the link only; turn: the first region
    only, in its turn)."""
    if library:
        sys.path.insert(0, library)
    from .envs import make_env

    sizes = _sizes(dry_run, gib)
    env = make_env(mode if library else None, dry_run, use_tms=bool(library))
    out = {"library": library, "mode": mode, "init": init, "sections": {}, "errors": {}}
    if not library:
        from . import limits

        out["sections"]["limits"] = limits.run(env, {"bytes": min(sizes["backup"], 4 * GiB), "reps": 3},
                                               Deadline(time.time() + 120))
        out["env"] = env.info()
        return out
    out["loaded_from"] = import_library(library)  # imported by make_env: this checks which one
    tms = env.tms
    steps = [("first_region", lambda: _first_region(env, tms, sizes["first"], init, not turn)[0])]
    if turn:
        _take_turn(turn)
    elif not init:  # the rest would pause the whole process's memory in preload-init mode
        steps += [("latency", lambda: _latency(env, tms, sizes["latency"], sizes["cycles"], floor_lib)),
                  ("kinds", lambda: _kinds(env, tms, sizes["backup"])),
                  ("retained", lambda: _retained(env, tms, sizes["backup"], gap_s, cycles)),
                  ("skip", lambda: _skip(env, tms, sizes["backup"], cycles)),
                  ("integrity", lambda: _integrity(env, tms, sizes["backup"], sizes["fill"], cycles, min(gap_s, 1.0))),
                  ("model", lambda: _model(env, tms, sizes["model"], sizes["kv"], sizes["bulk_tensor"], cycles)),
                  # last: what it drops of the libraries' pools could end the process for the rows after it
                  ("alloc", lambda: _alloc(env, tms, sizes["alloc"], cycles, floor_lib))]
    for name, fn in steps:
        if sections and name not in sections:
            continue
        try:
            out["sections"][name] = fn()
        except Exception as e:  # one row failing keeps the others
            out["errors"][name] = f"{type(e).__name__}: {e}"[:2000]
        if save:
            save(out)
    if turn and save:  # saved: its teardown is no part of what it measures, and the next one's turn waits for it
        os._exit(0)
    return out


# ---- the runner's side ---------------------------------------------------------------

def run_one(library, mode, init, args, floor_lib=None, turn=None, timeout=600):
    env = child_env(args.dry_run, clean=True)  # this checkout's benchmarks; the worker puts library first
    if init:
        env.update(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    wargs = {"library": library, "mode": mode, "init": init, "gib": args.gib, "gap_s": args.gap,
             "dry_run": args.dry_run, "sections": args.sections.split(",") if args.sections else None,
             "cycles": args.cycles, "floor_lib": floor_lib, "turn": turn}
    label = f"{_label(library, args)} {mode}{' init' if init else ''}{' first region' if turn else ''}"
    doc = run_row("speed", wargs, env, {"library": library, "mode": mode, "init": init, "sections": {}, "errors": {}},
                  timeout, library=library if mode == "preload" and library and not args.dry_run else None,
                  echo=lambda line: print(f"  [{label}] {line}", flush=True))
    if "error" in doc:
        doc["errors"]["process"] = doc.pop("error")
    doc["exit_code"] = doc.get("exit_code", 0)
    return doc


def first_regions(library, args, modes):
    """{(mode, init): (first_region sections, errors or None)} of cycles - 1 workers per mode doing only that, all
    started together and measuring one at a time once all are ready: a process has one first region, and workers one
    after the other would spend most of the run importing PyTorch."""
    extra = 1 if args.dry_run else args.cycles - 1  # a dry run checks the mechanism: one is enough
    jobs, folder = [m for m in modes for _ in range(extra)], tempfile.mkdtemp(prefix="tms-speed-turn-")
    with concurrent.futures.ThreadPoolExecutor(max(1, len(jobs))) as pool:
        docs = list(pool.map(lambda m: run_one(library, *m, args, turn=(folder, len(jobs)), timeout=240), jobs))
    shutil.rmtree(folder, ignore_errors=True)
    ds = {m: [d for d in docs if (d["mode"], d["init"]) == m] for m in modes}
    return {m: ([d["sections"]["first_region"] for d in ds[m] if "first_region" in d["sections"]],
                [d["errors"] for d in ds[m] if d["errors"]]) for m in modes}


def _label(library, args):
    for label, path in (("upstream", args.upstream), ("before", args.before)):
        if library and path and os.path.abspath(library) == os.path.abspath(path):
            return label
    return "ours"


# ---- the report ----------------------------------------------------------------------

def _gbps(n, s):
    return n / s / 1e9 if s else None


def _fmt(x):
    return "-" if x is None else f"{x:.2f}"


def figures(doc):
    """{(library, mode, init): {row: value}} and the rows' names and units, from the workers."""
    rows = {}
    for w in doc["workers"]:
        if not w.get("library"):
            continue
        s, key, f = w["sections"], (w["label"], w["mode"], w["init"]), {}
        frs = [fr for fr in [s.get("first_region")] + w.get("first_regions", []) if fr]  # one a process
        if frs:
            f["first region, allocate + fill, over plain (ms)"] = median(r["region_s"] - r["plain_s"]
                                                                         for r in frs) * 1e3
            f["first backed-up pause (ms)"] = median(r["first_pause_s"] for r in frs) * 1e3
        al, ways = s.get("alloc"), {"backed": "backed-up region", "region": "region without backup", "plain": "plain"}
        if al:
            name, alone = f"{al['tensors']} x {al['tensor_bytes'] // MiB} MiB", ("backed", "region")
            for way, what in ways.items():
                f[f"allocate + fill {name}, {what} (ms)"] = median(a + b for a, b in al[way]) * 1e3
            for way in alone:
                f[f"allocate {name} alone, {ways[way]} (ms)"] = median(a for a, _ in al[way]) * 1e3
            _floor_rows(f, al["floor"], "resume", name, [f"allocate {name} alone, {ways[w]}" for w in alone])
        for r in s.get("latency", []):
            name = f"{r['tensors']} x {r['tensor_bytes'] // MiB} MiB"
            for op in ("pause", "resume"):
                f[f"discard {op}, {name} (ms)"] = r[f"{op}_s"] * 1e3
                _floor_rows(f, r["floor"], op, name, [f"discard {op}, {name}"])
        for kind, k in s.get("kinds", {}).items():
            f[f"{kind} pause, first (GB/s)"] = _gbps(k["bytes"], k["pause_s"][0])
            f[f"{kind} pause, again (GB/s)"] = _gbps(k["bytes"], k["pause_s"][-1])
            f[f"{kind} resume (GB/s)"] = _gbps(k["bytes"], statistics.median(k["resume_s"]))
        rt = s.get("retained")
        if rt:
            f["retained pause, first (GB/s)"] = _gbps(rt["bytes"], rt["first"][0])
            f["retained pause, no gap (GB/s)"] = _gbps(rt["bytes"], statistics.median(rt["no_gap_pause_s"]))
            f["retained resume, no gap (GB/s)"] = _gbps(rt["bytes"], statistics.median(rt["no_gap_resume_s"]))
            f[f"retained pause, after {rt['gap_s']:g} s idle (GB/s)"] = _gbps(rt["bytes"], rt["gap"][0])
            f["retained pause, no gap (ms)"] = statistics.median(rt["no_gap_pause_s"]) * 1e3
        for case, runs in {k: v for k, v in (s.get("skip") or {}).items() if "changed" in k}.items():
            f[f"skip_unchanged pause, {case} (ms)"] = statistics.median(r[0] for r in runs) * 1e3
            f[f"skip_unchanged pause, {case}: fingerprints (ms)"] = statistics.median(r[2] for r in runs) * 1e3
        it = s.get("integrity")
        if it:
            med = {k: statistics.median(it[k]["resume_s"]) for k in ("on", "off")}
            pmed = {k: statistics.median(it[k]["pause_s"]) for k in ("on", "off")}
            f["retained resume, checked (GB/s)"] = _gbps(it["bytes"], med["on"])
            f["retained resume, unchecked (GB/s)"] = _gbps(it["bytes"], med["off"])
            f["retained pause, recorded (GB/s)"] = _gbps(it["bytes"], pmed["on"])
            f["retained pause, unrecorded (GB/s)"] = _gbps(it["bytes"], pmed["off"])
            f["checking's share of the resume (%)"] = (med["on"] - med["off"]) / med["off"] * 100
            f["recording's share of the pause (%)"] = (pmed["on"] - pmed["off"]) / pmed["off"] * 100
            memset = statistics.median(it["memset_s"])
            f[f"plain fill of {it['fill_bytes'] / GiB:g} GiB (ms)"] = memset * 1e3
            for mode in ("none", "zero", "poison"):
                f[f"discarded resume, restore={mode} (ms)"] = statistics.median(it[f"resume_{mode}_s"]) * 1e3
            for mode in ("zero", "poison"):
                extra = statistics.median(it[f"resume_{mode}_s"]) - statistics.median(it["resume_none_s"])
                f[f"restore={mode}: its cost over a plain fill"] = extra / memset if memset else None
        m = s.get("model")
        if m:
            resume = statistics.median(c["resume_model_s"] + c["resume_kv_s"] for c in m["cycles"])
            f["model resume, weights + KV (GB/s of weights)"] = _gbps(m["weights_bytes"], resume)
            f["model resume, weights tag alone (GB/s)"] = _gbps(
                m["weights_bytes"], statistics.median(c["resume_model_s"] for c in m["cycles"]))
            f["model resume, KV tag alone (ms)"] = statistics.median(c["resume_kv_s"] for c in m["cycles"]) * 1e3
            f["bulk resume, same bytes in 512 MiB tensors (GB/s)"] = _gbps(m["bulk_bytes"],
                                                                           statistics.median(m["bulk_resume_s"]))
            f["model resume over bulk resume"] = (f["model resume, weights + KV (GB/s of weights)"]
                                                  / f["bulk resume, same bytes in 512 MiB tensors (GB/s)"])
        rows[key] = f
    return rows


def _floor_rows(f, fl, op, shape, rows):
    """The paired floor's median of op (ms) as a row, and each of rows over it, where the floor ran."""
    ms = median(t[op == "resume"] for t in fl["times"]) * 1e3 if fl["times"] else None
    if ms:
        f[f"driver floor: {'unmap + release' if op == 'pause' else 'create + map'} {shape} (ms)"] = ms
        f.update({f"{r} over its floor": f[f"{r} (ms)"] / ms for r in rows})


def table(doc):
    per = figures(doc)
    columns = [k for k in per]
    names = []
    for f in per.values():
        names += [n for n in f if n not in names]
    head = ["row"] + [f"{lib} {mode}{' init' if init else ''}" for lib, mode, init in columns]
    ups = {(mode, init): per[(lib, mode, init)] for lib, mode, init in columns if lib == "upstream"}
    if ups:
        head += [f"ours ÷ upstream, {mode}{' init' if init else ''}" for mode, init in ups]
    out = []
    for n in names:
        row = [n] + [_fmt(per[c].get(n)) for c in columns]
        for (mode, init), up in ups.items():
            ours, theirs = per.get(("ours", mode, init), {}).get(n), up.get(n)
            row.append(_fmt(ours / theirs) + "×" if ours is not None and theirs else "-")
        out.append(row)
    return report.table(head, out)


def plot(doc, out, stem):
    """Pause and resume GB/s of each backup kind, ours and upstream per hook mode,
    against the link measured in the same run."""
    plt = pyplot()
    if plt is None:
        return {}
    per = figures(doc)
    groups = [("mmap pause, again (GB/s)", "mmap resume (GB/s)", "mmap"),
              ("pinned pause, again (GB/s)", "pinned resume (GB/s)", "pinned"),
              ("retained pause, no gap (GB/s)", "retained resume, no gap (GB/s)", "retained, no gap"),
              ("retained pause, first (GB/s)", None, "first pause, retained")]
    columns = [k for k in per if not k[2] and k[0] in ("ours", "upstream")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    width = 0.8 / max(1, len(columns))
    for ax, which, title in ((axes[0], 0, "pause"), (axes[1], 1, "resume")):
        for j, col in enumerate(columns):
            vals = [per[col].get(g[which]) if g[which] else None for g in groups]
            xs = [i + j * width for i in range(len(groups))]
            ax.bar(xs, [v or 0 for v in vals], width, label=f"{col[0]} {col[1]}")
        link = doc.get("link", {}).get("d2h" if which == 0 else "h2d")
        if link:
            ax.axhline(link, color="k", linestyle="--", linewidth=1, label="pinned link")
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(groups))])
        ax.set_xticklabels([g[2] for g in groups], fontsize=8)
        ax.set_title(f"{title} GB/s")
    axes[0].set_ylabel("GB/s (1e9 bytes/s)")
    axes[1].legend(fontsize=8)
    fig.suptitle(f"{doc['meta'].get('device_name', '')}: backups, ours vs upstream", fontsize=10)
    name = f"{stem}.png"
    save_png(plt, fig, os.path.join(out, name))
    return {"backups": name}


def main(argv=None):
    ap = parser("speed", __doc__)
    ap.add_argument("--upstream", metavar="DIR", help="also run the torch_memory_saver found in DIR")
    ap.add_argument("--before", metavar="DIR", help="also run an earlier checkout of this library (built) in DIR")
    ap.add_argument("--gib", type=float, default=8.0, help="backed-up bytes of the kinds and retained rows")
    ap.add_argument("--gap", type=float, default=8.0, help="idle seconds before the retained row's last pause")
    ap.add_argument("--sections", metavar="A,B", help="only these sections (first_region, alloc, latency, kinds, "
                    "retained, skip, integrity, model)")
    ap.add_argument("--cycles", type=int, default=9, help="cycles (and first-region processes) of the millisecond rows "
                    "that have no count of their own (default 9; a dry run's at most 3)")
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)
    if args.dry_run:
        args.gap, args.cycles = min(args.gap, 0.1), min(args.cycles, 3)
    meta, start, tmp = report.collect_meta("speed", argv, args.dry_run), time.time(), tempfile.mkdtemp()
    try:  # the driver's own calls, cycled beside the library's in each worker (floor.Paired)
        floor_lib = None if args.dry_run else floor.build(tmp, library=True)[0]
    except (RuntimeError, OSError) as e:
        floor_lib, meta["floor_error"] = None, str(e)[:2000]
    # The upstream library has no host backend: a dry run measures this one (and --before).
    libraries = [REPO] + [os.path.abspath(d) for d in (None if args.dry_run else args.upstream, args.before) if d]
    workers = [] if args.dry_run else [run_one(None, "torch", False, args)]
    # TMS_INIT_ENABLE routes cudaMalloc: nothing of it on the host backend
    modes = [(mode, init) for mode, init in WORKERS if not (args.dry_run and init)]
    for library in libraries:
        more = first_regions(library, args, modes) if "first_region" in (args.sections or "first_region") else {}
        for m in modes:
            workers.append(run_one(library, *m, args, floor_lib))
            workers[-1]["first_regions"], failed = more.get(m, ([], []))
            if failed:  # upstream's torch mode exits 1 at its teardown: one line for them all
                workers[-1]["errors"]["first-region workers"] = f"{len(failed)} failed: {failed[0]}"[:2000]
    shutil.rmtree(tmp, ignore_errors=True)
    meta["wall_s"] = time.time() - start
    for w in workers:
        w["label"] = _label(w.get("library"), args) if w.get("library") else "link"
    if not args.dry_run:
        meta["device_name"] = (workers[0].get("env") or {}).get("device_name") or meta.get("device_name")
    lim = next((w["sections"].get("limits") for w in workers if w["label"] == "link"), None) or {}
    doc = {"meta": meta, "workers": workers,
           "link": {"d2h": lim.get("pinned_d2h_gbps"), "h2d": lim.get("pinned_h2d_gbps")}}
    errors = {f"{w['label']} {w['mode']}{' init' if w['init'] else ''}": w["errors"] for w in workers if w["errors"]}

    def body(images):
        backed = _sizes(args.dry_run, args.gib)["backup"]
        lines = [f"Workers: {', '.join(sorted({w['label'] for w in workers}))}; backed-up rows {backed / GiB:g} GiB in "
                 f"16 tensors; retained gap {args.gap:g} s; link (pinned copies) {_fmt(doc['link']['d2h'])} GB/s to "
                 f"host, {_fmt(doc['link']['h2d'])} to device. Millisecond rows: medians of {args.cycles} cycles (the "
                 f"discard rows' of {_sizes(args.dry_run, args.gib)['cycles']}), the first region's of as many "
                 "processes; *driver floor*: vmm_floor.c's loop on as many allocations, cycled beside the row in its "
                 f"worker{'' if floor_lib else ' (none: %s)' % (meta.get('floor_error') or 'a dry run')[:300]}. "
                 f"Contents exact in every row: {all(_exact(w) for w in workers)}.", "", table(doc), ""]
        if errors:
            lines += ["Errors: " + "; ".join(f"{k}: {v}" for k, v in errors.items()), ""]
        lines += [f"![backups]({images['backups']})" if images.get("backups") else ""]
        return "\n".join(lines)

    report.publish(args, doc, TITLE, body, plots=lambda out, stem: plot(doc, out, stem))
    return 1 if errors or not all(_exact(w) for w in workers) else 0


def _exact(w):
    s = w.get("sections", {})
    return all(v.get("exact", True) for v in s.values() if isinstance(v, dict) and "exact" in v) and \
        all(k.get("exact", True) for k in s.get("kinds", {}).values())


if __name__ == "__main__":
    sys.exit(main())
