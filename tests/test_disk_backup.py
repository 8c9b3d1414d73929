"""Disk backup on the host backend: files, their lifecycle and owners,
failures with every byte kept, the page cache left alone, environment and API. The
cases are functions of tests/host_scenarios/disk_backup.py, each run in a fresh process."""
import os
import subprocess
import sys

import pytest

from conftest import HOST_SCENARIOS, HOOK_MODES, MiB, child_env
from host_scenarios import disk_backup


@pytest.fixture
def run_disk(in_child, tmp_path):
    """run_disk(case, *args, env=None, mode="torch", directory=None, timeout=60, stderr_empty=True)
    runs case(directory, mode, *args) of tests/host_scenarios/disk_backup.py in a fresh process
    (the backup directory defaults to tmp_path/backups) and returns what it returned."""

    def run(case, *args, env=None, mode="torch", directory=None, timeout=60, stderr_empty=True):
        __tracebackhide__ = True
        d = str(directory or tmp_path / "backups")
        return in_child(case, d, mode, *args, env=env, timeout=timeout, stderr_empty=stderr_empty)

    run.outcome = lambda case, *args, env=None, mode="torch", directory=None: in_child.run(
        case, str(directory or tmp_path / "backups"), mode, *args, env=env)
    return run


def _bins(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".bin")) if os.path.isdir(d) else []


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_file_per_allocation_rewritten_in_place_and_bit_exact(run_disk, tmp_path, mode):
    # 1 MiB blocks: the 5 MiB + 12345 allocation moves in six blocks with an odd tail.
    run_disk(disk_backup.file_per_allocation, mode=mode, env={"TMS_DISK_BACKUP_CHUNK_MB": "1"})
    assert os.listdir(tmp_path / "backups") == []                          # nothing left at exit, lock included


def test_many_allocations_under_a_low_descriptor_limit(run_disk):
    # A file is open only while a pause or resume moves it, at most 64 at once: 300
    # disk-backed allocations cycle with RLIMIT_NOFILE 100 above what the process
    # holds (on the host backend each active allocation holds a memfd itself).
    run_disk(disk_backup.low_descriptor_limit, env={"TMS_HOST_DEVICE_BYTES": "2GiB"})


def test_free_removes_the_file_paused_or_active(run_disk):
    run_disk(disk_backup.free_removes_the_file)


def test_page_cache_and_host_memory_stay_flat(run_disk):
    # 96 MiB backed up: the file's pages must not stay in the page cache (the library
    # drops them as it writes), the device's bytes go, and no host backup holds them.
    n = 96 * MiB
    cached, released, backups, host_held = run_disk(disk_backup.page_cache_and_host_memory_flat, n)
    assert cached <= 8 * MiB, f"{cached} bytes of the backup cached"
    assert (released, backups, host_held) == (n, {"pinned": 0, "mmap": 0, "disk": n}, 0)


