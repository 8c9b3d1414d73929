"""benchmarks/results holds the latest report of each suite on each device, their
plots, and README.md, the index of them that benchmarks/report.py writes; variants
and one run's experiments belong in git history, not in the folder."""
import collections
import json
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import report  # noqa: E402


def test_few_files_each_part_of_a_suite_report():
    files = sorted(p.name for p in RESULTS.iterdir())
    assert len(files) <= 30, files
    stems = [f[:-len(".json")] for f in files if f.endswith(".json")]
    assert all(any(s.startswith(suite + "_") for suite in report.SUITES) for s in stems), stems
    for f in files:
        assert f == "README.md" or any(f.startswith(s + ".") or f.startswith(s + "-") for s in stems), f
    for s in stems:
        assert f"{s}.md" in files, s


def test_one_report_per_suite_and_device():
    """A device is the GPU model and how many of them the run used (the processes of
    multi_gpu --share-gpu share one)."""
    reports = collections.defaultdict(list)
    for path in sorted(RESULTS.glob("*.json")):
        doc = json.loads(path.read_text())
        meta = doc.get("meta") or doc  # reports written before the one writer kept it at the top level
        suite = next(s for s in report.SUITES if path.name.startswith(s + "_"))
        gpus = 1 if doc.get("share_gpu") else doc.get("gpus", 1)
        reports[(suite, meta.get("device_name") or meta.get("device"), gpus)].append(path.name)
    assert all(len(names) == 1 for names in reports.values()), dict(reports)


def test_index_is_current(tmp_path):
    copy = tmp_path / "results"
    shutil.copytree(RESULTS, copy)
    report.write_index(str(copy))
    assert (copy / "README.md").read_text() == (RESULTS / "README.md").read_text()
