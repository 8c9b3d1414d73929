"""Group pause and resume (torch_memory_saver.distributed) across host-backend
processes joined by gloo (tests/host_scenarios/distributed.py forks the ranks):
every rank's report comes back in rank order; a fault on one rank rolls every
rank back and raises the same GroupError on each; a staged resume is all or
nothing; bad arguments raise before any collective."""
import importlib.util

import pytest

from conftest import check_ok

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (gloo)")

WORLD = 4


def lines(out):
    """A scenario's stdout as each rank's lines, in rank order (the ranks print at once)."""
    by_rank = {}
    for line in out.splitlines():
        by_rank.setdefault(int(line.split(":")[0].removeprefix("rank ")), []).append(line)
    return [by_rank[r] for r in sorted(by_rank)]


def every_rank(*lines_of_rank, world=WORLD):
    return [[line.format(r=r) for line in lines_of_rank] for r in range(world)]


def run_ranks(run_scenario, case, *args, world=WORLD, faults=None, dies=None):
    flags = ["--world", world] + (["--dies", dies] if dies is not None else [])
    for rank, spec in (faults or {}).items():
        flags += ["--fault", f"{rank}={spec}"]
    return lines(check_ok(run_scenario("distributed", case, *args, *flags, timeout=50)))


def test_every_rank_pauses_and_resumes_with_every_report(run_scenario):
    assert run_ranks(run_scenario, "pause_and_resume") == every_rank("rank {r}: 4 reports each way, bytes exact")


# A fault on one rank, and what the ranks undo. A failed backup copy unmaps
# nothing; a failed unmap (the 2nd of two allocations) leaves the other paused on
# the failing rank, which resumes it as the others resume theirs.
@pytest.mark.parametrize("fault,undone", [
    ("copy_to_host:1", "ranks 0, 1, 3 resumed what they had paused"),
    ("unmap:2", "ranks 0, 1, 2, 3 resumed what they had paused"),
], ids=["copy_to_host", "unmap"])
def test_a_pause_fault_on_one_rank_rolls_every_rank_back(run_scenario, fault, undone):
    out = run_ranks(run_scenario, "pause_fault", 2, faults={2: fault})
    assert out == every_rank("rank {r}: " + undone, "rank {r}: rolled back, then paused and resumed")


# Rank 2's backup copy fails; rank 0's undo (a resume) fails at its first restore copy.
def test_a_failed_undo_is_in_every_rank_s_error(run_scenario):
    out = run_ranks(run_scenario, "undo_fault", 2, 0, faults={2: "copy_to_host:1", 0: "copy_to_device:1"})
    assert out == every_rank("rank {r}: the failed undo named; resumed on its own")


# The 2nd restore copy (of two allocations, one block each) fails: the failing
# rank has resumed one allocation, and pauses it again as the others do theirs.
def test_a_resume_fault_on_one_rank_leaves_every_rank_paused(run_scenario):
    out = run_ranks(run_scenario, "resume_fault", 1, faults={1: "copy_to_device:2"})
    assert out == every_rank("rank {r}: ranks 0, 1, 2, 3 paused again what they had resumed",
                             "rank {r}: paused again, then resumed")


# Restore copies, one block per allocation, two allocations per tag: the first
# staged resume makes copies 1-4, the second 5-6 (w) and 7-8 (kv): the 8th fails.
def test_a_staged_resume_is_all_or_nothing(run_scenario):
    out = run_ranks(run_scenario, "staged_resume", 3, faults={3: "copy_to_device:8"})
    assert out == every_rank("rank {r}: ranks 0, 1, 2, 3 paused again what they had resumed",
                             "rank {r}: both stages paused again, then resumed")


def test_bad_arguments_raise_before_any_collective(run_scenario):
    out = run_ranks(run_scenario, "bad_arguments", world=2)
    assert out == every_rank("rank {r}: raised before any collective", world=2)


# A rank killed before the call or inside its own pause: the others raise a
# GroupError of a broken group that names it and says what they keep paused.
@pytest.mark.parametrize("when", ["call", "pause"])
def test_a_rank_lost_mid_call_is_named_on_every_survivor(run_scenario, when):
    out = run_ranks(run_scenario, "rank_dies", 2, when, dies=2)
    want = every_rank("rank {r}: rank 2 lost at the " + when + ": named, nothing undone")
    assert out == want[:2] + want[3:]
