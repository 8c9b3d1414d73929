"""Small helpers shared by the runner and the workers (no torch import here)."""
import json
import os
import statistics
import sys
import time

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

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


def eprint(*args):
    print(*args, file=sys.stderr, flush=True)


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
