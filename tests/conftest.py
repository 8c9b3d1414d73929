"""Shared fixtures for the CPU-side suite.

The backend and the TMS_* environment are fixed per process, so most tests run
their scenario in a fresh Python process on the host backend: a function of the
test's module or of a scenario module in tests/host_scenarios/ (`in_child`, which
returns what it returned), a case of a scenario program run by name (`run_scenario`),
or a snippet of a line or two (`run_py`). All three import the one prelude,
tests/host_scenarios/_prelude.py.
"""
import contextlib
import importlib.util
import itertools
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

import child
import gpus

REPO = Path(__file__).resolve().parent.parent
# Scenario modules import the prelude by its own name, here as in a child.
sys.path.insert(1, str(REPO / "tests" / "host_scenarios"))
PKG = REPO / "torch_memory_saver"
HOOK_MODES = ("preload", "torch")
MiB = 1 << 20


def library_file(mode):
    """Path of the in-place build of one variant (torch_memory_saver/_tms_<mode>.abi3.so)."""
    return PKG / f"_tms_{mode}.abi3.so"


# Variables that would change the child's behaviour if inherited from the
# pytest process (the per-test `env` argument sets what a scenario needs).
_SCRUB_PREFIXES = ("TMS_",)
_SCRUB = ("LD_PRELOAD", "LD_BIND_NOW", "PYTHONFAULTHANDLER", "PYTHONSTARTUP", "PYTHONWARNINGS")


def _private_runtime_dir():
    """A private directory (0700), gone when this process ends."""
    import atexit
    import shutil

    path = tempfile.mkdtemp(prefix="tms-run-")
    atexit.register(shutil.rmtree, path, True)
    return path


def child_env(env=None, backend="host"):
    """os.environ minus TMS_*/LD_PRELOAD, with PYTHONPATH = repo root and
    TMS_BACKEND=backend (None: unset); `env` entries override, None removes."""
    out = {k: v for k, v in os.environ.items() if not k.startswith(_SCRUB_PREFIXES) and k not in _SCRUB}
    out["PYTHONPATH"] = str(REPO)
    out["PYTHONDONTWRITEBYTECODE"] = "1"
    # Two copy workers whatever the machine: the pool's pinned staging (two
    # 8 MiB slots per worker) stays small and host_alloc calls are countable.
    out["TMS_BACKUP_THREADS"] = "2"
    if backend is not None:
        out["TMS_BACKEND"] = backend
    for k, v in (env or {}).items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = str(v)
    return out


@pytest.hookimpl(tryfirst=True)  # before pytest's tmp_path factory reads --basetemp
def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes a few seconds (builds a wheel)")
    config.addinivalue_line("markers", "packaging: builds or installs the package (make test-packaging)")
    _use_a_temp_dir_of_the_run(config)
    gpus.configure(config)
    # Every child of the run takes this for the user's runtime directory (XDG_RUNTIME_DIR),
    # the host backup ledger's first place: none shares a ledger with the user's own
    # processes, and none leaves one in the user's home or /dev/shm. (Here rather than at
    # import: a child that imports this module keeps the directory its parent gave it.)
    os.environ["XDG_RUNTIME_DIR"] = _private_runtime_dir()


# The build and packaging tests: wheels, the sdist, other interpreters, `make` itself.
# `make test-packaging` runs them (marked `packaging`), `make test` the rest, `make
# check` both: each stays within its time on two cores.
PACKAGING = ("tests/test_build.py::", "tests/test_pythons.py::",
             "tests/test_readme_promises.py::test_make_builds_what_changed_and_reinstalls_from_any_state",
             "tests/test_readme_promises.py::test_a_wheel_build_without_the_wheel_package_says_to_install_it")

