"""benchmarks/results holds the latest report per suite and device, their
plots, and README.md, the index of them that benchmarks/report.py writes; one
run's experiment notes belong in git history, not in the folder."""
import shutil
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import report  # noqa: E402


def test_few_files_each_part_of_a_suite_report():
    files = sorted(p.name for p in RESULTS.iterdir())
    # A report per suite and device (json, md and a plot or a few) for each of the
    # suites on two or three devices: more than this is experiments piling up.
    assert len(files) <= 6 * len(report.SUITES), files
    stems = [f[:-len(".json")] for f in files if f.endswith(".json")]
    assert all(any(s.startswith(suite + "_") for suite in report.SUITES) for s in stems), stems
    for f in files:
        assert f == "README.md" or any(f.startswith(s + ".") or f.startswith(s + "-") for s in stems), f
    for s in stems:
        assert f"{s}.md" in files, s


def test_index_is_current(tmp_path):
    copy = tmp_path / "results"
    shutil.copytree(RESULTS, copy)
    report.write_index(str(copy))
    assert (copy / "README.md").read_text() == (RESULTS / "README.md").read_text()
