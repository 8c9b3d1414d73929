"""The benchmarks as one tool: `python -m benchmarks <suite> --dry-run` runs every
suite end to end on the host backend (no GPU), and every suite's report comes
from the one writer: the same header (device, date, commit, command line), the
same naming (<suite>_<device>[-<variant>].{md,json}) and an index of the folder."""
import os
import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from benchmarks import report, switch  # noqa: E402

# Each suite's dry run as documented: `python -m benchmarks <suite> --dry-run`.
DRY_RUNS = ["run", "multi_gpu", "alloc_count", "speed", "switch"]
# What each dry run measured, beyond the plumbing: the rows its report names.
CHECKS = {
    "run": lambda d: (sorted(d["backup"]) == ["mmap", "mmap_retained", "pinned", "pinned_retained"]
                      and all(b.get("all_verified") for b in d["backup"].values())
                      and [len(d["latency"][m]["shapes"]) for m in ("torch", "preload")] == [3, 3]
                      and all(e["freed_ok"] and e["same_addresses"] for m in ("torch", "preload")
                              for e in d["latency"][m]["shapes"])
                      and sorted(d["disk"]) == ["disk", "tmpfs"] and all(r["files_ok"] for r in d["disk"].values())
                      and d["limits"]["pinned_d2h_gbps"] > 0 and d["errors"] == []
                      and [s["where"] for s in d["skipped"]] == ["paired floor"]),
    "multi_gpu": lambda d: ([(r["config"], r["exit_codes"], len(r["cycles"])) for r in d["rows"]]
                            == [("mmap", [0, 0], 3), ("pinned", [0, 0], 3), ("mmap_retained", [0, 0], 3)]
                            and all(c["verified"] for r in d["rows"] for c in r["cycles"])
                            and all(f"limit_{k}" in d for k in ("fill", "copy", "d2h", "h2d"))),
    "alloc_count": lambda d: ([p["allocations"] for p in d["points"]] == [1, 10, 100]
                              and all(len(p["pause"]) == 8 and len(p["lookup_s"]) == 3 for p in d["points"])),
    "speed": lambda d: ([(w["mode"], w["init"], w["exit_code"], sorted(w["sections"]), w["errors"])
                         for w in d["workers"]]
                        == [(m, False, 0, ["alloc", "first_region", "integrity", "kinds", "latency", "model", "retained",
                                           "skip"], {}) for m in ("torch", "preload")]
                        and all(len(w["first_regions"]) == 1 and all(len(w["sections"]["alloc"][k]) == 3
                                                                     for k in ("backed", "region", "plain"))
                                for w in d["workers"])
                        and d["workers"][0]["sections"]["model"]["tensors"] == 24
                        and all(w["sections"]["retained"]["exact"] and w["sections"]["model"]["exact"]
                                and w["sections"]["skip"]["exact"] and w["sections"]["integrity"]["exact"]
                                and w["sections"]["integrity"]["on"]["verified"] == [w["sections"]["integrity"]["bytes"]] * 3
                                and w["sections"]["integrity"]["off"]["verified"] == [0] * 3
                                and [r[1] for r in w["sections"]["skip"]["unchanged"]] == [0] * 3
                                and all(r[1] == w["sections"]["skip"]["bytes"] for r in w["sections"]["skip"]["all changed"])
                                for w in d["workers"])),
    "switch": lambda d: (list(d["switch"]) == ["ours"] and not d["switch"]["ours"]["errors"]
                         and [c["kind"] for c in d["switch"]["ours"]["cycles"]] == ["warm", "after", "nogap", "idle"]
                         and all(c["refresh_exact"] and c["trainer_exact"] and c["switch_s"] > 0
                                 and sorted(c["phases"]) == sorted(switch.PHASES)
                                 for c in d["switch"]["ours"]["cycles"] if c["kind"] != "nogap")
                         and all(c["trainer_exact"] and sorted(c["phases"]) == ["kv_resume", "rollout_pause",
                                                                                "trainer_pause"]
                                 and all("s" in p for p in c["phases"].values())
                                 for c in d["switch"]["ours"]["cycles"] if c["kind"] == "nogap")
                         and [(r["who"], r["when"]) for r in d["wait"]["rows"]]
                         == [("library", "after"), ("library", "idle")] * 2 and not d["wait"]["errors"]),
}
STEMS = {"run": "run_host-backend-dry-run", "multi_gpu": "multi_gpu_host-backend-dry-run-2procs-on-1",
         "alloc_count": "alloc_count_host-backend-dry-run", "speed": "speed_host-backend-dry-run",
         "switch": "switch_host-backend-dry-run"}


