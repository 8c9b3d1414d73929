"""The `run` suite, `make bench`: `python -m benchmarks run [--quick] [--dry-run] [--out DIR]`.

One process tree on one GPU. The runner itself never touches the GPU; it starts
one worker process per step (limits; torch hook mode; preload hook mode through
`python -m torch_memory_saver run --`; one per backup configuration; disk),
builds and runs the raw driver floor (vmm_floor.c) for the allocation shapes the
workers observed, then writes the report (run_<device>.json, .md, .log and PNGs)
to the output folder. A failing section is recorded as an error and the run goes
on; a worker that dies is restarted for its remaining sections. The report is
rewritten after every step, so a run cut short still leaves its partial results.

--dry-run: no GPU. Workers use the library's host backend (TMS_BACKEND=host) and
tiny sizes, so every loop, the report and the error paths run here; the figures
mean nothing. Output defaults to build/bench-dry-run.
"""
import argparse
import collections
import json
import os
import shutil
import signal
import sys
import tempfile
import time

from . import floor, report, run_report
from .common import GiB, MiB, Deadline, child_env, error_record, log, read_json, run_worker, set_log_prefix

# ---- what each preset measures ------------------------------------------------------

CANONICAL_SHAPES = [(1, 8 * GiB), (64, 128 * MiB), (2048, 4 * MiB)]

PRESETS = {
    "full": {
        "budget_s": 400,
        "limits": {"bytes": 8 * GiB, "reps": 3},
        "latency": {"shapes": CANONICAL_SHAPES, "cycles": 7, "warmup": 1},
        "backup": {"bytes": 8 * GiB, "tensors": 16, "cycles": 5},
        "alloc_overhead": {"count": 128, "bytes": 20 * MiB, "rounds": 5},
        "passthrough": {"null_iters": 20000, "alloc_iters": 300, "batches": 9},
        "contention": {"bytes": 8 * GiB, "tensors": 16, "cycles": 3},
        "scaling_count": {"counts": [1, 4, 16, 64, 256, 1024, 4096], "cycles": 5, "warmup": 1},
        "scaling_bytes": {"sizes": [s * MiB for s in (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)],
                          "cycles": 5, "warmup": 1},
        "floor": {"cycles": 7, "warmup": 1},
        "disk": {"bytes": 8 * GiB, "tensors": 16, "cycles": 3, "limit_reps": 2},
    },
    "quick": {
        "budget_s": 240,
        "limits": {"bytes": 4 * GiB, "reps": 3},
        "latency": {"shapes": CANONICAL_SHAPES, "cycles": 5, "warmup": 1},
        "backup": {"bytes": 8 * GiB, "tensors": 16, "cycles": 3},
        "alloc_overhead": {"count": 64, "bytes": 20 * MiB, "rounds": 3},
        "passthrough": {"null_iters": 10000, "alloc_iters": 200, "batches": 5},
        "contention": {"bytes": 8 * GiB, "tensors": 16, "cycles": 2},
        "scaling_count": {"counts": [1, 16, 256, 1024], "cycles": 5, "warmup": 1},
        "scaling_bytes": {"sizes": [s * MiB for s in (256, 1024, 4096, 8192)], "cycles": 5, "warmup": 1},
        "floor": {"cycles": 5, "warmup": 1},
        "disk": {"bytes": 8 * GiB, "tensors": 16, "cycles": 3, "limit_reps": 1},
    },
    "dry": {
        "budget_s": 180,
        "limits": {"bytes": 64 * MiB, "reps": 3},
        "latency": {"shapes": [(1, 64 * MiB), (8, 8 * MiB), (32, 2 * MiB)], "cycles": 3, "warmup": 1},
        "backup": {"bytes": 64 * MiB, "tensors": 16, "cycles": 3},
        "alloc_overhead": {"count": 16, "bytes": 2 * MiB, "rounds": 3},
        "passthrough": {"null_iters": 2000, "alloc_iters": 50, "batches": 5},
        "contention": {"bytes": 32 * MiB, "tensors": 16, "cycles": 2},
        "scaling_count": {"counts": [1, 16], "cycles": 3, "warmup": 1},
        "scaling_bytes": {"sizes": [2 * MiB, 32 * MiB], "cycles": 3, "warmup": 1},
        "floor": {"cycles": 3, "warmup": 1},
        "disk": {"bytes": 64 * MiB, "tensors": 16, "cycles": 3, "limit_reps": 1},
    },
}

