"""The `run` suite, `make bench`: `python -m benchmarks run [--quick] [--dry-run] [--out DIR]`.

One process tree on one GPU. The runner itself never touches the GPU; it builds the raw driver floor (vmm_floor.c)
as a library the workers cycle beside their own pauses (the paired floor), then starts one worker process per step
(limits; torch hook mode; preload hook mode through `python -m torch_memory_saver run --`; one per backup
configuration; disk) and writes the report (run_<device>.json, .md) to the output folder. A failing step (a worker
that fails, dies or runs past its time) is recorded as an error and the run goes on. The report is rewritten after
every step, so a run cut short still leaves its partial results.

--dry-run: no GPU. Workers use the library's host backend (TMS_BACKEND=host) and tiny sizes, so every loop, the
report and the error paths run here; the figures mean nothing. Output defaults to build/bench-dry-run.
"""
import collections
import json
import os
import shutil
import signal
import sys
import tempfile
import time

from . import cycles, floor, limits, report
from .common import (GiB, MiB, Deadline, child_env, error_record, fmt_bytes, log, median, no_gpu, parser, run_row)
from .envs import make_env

SHAPES = [(1, 8 * GiB), (64, 128 * MiB), (2048, 4 * MiB)]
PRESETS = {
    "full": {"budget_s": 400, "limits": {"bytes": 8 * GiB, "reps": 3},
             "latency": {"shapes": SHAPES, "cycles": 7, "warmup": 1},
             "backup": {"bytes": 8 * GiB, "tensors": 16, "cycles": 5},
             "disk": {"bytes": 8 * GiB, "tensors": 16, "cycles": 3, "limit_reps": 2}},
    "quick": {"budget_s": 240, "limits": {"bytes": 4 * GiB, "reps": 3},
              "latency": {"shapes": SHAPES, "cycles": 5, "warmup": 1},
              "backup": {"bytes": 8 * GiB, "tensors": 16, "cycles": 3},
              "disk": {"bytes": 8 * GiB, "tensors": 16, "cycles": 3, "limit_reps": 1}},
    "dry": {"budget_s": 180, "limits": {"bytes": 64 * MiB, "reps": 3},
            "latency": {"shapes": [(1, 64 * MiB), (8, 8 * MiB), (32, 2 * MiB)], "cycles": 3, "warmup": 1},
            "backup": {"bytes": 64 * MiB, "tensors": 16, "cycles": 3},
            "disk": {"bytes": 64 * MiB, "tensors": 16, "cycles": 3, "limit_reps": 1}},
}
Step = collections.namedtuple("Step", "name mode section cap_s expect_s")
STEPS = [Step("limits", "none", "limits", 100, 30), Step("torch", "torch", "latency", 100, 30),
         Step("preload", "preload", "latency", 100, 30),
         *(Step(f"backup:{c}", "torch", f"backup:{c}", 80, 30) for c in ("pinned", "mmap", "mmap_retained",
                                                                        "pinned_retained")),
         Step("disk:disk", "torch", "disk:disk", 150, 60), Step("disk:tmpfs", "torch", "disk:tmpfs", 60, 15)]
GRACE_S = 30  # past a worker's soft deadline before it is killed


class Interrupted(BaseException):
    """SIGTERM, raised as KeyboardInterrupt is: no `except Exception` on the way swallows it."""


def _on_signal(signum, frame):
    raise Interrupted(f"signal {signum}")


# ---- the worker's side -------------------------------------------------------------

def _section(name):
    """The function that measures a section: fn(env, params, deadline) -> dict."""
    kind, _, arg = name.partition(":")
    if kind in ("disk", "backup"):
        return lambda env, params, deadline: getattr(cycles, kind)(env, arg, params, deadline)
    return {"limits": limits.run, "latency": cycles.latency}[name]


def worker(mode, section, deadline, params, dry_run=False, save=None):
    """Runs in a worker process (benchmarks.worker): one section in one hook mode
    ("none": no library)."""
    deadline = Deadline(deadline)
    result = {"mode": mode, "pid": os.getpid(), "env": None}
    t0 = time.time()
    try:
        env = make_env(None if mode == "none" else mode, dry_run, use_tms=mode != "none")
        result["env"] = dict(env.info(), tms_backup_threads=os.environ.get("TMS_BACKUP_THREADS"),
                             ld_preload=os.environ.get("LD_PRELOAD") if mode == "preload" else None)
    except Exception as e:
        rec = error_record(e)
        log(f"cannot set up: {rec['error']}")
        return dict(result, out=dict(rec, error=f"setup failed: {rec['error']}"))
    log(f"{section}: start ({deadline.at - time.time():.0f} s left in this process's budget)")
    try:
        out = _section(section)(env, params.get(section.split(":", 1)[0], {}), deadline)
    except Exception as e:
        out = error_record(e)
        log(f"{section}: FAILED: {out['error']}")
    out["wall_s"] = time.time() - t0
    log(f"{section}: done in {out['wall_s']:.1f} s")
    return dict(result, out=out)


