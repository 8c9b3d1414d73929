"""Builds the C test programs once per test run, shared by the run's workers
(once_per_run): the CMake builds of this tree (cmake_build: plain, and under
ThreadSanitizer), whose programs ctest, valgrind, the fuzz driver and ThreadSanitizer all
run, and, for a build no CMake option makes (libFuzzer under clang), a program compiled
straight with the C compiler (build: the core once per compiler and flags). Sources and
flags come from src/build.txt, as in setup.py and CMakeLists.txt."""
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
C_TESTS = ROOT / "tests" / "c"

_built = {}


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


def once_per_run(key, make):
    """The directory make(directory) filled, made once per test run and shared by the
    run's pytest-xdist workers: the first to need it builds it under a lock in the run's
    temporary directory, the others wait for it and take it. A build that fails leaves
    nothing: the next to need it tries again."""
    import fcntl
    import hashlib

    root = Path(tempfile.gettempdir()) / "tms-builds"
    root.mkdir(exist_ok=True)
    name = hashlib.sha256(repr(key).encode()).hexdigest()[:20]
    out = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / ".built").exists():
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir()
            try:
                make(out)
            except BaseException:
                shutil.rmtree(out, ignore_errors=True)
                raise
            (out / ".built").touch()
    return out


# The targets a sanitizer's build makes: what the suites run under it (a plain build
# makes every target; ctest runs them all).
SANITIZER_TARGETS = {"thread": ("test_core_host", "fuzz_core", "test_reloc_race")}


def cmake_build(sanitize=None, python_modules=True):
    """The directory of this tree's CMake build (RelWithDebInfo: -O2 -g), plain or under
    -fsanitize=<sanitize>, made once per test run: every suite that runs a C test program
    takes it from here, so none is compiled twice. Skips the test where cmake or a C
    compiler is missing; fails it if the build fails."""
    for tool in ("cmake", "ctest"):
        if not shutil.which(tool):
            pytest.skip(f"{tool} not installed")
    if not compiler():
        pytest.skip("no C compiler (cc, or $CC)")
    options = [f"-DPython3_EXECUTABLE={sys.executable}", f"-DTMS_PYTHON_MODULES={'ON' if python_modules else 'OFF'}"]
    if sanitize:
        options.append(f"-DTMS_SANITIZE={sanitize}")
    targets = SANITIZER_TARGETS.get(sanitize, ())

    def make(d):
        for cmd in (["cmake", "-S", ROOT, "-B", d, *options],
                    ["cmake", "--build", d, "-j", "2", *(["--target", *targets] if targets else [])]):
            proc = run(cmd, timeout=300)
            assert proc.returncode == 0, f"{shlex.join(map(str, cmd))}\n{detail(proc)}"

    return once_per_run(("cmake", str(ROOT), sanitize, python_modules), make)


def _compile_all(commands):
    """Runs compiler commands two at a time (the machine's cores are the tests' too);
    fails the test with the first one's messages."""
    pending, running = list(commands), []
    while pending or running:
        while pending and len(running) < 2:
            cmd = pending.pop(0)
            running.append((cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        cmd, proc = running.pop(0)
        _, err = proc.communicate(timeout=300)
        if proc.returncode != 0:
            for _, other in running:
                other.kill()
                other.wait()
            raise AssertionError(f"{shlex.join(cmd)}\n{err}")


def core_objects(cc, flags=(), defines=()):
    """The core's object files compiled with these flags, once per run (every program
    built with the same flags links the same objects)."""
    common = [*cc, *core_flags(), "-g", "-Werror", *flags, *(f"-D{d}" for d in defines), f"-I{SRC}",
              f"-I{ROOT / 'include'}"]

    def make(d):
        _compile_all([[*common, "-c", str(src), "-o", str(d / (str(src.relative_to(SRC)).replace("/", "_") + ".o"))]
                      for src in core_sources()])

    d = once_per_run(("core", tuple(cc), tuple(flags), tuple(defines)), make)
    return sorted(d.glob("*.o"))


def build(program, cc=None, flags=(), defines=()):
    """Path of tests/c/<program>.c linked with the core, built once per test run.
    Skips the test if there is no C compiler; fails it if the build fails."""
    cc = cc or compiler()
    if not cc:
        pytest.skip("no C compiler (cc, or $CC)")
    key = (program, tuple(cc), tuple(flags), tuple(defines))
    if key in _built:
        return _built[key]
    objects = core_objects(cc, flags, defines)

    def make(d):
        cmd = [*cc, *core_flags(), "-g", "-Werror", *flags, *(f"-D{d_}" for d_ in defines), f"-I{SRC}",
               f"-I{ROOT / 'include'}", str(C_TESTS / f"{program}.c"), *map(str, objects), "-o", str(d / program),
               "-ldl", "-lpthread"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{shlex.join(cmd)}\n{proc.stderr}"

    _built[key] = once_per_run(("program",) + key, make) / program
    return _built[key]


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
