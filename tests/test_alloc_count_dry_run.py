"""benchmarks.alloc_count end to end on the host backend (--dry-run, no GPU,
no floor): --beside keeps that many allocations of another tag live while the
measured tag is timed, and the report says so; each count's tensors are
looked up by an address inside them (allocation_at), and the report shows it."""
import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_beside_allocations_live_in_another_tag(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "alloc_count", "--dry-run", "--counts", "1,3",
                           "--beside", "5", "--cycles", "2", "--warmup", "1", "--out", str(tmp_path)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (report,) = tmp_path.glob("alloc_count_*-beside5.json")
    r = json.loads(report.read_text())
    assert r["beside"] == 5
    assert [p["allocations"] for p in r["points"]] == [1, 3]  # the other tag's are not counted
    assert all(len(p["pause"]) == 2 and len(p["resume"]) == 2 for p in r["points"])
    assert [p["tensors"] for p in r["points"]] == [1, 3]
    # Three timed lookups per count; how long they take is the benchmark's figure, not a
    # bound for a test on a machine others load.
    assert all(len(p["lookup_s"]) == 3 and all(t > 0 for t in p["lookup_s"]) for p in r["points"])
    text = report.with_suffix(".md").read_text()
    assert "5 allocations of another tag live beside the measured one" in text
    assert "| 3 | 3 | " in text  # the lookup table's row for 3 allocations