# ---- running workers ---------------------------------------------------------------

def run_step(args, preset, floor_lib, step, deadline_at):
    """The step's section in a worker process of its own: (its result, the worker's record)."""
    left = deadline_at - time.time()
    if left <= 1:
        return {"error": "skipped: time budget exhausted before the worker started"}, {}
    params = {k: v for k, v in preset.items() if k != "budget_s"}
    if floor_lib:
        params["latency"] = dict(params["latency"], floor_lib=floor_lib)
    wargs = {"mode": step.mode, "section": step.section, "deadline": deadline_at, "params": params,
             "dry_run": args.dry_run}
    log(f"{step.name}: worker for {step.section}")
    t0 = time.time()
    res = run_row("run", wargs, child_env(args.dry_run), {}, left + GRACE_S, step.mode == "preload")
    record = {"exit_code": res.get("exit_code", 0), "wall_s": time.time() - t0, "env": res.get("env")}
    if res.get("out") is not None:
        return res["out"], record
    log(f"{step.name}: {res['error'][:200]}")
    return {"error": f"the worker failed during this section: {res['error']}"}, record


def merge(results, step, out):
    kind, _, arg = step.section.partition(":")
    if kind == "limits":
        results["limits"] = out
    else:
        results.setdefault(kind, {})[arg or step.mode] = out
    if str(out.get("error", "")).startswith("skipped"):
        results["skipped"].append({"where": step.name, "why": out["error"]})
    elif "error" in out:
        results["errors"].append({"where": step.name, "error": out["error"]})
    else:
        results["errors"] += [{"where": f"{step.name}{w}", "error": e} for w, e in _failed_checks(out)]


def _failed_checks(out):
    """(where, error) of the per-shape errors and failed checks (bytes freed, addresses, contents)."""
    for e in out.get("shapes") or []:
        if e.get("error"):
            yield f"/{e['shape']}", e["error"]
        if e.get("freed_ok") is False:
            yield f"/{e['shape']}", (f"check failed: pause did not free the tag's reserved bytes (freed "
                                     f"{e.get('freed_bytes')}, reserved {e.get('reserved_bytes')})")
        if e.get("same_addresses") is False:
            yield f"/{e['shape']}", "check failed: addresses changed"
    for r in out.get("per_cycle") or []:
        if r.get("verified") is False:
            yield f"/cycle {r.get('cycle')}", "check failed: contents differ after resume"
    if out.get("cycle_error"):
        yield "", out["cycle_error"]
    if out.get("files_ok") is False:
        yield "", "check failed: not one backup file per allocation, or stats' bytes_backup_disk != the bytes backed up"
    if out.get("copied_bytes_ok") is False:
        yield "", "check failed: bytes copied to/from host != tensor bytes"


def build_paired_floor(args, tmp, results):
    """The floor as a library the workers load (floor.Paired), or None: the
    cycles are then reported without a floor beside them."""
    why = "the host backend (dry run)" if args.dry_run else no_gpu()
    if why:
        results["skipped"].append({"where": "paired floor", "why": f"no driver floor: {why}"})
        return None
    try:
        lib, build = floor.build(tmp, library=True)
        log(f"paired floor: built with {build['command']}")
        return lib
    except (RuntimeError, OSError) as e:
        results["errors"].append({"where": "paired floor", "error": str(e)[:2000]})
        return None


# ---- the report ------------------------------------------------------------------

def _f(x, fmt="{:.2f}"):
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "**NO**"
    return fmt.format(x)


def _x(a, b):
    """a / b as a ratio cell."""
    return f"{a / b:.2f}×" if a is not None and b else "-"


def _ok(section):
    return isinstance(section, dict) and "error" not in section


def header_rows(meta):
    """What the run's report header adds to the common one."""
    return [["driver", meta.get("driver_version", "-")],
            ["torch / CUDA", f"{meta.get('torch_version', '-')} / {meta.get('torch_cuda_version', '-')}"],
            ["host", f"{meta.get('cpu_count', '-')} CPUs, {_f(meta.get('host_mem_gib'), '{:.0f}')} GiB RAM"],
            ["wall time", f"{_f(meta.get('wall_s'), '{:.0f}')} s"]]