# The tests that take longest (builds under sanitizers, runs under tools), started
# first: pytest-xdist hands tests out in collection order as workers free up, so one
# left for the end would run alone while the other worker idles.
LONGEST_FIRST = ("tests/test_readme_promises.py::test_make_builds_what_changed",
                 "tests/test_c_suite.py::test_ctest", "tests/test_c_suite.py::test_ctest_address_undefined_sanitizers",
                 "tests/test_concurrency.py::test_threads_scenarios_under_thread_sanitizer",
                 "tests/test_build.py::test_sdist_builds", "tests/test_fuzz.py::test_injected_faults",
                 "tests/test_fuzz.py::test_random_sequences", "tests/test_valgrind.py::",
                 "tests/test_share.py::",
                 "tests/test_bench_suites.py::test_each_suite_dry_run")


def _rank(nodeid, prefixes):
    return next((i for i, p in enumerate(prefixes) if nodeid.startswith(p)), len(prefixes))


def pytest_collection_modifyitems(config, items):
    """`make test` runs two pytest-xdist workers (--dist loadgroup): the GPU
    scenarios share one group, so they run one after the other on one worker
    and never compete for the GPU's memory; `make test-gpu` spreads them over
    the GPUs instead, one worker per GPU (tests/gpus.py). The longest tests go
    first, the packaging tests are marked."""
    items.sort(key=lambda item: _rank(item.nodeid, LONGEST_FIRST))  # stable: the rest keep their order
    for item in items:
        if _rank(item.nodeid, PACKAGING) < len(PACKAGING):
            item.add_marker(pytest.mark.packaging)
    gpus.arrange(config, items)


def _ensure_built():
    missing = [m for m in HOOK_MODES if not library_file(m).exists()]
    if missing:
        subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=REPO, check=True,
                       env=dict(os.environ, TMS_WERROR="1"))
    for m in HOOK_MODES:
        assert library_file(m).exists(), f"{library_file(m)} missing: run `make build`"


@pytest.fixture(scope="session")
def built_libs():
    """{'preload': Path, 'torch': Path} of the in-place builds (built if missing)."""
    _ensure_built()
    return {m: library_file(m) for m in HOOK_MODES}


# What a run_py snippet starts with (prelude=True): the one prelude's names, as a
# child function's module imports them.
PRELUDE_IMPORT = "import sys\nsys.path.insert(1, {dir!r})\nfrom _prelude import *\n"


