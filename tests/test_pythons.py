"""The one abi3 wheel on every CPython from the lowest that requires-python names
(3.10): each interpreter found on this machine (pyenv's, python3.X on PATH) imports
the wheel's package from a plain directory and runs a host-backend walk through
both variants: regions, backed-up pause/resume, get_cpu_backup's views, stats,
the public exceptions, the environment checked at import. No pytest, torch or
network needed in those interpreters."""
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import check_ok, tree_build_lock

_SMOKE = r"""
import ctypes, os, pickle, sys
import torch_memory_saver as m
assert m.__file__.startswith(os.environ["SITE"]), m.__file__
tms = m.torch_memory_saver
MiB = 1 << 20
for mode in ("preload", "torch"):
    core = __import__("torch_memory_saver._tms_" + mode, fromlist=["x"])
    assert core.__file__.endswith(".abi3.so") and core.Error is m.Error, core.__file__
    core.set_region(True, "w-" + mode, True, "mmap")
    p = core.malloc(3 * MiB + 1)
    core.set_region(False, "default", False, "mmap")
    data = os.urandom(3 * MiB + 1)
    ctypes.memmove(p, data, len(data))
    core.pause("w-" + mode)
    view = core.get_cpu_backup(p, len(data))
    assert bytes(view[5:9]) == data[5:9] and view[7] == data[7]
    try:
        core.pause("w-" + mode)
    except m.Error as e:
        assert "already paused" in str(e)
    else:
        raise AssertionError("double pause")
    core.resume("w-" + mode)
    assert ctypes.string_at(p, len(data)) == data and bytes(view) == data
    core.free(p)
with tms.region("pub", enable_cpu_backup=True):
    q = tms.malloc(MiB)
tms.pause("pub"); tms.resume("pub"); tms.free(q)
assert m.stats()[0]["pub"]["pauses"] == 1
assert type(pickle.loads(pickle.dumps(m.OutOfMemoryError("x")))) is m.OutOfMemoryError
print("ok", sys.version.split()[0])
"""


def _interpreters():
    found = {}
    roots = [Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"]
    candidates = [p / "bin" / "python3" for r in roots if r.is_dir() for p in sorted(r.iterdir())]
    candidates += [Path(w) for w in (shutil.which(f"python3.{n}") for n in range(10, 20)) if w]
    candidates.append(Path(sys.executable))
    for exe in candidates:
        if not exe.exists():
            continue
        try:
            out = subprocess.run([str(exe), "-c", "import sys; print('%d.%d' % sys.version_info[:2], "
                                  "sys.implementation.name)"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.TimeoutExpired):
            continue
        m = re.fullmatch(r"(\d+)\.(\d+) (\w+)\n", out)
        if m and m.group(3) == "cpython" and (int(m.group(1)), int(m.group(2))) >= (3, 10):
            found.setdefault(f"{m.group(1)}.{m.group(2)}", exe)
    return found


INTERPRETERS = _interpreters()


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """The wheel `pip wheel .` builds, unpacked: a site directory any interpreter can use."""
    tmp = tmp_path_factory.mktemp("pythons")
    with tree_build_lock():
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "--no-index",
                               "-w", str(tmp), str(Path(__file__).resolve().parent.parent)],
                              capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [wheel] = list(tmp.glob("*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(tmp / "site")
    return tmp / "site"


def test_every_interpreter_of_this_machine_is_covered():
    # The discovery is what makes this suite mean "every CPython >= 3.10 here":
    # the running one and each pyenv version from 3.10 on must be in it.
    print("interpreters:", {v: str(p) for v, p in sorted(INTERPRETERS.items())})
    expected = {"%d.%d" % sys.version_info[:2]}
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for d in (pyenv.iterdir() if pyenv.is_dir() else []):
        m = re.fullmatch(r"(\d+)\.(\d+)\.\d+", d.name)
        if m and (int(m.group(1)), int(m.group(2))) >= (3, 10) and (d / "bin" / "python3").exists():
            expected.add(f"{m.group(1)}.{m.group(2)}")
    assert expected <= set(INTERPRETERS), (sorted(expected), sorted(INTERPRETERS))


@pytest.mark.parametrize("version", sorted(INTERPRETERS))
def test_the_wheel_works_on(version, site, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "LD_", "PYTHON"))}
    env.update(PYTHONPATH=str(site), SITE=str(site), TMS_BACKEND="host", TMS_BACKUP_THREADS="2")
    exe = str(INTERPRETERS[version])
    out = check_ok(subprocess.run([exe, "-c", _SMOKE], cwd=tmp_path, env=env, capture_output=True, text=True,
                                  timeout=120))
    assert out.startswith(f"ok {version}."), out
    bad = subprocess.run([exe, "-c", "import torch_memory_saver"], cwd=tmp_path, capture_output=True, text=True,
                         env=dict(env, TMS_CHUNK_BYTES="lots"), timeout=120)
    assert bad.returncode == 1 and "ValueError: torch_memory_saver: TMS_CHUNK_BYTES='lots'" in bad.stderr, bad.stderr