def _limits(results):
    lim = results.get("limits") or {}
    out = ["## 1. Limits of this machine\n"]
    if lim.get("stand_in"):
        out.append(f"_Stand-in: {lim['stand_in']}._\n")
    if not _ok(lim):
        out.append(f"**Not measured**: {lim.get('error', 'not run')}\n")
    h2d, d2h = lim.get("pinned_h2d_gbps"), lim.get("pinned_d2h_gbps")
    out.append(report.table(["limit", "value", "ratio"], [
        ["pinned host→device copy", f"{_f(h2d, '{:.1f}')} GB/s", "1.00× (reference)"],
        ["pinned device→host copy", f"{_f(d2h, '{:.1f}')} GB/s", "1.00× (reference)"],
        ["pageable host→device copy", f"{_f(lim.get('pageable_h2d_gbps'), '{:.1f}')} GB/s",
         f"{_x(lim.get('pageable_h2d_gbps'), h2d)} of pinned"],
        ["pageable device→host copy", f"{_f(lim.get('pageable_d2h_gbps'), '{:.1f}')} GB/s",
         f"{_x(lim.get('pageable_d2h_gbps'), d2h)} of pinned"],
        [f"pinning {fmt_bytes(lim.get('bytes'))} (`torch.empty(pin_memory=True)`)", f"{_f(lim.get('pin_s'))} s",
         f"{_f(lim.get('pin_gbps'), '{:.1f}')} GB/s = {_x(lim.get('pin_gbps'), d2h)} of pinned D→H"],
        ["first touch of fresh pageable memory", f"{_f(lim.get('pageable_first_touch_gbps'), '{:.1f}')} GB/s", ""],
        [f"`cudaHostRegister` of {fmt_bytes(lim.get('bytes'))} populated", f"{_f(lim.get('host_register_s'))} s", ""],
    ]) + "\n")
    return out


def _latency(results):
    out = ["## 2. Pause/resume latency without backup\n",
           "`allocations` is what the library holds (PyTorch's caching allocator carves 1–10 MiB tensors out of 20 "
           "MiB segments). The paired floor is the raw driver loop (`benchmarks/vmm_floor.c`) on as many allocations "
           "of the same size in the same process, one cycle beside each of the library's (before and after it in "
           "turn): both see the same driver state and idle time. Ratios of medians, and of the fastest cycles: the "
           "driver's release or create of a large allocation takes either well under a millisecond or tens of "
           "milliseconds from one cycle to the next, in the floor as in the library.\n"]
    rows = []
    for mode in ("torch", "preload"):
        for e in (results.get("latency") or {}).get(mode, {}).get("shapes", []):
            if e.get("pause_median_s") is None:
                rows.append([e["shape"], mode, _f(e.get("allocations"), "{}")] + ["-"] * 8
                            + [e.get("skipped") or e.get("error") or "not measured"])
                continue
            fp, fr = e.get("paired_pause_median_s"), e.get("paired_resume_median_s")
            freed = f"{_f((median(e.get('freed_bytes') or []) or 0) / GiB)} of {_f(e['reserved_bytes'] / GiB)} GiB"
            note = "; ".join(x for x in (f"addresses kept: {_f(e.get('same_addresses'))}", e.get("paired_note")) if x)
            rows.append([e["shape"], mode, f"{e['allocations']} × {fmt_bytes(e['reserved_size'])}",
                         _f(e["pause_median_s"] * 1e3, "{:.3f}"), _f(fp and fp * 1e3, "{:.3f}"),
                         _x(e["pause_median_s"], fp), _f(e["resume_median_s"] * 1e3, "{:.3f}"),
                         _f(fr and fr * 1e3, "{:.3f}"), _x(e["resume_median_s"], fr),
                         f"{_x(e.get('pause_min_s'), e.get('paired_pause_min_s'))} / "
                         f"{_x(e.get('resume_min_s'), e.get('paired_resume_min_s'))}",
                         f"{freed} {_f(e.get('freed_ok'))}", note])
    out.append(report.table(["tensors", "mode", "allocations", "pause ms", "paired floor ms", "ratio", "resume ms",
                             "paired floor ms", "ratio", "fastest cycle × paired floor's pause / resume",
                             "freed (mem_get_info)", "note"], rows) + "\n" if rows else "_not measured_\n")
    return out