def _owner(d):
    """A process that backs up to d, then waits for a line: the Popen, once it is paused."""
    p = subprocess.Popen([sys.executable, str(HOST_SCENARIOS / "disk_backup.py"), "hold", str(d), "torch"],
                         env=child_env(), stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "paused\n"
    return p


def test_files_of_a_killed_process_are_removed_by_the_next(run_disk, tmp_path):
    d = tmp_path / "shared"
    killed = _owner(d)
    alive = _owner(d)
    killed.kill()                                                     # SIGKILL: no exit handler runs
    killed.wait()
    names = sorted(os.listdir(d))
    assert len(_bins(d)) == 2 and sum(n.endswith(".lock") for n in names) == 2, names
    (d / "tms-999999-00000000deadbeef-00000000000000aa.bin").write_bytes(b"x")  # no lock: not proof of death
    (d / "unrelated.bin").write_bytes(b"y")                                     # not ours: never touched
    left = run_disk(disk_backup.listing, directory=d)
    killed_prefix = f"tms-{killed.pid}-"
    alive_prefix = f"tms-{alive.pid}-"
    assert not any(n.startswith(killed_prefix) for n in left), left           # the dead owner's files went
    assert sum(n.startswith(alive_prefix) for n in left) == 2, left           # the live owner's stay
    assert "unrelated.bin" in left and "tms-999999-00000000deadbeef-00000000000000aa.bin" in left, left
    alive.stdin.write("\n")
    alive.stdin.flush()
    assert alive.stdout.readline() == "resumed\n"
    assert alive.wait(timeout=30) == 0
    assert sorted(os.listdir(d)) == ["tms-999999-00000000deadbeef-00000000000000aa.bin", "unrelated.bin"]


def test_write_error_keeps_every_allocation_active_and_removes_partial_files(run_disk):
    run_disk(disk_backup.write_error, env={"TMS_FAULT": "disk_write:3", "TMS_DISK_BACKUP_CHUNK_MB": "1"})


def test_write_error_on_a_rewrite_drops_the_stale_file(run_disk):
    # The second pause rewrites the files in place; a failure then must not leave
    # a half-old, half-new file that a later resume could read.
    run_disk(disk_backup.write_error_on_a_rewrite, env={"TMS_FAULT": "disk_write:6", "TMS_DISK_BACKUP_CHUNK_MB": "1"})


def test_read_error_leaves_the_allocation_paused_with_its_file_and_a_retry_resumes(run_disk):
    run_disk(disk_backup.read_error, env={"TMS_FAULT": "disk_read:2", "TMS_DISK_BACKUP_CHUNK_MB": "1"})


def test_short_writes_are_continued(run_disk):
    run_disk(disk_backup.short_writes, env={"TMS_FAULT": "disk_short_write:1,disk_short_write:1",
                                            "TMS_DISK_BACKUP_CHUNK_MB": "2"})


def test_disk_full_raises_and_keeps_every_byte(run_disk):
    # A file size limit stands in for a full disk: the 8 MiB file cannot be made.
    run_disk(disk_backup.disk_full)


def test_disk_full_during_the_writes_on_tmpfs(run_disk, tmp_path):
    # On tmpfs no space is reserved up front: the limit is hit by a write midway.
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    d = f"/dev/shm/tms-test-{os.getpid()}-{tmp_path.name}"
    try:
        child = run_disk.outcome(disk_backup.disk_full_midway, directory=d, env={"TMS_DISK_BACKUP_CHUNK_MB": "1"})
        child.result(stderr_empty=False)
        assert "is on a tmpfs" in child.stderr and d in child.stderr, child.stderr   # the warning line
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def test_environment_defaults(run_disk, tmp_path):
    d = tmp_path / "from-env"
    run_disk(disk_backup.environment, env={"TMS_DISK_BACKUP_DIR": d, "TMS_INIT_ENABLE_DISK_BACKUP": "1",
                                           "TMS_DISK_BACKUP_CHUNK_MB": "3"})
    assert run_disk(disk_backup.default_dir, env={"TMPDIR": str(tmp_path)}) == str(tmp_path)
    assert run_disk(disk_backup.default_dir, env={"TMPDIR": None}) == "/tmp"


@pytest.mark.parametrize("source", ["TMS_DISK_BACKUP_DIR", "TMPDIR"])
@pytest.mark.parametrize("kind", ["writable by all", "a file", "under a file"])
def test_an_unusable_directory_is_a_disk_backup_dir_error_whatever_names_it(run_disk, tmp_path, source, kind):
    target = tmp_path / "d"
    if kind == "writable by all":
        target.mkdir()
        target.chmod(0o777)
        said = f"disk backup directory {target} is not safe"
    elif kind == "a file":
        target.write_text("")
        said = f"opening directory {target} failed: Not a directory"
    else:
        (tmp_path / "f").write_text("")
        target = tmp_path / "f" / "d"
        said = f"creating directory {target} failed: Not a directory"
    env = {"TMS_DISK_BACKUP_DIR": None, source: target}
    out = run_disk(disk_backup.unusable_dir_from_the_environment, env=env)
    assert out.startswith("torch_memory_saver: ") and said in out, out


@pytest.mark.parametrize("var,value", [
    ("TMS_DISK_BACKUP_CHUNK_MB", "0"), ("TMS_DISK_BACKUP_CHUNK_MB", "256MiB"), ("TMS_DISK_BACKUP_CHUNK_MB", "5000"),
    ("TMS_INIT_ENABLE_DISK_BACKUP", "on"),
])
def test_malformed_environment_is_a_value_error_at_import(run_py, var, value):
    proc = run_py("import torch_memory_saver", prelude=False, env={var: value})
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr and f"{var}='{value}'" in proc.stderr, proc.stderr


def test_api_shapes_and_errors(run_disk, tmp_path):
    d = tmp_path / "a" / "b" / "c"
    run_disk(disk_backup.api, str(d))


def test_forked_child_never_removes_or_rewrites_the_parents_files(run_disk):
    # After a fork the parent's next pause writes a new file instead of rewriting
    # the one the child may still read: the child's resume then gives the bytes of
    # the fork, or (the old file removed by the parent) raises, never the parent's
    # newer bytes. The child's free does not remove the parent's file.
    run_disk(disk_backup.forked_child)