Step = collections.namedtuple("Step", "name kind mode sections cap_s expect_s")

STEPS = [
    Step("limits", "worker", "none", ["limits"], 100, 30),
    Step("torch", "worker", "torch", ["latency", "alloc_overhead", "passthrough", "scaling_count", "scaling_bytes"],
         180, 70),
    Step("preload", "worker", "preload", ["latency", "alloc_overhead", "passthrough", "contention"], 130, 45),
    Step("floor", "floor", None, [], 90, 20),
    Step("backup:pinned", "worker", "torch", ["backup:pinned"], 80, 35),
    Step("backup:mmap", "worker", "torch", ["backup:mmap"], 80, 30),
    Step("backup:mmap_retained", "worker", "torch", ["backup:mmap_retained"], 80, 30),
    Step("backup:pinned_retained", "worker", "torch", ["backup:pinned_retained"], 80, 30),
    Step("disk:disk", "worker", "torch", ["disk:disk"], 150, 60),
    Step("disk:tmpfs", "worker", "torch", ["disk:tmpfs"], 60, 15),
]
GRACE_S = 30  # past a worker's soft deadline before it is killed
PAIRED_SECTIONS = ("latency", "scaling_count", "scaling_bytes")  # discard cycles, each beside one of the floor's


class Interrupted(Exception):
    pass


def _on_signal(signum, frame):
    raise Interrupted(f"signal {signum}")


# ---- the worker's side -------------------------------------------------------------

def _section(name):
    """The function that measures a section: fn(env, params, deadline) -> dict."""
    from . import cycles, disk, limits, overhead

    kind, _, arg = name.partition(":")
    if kind == "disk":
        return lambda env, params, deadline: disk.run(env, arg, params, deadline)
    if kind == "backup":
        return lambda env, params, deadline: cycles.backup(env, arg, params, deadline)
    return {"limits": limits.run, "latency": cycles.latency, "scaling_count": cycles.scaling_count,
            "scaling_bytes": cycles.scaling_bytes, "alloc_overhead": overhead.alloc_overhead,
            "passthrough": overhead.passthrough, "contention": overhead.contention}[name]


def worker(mode, sections, deadline, params, dry_run=False, save=lambda doc: None):
    """Runs in a worker process (benchmarks.worker): the named sections in one
    hook mode ("none": no library), saving the document after each section so
    that a crash or a kill keeps what was done."""
    from .envs import make_env

    deadline = Deadline(deadline)
    set_log_prefix(f"worker:{mode}")
    result = {"mode": mode, "pid": os.getpid(), "python": sys.version.split()[0], "sections": {},
              "current": None, "env": None, "started": time.time()}
    save(result)
    try:
        env = make_env(None if mode == "none" else mode, dry_run, use_tms=mode != "none")
        result["env"] = env.info()
        if mode == "preload":
            result["env"]["ld_preload"] = os.environ.get("LD_PRELOAD")
        result["env"]["tms_backup_threads"] = os.environ.get("TMS_BACKUP_THREADS")
    except Exception as e:
        rec = error_record(e)
        log(f"cannot set up: {rec['error']}")
        for name in sections:
            result["sections"][name] = dict(rec, error=f"setup failed: {rec['error']}")
        return result

    for name in sections:
        result["current"] = name
        save(result)
        p = params.get(name.split(":", 1)[0], {})
        log(f"{name}: start ({deadline.left():.0f} s left in this process's budget)")
        t0 = time.time()
        if deadline.left() <= 0:
            out = {"error": "skipped: time budget exhausted"}
        else:
            try:
                out = _section(name)(env, p, deadline)
            except Exception as e:
                out = error_record(e)
                log(f"{name}: FAILED: {out['error']}")
        out["wall_s"] = time.time() - t0
        result["sections"][name] = out
        result["current"] = None
        save(result)
        log(f"{name}: done in {out['wall_s']:.1f} s")
    result["finished"] = time.time()
    return result


