"""`make test-gpu` spreads the GPU tests over the GPUs, PER_GPU pytest-xdist workers per
GPU (tests/gpus.py): checked here without a GPU, on GPU ids that need not exist."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

import gpus
from conftest import REPO


def test_the_gpu_list_is_parsed_strictly():
    assert gpus.parse("") == [] and gpus.parse(None) == []
    assert gpus.parse("0,1") == ["0", "1"] and gpus.parse(" 3 , 1") == ["3", "1"]
    assert gpus.parse("GPU-8f0e,GPU-1a2b") == ["GPU-8f0e", "GPU-1a2b"]
    for bad in ("0,,1", "0,0", ",", "1,"):
        with pytest.raises(ValueError, match="TMS_TEST_GPUS"):
            gpus.parse(bad)


def test_each_worker_has_a_gpu_of_its_own():
    assert [gpus.worker_gpu(["4", "6", "7"], f"gw{i}", 3) for i in range(3)] == ["4", "6", "7"]
    assert gpus.worker_gpu(["0", "1"], "gw0", 1) == "0"          # fewer workers than GPUs: the first ones
    with pytest.raises(ValueError, match="3 pytest-xdist workers for 2 GPUs"):
        gpus.worker_gpu(["0", "1"], "gw2", 3)
    with pytest.raises(ValueError, match="has no GPU"):
        gpus.worker_gpu(["0", "1"], "master", 2)


def test_workers_per_gpu_take_the_gpus_in_turn():
    assert [gpus.worker_gpu(["4", "6"], f"gw{i}", 5, 3) for i in range(5)] == ["4", "6", "4", "6", "4"]
    with pytest.raises(ValueError, match=r"7 pytest-xdist workers for 2 GPUs .* 3 per GPU .*-n 6"):
        gpus.worker_gpu(["0", "1"], "gw0", 7, 3)
    assert gpus.per_gpu(None) == 1 and gpus.per_gpu("") == 1 and gpus.per_gpu("4") == 4
    for bad in ("0", "-1", "x", "17", "2.5"):
        with pytest.raises(ValueError, match="TMS_TEST_PER_GPU"):
            gpus.per_gpu(bad)


# A run of this generated module: each test writes down where it ran and which GPUs it saw.
_TESTS = """
    import json, os, pytest

    def record(name):
        with open(os.environ["RECORD"], "a") as f:
            f.write(json.dumps([name, os.environ.get("PYTEST_XDIST_WORKER"),
                                os.environ.get("CUDA_VISIBLE_DEVICES")]) + "\\n")

    @pytest.mark.gpu
    @pytest.mark.parametrize("i", range(8))
    def test_one_gpu(i):
        record(f"one_gpu[{i}]")

    @pytest.mark.gpu
    @pytest.mark.two_gpus
    def test_two_gpus():
        record("two_gpus")

    @pytest.mark.gpu
    @pytest.mark.whole_gpu
    def test_whole_gpu():
        record("whole_gpu")
"""


def _run(tmp_path, *args, gpu_list, per_gpu=None):
    tests = tmp_path / "test_spread.py"
    tests.write_text(textwrap.dedent(_TESTS))
    record = tmp_path / "record.jsonl"
    record.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TMS_", "CUDA_"))}
    env.update(RECORD=str(record), TMS_TEST_GPUS=gpu_list, PYTHONPATH=str(REPO / "tests"))
    if per_gpu:
        env["TMS_TEST_PER_GPU"] = per_gpu
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "gpus", "-p", "no:cacheprovider",
                           "-rs", *args, str(tests)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    rows = [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []
    return proc, rows


@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="pytest-xdist is not installed")
def test_two_workers_run_on_two_gpus_and_the_pair_tests_alone(tmp_path):
    proc, rows = _run(tmp_path, "-n", "2", "--dist", "loadgroup", gpu_list="5,7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(name for name, _, _ in rows) == [f"one_gpu[{i}]" for i in range(8)] + ["whole_gpu"], rows
    assert {(worker, gpu) for _, worker, gpu in rows} == {("gw0", "5"), ("gw1", "7")}, rows   # each on its own
    assert "has GPU 5 alone" in proc.stdout or "has GPU 7 alone" in proc.stdout, proc.stdout  # two_gpus: skipped

    # The second step: no workers, every GPU of the list visible.
    proc, rows = _run(tmp_path, "-m", "two_gpus", gpu_list="5,7")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert rows == [["two_gpus", None, "5,7"]], rows

    proc, _ = _run(tmp_path, "-n", "3", gpu_list="5,7")
    assert proc.returncode != 0 and "run at most -n 2" in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("xdist") is None, reason="pytest-xdist is not installed")
def test_workers_sharing_a_gpu_leave_the_whole_gpu_tests_to_the_second_step(tmp_path):
    proc, rows = _run(tmp_path, "-n", "4", "--dist", "loadgroup", gpu_list="5,7", per_gpu="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(name for name, _, _ in rows) == [f"one_gpu[{i}]" for i in range(8)], rows
    assert {(w, gpu) for _, w, gpu in rows} <= {("gw0", "5"), ("gw1", "7"), ("gw2", "5"), ("gw3", "7")}, rows
    assert "reads GPU 5's free memory" in proc.stdout or "reads GPU 7's free memory" in proc.stdout, proc.stdout

    proc, rows = _run(tmp_path, "-m", "two_gpus or whole_gpu", gpu_list="5,7", per_gpu="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(rows) == [["two_gpus", None, "5,7"], ["whole_gpu", None, "5,7"]], rows

    proc, _ = _run(tmp_path, "-n", "5", gpu_list="5,7", per_gpu="2")
    assert proc.returncode != 0 and "run at most -n 4" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