def _bench(*args, timeout=240, tmpdir=None):
    # The run's private runtime directory (conftest.py): the budget's ledger goes there.
    env = {"TMS_BACKEND": "host", "PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": os.environ["XDG_RUNTIME_DIR"]}
    if tmpdir is not None:
        env["TMPDIR"] = str(tmpdir)
    return subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def _header(text):
    rows = [line for line in text.splitlines()[:10] if line.startswith("| ")]
    return {c[0]: c[1] for c in ([x.strip() for x in r.strip("|").split("|")] for r in rows)}


@pytest.mark.parametrize("suite", DRY_RUNS)
def test_each_suite_dry_run_writes_its_report_through_the_one_writer(suite, tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    proc = _bench(suite, "--dry-run", "--out", str(tmp_path), tmpdir=scratch)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert not any(scratch.iterdir()), f"the {suite} suite left {sorted(p.name for p in scratch.iterdir())} behind"
    stem = STEMS[suite]
    doc = json.loads((tmp_path / f"{stem}.json").read_text())
    meta = doc["meta"]
    assert meta["suite"] == suite and meta["dry_run"] is True
    assert meta["command"] == f"python -m benchmarks {suite} --dry-run --out {tmp_path}"
    assert meta["git_commit"] and meta["date"].endswith("Z")
    assert CHECKS[suite](doc), json.dumps(doc)[-3000:]
    text = (tmp_path / f"{stem}.md").read_text()
    assert text.startswith("# ") and "DRY RUN" in text.splitlines()[0]
    head = _header(text)
    assert head["device"] == "host backend (dry run)" and head["date (UTC)"] == meta["date"]
    assert head["commit"].startswith(f"`{meta['git_commit']}`") and head["command"] == f"`{meta['command']}`"
    index = (tmp_path / "README.md").read_text()
    assert f"[{stem}.md]({stem}.md)" in index and f"| `{suite}` |" in index


def _results_state():
    """What a run could change in the tracked results folder: git's view of it and each file's size and time."""
    status = subprocess.run(["git", "status", "--porcelain", "--", "benchmarks", "build/bench-dry-run"], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=60).stdout
    files = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in (REPO_ROOT / "benchmarks" / "results").iterdir()}
    return status, files


