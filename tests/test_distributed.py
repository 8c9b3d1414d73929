"""Group pause and resume (torch_memory_saver.distributed) across host-backend
processes joined by gloo (tests/host_scenarios/distributed.py): every rank's
report comes back in rank order; a fault on one rank rolls every rank back and
raises the same GroupError on each; a staged resume is all or nothing; bad
arguments raise before any collective."""
import importlib.util
import socket
import subprocess
import sys
import time

import pytest

from conftest import HOST_SCENARIOS, REPO, check_ok, child_env

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (gloo)")

WORLD = 4


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def run_ranks(built_libs, tmp_path):
    """run_ranks(case, *args, world=4, faults={rank: TMS_FAULT}, timeout=45) starts
    one process per rank of host_scenarios/distributed.py <case> on a fresh port,
    and returns each rank's stdout once all exited 0. A rank that fails stops the
    others at once (they would wait for it until the group's timeout)."""

    def run(case, *args, world=WORLD, faults=None, timeout=45):
        port, procs, logs = free_port(), [], []
        for rank in range(world):
            env = child_env({"RANK": rank, "WORLD_SIZE": world, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
                             "TMS_FAULT": (faults or {}).get(rank)})
            out, err = tmp_path / f"{case}.{rank}.out", tmp_path / f"{case}.{rank}.err"
            logs.append((out, err))
            with open(out, "w") as o, open(err, "w") as e:
                procs.append(subprocess.Popen([sys.executable, str(HOST_SCENARIOS / "distributed.py"), case,
                                               *map(str, args)], cwd=REPO, env=env, stdout=o, stderr=e))
        deadline, why = time.monotonic() + timeout, None
        try:
            while any(p.poll() is None for p in procs):
                if any(p.returncode not in (None, 0) for p in procs):
                    why = "a rank failed"
                    break
                if time.monotonic() > deadline:
                    why = f"timed out after {timeout} s"
                    break
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                p.wait()
        done = [subprocess.CompletedProcess(p.args, p.returncode, o.read_text(), e.read_text())
                for p, (o, e) in zip(procs, logs)]
        if why:
            pytest.fail(f"{why}:\n" + "\n".join(f"=== rank {r}: rc={d.returncode}\n{d.stdout}{d.stderr}"
                                                   for r, d in enumerate(done)))
        return [check_ok(d) for d in done]

    return run


def test_every_rank_pauses_and_resumes_with_every_report(run_ranks):
    outs = run_ranks("pause_and_resume")
    assert outs == [f"rank {r}: 4 reports each way, bytes exact\n" for r in range(WORLD)]


# A fault on one rank, and what the others (and that rank) undo. A failed backup
# copy unmaps nothing; a failed unmap (the 2nd of two allocations) leaves the other
# paused on the failing rank, which resumes it too.
@pytest.mark.parametrize("fault,undone", [
    ("copy_to_host:1", "ranks 0, 1, 3 resumed what they had paused"),
    ("unmap:2", "ranks 0, 1, 2, 3 resumed what they had paused"),
])
def test_a_pause_fault_on_one_rank_rolls_every_rank_back(run_ranks, fault, undone):
    outs = run_ranks("pause_fault", 2, faults={2: fault})
    assert outs == [f"rank {r}: {undone}\nrank {r}: rolled back, then paused and resumed\n" for r in range(WORLD)]


# The 2nd restore copy (of two allocations, one block each) fails: the failing
# rank has resumed one allocation, and pauses it again with the others.
def test_a_resume_fault_on_one_rank_leaves_every_rank_paused(run_ranks):
    outs = run_ranks("resume_fault", 1, faults={1: "copy_to_device:2"})
    undone = "ranks 0, 1, 2, 3 paused again what they had resumed"
    assert outs == [f"rank {r}: {undone}\nrank {r}: paused again, then resumed\n" for r in range(WORLD)]


# Restore copies, one block per allocation, two allocations per tag: the first
# staged resume makes copies 1-4, the second 5-6 (w) and 7-8 (kv): the 8th fails.
def test_a_staged_resume_is_all_or_nothing(run_ranks):
    outs = run_ranks("staged_resume", 3, faults={3: "copy_to_device:8"})
    undone = "ranks 0, 1, 2, 3 paused again what they had resumed"
    assert outs == [f"rank {r}: {undone}\nrank {r}: both stages paused again, then resumed\n" for r in range(WORLD)]


def test_bad_arguments_raise_before_any_collective(run_ranks):
    outs = run_ranks("bad_arguments", world=2, timeout=40)
    assert outs == [f"rank {r}: raised before any collective\n" for r in range(2)]
