"""Helpers every suite shares: units, logging, statistics, JSON files and the
launching of worker processes (no torch import here)."""
import collections
import json
import os
import statistics
import subprocess
import sys
import threading
import time

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRY_RUN_OUT = os.path.join(REPO, "build", "bench-dry-run")
RESULTS = os.path.join(REPO, "benchmarks", "results")

_T0 = time.monotonic()
_PREFIX = ["bench"]


def set_log_prefix(prefix: str) -> None:
    _PREFIX[0] = prefix


def log(msg: str, prefix: str = None) -> None:
    """A progress line, flushed at once so a partial log is useful."""
    print(f"[{prefix or _PREFIX[0]} {time.monotonic() - _T0:7.1f}s] {msg}", flush=True)


def median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS), in bytes."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    n = int(n)
    for unit, size in (("TiB", 1 << 40), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n} B"


def shape_name(count: int, size: int) -> str:
    return f"{count}x{fmt_bytes(size).replace(' ', '')}"


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
            try:
                return getattr(o, attr)()
            except Exception:
                pass
    return repr(o)


class Deadline:
    """A soft deadline: loops ask whether another step of a given cost fits."""

    def __init__(self, at: float):
        self.at = at

    def left(self) -> float:
        return self.at - time.time()

    def allows(self, cost_s: float = 0.0) -> bool:
        return self.left() > cost_s


def error_record(exc: BaseException) -> dict:
    import traceback

    return {
        "error": f"{type(exc).__name__}: {exc}",
        "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))[-4000:],
    }


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
    return path


# ---- worker processes ------------------------------------------------------------------

def child_env(dry_run=False, clean=False):
    """The environment of a worker process: this checkout first on PYTHONPATH and
    unbuffered output. The preload library is left off LD_PRELOAD (worker_cmd
    adds it to the workers that measure it), as a torch-mode worker under it
    would measure something else. clean drops TMS_* and PYTORCH_CUDA_ALLOC_CONF,
    for suites whose rows set them. A dry run gets the host backend."""
    env = dict(os.environ)
    if clean:
        env = {k: v for k, v in env.items() if not k.startswith("TMS_") and k != "PYTORCH_CUDA_ALLOC_CONF"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    kept = [e for e in env.get("LD_PRELOAD", "").replace(":", " ").split() if "_tms_preload" not in e]
    if kept:
        env["LD_PRELOAD"] = " ".join(kept)
    else:
        env.pop("LD_PRELOAD", None)
    if dry_run:
        env["TMS_BACKEND"] = "host"
    return env


def worker_cmd(suite, result, args, preload=False):
    """`python -m benchmarks.worker SUITE RESULT ARGS`, under the library's
    `run --` (the preload library on LD_PRELOAD) where preload is set."""
    cmd = [sys.executable, "-m", "benchmarks.worker", suite, result, json.dumps(args)]
    return [sys.executable, "-m", "torch_memory_saver", "run", "--", *cmd] if preload else cmd


def run_child(cmd, env, timeout=None, echo=None):
    """Runs cmd in the checkout, each output line passed to echo as it comes (a
    run cut short still shows where it was); kills it after timeout seconds or
    when this process is interrupted. Returns (exit status, timed out, last lines)."""
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
        proc.kill()
        proc.wait()
    except BaseException:  # interrupted: the worker must not outlive its runner
        proc.kill()
        proc.wait()
        raise
    finally:
        reader.join(timeout=5)
    return proc.returncode, timed_out, list(tail)


def run_worker(suite, args, result, env, timeout=None, preload=False, echo=None):
    """Runs the suite's worker(**args) in a process of its own; returns
    (its document, exit status, timed out, last lines of its output)."""
    rc, timed_out, tail = run_child(worker_cmd(suite, result, args, preload), env, timeout, echo)
    return read_json(result), rc, timed_out, tail
