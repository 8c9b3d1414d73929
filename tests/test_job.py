"""Lending within a job (TMS_JOB / torch_memory_saver.job) on the host backend: member
processes keep what the others will ask for, a resume maps another member's chunks
(restored byte-exact for a backed-up tag), outsiders get nothing, killed and stopped
members leave no chunk behind and hold nobody up, another user can neither take the
job's names nor flood its sockets, this user's flood of a member's share socket leaves its
job socket answering, and a forged lend is refused (tests/host_scenarios/
job.py). The GPU case is test_gpu.py's test_job_lends_between_two_processes."""
import importlib.util
import uuid

import pytest

from conftest import check_ok
from host_scenarios import job

# Each case waits at most a few seconds for what a member's thread does on its own.
TIMEOUT = 120


@pytest.mark.parametrize("case", ["lend_and_reuse", "shared_on_memory_is_never_lent_again", "own_memory_back", "a_larger_handle_is_not_lent", "many_pieces", "a_forked_child_keeps_no_lent_descriptor", "descriptors_kept_within_a_quarter_of_the_limit",
                                  "kept_memory_gives_way", "kept_memory_expires", "stuck_member", "forged_requests", "without_a_job",
                                  "stopped_members_cost_one_wait", "bad_lends"])
def test_members_lend_and_outsiders_get_nothing(run_scenario, case):
    assert check_ok(run_scenario("job", case, timeout=TIMEOUT)) == "done\n"


@pytest.mark.parametrize("step", ["kept", "lent", "returned"])
def test_a_killed_lender_leaves_no_chunk_behind(run_scenario, step):
    assert check_ok(run_scenario("job", "lender_killed", step, timeout=TIMEOUT)) == "done\n"


@pytest.mark.parametrize("step", ["asking", "lent", "returned"])
def test_a_killed_borrower_gives_every_chunk_back(run_scenario, step):
    assert check_ok(run_scenario("job", "borrower_killed", step, timeout=TIMEOUT)) == "done\n"


def test_another_users_process_gets_nothing(run_scenario, other_uids):
    _, attacker = other_uids
    assert check_ok(run_scenario("job", "forged_requests", attacker, attacker, timeout=TIMEOUT)) == "done\n"


def test_another_users_names_do_not_stop_the_job(run_scenario, other_uids):
    # 200 names taken before the job starts: the members still find each other, and only them.
    _, attacker = other_uids
    assert check_ok(run_scenario("job", "squatted_names", attacker, attacker, timeout=TIMEOUT)) == "done\n"


def test_another_users_flood_does_not_stop_lending(run_scenario, other_uids):
    # Its connects reach no socket of the member: every resume borrows all it needs.
    _, attacker = other_uids
    assert check_ok(run_scenario("job", "flooded_members", attacker, attacker, timeout=TIMEOUT)) == "done\n"


def test_a_flood_of_a_members_share_socket_leaves_its_job_socket_answering(run_scenario):
    # Another listener of the same process, flooded by this user: every resume still borrows.
    assert check_ok(run_scenario("job", "share_socket_flooded", timeout=TIMEOUT)) == "done\n"


def test_idle_connections_of_one_listener_leave_the_other_room_at_a_low_limit(run_scenario):
    # The smallest cap on kept connections (RLIMIT_NOFILE 64): idle ones of the share socket
    # cannot take the places the job socket needs.
    assert check_ok(run_scenario("job", "idle_connections_of_the_share_socket_leave_the_job_socket_room",
                                 timeout=TIMEOUT)) == "done\n"


def test_the_job_setting(in_child):
    in_child(job.job_setting, env={"TMS_JOB": "from-env"})


def test_a_job_name_takes_no_character_the_variable_refuses(in_child):
    in_child(job.job_name_refused)


def test_a_malformed_job_variable_is_named_at_import(run_py):
    for var, value in (("TMS_JOB", "a b"), ("TMS_JOB_HOLD_MS", "2s"), ("TMS_JOB_WAIT_MS", "-1")):
        proc = run_py("import torch_memory_saver", prelude=False, env={var: value})
        assert proc.returncode == 1 and f"{var}='{value}'" in proc.stderr, proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch (gloo)")
def test_a_group_pause_in_a_job(run_scenario):
    # Four ranks on one device, all in one job, and a fault in the last rank's second resume.
    proc = run_scenario("job_group", "lend_in_a_group", 3, "--world", 4, "--fault", "3=copy_to_device:3", timeout=90,
                        env={"TMS_JOB": f"group-{uuid.uuid4().hex[:12]}", "TMS_JOB_WAIT_MS": "5000",
                             "TMS_JOB_HOLD_MS": "60000"})
    assert sorted(check_ok(proc).splitlines()) == [f"rank {r}: kept, mapped again, rolled back, bytes exact"
                                                   for r in range(4)]


def test_the_budget_in_a_job(run_scenario, tmp_path):
    assert check_ok(run_scenario("job", "budget_in_a_job", env={"TMS_DISK_BACKUP_DIR": tmp_path},
                                 timeout=TIMEOUT)) == "done\n"