# ---- running workers ---------------------------------------------------------------

class Runner:
    def __init__(self, args, preset, log_path):
        self.args = args
        self.preset = preset
        self.log_file = open(log_path, "a", buffering=1)
        self.tmp = tempfile.mkdtemp(prefix="tms-bench-")
        self.partial = None  # (step, sections done, record) of the worker step under way
        self.floor_lib = None  # the floor as a library, for the cycles paired with the library's

    def echo(self, line):
        line = f"  | {line}"
        print(line, flush=True)
        self.log_file.write(line + "\n")

    def say(self, msg):
        log(msg)
        self.log_file.write(msg + "\n")

    def worker(self, step, deadline_at):
        """Runs the step's sections, restarting the worker after a crash for the
        sections not yet done. Returns ({section: result}, worker record)."""
        pending = list(step.sections)
        done, record = {}, {"attempts": []}
        params = {k: self.preset[k] for k in self.preset if k != "budget_s"}
        if self.floor_lib:
            for k in PAIRED_SECTIONS:
                params[k] = dict(params[k], floor_lib=self.floor_lib)
        for attempt in range(3):
            if not pending:
                break
            left = deadline_at - time.time()
            if left <= 1:
                for s in pending:
                    done[s] = {"error": "skipped: time budget exhausted before the worker started"}
                pending = []
                break
            result_path = os.path.join(self.tmp, f"{step.name.replace(':', '_')}-{attempt}.json")
            args = {"mode": step.mode, "sections": pending, "deadline": deadline_at, "params": params,
                    "dry_run": self.args.dry_run}
            self.say(f"{step.name}: worker for {','.join(pending)}" + (" (preload)" if step.mode == "preload" else ""))
            t0 = time.time()
            self.partial = (step, done, record)
            try:
                res, rc, timed_out, tail = run_worker("run", args, result_path, child_env(self.args.dry_run),
                                                      left + GRACE_S, preload=step.mode == "preload",
                                                      echo=self.echo)
            except BaseException:  # interrupted: keep the sections the worker finished
                done.update(_sections(result_path))
                raise
            if timed_out:
                self.say(f"{step.name}: past its {left + GRACE_S:.0f} s limit: killed")
            if "read_error" in res:
                res.setdefault("current", pending[0] if pending else None)
            att = {"sections": list(pending), "rc": rc, "timed_out": timed_out, "wall_s": time.time() - t0,
                   "env": res.get("env")}
            record["attempts"].append(att)
            if res.get("env"):
                record["env"] = res["env"]
            done.update(res.get("sections") or {})
            missing = [s for s in pending if s not in done]
            if not missing:
                pending = []
                break
            crashed = res.get("current") or missing[0]
            why = "killed after its time limit" if timed_out else f"worker exited with status {rc}"
            done[crashed] = {"error": f"{why} during this section", "output_tail": "\n".join(tail[-25:])}
            att["crashed_in"] = crashed
            self.say(f"{step.name}: {why} in section {crashed}")
            pending = [s for s in missing if s != crashed]
            if timed_out:
                for s in pending:
                    done[s] = {"error": "skipped: the worker ran out of time"}
                pending = []
        for s in pending:
            done[s] = {"error": "not run: the worker crashed in three earlier sections"}
        return done, record


