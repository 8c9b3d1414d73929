"""Live-only backups, reports of pause and resume, and disable()'s scratch memory.

On the host backend (tests/host_scenarios/live.py) the native pause takes the
free ranges a caller names, as the Python layer passes PyTorch's free blocks on
a GPU; tests/gpu_scenarios/live_only.py checks the whole path on the GPU."""
import pytest

from conftest import MiB
from host_scenarios import live


@pytest.mark.parametrize("kind", ["mmap", "pinned", "disk"])
def test_only_live_bytes_are_copied_and_restored(in_child, kind):
    in_child(live.only_live_bytes_are_copied, kind, timeout=120)


def test_a_pageable_backup_holds_only_live_bytes_in_host_memory(in_child):
    # 64 MiB of which 48 MiB are free: the device's 64 MiB go, 16 MiB of backup come (the
    # backup's own pages in memory, and the library's count; not RSS).
    assert in_child(live.host_memory_holds_only_live_bytes) == (64 * MiB, 16 * MiB, 16 * MiB, 16 * MiB)


def test_a_retained_backup_follows_the_live_ranges_of_each_pause(in_child):
    in_child(live.retained_backup_follows_the_live_ranges)


def test_pause_and_resume_return_reports(in_child):
    in_child(live.reports_of_the_public_calls)


def test_memory_report_attributes_each_device(in_child):
    in_child(live.memory_report_attributes_the_device)


@pytest.mark.parametrize("env", [None, "0", "1"])
def test_live_only_is_on_by_default_and_can_be_turned_off(in_child, env):
    in_child(live.live_only_setting, env={"TMS_BACKUP_LIVE_ONLY": env})


def test_bad_skip_ranges_are_errors_naming_them(in_child):
    in_child(live.bad_skip_arguments)
