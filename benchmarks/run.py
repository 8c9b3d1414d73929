"""The benchmark run: `python -m benchmarks.run [--quick] [--dry-run] [--out DIR]`.

One process tree on one GPU. The runner itself never touches the GPU; it starts
one worker process per step (limits; torch hook mode; preload hook mode through
`python -m torch_memory_saver run --`; one per backup configuration), builds and
runs the raw driver floor (vmm_floor.c) for the allocation shapes the workers
observed, then writes <stem>.json, <stem>.md, latest.md and <stem>-*.png to the
output folder (default benchmarks/results). A failing section is recorded as an
error and the run goes on; a worker that dies is restarted for its remaining
sections. Results are rewritten after every step, so a run cut short still
leaves its partial results.

--dry-run: no GPU. Workers use the library's host backend (TMS_BACKEND=host) and
tiny sizes, so every loop, the JSON/Markdown/PNG writing and the error paths run
here; the figures mean nothing. Output defaults to build/bench-dry-run.
"""
import argparse
import collections
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from . import floor, run_report as report
from .common import GiB, MiB, error_record, log, write_json_atomic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
        "latency": {"shapes": [(1, 64 * MiB), (8, 8 * MiB), (32, 2 * MiB)], "cycles": 5, "warmup": 1},
        "backup": {"bytes": 64 * MiB, "tensors": 16, "cycles": 3},
        "alloc_overhead": {"count": 16, "bytes": 2 * MiB, "rounds": 3},
        "passthrough": {"null_iters": 2000, "alloc_iters": 50, "batches": 5},
        "contention": {"bytes": 64 * MiB, "tensors": 16, "cycles": 2},
        "scaling_count": {"counts": [1, 4, 16, 64], "cycles": 3, "warmup": 1},
        "scaling_bytes": {"sizes": [2 * MiB, 8 * MiB, 32 * MiB, 128 * MiB], "cycles": 3, "warmup": 1},
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


# ---- machine facts ----------------------------------------------------------------

def _run_text(cmd, timeout=20):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.stdout.strip() if p.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def _nvidia_smi():
    if not shutil.which("nvidia-smi"):
        return {}
    index = "0"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    if visible.isdigit():
        index = visible
    fields = ["name", "driver_version", "memory.total", "pcie.link.gen.max", "pcie.link.width.max"]
    text = _run_text(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits", "-i", index])
    if not text:
        return {}
    vals = [v.strip() for v in text.splitlines()[0].split(",")]
    out = dict(zip(fields, vals))
    return {"device_name": out.get("name"), "driver_version": out.get("driver_version"),
            "nvidia_smi_memory_total_mib": out.get("memory.total"),
            "pcie": f"gen{out.get('pcie.link.gen.max')} x{out.get('pcie.link.width.max')}"}


def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _mem_gib():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024 / GiB
    except OSError:
        pass
    return None


def _git():
    """(commit, dirty). TMS_BENCH_COMMIT names the commit of a copied tree
    whose git metadata is not its own (the lent GPU machines keep the .git of
    an earlier copy); whether such a tree is dirty is then unknown (None)."""
    named = os.environ.get("TMS_BENCH_COMMIT")
    if named:
        return named, None
    commit = _run_text(["git", "-C", REPO, "rev-parse", "HEAD"])
    dirty = None
    status = _run_text(["git", "-C", REPO, "status", "--porcelain", "--untracked-files=no"])
    if status is not None:
        dirty = any(line and "benchmarks/results" not in line for line in status.splitlines())
    return commit or "unknown", dirty


def collect_meta(args, preset_name):
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "preset": preset_name,
        "dry_run": bool(args.dry_run),
        "command": "python -m benchmarks.run " + " ".join(sys.argv[1:]),
        "python": sys.version.split()[0],
        "kernel": os.uname().release,
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "host_mem_gib": _mem_gib(),
        "environment": {k: v for k, v in sorted(os.environ.items())
                        if k.startswith("TMS_") or k in ("PYTORCH_CUDA_ALLOC_CONF", "CUDA_VISIBLE_DEVICES")},
    }
    meta["git_commit"], meta["git_dirty"] = _git()
    try:
        from torch_memory_saver import __version__

        meta["tms_version"] = __version__
    except Exception as e:
        meta["tms_version"] = f"import failed: {e}"
    if not args.dry_run:
        meta.update({k: v for k, v in _nvidia_smi().items() if v})
    return meta