def _sections(path):
    return read_json(path).get("sections") or {}


# ---- merging ------------------------------------------------------------------------

def merge(results, step, sections):
    for name, out in sections.items():
        if name == "limits":
            results["limits"] = out
        elif name in ("latency", "alloc_overhead", "passthrough", "contention"):
            results.setdefault(name, {})[step.mode] = out
        elif name == "scaling_count":
            results.setdefault("scaling", {})["count"] = out
        elif name == "scaling_bytes":
            results.setdefault("scaling", {})["bytes"] = out
        elif name.startswith("backup:"):
            results.setdefault("backup", {})[name.split(":", 1)[1]] = out
        elif name.startswith("disk:"):
            results.setdefault("disk", {})[name.split(":", 1)[1]] = out
        if isinstance(out, dict) and str(out.get("error", "")).startswith("skipped"):
            results["skipped"].append({"where": f"{step.name}/{name}", "why": out["error"]})
        elif isinstance(out, dict) and "error" in out:
            results["errors"].append({"where": f"{step.name}/{name}", "error": out["error"]})
        elif isinstance(out, dict):
            _failed_checks(results, f"{step.name}/{name}", out)


def _failed_checks(results, where, out):
    """Per-shape errors and failed checks (bytes freed, addresses, contents) into the error list."""
    for e in (out.get("shapes") or []) + (out.get("points") or []):
        label = e.get("shape") or e.get("requested_allocations") or e.get("bytes")
        if e.get("error"):
            results["errors"].append({"where": f"{where}/{label}", "error": e["error"]})
        if e.get("freed_ok") is False:
            results["errors"].append({"where": f"{where}/{label}", "error": "check failed: pause did not free the "
                                      f"tag's reserved bytes (freed {e.get('freed_bytes')}, reserved "
                                      f"{e.get('reserved_bytes')})"})
        if e.get("same_addresses") is False:
            results["errors"].append({"where": f"{where}/{label}", "error": "check failed: addresses changed"})
    for r in out.get("per_cycle") or []:
        if r.get("verified") is False:
            results["errors"].append({"where": f"{where}/cycle {r.get('cycle')}",
                                      "error": "check failed: contents differ after resume"})
    if out.get("cycle_error"):
        results["errors"].append({"where": where, "error": out["cycle_error"]})
    if out.get("files_ok") is False:
        results["errors"].append({"where": where, "error": "check failed: not one backup file per allocation, or "
                                  "stats' bytes_backup_disk != the bytes backed up"})
    if out.get("copied_bytes_ok") is False:
        results["errors"].append({"where": where, "error": "check failed: bytes copied to/from host != tensor bytes"})


def fill_meta_from_env(results, env):
    meta = results["meta"]
    if not env:
        return
    for k in ("torch_version", "torch_cuda_version", "device_total_bytes", "capability"):
        if env.get(k) is not None and meta.get(k) is None:
            meta[k] = env[k]
    if env.get("device_name") and not meta.get("device_name"):
        meta["device_name"] = env["device_name"]


def build_paired_floor(runner, results):
    """The floor as a library the workers load (floor.Paired); without it
    the cycles are compared with the own-process floor alone."""
    try:
        runner.floor_lib, build = floor.build(runner.tmp, library=True)
        results["paired_floor"] = {"ok": True, "build": build["command"]}
        runner.say(f"paired floor: built with {build['command']}")
    except (RuntimeError, OSError) as e:
        results["paired_floor"] = {"ok": False, "error": str(e)[:2000]}
        results["errors"].append({"where": "paired floor", "error": str(e)[:2000]})