@pytest.mark.parametrize("suite", DRY_RUNS)
def test_each_suite_without_a_gpu_says_why_in_one_line_and_writes_nothing(suite, tmp_path):
    # CUDA_VISIBLE_DEVICES="" hides every GPU from the driver, so this holds on a GPU machine too.
    before = _results_state()
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "", "TMPDIR": str(tmp_path),
           "XDG_RUNTIME_DIR": os.environ["XDG_RUNTIME_DIR"]}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", suite], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert proc.stderr.startswith(f"python -m benchmarks {suite}: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert "nothing is written" in proc.stderr and "--dry-run" in proc.stderr, proc.stderr
    assert _results_state() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_alias_entry_points_still_run(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.alloc_count", "--dry-run", "--counts", "2", "--cycles",
                           "2", "--warmup", "1", "--out", str(tmp_path)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120, env={"TMS_BACKEND": "host", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    doc = json.loads((tmp_path / "alloc_count_host-backend-dry-run.json").read_text())
    assert [p["allocations"] for p in doc["points"]] == [2]


def test_usage_lists_the_suites_and_unknown_ones_are_refused():
    proc = _bench(timeout=60)
    assert proc.returncode == 2
    for suite in report.SUITES:
        assert f"  {suite} " in proc.stdout
    proc = _bench("nope", timeout=60)
    assert proc.returncode == 2 and "unknown suite 'nope'" in proc.stderr
    proc = _bench("multi-gpu", "--help", timeout=60)
    assert proc.returncode == 0 and "python -m benchmarks multi_gpu" in proc.stdout


def test_a_failing_plot_costs_no_figures_and_the_index_lists_each_report(tmp_path):
    meta = {"suite": "alloc_count", "device_name": "Made-up GPU 80GB", "date": "2026-11-25T00:00:00Z",
            "git_commit": "0123456789abcdef", "command": "python -m benchmarks alloc_count"}

    def broken_plots(out, stem):
        raise RuntimeError("no display")

    def plots(out, stem):
        (Path(out) / f"{stem}.png").write_bytes(b"png")
        return {"plot": f"{stem}.png"}

    stem = report.name(meta, "beside5")
    assert stem == "alloc_count_Made-up-GPU-80GB-beside5"
    doc = {"meta": meta, "points": [1, 2]}
    md = report.write(str(tmp_path), stem, doc, "Title", lambda images: f"body {sorted(images)}\n", broken_plots)
    assert Path(md).read_text().endswith("body []\n")
    saved = json.loads((tmp_path / f"{stem}.json").read_text())
    assert saved["points"] == [1, 2] and saved["errors"][0]["error"] == "RuntimeError: no display"

    other = dict(meta, suite="speed")
    report.write(str(tmp_path), report.name(other), {"meta": other}, "Title", lambda images: "", plots)
    index = (tmp_path / "README.md").read_text()
    assert ("| `alloc_count` | Made-up GPU 80GB (beside5) | 2026-11-25T00:00:00Z | `0123456789ab` | "
            f"[{stem}.md]({stem}.md) | - |") in index
    assert ("[speed_Made-up-GPU-80GB.md](speed_Made-up-GPU-80GB.md) | "
            "[plot](speed_Made-up-GPU-80GB.png) |") in index


def test_benchmarks_use_the_public_api_but_for_the_interior_lookup():
    """tms._core only where no public call does the same: the timed
    allocation_at() of alloc_count."""
    uses = [(p.name, line.strip()) for p in sorted((REPO_ROOT / "benchmarks").glob("*.py"))
            for line in p.read_text().splitlines() if "._core" in line]
    assert uses == [("alloc_count.py", "at = env.tms._core.allocation_at")], uses


def test_every_suite_shares_the_command_line_and_the_writer():
    """Each suite's parser comes from common.parser (--out, --dry-run) and its
    report from report.write, and no module is left that no suite imports."""
    import ast

    modules = {p.stem: p.read_text() for p in (REPO_ROOT / "benchmarks").glob("*.py")}
    for suite in report.SUITES:
        assert f'parser("{suite}", __doc__' in modules[suite], suite
        assert "report.publish(" in modules[suite] or "report.write(" in modules[suite], suite
    imported = set()
    for text in modules.values():
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                imported |= {node.module} if node.module else {a.name for a in node.names}
    helpers = set(modules) - set(report.SUITES) - {"__init__", "__main__", "worker"}
    assert helpers <= imported, sorted(helpers - imported)


def test_benchmarks_stay_within_their_line_budget():
    files = [p for p in (REPO_ROOT / "benchmarks").iterdir() if p.is_file() and p.suffix in (".py", ".c")]
    assert sum(len(p.read_text().splitlines()) for p in files) <= 4600


def test_a_new_report_takes_the_plots_of_the_one_it_replaces(tmp_path):
    meta = {"suite": "speed", "device_name": "Made-up GPU", "date": "2026-11-25T00:00:00Z", "command": "-"}

    def plots(out, stem):
        (Path(out) / f"{stem}-a.png").write_bytes(b"png")
        return {"a": f"{stem}-a.png"}

    report.write(str(tmp_path), "speed_Made-up-GPU", {"meta": meta}, "Title", lambda images: "", plots)
    (tmp_path / "speed_Made-up-GPU-other.png").write_bytes(b"png")  # another report's, of a variant
    report.write(str(tmp_path), "speed_Made-up-GPU", {"meta": meta}, "Title", lambda images: "")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["README.md", "speed_Made-up-GPU-other.png",
                                                          "speed_Made-up-GPU.json", "speed_Made-up-GPU.md"]
