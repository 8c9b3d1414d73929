"""Checked restores and restore modes on the host backend (tests/host_scenarios/integrity.py):
a byte changed in a host or disk backup while paused is found by the resume, which raises
and leaves the allocation paused with its backup; a backup spilled to disk and a restore onto
memory lent in a job are checked too; a write racing a pause's copy, or made through a
zero-copy view, is never trusted and the report says so; a double fault leaves no backup
overwritten; TMS_VERIFY_RESTORE; zero and poison restores, in a job too. The GPU cases are
test_gpu.py's test_scenario[integrity-*]."""
import uuid

import pytest

from host_scenarios import integrity


@pytest.mark.parametrize("kind", ["mmap", "pinned"])
def test_a_flipped_byte_in_a_host_backup_is_refused_then_restored_once_repaired(in_child, kind):
    assert in_child.output(integrity.flipped_host_backup, kind) == "done\n"


def test_a_flipped_byte_in_a_disk_backup_file_is_refused_then_restored_once_repaired(in_child, tmp_path):
    assert in_child.output(integrity.flipped_disk_backup, env={"TMS_DISK_BACKUP_DIR": tmp_path}) == "done\n"


def test_a_write_racing_the_copy_is_never_trusted_later(in_child, tmp_path):
    out = in_child.output(integrity.write_racing_the_copy, env={"TMS_HOST_COPY_GATE": tmp_path / "gate"})
    assert out == "done\n"


def test_a_double_fault_keeps_the_good_backup_for_the_next_cycle(in_child):
    # The restore's copy fails, then the unmap that would pause it again; the pause that keeps
    # the backup says so on stderr (the library's warning), naming the allocation.
    child = in_child.run(integrity.double_fault, env={"TMS_FAULT": "copy_to_device:1,unmap:2"})
    assert (child.returncode, child.stdout) == (0, "done\n"), child.stderr
    assert "held bytes not its own since a failed resume: its backup was kept" in child.stderr, child.stderr


def test_a_native_view_leaves_the_backup_untrusted_and_the_packages_copy_does_not(in_child):
    assert in_child.output(integrity.read_only_native_view) == "done\n"


def test_a_last_chunk_that_could_not_be_zeroed_is_never_trusted(in_child):
    assert in_child.output(integrity.tail_not_zeroed, env={"TMS_FAULT": "fill:3"}) == "done\n"


def test_verify_restore_off_restores_unchecked_and_says_so(in_child):
    assert in_child.output(integrity.verify_off, env={"TMS_VERIFY_RESTORE": "1"}) == "done\n"


def test_a_failed_fingerprint_records_nothing_and_says_why(in_child):
    assert in_child.output(integrity.fingerprint_fails_at_pause, env={"TMS_FAULT": "fingerprint:1"}) == "done\n"


@pytest.mark.parametrize("default", [None, "poison"])
def test_zero_and_poison_after_a_real_pause(in_child, default):
    env = {"TMS_RESTORE": default} if default else None
    assert in_child.output(integrity.restore_modes, env=env) == "done\n"


def test_a_failed_fill_leaves_the_allocation_paused(in_child):
    assert in_child.output(integrity.fill_fails, env={"TMS_FAULT": "fill:1"}) == "done\n"


def test_memory_a_receiver_may_still_map_is_never_lent_in_a_job(in_child):
    env = {"TMS_CHUNK_BYTES": "2MiB", "TMS_JOB_WAIT_MS": "5000", "TMS_JOB_HOLD_MS": "60000"}
    assert in_child.output(integrity.unconfirmed_memory_is_never_lent, env=env, timeout=120) == "done\n"


def test_a_backup_spilled_to_disk_is_checked_at_the_resume(in_child, tmp_path):
    env = {"TMS_HOST_BACKUP_LIMIT": "4MiB", "TMS_SPILL_TO_DISK": "1", "TMS_DISK_BACKUP_DIR": tmp_path,
           "TMS_HOST_BACKUP_LIMIT_NAME": f"spill-{uuid.uuid4().hex[:12]}"}
    assert in_child.output(integrity.spilled_backup_verified, env=env) == "done\n"


@pytest.mark.parametrize("value", ["0", "1"])
def test_the_verify_restore_variable_turns_checking_off_and_on(in_child, value):
    assert in_child.output(integrity.verify_from_the_environment, env={"TMS_VERIFY_RESTORE": value}) == "done\n"


def test_bytes_written_through_a_zero_copy_view_come_back_unchecked_and_said_so(in_child):
    assert in_child.output(integrity.written_through_the_packages_zero_copy_view) == "done\n"


def test_a_restore_onto_memory_lent_in_a_job_is_checked(in_child):
    env = {"TMS_CHUNK_BYTES": "2MiB", "TMS_JOB_WAIT_MS": "5000", "TMS_JOB_HOLD_MS": "60000"}
    assert in_child.output(integrity.restore_onto_lent_memory_verified, env=env, timeout=120) == "done\n"


def test_zero_and_poison_keep_another_members_bytes_out_in_a_job(in_child):
    env = {"TMS_CHUNK_BYTES": "2MiB", "TMS_JOB_WAIT_MS": "5000", "TMS_JOB_HOLD_MS": "60000"}
    assert in_child.output(integrity.zero_and_poison_over_lent_memory, env=env, timeout=120) == "done\n"