def run_floor(runner, results, deadline_at):
    p = runner.preset["floor"]
    shapes = [f"{c}x{s}" for c, s in CANONICAL_SHAPES]
    for c, s in run_report.floor_shapes_for(results):
        t = f"{c}x{s}"
        if t not in shapes:
            shapes.append(t)
    rec = {"shapes_requested": shapes}
    if not _driver_present():
        # No GPU here (a dry run, or --force): there is no driver floor to measure, and nothing failed.
        rec.update(ok=False, skipped="no CUDA driver (libcuda.so.1 cannot be loaded): the driver floor needs a GPU")
        results["skipped"].append({"where": "floor", "why": rec["skipped"]})
        results["vmm_floor"] = rec
        return
    try:
        exe, build = floor.build(runner.tmp)
        rec["build"] = build
        runner.say(f"floor: built with {build['command']}")
        runner.say(f"floor: running {len(shapes)} shapes")
        doc = floor.run(exe, shapes[:64], p["cycles"], p["warmup"], max(5.0, deadline_at - time.time() + 15))
        if doc.get("stderr_tail"):
            for line in doc["stderr_tail"].splitlines()[-10:]:
                runner.echo(f"  | {line}")
        rec.update(doc)
        if not doc.get("ok"):
            results["errors"].append({"where": "floor", "error": doc.get("error")})
        else:
            results["meta"]["cuda_driver_api"] = doc.get("driver_version")
            results["meta"].setdefault("device_name", doc.get("device"))
            for s in doc.get("shapes", []):
                if s.get("error") and not str(s["error"]).startswith("skipped"):
                    results["errors"].append({"where": f"floor/{s.get('shape')}", "error": s["error"]})
    except Exception as e:
        r = error_record(e)
        rec.update(ok=False, error=r["error"])
        results["errors"].append({"where": "floor", "error": r["error"]})
    results["vmm_floor"] = rec


# ---- writing -------------------------------------------------------------------------

def write_outputs(results, out, stem, with_plots):
    try:
        results["derived"] = run_report.derive(results)
    except Exception as e:
        results["derived"] = {}
        results["errors"].append({"where": "report/derive", **error_record(e)})

    def plots(out, stem):
        images, errors = run_report.plots(results, out, stem)
        for e in errors:
            if e == "matplotlib unavailable":  # the figures are all there; only their plots are not
                results["notes"].append({"where": "report/plots", "note": "no plots: matplotlib is not installed "
                                                                          "(pip install matplotlib)"})
            else:
                results["errors"].append({"where": "report/plots", "error": e})
        return images

    report.write(out, stem, results, "torch_memory_saver benchmark",
                 lambda images: run_report.markdown(results, images or results.get("plots") or {}),
                 plots if with_plots else None, lambda: run_report.header_rows(results["meta"]))