def _backup(results):
    lim = results.get("limits") or {}
    h2d, d2h = lim.get("pinned_h2d_gbps"), lim.get("pinned_d2h_gbps")
    b0 = next((b for b in (results.get("backup") or {}).values() if _ok(b)), {})
    out = [f"## 3. Backup bandwidth ({fmt_bytes(b0.get('bytes'))} in {b0.get('tensors', '-')} tensors)\n",
           f"Pause GB/s against the pinned device→host copy ({_f(d2h, '{:.1f}')} GB/s), resume against pinned "
           f"host→device ({_f(h2d, '{:.1f}')} GB/s). First = cycle 1; steady = median of cycles 2..N. Contents are "
           "refilled with fresh random data before every cycle and compared after every resume. RSS = this "
           "process's VmRSS.\n"]
    rows = []
    for config in ("pinned", "mmap", "mmap_retained", "pinned_retained"):
        b = (results.get("backup") or {}).get(config)
        if not _ok(b):
            rows.append([config] + ["-"] * 7 + [f"error: {str((b or {}).get('error', 'not run'))[:120]}"])
            continue
        rss = " → ".join(_f((b.get(k) or 0) / GiB) for k in ("rss_before_last", "rss_paused_last",
                                                             "rss_after_last_resume"))
        rows.append([config] + [f"{_f(b.get(k), '{:.1f}')} ({_x(b.get(k), link)})"
                                for k, link in (("first_pause_gbps", d2h), ("steady_pause_gbps", d2h),
                                                ("first_resume_gbps", h2d), ("steady_resume_gbps", h2d))]
                    + [len(b.get("per_cycle") or []), f"{_f(b.get('all_verified'))} ({b.get('verify_method')})", rss,
                       (b.get("cycle_error") or "") + (" (cut short: time budget)" if b.get("truncated") else "")])
    out.append(report.table(["backend", "pause first GB/s", "pause steady GB/s", "resume first GB/s",
                             "resume steady GB/s", "cycles", "contents exact",
                             "RSS GiB before → paused → after (last cycle)", "note"], rows) + "\n")
    disk = results.get("disk") or {}
    if disk:
        r0 = next((r for r in disk.values() if _ok(r)), {})
        out.append(f"### Disk backup ({fmt_bytes(r0.get('bytes'))} in {r0.get('tensors', '-')} tensors, "
                   "`enable_disk_backup=True`)\n")
        out.append("Each directory's limit is measured first in the same process: a parallel O_DIRECT writer and "
                   "reader with as many threads as the library's copy workers, 8 MiB blocks taken in turns across "
                   "one file per tensor. Pause/resume GB/s are medians of all cycles; contents compared after every "
                   "resume. RSS growth is the peak VmRSS sampled every 2 ms during each pause minus VmRSS before it; "
                   "page cache growth is the system's `Cached:` across the pause (a tmpfs counts there by nature).\n")
        rows = []
        for target, r in sorted(disk.items()):
            if not _ok(r) or r.get("pause_gbps") is None:
                rows.append([target] + ["-"] * 6 + [f"error: {str(r.get('error', 'no cycle measured'))[:120]}"])
                continue
            lim = r.get("limit") or {}
            cache = max((c.get("page_cache_growth") or 0 for c in r.get("per_cycle") or []), default=None)
            rows.append([f"{target} ({r.get('fs_type')})", f"{_f(lim.get('write_gbps'))} / {_f(lim.get('read_gbps'))}"
                         + ("" if lim.get("o_direct") else " (buffered)"),
                         f"{_f(r['pause_gbps'])} ({_x(r['pause_gbps'], lim.get('write_gbps'))})",
                         f"{_f(r['resume_gbps'])} ({_x(r['resume_gbps'], lim.get('read_gbps'))})",
                         f"{_f(r.get('first_pause_gbps'))} / {_f(r.get('first_resume_gbps'))}",
                         f"{_f(r.get('all_verified'))} ({r.get('verify_method')})",
                         f"{fmt_bytes(r.get('rss_peak_growth_max'))} / {fmt_bytes(cache)}",
                         "" if r.get("files_ok") else "**not one file per allocation**"])
        out.append(report.table(["directory", "limit write / read GB/s", "pause GB/s (vs write)",
                                 "resume GB/s (vs read)", "first pause / resume GB/s", "contents exact",
                                 "RSS / page cache growth (max)", "note"], rows) + "\n")
    return out