@pytest.fixture
def run_py(built_libs, tmp_path):
    """run_py(code, env=None, prelude=True, load_core=True, backend="host", timeout=60, args=())
    runs `code` in a fresh `python <script>` with cwd = repo root, PYTHONPATH = repo
    root and TMS_BACKEND=backend, and returns the CompletedProcess (text).
    prelude: start with `from _prelude import *` (tests/host_scenarios/_prelude.py);
    load_core: also bind `core = tms._core` (first use of the singleton: leave it False
    to set hook_mode first). A test of more than a few lines is a function run by
    `in_child` instead."""

    counter = itertools.count()

    def run(code, env=None, prelude=True, load_core=True, backend="host", timeout=60, args=(), cwd=REPO):
        src = textwrap.dedent(code)
        if prelude:
            src = (PRELUDE_IMPORT.format(dir=str(HOST_SCENARIOS)) + ("core = tms._core\n" if load_core else "")
                   + src)
        # A file rather than `-c`, so a failing assert shows its source line.
        script = tmp_path / f"child_{next(counter)}.py"
        script.write_text(src)
        return subprocess.run(
            [sys.executable, str(script), *args],
            cwd=cwd,
            env=child_env(env, backend),
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    return run


class InChild:
    """The `in_child` fixture: in_child(fn, *args, env=None, backend="host", timeout=60,
    stderr_empty=True) runs fn(*args) in a fresh Python process (tests/child.py) with
    child_env(env, backend), cwd = repo root, and returns what fn returned; what fn
    raised is raised here, with the child's traceback as its cause. fn is a module-level
    function of the test's module or of a scenario module (tests/host_scenarios/). The
    child must exit 0 and (stderr_empty) write nothing to stderr. in_child.run(...)
    takes the same arguments and returns the child.Outcome (returncode, stdout, stderr,
    value or error) without judging it: for a child that is to die or to log;
    in_child.output(...) judges it as in_child() does and returns what it printed."""

    def __init__(self, tmp_path):
        self._dir = tmp_path / "children"

    def run(self, fn, *args, env=None, backend="host", timeout=60, cwd=REPO, python=None):
        return child.run(fn, args, child_env(env, backend), cwd, timeout, self._dir, python)

    def __call__(self, fn, *args, stderr_empty=True, **options):
        __tracebackhide__ = True
        return self.run(fn, *args, **options).result(stderr_empty)

    def output(self, fn, *args, stderr_empty=True, **options):
        """What fn printed (its stdout), judged as in_child() judges the child."""
        __tracebackhide__ = True
        child = self.run(fn, *args, **options)
        child.result(stderr_empty)
        return child.stdout


@pytest.fixture
def in_child(built_libs, tmp_path):
    return InChild(tmp_path)


HOST_SCENARIOS = REPO / "tests" / "host_scenarios"


@pytest.fixture
def run_scenario(built_libs):
    """run_scenario(name, *args, env=None, timeout=60, backend="host") runs
    tests/host_scenarios/<name>.py in a fresh Python process (cwd = repo root,
    PYTHONPATH = repo root, TMS_BACKEND=backend) and returns the CompletedProcess."""

    def run(name, *args, env=None, timeout=60, backend="host"):
        return subprocess.run([sys.executable, str(HOST_SCENARIOS / f"{name}.py"), *map(str, args)], cwd=REPO,
                              env=child_env(env, backend), capture_output=True, text=True, timeout=timeout)

    return run


def cc(*args):
    """Compiles with the system C compiler; fails the test with its messages."""
    proc = subprocess.run(["cc", *map(str, args)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def check_ok(proc, stderr_empty=True):
    """Asserts a child exited 0 (and wrote nothing to stderr); returns its stdout."""
    detail = f"rc={proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, detail
    if stderr_empty:
        assert proc.stderr == "", detail
    return proc.stdout


@pytest.fixture
def ok():
    return check_ok


@contextlib.contextmanager
def tree_build_lock():
    """Held around each `pip install .` / `pip wheel .` of this tree: pip builds in the
    tree's build/ folder, and two builds at once (pytest-xdist workers) can package each
    other's half-written files (a shim of 0 bytes)."""
    import fcntl

    # In the tree's build/ folder, where pip builds: every run on this tree sees it, and
    # the temporary directory holds nothing of the run after it.
    (REPO / "build").mkdir(exist_ok=True)
    with open(REPO / "build" / "tms-tree-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


@pytest.fixture(scope="session")
def installed(tmp_path_factory):
    """A site directory holding the package as `pip install .` lays it out (the
    libraries under their upstream names at its root), built from this tree."""
    site = tmp_path_factory.mktemp("site")
    with tree_build_lock():
        proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-build-isolation", "--no-deps",
                               "--no-index", "--target", str(site), str(REPO)], capture_output=True, text=True,
                              timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def installed_env(site, env=None):
    """child_env for a process that imports the installed package from `site`
    (no TMS_BACKEND unless `env` sets it)."""
    out = child_env(env, backend=None)
    out["PYTHONPATH"] = str(site)
    return out


def libcuda_present():
    """True if this machine can load a CUDA driver (then GPU-less checks do not apply)."""
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")
        return True
    except OSError:
        return False


def module_spec_origin(mode):
    spec = importlib.util.find_spec(f"torch_memory_saver._tms_{mode}")
    return spec.origin if spec else None


# ---- the run's temporary files ---------------------------------------------------------
# Everything the run puts in the temporary directory (pytest's tmp_path folders, the
# children's files, pip's builds, disk backups in the default directory) goes into
# one directory of its own, which the run removes when it ends, failed or not:
# `make test` leaves nothing behind. (--basetemp DIR keeps the tmp_path folders there.)

def _use_a_temp_dir_of_the_run(config):
    if hasattr(config, "workerinput"):
        return  # a pytest-xdist worker: the controller's TMPDIR and basetemp are already the run's
    run_dir = tempfile.mkdtemp(prefix="tms-")
    # Shared and sticky, as /tmp is: the tests that run a process as another user give it
    # a directory of its own in here. pytest's folders inside stay private (0700).
    os.chmod(run_dir, 0o1777)
    os.environ["TMPDIR"] = run_dir  # children, and pytest-xdist's workers, started from now on
    tempfile.tempdir = run_dir      # this process
    if config.option.basetemp is None:
        # A short path: messages that name a test's directory twice stay within their buffer.
        config.option.basetemp = os.path.join(run_dir, "t")
    config._tms_run_dir = run_dir


def pytest_unconfigure(config):
    import shutil

    run_dir = getattr(config, "_tms_run_dir", None)
    if run_dir:
        shutil.rmtree(run_dir, ignore_errors=True)


# ---- other users -----------------------------------------------------------------------
# A test that plays another user never touches the user database unless asked to:
#   TMS_TEST_USERS=victim,attacker   two existing accounts to act as (the suite runs as root);
#   TMS_TEST_CREATE_USERS=1          the suite may make two throwaway accounts (useradd, as
#                                    root) and removes them (userdel) when it ends.
# Elsewhere such a test skips, naming both. A case that needs only another uid's processes
# and files (no name, no home) uses `other_uids`, which needs root and nothing else.
TEST_USERS_VAR = "TMS_TEST_USERS"
CREATE_USERS_VAR = "TMS_TEST_CREATE_USERS"


@pytest.fixture(scope="session")
def two_users():
    """(victim, attacker): two accounts with homes, as pwd entries, that root acts as."""
    import pwd
    import shutil
    import uuid

    named = os.environ.get(TEST_USERS_VAR, "")
    if named:
        names = [n.strip() for n in named.split(",") if n.strip()]
        if len(names) != 2:
            pytest.fail(f"{TEST_USERS_VAR}={named!r}: name two existing accounts, victim,attacker")
        if os.geteuid() != 0:
            pytest.skip(f"acting as the users of {TEST_USERS_VAR} needs root")
        try:
            users = tuple(pwd.getpwnam(n) for n in names)
        except KeyError as e:
            pytest.fail(f"{TEST_USERS_VAR}: no account {e}")
        yield users
        return
    if os.environ.get(CREATE_USERS_VAR) != "1":
        pytest.skip(f"needs two other users: {TEST_USERS_VAR}=victim,attacker (existing accounts) or "
                    f"{CREATE_USERS_VAR}=1 (root makes two with useradd and removes them)")
    if os.geteuid() != 0:
        pytest.skip(f"{CREATE_USERS_VAR}=1 needs root (useradd)")
    if not shutil.which("useradd") or not shutil.which("userdel"):
        pytest.skip(f"{CREATE_USERS_VAR}=1: no useradd/userdel here")
    tag = uuid.uuid4().hex[:6]
    made = []
    try:
        for role in ("v", "a"):
            name = f"tms{role}{tag}"
            proc = subprocess.run(["useradd", "-m", "-U", "-s", "/bin/sh", name], capture_output=True, text=True,
                                  timeout=60)
            if proc.returncode != 0:
                pytest.skip(f"useradd is not permitted here: {proc.stderr.strip()}")
            made.append(name)
        yield tuple(pwd.getpwnam(n) for n in made)
    finally:
        for name in made:
            subprocess.run(["userdel", "-r", name], capture_output=True, timeout=60)


@pytest.fixture(scope="session")
def other_uids():
    """(victim uid, attacker uid): two uids no account of the user database has, for root
    to switch a process to (they have no name and no home)."""
    import pwd
    import random

    if os.geteuid() != 0:
        pytest.skip("acting as another uid needs root")
    free = []
    for uid in random.Random().sample(range(61000, 65000), 64):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            free.append(uid)
        if len(free) == 2:
            return tuple(free)
    pytest.skip("no free uid in 61000..65000")