# ---- main ------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer cycles and points (about 4 minutes)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: host backend, tiny sizes, plumbing only")
    ap.add_argument("--out", help="output folder (default benchmarks/results; build/bench-dry-run for --dry-run)")
    ap.add_argument("--budget", type=float, help="wall-clock budget in seconds for all steps")
    ap.add_argument("--force", action="store_true", help="run even if no CUDA driver is found")
    ap.add_argument("--only", help="comma-separated step names to run (debugging): " + ",".join(s.name for s in STEPS))
    argv = sys.argv[1:] if argv is None else argv
    args = ap.parse_args(argv)

    if not args.dry_run and not args.force and not _driver_present():
        print("python -m benchmarks run: no CUDA driver here (libcuda.so.1 cannot be loaded), so there is nothing "
              "to measure and nothing is written to benchmarks/results.\n"
              "Use --dry-run to exercise the benchmark on the host backend (output in build/bench-dry-run), "
              "or --force to run anyway.", file=sys.stderr)
        return 2
    preset_name = "dry" if args.dry_run else ("quick" if args.quick else "full")
    preset = PRESETS[preset_name]
    budget = args.budget or preset["budget_s"]
    out = report.out_dir(args.out, args.dry_run)
    t_start = time.time()
    global_deadline = t_start + budget

    meta = report.collect_meta("run", argv, args.dry_run)
    meta["preset"] = preset_name
    stem = report.name(meta)
    results = {"schema": 1, "meta": meta, "params": preset, "errors": [], "skipped": [], "notes": [], "workers": {},
               "steps": {}}
    runner = Runner(args, preset, os.path.join(out, f"{stem}.log"))
    runner.say(f"benchmark run {stem}: preset {preset_name}, budget {budget:.0f} s, output {out}")
    runner.say(f"meta: {json.dumps(meta)}")

    if not args.dry_run:
        build_paired_floor(runner, results)
    old_term = signal.signal(signal.SIGTERM, _on_signal)
    steps = [s for s in STEPS if not args.only or s.name in args.only.split(",")]
    try:
        for i, step in enumerate(steps):
            now = time.time()
            reserve_later = sum(s.expect_s for s in steps[i + 1:])
            left = global_deadline - now
            if left <= 5:
                results["steps"][step.name] = {"skipped": "time budget exhausted"}
                results["skipped"].append({"where": step.name, "why": "skipped: time budget exhausted"})
                continue
            give = min(step.cap_s, max(step.expect_s, left - reserve_later), left)
            deadline_at = now + give
            runner.say(f"=== step {step.name} ({give:.0f} s of {left:.0f} s left) ===")
            t0 = time.time()
            try:
                if step.kind == "floor":
                    run_floor(runner, results, deadline_at)
                else:
                    sections, record = runner.worker(step, deadline_at)
                    runner.partial = None
                    results["workers"][step.name] = record
                    fill_meta_from_env(results, record.get("env"))
                    merge(results, step, sections)
            except Interrupted:
                raise
            except Exception as e:  # the runner's own bug must not lose the other steps
                results["errors"].append({"where": f"runner/{step.name}", **error_record(e)})
            results["steps"][step.name] = {"wall_s": time.time() - t0, "given_s": give}
            results["meta"]["wall_s"] = time.time() - t_start
            write_outputs(results, out, stem, with_plots=False)
            runner.say(f"=== step {step.name} done in {time.time() - t0:.1f} s ===")
    except (Interrupted, KeyboardInterrupt) as e:
        if runner.partial is not None:
            step, done, record = runner.partial
            results["workers"][step.name] = record
            merge(results, step, done)
        results["errors"].append({"where": "runner", "error": f"interrupted: {e!r}"})
        runner.say(f"interrupted ({e!r}): writing what was measured")
    finally:
        signal.signal(signal.SIGTERM, old_term)
        results["meta"]["wall_s"] = time.time() - t_start
        write_outputs(results, out, stem, with_plots=True)
        shutil.rmtree(runner.tmp, ignore_errors=True)
        runner.say(f"wrote {os.path.join(out, stem)}.json / .md / .log, "
                   f"{len(results.get('plots') or {})} plots; {len(results['errors'])} errors, "
                   f"{len(results['skipped'])} skipped, {len(results['notes'])} notes; "
                   f"{results['meta']['wall_s']:.0f} s")
        for e in results["skipped"]:
            runner.say(f"  skipped: {e.get('where')}: {str(e.get('why'))[:300]}")
        for e in results["notes"]:
            runner.say(f"  note: {e.get('where')}: {str(e.get('note'))[:300]}")
        for e in results["errors"]:
            runner.say(f"  error: {e.get('where')}: {str(e.get('error'))[:300]}")
        runner.log_file.close()
    # The report is written either way; the status says whether everything ran
    # (skips and notes are not failures).
    return 0 if (_measured_anything(results) or results["skipped"]) and not results["errors"] else 1


def _measured_anything(results):
    sections = [results.get("limits")]
    for key in ("latency", "alloc_overhead", "passthrough", "scaling", "backup"):
        sections += list((results.get(key) or {}).values())
    return results.get("vmm_floor", {}).get("ok") or any(isinstance(x, dict) and "error" not in x for x in sections)


def _driver_present():
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())
