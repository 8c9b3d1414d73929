"""`python -m benchmarks run` on a machine without a GPU: what cannot run here (the
paired driver floor) is a skip, not an error; an error exits non-zero with the report
written, and the other steps still measured."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STEM = "run_host-backend-dry-run"


def _run(out, *only, env=None):
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "run", "--dry-run", "--only", ",".join(only),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "TMPDIR": str(out), **(env or {})})
    return proc, json.loads((out / f"{STEM}.json").read_text())


def test_no_driver_floor_is_a_skip(tmp_path):
    proc, doc = _run(tmp_path, "limits")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert doc["errors"] == [], doc["errors"]
    assert [s["where"] for s in doc["skipped"]] == ["paired floor"], doc["skipped"]
    assert doc["limits"]["pinned_h2d_gbps"] > 0 and list(doc["workers"]) == ["limits"]
    text = (tmp_path / f"{STEM}.md").read_text()
    assert "## Skipped" in text and "## Errors" not in text
    assert "0 errors, 1 skipped" in proc.stdout


def test_an_error_exits_non_zero_with_the_report_written(tmp_path):
    # The first disk write of the disk section fails; the limits section still measured.
    proc, doc = _run(tmp_path, "limits", "disk:tmpfs", env={"TMS_FAULT": "disk_write:1"})
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert [e["where"] for e in doc["errors"]] == ["disk:tmpfs"], doc["errors"]
    assert doc["limits"] and "error" not in doc["limits"]
    assert "## Errors and failed checks" in (tmp_path / f"{STEM}.md").read_text()
