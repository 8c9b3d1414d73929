"""Concurrency: no lost allocation, no deadlock, no data race.

- ThreadSanitizer: the C tests built with CMake -DTMS_SANITIZE=thread; the
  `threads` scenario of test_core_host (workers allocating, freeing, pausing and
  resuming their own tags while the main thread cycles a backed-up tag) and the
  plain fuzz driver (the copy workers under every backup size). Skipped where
  the compiler or the kernel cannot run ThreadSanitizer.
- A Python-level stress on the host backend (tests/host_scenarios/concurrency.py):
  threads in different regions and tags allocate and free while others pause/resume
  other tags with backups (contents checked every cycle), read the table and
  the statistics with the GIL held, and toggle retain. A watchdog ends a hung
  child with every thread's stack; the parent's timeout is the backstop.
"""

import pytest

import cbuild
from host_scenarios import concurrency

# ---- ThreadSanitizer ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tsan_build(tmp_path_factory):
    cbuild.skip_unless_sanitizer_runs("thread", tmp_path_factory.mktemp("tsan"))
    return cbuild.cmake_build("thread")  # its test_reloc_race is test_reloc.py's


TSAN_ENV = {"TSAN_OPTIONS": "halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0"}


def test_threads_scenarios_under_thread_sanitizer(tsan_build):
    # A quarter of the work the plain and ASan builds do under ctest: ThreadSanitizer
    # reports a race from one pair of accesses that nothing orders, whether or not they
    # happen to overlap, so ten of the threads scenario's forty rounds show what forty
    # do; and as every access costs it tenfold, a pause of 64 MiB still moves for
    # seconds while nowait's other calls run (256 MiB, under half a second, in the plain build).
    proc = cbuild.run([tsan_build / "test_core_host", "threads", "nowait", "--threads-rounds", "10", "--nowait-mib", "64"],
                      timeout=300, env=cbuild.tool_env(**TSAN_ENV))
    assert proc.returncode == 0, cbuild.detail(proc)
    assert "ok   threads" in proc.stdout and "ok   nowait" in proc.stdout, cbuild.detail(proc)
    assert " 0 failed" in proc.stdout, cbuild.detail(proc)
    assert "ThreadSanitizer" not in proc.stderr, cbuild.detail(proc)


def test_copy_workers_under_thread_sanitizer(tsan_build):
    proc = cbuild.run([tsan_build / "fuzz_core", "--runs", "5", "--seed", "4"], timeout=300,
                      env=cbuild.tool_env(TMS_BACKUP_THREADS=3, TMS_CHUNK_BYTES="4MiB", **TSAN_ENV))
    assert proc.returncode == 0, cbuild.detail(proc)
    assert "5 passed, 0 failed" in proc.stdout, cbuild.detail(proc)
    assert "ThreadSanitizer" not in proc.stderr, cbuild.detail(proc)


# ---- Python-level stress on the host backend -----------------------------------------


def test_threads_allocate_while_others_pause_and_resume(in_child):
    # A watchdog of 60 s, 60 iterations per allocator, 12 pause cycles.
    in_child(concurrency.stress, 60, 60, 12, timeout=120, env={"TMS_BACKUP_THREADS": "3"})


# ---- nothing waits for a pause in progress -------------------------------


def test_nothing_waits_for_a_backed_up_pause_in_progress(in_child, tmp_path):
    in_child(concurrency.nothing_waits_for_a_pause, timeout=120, env={"TMS_HOST_COPY_GATE": tmp_path / "gate"})


def test_fork_during_a_pause_gives_a_child_that_works(in_child):
    in_child(concurrency.fork_during_a_pause, timeout=120, env={"TMS_BACKUP_THREADS": "1"})
