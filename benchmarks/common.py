"""Helpers every suite shares: units, logging, statistics, JSON files, the command line's common options and the
launching of worker processes (no torch import here)."""
import argparse
import collections
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRY_RUN_OUT = os.path.join(REPO, "build", "bench-dry-run")
RESULTS = os.path.join(REPO, "benchmarks", "results")
# Starts a command under its library's own configure_subprocess() (the preload
# library on LD_PRELOAD): argv[1] holds that torch_memory_saver; exec keeps the
# descriptors the command inherits.
LAUNCH = ("import os, sys\nsys.path.insert(0, sys.argv[1])\nfrom torch_memory_saver import configure_subprocess\n"
          "with configure_subprocess():\n    os.execve(sys.argv[2], sys.argv[2:], dict(os.environ))\n")

_T0 = time.monotonic()


def log(msg: str) -> None:
    """A progress line, flushed at once so a partial log is useful."""
    print(f"[bench {time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def proc_field(path, name):
    """The value of the first `name: value` line of a /proc file (None where there is none)."""
    try:
        with open(path) as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith(name)), None)
    except OSError:
        return None


def meminfo(field, path="/proc/self/status"):
    """A `Field:  N kB` line of a /proc file, in bytes (None where it is missing)."""
    v = proc_field(path, field + ":")
    return int(v.split()[0]) * 1024 if v else None


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS), in bytes (-1 where unknown)."""
    return meminfo("VmRSS") or -1


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    n = int(n)
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n} B"


def spin(seconds):
    """Busy-waits: the device idles, the CPU does not (no sleep state to wake from)."""
    until = time.perf_counter() + seconds
    while time.perf_counter() < until:
        pass


def write_json_atomic(path: str, obj, strip: str = None) -> None:
    """Writes obj as JSON via a temporary file; `strip` (a path prefix) is removed
    from every string so results do not carry this machine's paths."""
    text = json.dumps(obj, indent=1, sort_keys=False, default=_json_default)
    if strip:
        text = text.replace(json.dumps(strip)[1:-1], "")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def read_json(path):
    """The document at path, or {"read_error": why} (a worker that died before writing)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        return {"read_error": f"{type(e).__name__}: {e}"}


def _json_default(o):
    # numpy / torch scalars and anything else: best effort, never fail a write.
    for attr in ("item", "tolist"):
        if hasattr(o, attr):
            with contextlib.suppress(Exception):
                return getattr(o, attr)()
    return repr(o)


class Deadline:
    """A soft deadline: loops ask whether another step of a given cost fits."""

    def __init__(self, at: float):
        self.at = at

    def allows(self, cost_s: float = 0.0) -> bool:
        return self.at - time.time() > cost_s


def error_record(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}",
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:]}


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None (saying why) where it is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:
        print(f"no plot: matplotlib unavailable ({type(e).__name__}: {e})")
        return None
    return plt


def save_png(plt, fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return os.path.basename(path)


def _host_gpus():
    """NVIDIA/AMD PCI functions of class display or accelerator, as src/platform/topology.c counts them."""
    root, n = "/sys/bus/pci/devices", 0
    for dev in os.listdir(root) if os.path.isdir(root) else []:
        try:
            vendor = int(open(f"{root}/{dev}/vendor").read(), 16)
            base_class = int(open(f"{root}/{dev}/class").read(), 16) >> 16
        except (OSError, ValueError):
            continue
        n += vendor in (0x10DE, 0x1002) and base_class in (0x03, 0x12)
    return n


def copy_threads():
    """The copy workers the library runs in this process (src/backup/transfer.c tms_transfer_default_workers)."""
    n = int(os.environ.get("TMS_BACKUP_THREADS", "0") or 0)
    if n > 0:
        return n
    allowed, online, gpus = len(os.sched_getaffinity(0)), os.cpu_count() or 1, _host_gpus()
    cpus = online // gpus if allowed >= online and gpus > 1 else allowed
    return min(16, max(2, cpus))


class _Parser(argparse.ArgumentParser):
    """Refuses, in one line, a run that is no dry run where the CUDA driver sees no GPU (`run --force` goes on)."""

    def parse_args(self, args=None, namespace=None):
        out = super().parse_args(args, namespace)
        why = None if out.dry_run or getattr(out, "force", False) else no_gpu()
        if why:
            self.exit(2, f"{self.prog}: {why}, so there is nothing to measure and nothing is written; --dry-run "
                         f"runs the suite on the host backend (output in build/bench-dry-run)\n")
        return out


def parser(suite, doc, dry_run_help="no GPU: host backend, tiny sizes, plumbing only"):
    """The suite's argument parser, with the options every suite has (--out, --dry-run)."""
    ap = _Parser(prog=f"python -m benchmarks {suite}", description=doc.split("\n\n")[0])
    ap.add_argument("--out", help="output folder (default benchmarks/results; build/bench-dry-run for --dry-run)")
    ap.add_argument("--dry-run", action="store_true", help=dry_run_help)
    return ap


