"""Sharing pauseable memory with other processes, on the host backend: the handle
protocol between two processes (tests/host_scenarios/share.py), every byte checked,
with receivers that close, die, fork, outlive their sender or run as another user,
and handles forged or replayed. The GPU paths (torch.multiprocessing, both hook
modes) are in test_gpu.py."""
import pytest

from conftest import check_ok
from test_budget import two_users  # noqa: F401  (a fixture)


@pytest.mark.parametrize("case", ["round_trip", "sender_exits_first"])
def test_share_between_two_processes(run_scenario, case):
    assert check_ok(run_scenario("share", case)) == "done\n"


def test_memory_made_without_exportable_handles_says_so(run_scenario):
    assert check_ok(run_scenario("share", "not_shareable", env={"TMS_SHAREABLE": "0"})) == "done\n"


def test_another_users_process_gets_nothing(run_scenario, two_users, tmp_path):  # noqa: F811
    _, attacker = two_users
    proc = run_scenario("share", "other_user", attacker.pw_uid, attacker.pw_gid)
    assert check_ok(proc) == "done\n"
