"""The driver floor the benchmarks compare against (benchmarks/vmm_floor.c):
it builds as a program and as a library, and each either measures (on a GPU
machine) or says why it cannot (without a driver), never crashes. Each run is
a child process, so this process never initialises CUDA."""
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import floor  # noqa: E402

NO_DRIVER = ("libcuda.so.1", "cuInit", "cuDeviceGet")


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    return floor.build(str(tmp_path_factory.mktemp("floor-exe")))[0]


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    return floor.build(str(tmp_path_factory.mktemp("floor-lib")), library=True)[0]


def test_program_measures_or_names_the_missing_driver(program):
    doc = floor.run(program, ["2x2M"], cycles=3, warmup=1, timeout=120, options=("--touch",))
    if not doc["ok"]:
        assert doc["rc"] == 2
        assert any(word in doc["error"] for word in NO_DRIVER), doc["error"]
        return
    (shape,) = doc["shapes"]
    assert shape["error"] is None, shape["error"]
    assert shape["count"] == 2 and shape["touched"] == 1 and shape["cycles"] == 3
    assert len(shape["pause_s"]) == len(shape["resume_s"]) == 3
    assert all(t > 0 for t in shape["pause_s"] + shape["resume_s"])


def test_program_rejects_a_bad_shape(program):
    p = subprocess.run([program, "2y2M"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    doc = json.loads(p.stdout)
    assert doc["ok"] is False and "bad shape" in doc["error"] and "2y2M" in doc["error"]


PAIRED = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[2])
    from benchmarks import floor
    out = {}
    try:
        paired = floor.Paired(sys.argv[1], 3, 2 << 20)
    except RuntimeError as e:
        out["error"] = str(e)
    else:
        out["cycles"] = [paired.cycle(c, 1e-4 * c) for c in range(3)]
        paired.close()
        try:
            floor.Paired(sys.argv[1], 0, 2 << 20)
        except RuntimeError as e:
            out["bad_shape"] = str(e)
    print(json.dumps(out))
""")


def test_paired_cycles_or_names_the_missing_driver(library):
    p = subprocess.run([sys.executable, "-c", PAIRED, library, str(REPO_ROOT)], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout.splitlines()[-1])
    if "error" in out:
        assert out["error"].startswith("vmm_floor_hold(3, 2097152): ")
        assert any(word in out["error"] for word in NO_DRIVER), out["error"]
        return
    assert len(out["cycles"]) == 3 and all(p > 0 and r > 0 for p, r in out["cycles"])
    assert "bad shape 0 x 2097152" in out["bad_shape"]
