"""The raw driver floor: builds benchmarks/vmm_floor.c and runs it for a list of shapes."""
import ctypes
import json
import os
import shutil
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "vmm_floor.c")


def _include_dirs():
    nvcc = shutil.which("nvcc")
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda",
             nvcc and os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    dirs = [os.path.join(r, "include") for r in roots if r] + ["/usr/local/cuda/targets/x86_64-linux/include",
                                                               "/usr/include"]
    return [d for i, d in enumerate(dirs) if d not in dirs[:i] and os.path.exists(os.path.join(d, "cuda.h"))]


def build(workdir=None, timeout=60, library=False):
    """Returns (path of the binary, build record). The driver is opened at run time, so only cuda.h is needed: a C
    compiler with its include dir, or nvcc. library=True builds the shared library Paired loads."""
    workdir = workdir or tempfile.mkdtemp(prefix="tms-vmm-floor-")
    exe = os.path.join(workdir, "libvmm_floor.so" if library else "vmm_floor")
    shared = ["-DVMM_FLOOR_LIBRARY", "-shared", "-fPIC"] if library else []
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    commands = [[cc, "-O2", "-std=c11", *shared, f"-I{inc}", "-o", exe, SOURCE, "-ldl"]
                for inc in (_include_dirs() if cc else [])]
    nvcc = shutil.which("nvcc")
    if nvcc:
        nv_shared = ["-DVMM_FLOOR_LIBRARY", "-shared", "-Xcompiler", "-fPIC"] if library else []
        commands.append([nvcc, "-O2", *nv_shared, "-o", exe, SOURCE, "-ldl"])
    attempts = []
    for cmd in commands:
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as e:
            attempts.append({"command": " ".join(cmd), "error": f"{type(e).__name__}: {e}"})
            continue
        attempts.append({"command": " ".join(cmd), "rc": p.returncode, "output": (p.stdout + p.stderr)[-2000:]})
        if p.returncode == 0 and os.path.exists(exe):
            return exe, {"command": " ".join(cmd), "attempts": attempts}
    raise RuntimeError("cannot build vmm_floor.c: " + json.dumps(attempts)[-3000:] if attempts else
                       "cannot build vmm_floor.c: no C compiler with cuda.h found and no nvcc")


def run(exe, shapes, cycles, warmup, timeout, options=()):
    """Runs the binary; returns its JSON (ok=false with the reason if the driver failed)."""
    cmd = [exe, "--cycles", str(cycles), "--warmup", str(warmup), *options] + list(shapes)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        raise RuntimeError(f"vmm_floor exited {p.returncode} without JSON; stdout: {p.stdout[-1500:]!r} "
                           f"stderr: {p.stderr[-1500:]!r}")
    doc.update(rc=p.returncode, command=" ".join(cmd), stderr_tail=p.stderr[-1500:])
    return doc


class Paired:
    """One shape of the floor held in this process (the library build() makes with library=True), cycled one cycle at a
    time beside the library's own cycles: both then see the same driver state and the same idle time. The library holds
    one shape at a time: a second Paired on the same file replaces the first one's."""

    def __init__(self, library, count, size):
        self._lib = lib = ctypes.CDLL(library)
        lib.vmm_floor_error.restype = ctypes.c_char_p
        lib.vmm_floor_hold.argtypes = [ctypes.c_long, ctypes.c_ulonglong]
        lib.vmm_floor_cycle.argtypes = [ctypes.c_int, ctypes.c_double, ctypes.POINTER(ctypes.c_double),
                                        ctypes.POINTER(ctypes.c_double)]
        self._times = (ctypes.c_double(), ctypes.c_double())
        if lib.vmm_floor_hold(count, size):
            raise RuntimeError(f"vmm_floor_hold({count}, {size}): {lib.vmm_floor_error().decode()}")

    def cycle(self, value, idle_s=0.0):
        """Writes the memory, synchronizes, spins idle_s (the device idle), then
        times one pause and one resume loop: (pause seconds, resume seconds)."""
        p, r = self._times
        if self._lib.vmm_floor_cycle(value & 0xFF, idle_s, ctypes.byref(p), ctypes.byref(r)):
            raise RuntimeError(f"vmm_floor_cycle: {self._lib.vmm_floor_error().decode()}")
        return p.value, r.value

    def close(self):
        self._lib.vmm_floor_drop()


class Beside:
    """A Paired floor that gives way to the library's cycles it runs beside: where it cannot hold its allocations (no
    room for a second set) or one of its cycles fails, it stops with the reason in .error and drops the times it had (a
    part of the cycles paired is no pairing); the library's figures still count. The caller keeps the times of the
    cycles it counts in .times."""

    def __init__(self, library, count, size, why_not=None):
        self.paired, self.error, self.times = None, why_not, []
        self.let_go = False  # set when a failed cycle gave the floor's memory back
        if library and not why_not:
            try:
                self.paired = Paired(library, count, size)
            except RuntimeError as e:
                self.error = str(e)

    def cycle(self, value, idle_s=0.0):
        """(pause, resume) seconds of one floor cycle, or None once stopped."""
        if not self.paired:
            return None
        try:
            return self.paired.cycle(value, idle_s)
        except RuntimeError as e:
            self.close()
            self.error, self.times, self.let_go = str(e), [], True
            return None

    def close(self):
        if self.paired:
            self.paired.close()
            self.paired = None
