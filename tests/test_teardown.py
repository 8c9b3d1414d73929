"""Interpreter exit (teardown) on the host backend, in both hook variants:
the process exits with its own status and writes nothing to stderr, whatever
is live at exit.

test_host_backend.py already exits with active, paused, pinned/mmap-backed,
retained and chunked allocations and a live backup view. Here, what it leaves
out: threads still inside regions (allocating, blocked, or finishing during
interpreter shutdown), a backed-up pause or resume in flight on another thread
(copy workers busy) at exit, atexit handlers that pause/resume/free, torch
tensors over allocations and over host backups (zero-copy) at exit, an uncaught
exception with paused allocations, and a forked child that exits normally. The
programs are tests/host_scenarios/teardown.py.
"""
import pytest

from conftest import HOOK_MODES


def _exits_cleanly(proc, stdout="bye\n"):
    detail = f"rc={proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, detail
    assert proc.stderr == "", detail
    assert proc.stdout == stdout, detail


@pytest.mark.parametrize("env", [{}, {"TMS_RETAIN_CPU_BACKUP": "1", "TMS_CHUNK_BYTES": "4MiB"}],
                         ids=["plain", "retain-chunked"])
@pytest.mark.parametrize("mode", HOOK_MODES)
def test_exit_with_threads_in_regions_and_a_pause_in_flight(run_scenario, mode, env):
    _exits_cleanly(run_scenario("teardown", "threads_in_regions", mode, env={"TMS_BACKUP_THREADS": "3", **env}))


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_exit_with_torch_tensors_and_atexit_handlers(run_scenario, mode):
    # torch's own atexit handlers; tensors over device memory and over host
    # backups (zero-copy) freed during finalization; a user atexit handler
    # driving the core while the interpreter shuts down.
    proc = run_scenario("teardown", "torch_tensors_and_atexit", mode)
    _exits_cleanly(proc, stdout="bye\ncleaned\n")


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_uncaught_exception_with_paused_allocations_prints_only_the_traceback(run_scenario, mode):
    proc = run_scenario("teardown", "uncaught_exception", mode)
    assert proc.returncode == 1, proc
    assert proc.stdout == ""
    assert proc.stderr.startswith("Traceback (most recent call last):"), proc.stderr
    assert proc.stderr.endswith("RuntimeError: boom\n") and proc.stderr.count("Traceback") == 1, proc.stderr


def test_forked_child_exits_normally_with_paused_backups(run_scenario):
    # The parent's copy workers do not exist in the child; the child pauses
    # with backups (its own pool), then leaves through normal interpreter exit
    # (not os._exit) with everything still paused.
    proc = run_scenario("teardown", "forked_child")
    _exits_cleanly(proc)