def _slug(text):
    return re.sub(r"[^A-Za-z0-9]+", "-", text or "gpu").strip("-") or "gpu"


# ---- running workers ---------------------------------------------------------------

class Runner:
    def __init__(self, args, preset, out_dir, log_path):
        self.args = args
        self.preset = preset
        self.out_dir = out_dir
        self.log_file = open(log_path, "a", buffering=1)
        self.tmp = tempfile.mkdtemp(prefix="tms-bench-")
        self.current = None
        self.partial = None  # (step, sections done, record) of the worker step under way
        self.floor_lib = None  # the floor as a library, for the cycles paired with the library's

    def echo(self, line):
        sys.stdout.write(line if line.endswith("\n") else line + "\n")
        sys.stdout.flush()
        self.log_file.write(line if line.endswith("\n") else line + "\n")

    def say(self, msg):
        log(msg)
        self.log_file.write(msg + "\n")

    def child_env(self, mode):
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env["PYTHONUNBUFFERED"] = "1"
        # Only the preload worker gets the preload library (the runner adds it).
        kept = [e for e in env.get("LD_PRELOAD", "").replace(":", " ").split() if "_tms_preload" not in e]
        if kept:
            env["LD_PRELOAD"] = " ".join(kept)
        else:
            env.pop("LD_PRELOAD", None)
        if self.args.dry_run:
            env["TMS_BACKEND"] = "host"
        return env

    def run_process(self, cmd, env, timeout, label):
        """Runs cmd, streaming its output; kills it after timeout. Returns (rc, timed_out, tail)."""
        tail = collections.deque(maxlen=40)
        self.say(f"{label}: {' '.join(cmd)[:300]}")
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, errors="replace")
        self.current = proc

        def pump():
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))
                self.echo(f"  | {line.rstrip()}")

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            self.say(f"{label}: past its {timeout:.0f} s limit: killing pid {proc.pid}")
            proc.kill()
            proc.wait()
        except BaseException:  # interrupted: the worker must not outlive the runner
            proc.kill()
            proc.wait()
            raise
        finally:
            reader.join(timeout=5)
            self.current = None
        return proc.returncode, timed_out, list(tail)

    def kill_current(self):
        proc = self.current
        if proc is not None and proc.poll() is None:
            try:
                proc.kill()
            except OSError:
                pass

    def worker(self, step, deadline_at):
        """Runs the step's sections, restarting the worker after a crash for the
        sections not yet done. Returns ({section: result}, worker record)."""
        pending = list(step.sections)
        done, record = {}, {"attempts": []}
        params = {k: self.preset[k] for k in self.preset if k != "budget_s"}
        if self.floor_lib:
            for k in PAIRED_SECTIONS:
                params[k] = dict(params[k], floor_lib=self.floor_lib)
        params = json.dumps(params)
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
            inner = [sys.executable, "-m", "benchmarks.worker", "--mode", step.mode, "--sections",
                     ",".join(pending), "--result", result_path, "--deadline", f"{deadline_at:.3f}",
                     "--params", params]
            if self.args.dry_run:
                inner.append("--dry-run")
            cmd = ([sys.executable, "-m", "torch_memory_saver", "run", "--"] + inner
                   if step.mode == "preload" else inner)
            t0 = time.time()
            self.partial = (step, done, record)
            try:
                rc, timed_out, tail = self.run_process(cmd, self.child_env(step.mode), left + GRACE_S, step.name)
            except BaseException:  # interrupted: keep the sections the worker finished
                done.update(_read_result(result_path).get("sections") or {})
                raise
            res = _read_result(result_path)
            if "read_error" in res:
                res.setdefault("current", pending[0] if pending else None)
            att = {"sections": list(pending), "rc": rc, "timed_out": timed_out, "wall_s": time.time() - t0,
                   "env": res.get("env")}
            record["attempts"].append(att)
            if res.get("env"):
                record["env"] = res["env"]
            for s, out in (res.get("sections") or {}).items():
                done[s] = out
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


def _read_result(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"sections": {}, "read_error": f"{type(e).__name__}: {e}"}


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
        if isinstance(out, dict) and "error" in out:
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
    for c, s in report.floor_shapes_for(results):
        t = f"{c}x{s}"
        if t not in shapes:
            shapes.append(t)
    rec = {"shapes_requested": shapes}
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

