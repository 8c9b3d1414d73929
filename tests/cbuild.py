"""Compiles the C test programs (tests/c/*.c + the core) straight with the C compiler,
for the suites that run them under a tool (valgrind, libFuzzer); one build per
(program, compiler, flags) per pytest session. Sources and flags come from
src/build.txt, as in setup.py and CMakeLists.txt."""
import atexit
import os
import re
import shlex
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
C_TESTS = ROOT / "tests" / "c"

_built = {}
_out_dir = None


def build_description():
    """src/build.txt as {key: [values]}."""
    desc = {}
    for line in (SRC / "build.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = line.split(None, 1)
            desc.setdefault(key, []).append(value.strip())
    return desc


def core_sources():
    """The core and, above it, the hooks both variants share: what a C test links."""
    desc = build_description()
    assert desc.get("core"), "no core source listed in src/build.txt"
    return [SRC / name for name in desc["core"] + desc.get("hooks", [])]


def core_flags():
    desc = build_description()
    return [*desc["cflags"][0].split(), "-include", str(SRC / desc["first"][0])]


def compiler():
    """$CC (or cc) as an argv list, or None if there is none."""
    cc = shlex.split(os.environ.get("CC", "")) or ["cc"]
    return cc if shutil.which(cc[0]) else None


def tool_env(**extra):
    """The environment minus outer TMS_* settings and preloads (the programs set their own)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_")}
    env.pop("LD_PRELOAD", None)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def build(program, cc=None, flags=(), defines=()):
    """Path of tests/c/<program>.c linked with the core, built once per session.
    Skips the test if there is no C compiler; fails it if the build fails."""
    global _out_dir
    cc = cc or compiler()
    if not cc:
        pytest.skip("no C compiler (cc, or $CC)")
    key = (program, tuple(cc), tuple(flags), tuple(defines))
    if key in _built:
        return _built[key]
    if _out_dir is None:
        _out_dir = Path(tempfile.mkdtemp(prefix="tms-cbuild-"))
        atexit.register(shutil.rmtree, _out_dir, True)
    out = _out_dir / f"{program}-{len(_built)}"
    cmd = [*cc, *core_flags(), "-g", "-Werror", *flags,
           *(f"-D{d}" for d in defines), f"-I{SRC}", f"-I{ROOT / 'include'}", str(C_TESTS / f"{program}.c"), *map(str, core_sources()),
           "-o", str(out), "-ldl", "-lpthread"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{shlex.join(cmd)}\n{proc.stderr}"
    _built[key] = out
    return out


def skip_unless_sanitizer_runs(sanitizer, tmp):
    """Skips the test unless the C compiler builds, and this machine runs, a threaded
    program under -fsanitize=<sanitizer> (ThreadSanitizer refuses to start on kernels
    with high mmap entropy)."""
    cc = compiler()
    if not cc:
        pytest.skip("no C compiler (cc, or $CC)")
    probe = Path(tmp) / f"probe-{sanitizer}.c"
    probe.write_text("#include <pthread.h>\nstatic void *f(void *a) { return a; }\n"
                     "int main(void) { pthread_t t; pthread_create(&t, 0, f, 0); return pthread_join(t, 0); }\n")
    exe = probe.with_suffix("")
    proc = subprocess.run([*cc, f"-fsanitize={sanitizer}", "-pthread", str(probe), "-o", str(exe)],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        pytest.skip(f"the C compiler cannot build with -fsanitize={sanitizer}: {proc.stderr.strip()[:300]}")
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=60,
                          env=tool_env(ASAN_OPTIONS="detect_leaks=0"))
    if proc.returncode != 0:
        pytest.skip(f"-fsanitize={sanitizer} programs do not run here: {proc.stderr.strip()[-300:]}")


def run(cmd, timeout, env=None, cwd=None):
    """Runs a test program; returns the CompletedProcess (text, stdout+stderr apart)."""
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout,
                          env=env or tool_env(), cwd=cwd)


def detail(proc):
    return f"rc={proc.returncode}\n--- stdout ---\n{proc.stdout[-6000:]}\n--- stderr ---\n{proc.stderr[-6000:]}"


def events(stdout):
    """The `fuzz_core: <event> <count>` lines of a plain fuzz_core run, as a dict."""
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^fuzz_core: (\w+) (\d+)$", stdout, re.M)}
