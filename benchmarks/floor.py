"""The raw driver floor: builds benchmarks/vmm_floor.c and runs it for a list of shapes."""
import json
import os
import shutil
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE = os.path.join(HERE, "vmm_floor.c")


def _include_dirs():
    dirs = []
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root:
            dirs.append(os.path.join(root, "include"))
    nvcc = shutil.which("nvcc")
    if nvcc:
        dirs.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "include"))
    dirs += ["/usr/local/cuda/targets/x86_64-linux/include", "/usr/include"]
    seen, out = set(), []
    for d in dirs:
        if d not in seen and os.path.exists(os.path.join(d, "cuda.h")):
            seen.add(d)
            out.append(d)
    return out


def build(workdir=None, timeout=60):
    """Returns (path of the binary, build record). The driver is opened at run
    time, so only cuda.h is needed: a C compiler with its include dir, or nvcc."""
    workdir = workdir or tempfile.mkdtemp(prefix="tms-vmm-floor-")
    exe = os.path.join(workdir, "vmm_floor")
    attempts = []
    commands = []
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc:
        for inc in _include_dirs():
            commands.append([cc, "-O2", "-std=c11", f"-I{inc}", "-o", exe, SOURCE, "-ldl"])
    nvcc = shutil.which("nvcc")
    if nvcc:
        commands.append([nvcc, "-O2", "-o", exe, SOURCE, "-ldl"])
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
    doc["rc"] = p.returncode
    doc["command"] = " ".join(cmd)
    doc["stderr_tail"] = p.stderr[-1500:]
    return doc