# In a process of its own: the runner, which only starts workers, then holds no driver state.
GPU_PROBE = ("import ctypes, os, sys\ntry:\n    cuda = ctypes.CDLL('libcuda.so.1')\nexcept OSError:\n"
             "    sys.exit('no CUDA driver here (libcuda.so.1 cannot be loaded)')\nn = ctypes.c_int(0)\n"
             "rc = cuda.cuInit(0) or cuda.cuDeviceGetCount(ctypes.byref(n))\nsys.exit(n.value < 1 and 'the CUDA driver "
             "sees no GPU (status %d, CUDA_VISIBLE_DEVICES=%r)' % (rc, os.environ.get('CUDA_VISIBLE_DEVICES')))\n")


def no_gpu():
    """Why the CUDA driver offers no GPU here (None where it sees one)."""
    try:
        probe = subprocess.run([sys.executable, "-c", GPU_PROBE], capture_output=True, text=True, timeout=120)
        return (probe.stderr.strip().splitlines() or ["the GPU probe failed"])[-1] if probe.returncode else None
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the GPU probe failed ({type(e).__name__}: {e})"


def import_library(library):
    """Imports torch_memory_saver from the directory library (None: this checkout),
    checking that the one loaded is that one; returns the directory it came from."""
    sys.path.insert(0, library or REPO)
    import torch_memory_saver

    found = os.path.dirname(os.path.dirname(os.path.abspath(torch_memory_saver.__file__)))
    if found != os.path.abspath(library or REPO):
        raise RuntimeError(f"asked for the torch_memory_saver in {library or REPO}, loaded {found}")
    return found


# ---- worker processes ------------------------------------------------------------------

def child_env(dry_run=False, clean=False):
    """A worker's environment: this checkout first on PYTHONPATH, unbuffered output, the preload library off LD_PRELOAD
    (worker_cmd adds it where it is measured: a torch-mode worker under it would measure something else); clean drops
    TMS_* and PYTORCH_CUDA_ALLOC_CONF; a dry run gets the host backend."""
    env = {k: v for k, v in os.environ.items()
           if not (clean and (k.startswith("TMS_") or k == "PYTORCH_CUDA_ALLOC_CONF"))}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    kept = [e for e in env.pop("LD_PRELOAD", "").replace(":", " ").split() if "_tms_preload" not in e]
    if kept:
        env["LD_PRELOAD"] = " ".join(kept)
    if dry_run:
        env["TMS_BACKEND"] = "host"
    return env


def worker_cmd(suite, result, args, preload=False, library=None):
    """`python -m benchmarks.worker SUITE RESULT ARGS`, under the library's `run --` (the preload library on LD_PRELOAD)
    where preload is set, or under configure_subprocess() of the torch_memory_saver in library."""
    cmd = [sys.executable, "-m", "benchmarks.worker", suite, result, json.dumps(args)]
    if library:
        return [sys.executable, "-c", LAUNCH, library] + cmd
    return [sys.executable, "-m", "torch_memory_saver", "run", "--", *cmd] if preload else cmd


def run_child(cmd, env, timeout=None, echo=None):
    """Runs cmd in the checkout, each output line passed to echo as it comes (a run cut short still shows where it was);
    kills it after timeout seconds or when this process is interrupted. Returns (exit status, timed out, last lines)."""
    echo = echo or (lambda line: print(f"  | {line}", flush=True))
    tail = collections.deque(maxlen=40)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, bufsize=1, errors="replace")

    def pump():
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            echo(line.rstrip())

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=None if timeout is None else max(1.0, timeout))
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:  # past its time, or this process interrupted: the worker must not outlive its runner
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(timeout=5)
    return proc.returncode, timed_out, list(tail)


def run_row(suite, args, env, row, timeout=600, preload=False, library=None, echo=None):
    """The suite's worker(**args) in a process of its own: the document it returns; where the worker failed, what it
    saved (over row's defaults) with an "error" saying how it ended and its "exit_code"."""
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        rc, timed_out, tail = run_child(worker_cmd(suite, out.name, args, preload, library), env, timeout, echo)
        doc = read_json(out.name)
    if rc == 0 and "read_error" not in doc:
        return doc
    why = f"killed after {timeout:.0f} s" if timed_out else f"exit {rc}"
    saved = {} if "read_error" in doc else doc
    return dict(row, **saved, error=f"{why}: {' / '.join(tail[-8:])[-2000:]}", exit_code=rc)
