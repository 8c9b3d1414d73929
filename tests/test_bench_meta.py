"""The commit a benchmark report names: the tree's own git, or TMS_BENCH_COMMIT
where the tree was copied beside stale git metadata (a copied checkout)."""
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import report  # noqa: E402


def test_named_commit_wins_and_dirtiness_is_unknown(monkeypatch):
    monkeypatch.setenv("TMS_BENCH_COMMIT", "aeb8818")
    assert report.git_commit() == ("aeb8818", None)


def test_without_a_name_the_tree_git_head_is_reported(monkeypatch):
    monkeypatch.delenv("TMS_BENCH_COMMIT", raising=False)
    head = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    commit, dirty = report.git_commit()
    if head.returncode != 0:  # a tree without git metadata (an sdist)
        assert commit == "unknown"
        return
    assert commit == head.stdout.strip()
    assert dirty in (True, False)
