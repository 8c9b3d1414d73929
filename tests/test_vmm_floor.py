"""The driver floor the benchmarks compare against (benchmarks/vmm_floor.c):
it builds as a program and as a library, and each either measures (on a GPU
machine) or says why it cannot (without a driver), never crashes. Each run is
a child process, so this process never initialises CUDA."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import floor  # noqa: E402

NO_DRIVER = ("libcuda.so.1", "cuInit", "cuDeviceGet")


def _build(tmp_path_factory, library):
    try:
        return floor.build(str(tmp_path_factory.mktemp("floor")), library=library)[0]
    except RuntimeError as e:  # no C compiler with cuda.h here
        pytest.skip(str(e)[:200])


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    return _build(tmp_path_factory, library=False)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return _build(tmp_path_factory, library=True)


def test_program_measures_or_names_the_missing_driver(program):
    doc = floor.run(program, ["2x2M"], cycles=3, warmup=1, timeout=120,
                    options=("--touch", "--idle-us", "50", "--margin", "0"))
    if not doc["ok"]:
        assert doc["rc"] == 2
        assert any(word in doc["error"] for word in NO_DRIVER), doc["error"]
        return
    (shape,) = doc["shapes"]
    assert shape["error"] is None, shape["error"]
    assert shape["count"] == 2 and shape["touched"] == 1 and shape["idle_us"] == 50 and shape["cycles"] == 3
    assert len(shape["pause_s"]) == len(shape["resume_s"]) == 3
    assert all(t > 0 for t in shape["pause_s"] + shape["resume_s"])


@pytest.mark.parametrize("args, message", [(["2y2M"], "bad shape (want COUNTxSIZE): 2y2M"),
                                           (["--idle-us", "x", "1x2M"], "bad --idle-us: x")])
def test_program_rejects_bad_arguments(program, args, message):
    p = subprocess.run([program, *args], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    doc = json.loads(p.stdout)
    assert doc == {"ok": False, "error": message}


def paired_cycles(library):
    """floor.Paired of a bad shape, then three cycles of a good one (or the error that
    stopped it), in a child: this process never initialises CUDA."""
    out = {}
    try:
        floor.Paired(library, 0, 2 << 20)
    except RuntimeError as e:
        out["bad_shape"] = str(e)
    try:
        paired = floor.Paired(library, 3, 2 << 20)
    except RuntimeError as e:
        out["error"] = str(e)
    else:
        out["cycles"] = [paired.cycle(c, 1e-4 * c) for c in range(3)]
        paired.close()
    return out


def test_paired_cycles_or_names_the_missing_driver(in_child, library):
    # What the floor returns is judged, not what a driver may say on stderr.
    out = in_child(paired_cycles, library, backend=None, timeout=120, stderr_empty=False)
    assert out["bad_shape"] == "vmm_floor_hold(0, 2097152): bad shape 0 x 2097152"
    if "error" in out:
        assert out["error"].startswith("vmm_floor_hold(3, 2097152): ")
        assert any(word in out["error"] for word in NO_DRIVER), out["error"]
        return
    assert len(out["cycles"]) == 3 and all(pause > 0 and resume > 0 for pause, resume in out["cycles"])