def markdown(results, images=None):
    """The report's body, below the header report.write puts above it."""
    out = ["Medians unless noted; GB/s = 10⁹ bytes/s; every ratio is against a limit this run measured on this "
           "machine.\n"]
    out += _limits(results) + _latency(results) + _backup(results)
    for key, heading, field in (("errors", "Errors and failed checks", "error"), ("skipped", "Skipped", "why")):
        if results.get(key):
            out += [f"## {heading}\n"] + [f"- **{e.get('where')}**: {str(e.get(field))[:400]}"
                                          for e in results[key]] + [""]
    return "\n".join(out) + "\n"


def write_outputs(results, out, stem):
    report.write(out, stem, results, "torch_memory_saver benchmark", lambda images: markdown(results),
                 extra_rows=lambda: header_rows(results["meta"]))


# ---- main ------------------------------------------------------------------------------

def main(argv=None):
    ap = parser("run", __doc__)
    ap.add_argument("--quick", action="store_true", help="fewer cycles (about 3 minutes)")
    ap.add_argument("--budget", type=float, help="wall-clock budget in seconds for all steps")
    ap.add_argument("--force", action="store_true", help="run even where the CUDA driver sees no GPU")
    ap.add_argument("--only", help="comma-separated step names to run (debugging): " + ",".join(s.name for s in STEPS))
    args = ap.parse_args(argv := sys.argv[1:] if argv is None else argv)
    preset_name = "dry" if args.dry_run else ("quick" if args.quick else "full")
    preset = PRESETS[preset_name]
    budget = args.budget or preset["budget_s"]
    out = report.out_dir(args.out, args.dry_run)
    t_start = time.time()
    meta = dict(report.collect_meta("run", argv, args.dry_run), preset=preset_name)
    stem = report.name(meta)
    results = {"schema": 2, "meta": meta, "params": preset, "errors": [], "skipped": [], "workers": {}, "steps": {}}
    tmp = tempfile.mkdtemp(prefix="tms-bench-")
    log(f"benchmark run {stem}: preset {preset_name}, budget {budget:.0f} s, output {out}")
    log(f"meta: {json.dumps(meta)}")
    floor_lib = build_paired_floor(args, tmp, results)
    old_term = signal.signal(signal.SIGTERM, _on_signal)
    steps = [s for s in STEPS if not args.only or s.name in args.only.split(",")]
    try:
        for i, step in enumerate(steps):
            now, left = time.time(), t_start + budget - time.time()
            if left <= 5:
                results["steps"][step.name] = {"skipped": "time budget exhausted"}
                results["skipped"].append({"where": step.name, "why": "skipped: time budget exhausted"})
                continue
            give = min(step.cap_s, max(step.expect_s, left - sum(s.expect_s for s in steps[i + 1:])), left)
            log(f"=== step {step.name} ({give:.0f} s of {left:.0f} s left) ===")
            try:
                section, results["workers"][step.name] = run_step(args, preset, floor_lib, step, now + give)
                env = results["workers"][step.name].get("env") or {}
                for k in ("torch_version", "torch_cuda_version", "device_total_bytes", "capability", "device_name"):
                    if env.get(k) is not None and meta.get(k) is None:
                        meta[k] = env[k]
                merge(results, step, section)
            except Exception as e:  # the runner's own bug must not lose the other steps
                results["errors"].append({"where": f"runner/{step.name}", **error_record(e)})
            results["steps"][step.name] = {"wall_s": time.time() - now, "given_s": give}
            meta["wall_s"] = time.time() - t_start
            write_outputs(results, out, stem)
            log(f"=== step {step.name} done in {time.time() - now:.1f} s ===")
    except (Interrupted, KeyboardInterrupt) as e:
        results["errors"].append({"where": "runner", "error": f"interrupted: {e!r}"})
        log(f"interrupted ({e!r}): writing what was measured")
    finally:
        signal.signal(signal.SIGTERM, old_term)
        meta["wall_s"] = time.time() - t_start
        write_outputs(results, out, stem)
        shutil.rmtree(tmp, ignore_errors=True)
        log(f"wrote {os.path.join(out, stem)}.json / .md; {len(results['errors'])} errors, "
            f"{len(results['skipped'])} skipped; {meta['wall_s']:.0f} s")
        for key, field in (("skipped", "why"), ("errors", "error")):
            for e in results[key]:
                log(f"  {key}: {e.get('where')}: {str(e.get(field))[:300]}")
    # The report is written either way; the status says whether everything ran (skips are not failures).
    measured = [results.get("limits"), *(v for k in ("latency", "backup") for v in (results.get(k) or {}).values())]
    return 0 if (any(_ok(x) for x in measured) or results["skipped"]) and not results["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
