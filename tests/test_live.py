"""Live-only backups, reports of pause and resume, and disable()'s scratch memory.

On the host backend (tests/host_scenarios/live.py) the native pause takes the
free ranges a caller names, as the Python layer passes PyTorch's free blocks on
a GPU; tests/gpu_scenarios/live_only.py checks the whole path on the GPU."""
import pytest

from conftest import check_ok


@pytest.mark.parametrize("kind", ["mmap", "pinned", "disk"])
def test_only_live_bytes_are_copied_and_restored(run_scenario, kind):
    assert check_ok(run_scenario("live", "only_live_bytes_are_copied", kind, timeout=120)) == "done\n"


def test_a_pageable_backup_holds_only_live_bytes_in_rss(run_scenario):
    assert check_ok(run_scenario("live", "rss_holds_only_live_bytes")) == "done\n"


def test_a_retained_backup_follows_the_live_ranges_of_each_pause(run_scenario):
    assert check_ok(run_scenario("live", "retained_backup_follows_the_live_ranges")) == "done\n"


def test_pause_and_resume_return_reports(run_scenario):
    assert check_ok(run_scenario("live", "reports_of_the_public_calls")) == "done\n"


def test_memory_report_attributes_each_device(run_scenario):
    assert check_ok(run_scenario("live", "memory_report_attributes_the_device")) == "done\n"


@pytest.mark.parametrize("env", [None, "0", "1"])
def test_live_only_is_on_by_default_and_can_be_turned_off(run_scenario, env):
    assert check_ok(run_scenario("live", "live_only_setting", env={"TMS_BACKUP_LIVE_ONLY": env})) == "done\n"


def test_bad_skip_ranges_are_errors_naming_them(run_scenario):
    assert check_ok(run_scenario("live", "bad_skip_arguments")) == "done\n"