def write_outputs(results, out_dir, stem, with_plots):
    try:
        results["derived"] = report.derive(results)
    except Exception as e:
        results["derived"] = {}
        results["errors"].append({"where": "report/derive", **error_record(e)})
    images = {}
    if with_plots:
        try:
            images, errs = report.plots(results, out_dir, stem)
            results["plots"] = images
            for e in errs:
                results["errors"].append({"where": "report/plots", "error": e})
        except Exception as e:
            results["errors"].append({"where": "report/plots", **error_record(e)})
    else:
        images = results.get("plots") or {}
    write_json_atomic(os.path.join(out_dir, f"{stem}.json"), results, strip=REPO + os.sep)
    try:
        md = report.markdown(results, images)
    except Exception as e:
        r = error_record(e)
        md = f"# torch_memory_saver benchmark\n\nMarkdown report failed: {r['error']}\n\n```\n{r['traceback']}\n```\n"
    for name in (f"{stem}.md", "latest.md"):
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(md)


# ---- main ------------------------------------------------------------------------------

def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer cycles and points (about 4 minutes)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: host backend, tiny sizes, plumbing only")
    ap.add_argument("--out", help="output folder (default benchmarks/results; build/bench-dry-run for --dry-run)")
    ap.add_argument("--budget", type=float, help="wall-clock budget in seconds for all steps")
    ap.add_argument("--force", action="store_true", help="run even if no CUDA driver is found")
    ap.add_argument("--only", help="comma-separated step names to run (debugging): " + ",".join(s.name for s in STEPS))
    args = ap.parse_args(argv)

    if not args.dry_run and not args.force and not _driver_present():
        print("benchmarks.run: no CUDA driver here (libcuda.so.1 cannot be loaded), so there is nothing to "
              "measure and nothing is written to benchmarks/results.\n"
              "Use --dry-run to exercise the benchmark on the host backend (output in build/bench-dry-run), "
              "or --force to run anyway.", file=sys.stderr)
        return 2
    preset_name = "dry" if args.dry_run else ("quick" if args.quick else "full")
    preset = PRESETS[preset_name]
    budget = args.budget or preset["budget_s"]
    default_out = os.path.join(REPO, "build", "bench-dry-run") if args.dry_run else os.path.join(REPO, "benchmarks",
                                                                                               "results")
    out_dir = os.path.abspath(args.out or default_out)
    os.makedirs(out_dir, exist_ok=True)
    t_start = time.time()
    global_deadline = t_start + budget

    meta = collect_meta(args, preset_name)
    device_for_stem = "host-dry-run" if args.dry_run else meta.get("device_name")
    stem = f"{datetime.datetime.now(datetime.timezone.utc).strftime('%Y%m%d-%H%M%S')}_{_slug(device_for_stem)}"
    results = {"schema": 1, "meta": meta, "params": preset, "errors": [], "workers": {}, "steps": {}}
    runner = Runner(args, preset, out_dir, os.path.join(out_dir, f"{stem}.log"))
    runner.say(f"benchmark run {stem}: preset {preset_name}, budget {budget:.0f} s, output {out_dir}")
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
                results["errors"].append({"where": step.name, "error": "skipped: time budget exhausted"})
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
            write_outputs(results, out_dir, stem, with_plots=False)
            runner.say(f"=== step {step.name} done in {time.time() - t0:.1f} s ===")
    except (Interrupted, KeyboardInterrupt) as e:
        runner.kill_current()
        if runner.partial is not None:
            step, done, record = runner.partial
            results["workers"][step.name] = record
            merge(results, step, done)
        results["errors"].append({"where": "runner", "error": f"interrupted: {e!r}"})
        runner.say(f"interrupted ({e!r}): writing what was measured")
    finally:
        signal.signal(signal.SIGTERM, old_term)
        results["meta"]["wall_s"] = time.time() - t_start
        write_outputs(results, out_dir, stem, with_plots=True)
        shutil.rmtree(runner.tmp, ignore_errors=True)
        runner.say(f"wrote {os.path.join(out_dir, stem)}.json / .md / .log, latest.md, "
                   f"{len(results.get('plots') or {})} plots; {len(results['errors'])} errors; "
                   f"{results['meta']['wall_s']:.0f} s")
        for e in results["errors"]:
            runner.say(f"  error: {e.get('where')}: {str(e.get('error'))[:300]}")
        runner.log_file.close()
    # 0 as long as anything was measured: failures are recorded in the results.
    return 0 if _measured_anything(results) else 1


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
