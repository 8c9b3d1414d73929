"""`python -m benchmarks run` on a machine without a GPU: what cannot run here is a skip
and a missing plotting library a note, neither an error; an error exits non-zero."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import libcuda_present

REPO = Path(__file__).resolve().parent.parent
STEM = "run_host-backend-dry-run"


def _run(out, *only, env=None):
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "run", "--dry-run", "--only", ",".join(only),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "TMPDIR": str(out), **(env or {})})
    return proc, json.loads((out / f"{STEM}.json").read_text())


@pytest.mark.skipif(libcuda_present(), reason="a CUDA driver is here: the driver floor runs")
def test_no_gpu_is_a_skip_and_no_matplotlib_a_note(tmp_path):
    proc, doc = _run(tmp_path, "floor")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert doc["errors"] == [], doc["errors"]
    assert [s["where"] for s in doc["skipped"]] == ["floor"] and "no CUDA driver" in doc["skipped"][0]["why"]
    plots = [n["note"] for n in doc["notes"] if n["where"] == "report/plots"]
    assert plots == ([] if importlib.util.find_spec("matplotlib") else
                     ["no plots: matplotlib is not installed (pip install matplotlib)"]), doc["notes"]
    text = (tmp_path / f"{STEM}.md").read_text()
    assert "## Skipped" in text and "## Errors" not in text
    assert "0 errors, 1 skipped" in proc.stdout


def test_an_error_exits_non_zero_with_the_report_written(tmp_path):
    # The first disk write of the disk section fails; the limits section still measured.
    proc, doc = _run(tmp_path, "limits", "disk:tmpfs", env={"TMS_FAULT": "disk_write:1"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [e["where"] for e in doc["errors"]] == ["disk:tmpfs/disk:tmpfs"], doc["errors"]
    assert doc["limits"] and "error" not in doc["limits"]
