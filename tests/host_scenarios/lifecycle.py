# Tests the native module too: which variant and backend loaded, get_cpu_backup views at exit.
"""Both hook variants on the host backend, exit with live allocations, and a backed-up
pause in a forked child (tests/test_host_backend.py)."""
import os
import sys
import time
import warnings

import torch_memory_saver
from _prelude import MiB, core, expect, fill, read, run_cases, states, tms

AT_EXIT = []  # what must still be alive when the interpreter exits


def variant(mode):
    """hook_mode `mode` loads that variant only, on the host backend, and pauses and resumes."""
    tms.hook_mode = mode
    native = core()
    assert native.__name__ == f"torch_memory_saver._tms_{mode}" and native.VARIANT == mode
    assert native.backend() == "host"
    other = "torch_memory_saver._tms_" + ("torch" if mode == "preload" else "preload")
    assert other not in sys.modules, "two cores in one process"
    n = 3 * MiB + 1
    with tms.region("h", enable_cpu_backup=True):
        p = tms.malloc(n)
    with tms.region("k"):
        q = tms.malloc(MiB)
    d = fill(p, n)
    tms.pause()
    assert states() == [("h", "paused"), ("k", "paused")]
    tms.resume()
    assert read(p, n) == d
    tms.pause("h")
    expect(torch_memory_saver.Error, tms.pause, "h", match="'h'")
    tms.resume("h")
    assert read(p, n) == d
    tms.free(p)
    tms.free(q)
    assert tms.allocations() == []
    print("done")


def exit_with_live_allocations(mode):
    """Exits with active, paused (none, pinned, mmap backups) and resumed allocations and a
    live backup view: the test checks the exit status and that stderr is empty."""
    tms.hook_mode = mode
    native = core()
    with tms.region("active"):
        a = tms.malloc(9 * MiB)
    with tms.region("discard"):
        b = tms.malloc(9 * MiB)
    with tms.region("pinned", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        c = tms.malloc(9 * MiB)
    with tms.region("mmap", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        d = tms.malloc(9 * MiB)
    with tms.region("resumed", enable_cpu_backup=True):
        e = tms.malloc(9 * MiB)
    for p in (a, b, c, d, e):
        fill(p, 9 * MiB)
    for tag in ("discard", "pinned", "mmap", "resumed"):
        tms.pause(tag)
    tms.resume("resumed")
    AT_EXIT.append(native.get_cpu_backup(c, 100))     # a live backup view at exit
    assert states() == [("active", "active"), ("discard", "paused"), ("mmap", "paused"),
                        ("pinned", "paused"), ("resumed", "active")], states()
    print("bye")


def backed_up_pause_in_a_forked_child():
    """The parent starts the copy workers; a forked child then pauses and resumes with backups."""
    n = 20 * MiB
    with tms.region("w", enable_cpu_backup=True):
        p = tms.malloc(n)
    d = fill(p, n)
    tms.pause("w")
    tms.resume("w")
    warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12 warns on fork with threads
    pid = os.fork()
    if pid == 0:
        try:
            with tms.region("c", enable_cpu_backup=True):
                q = tms.malloc(n)
            e = fill(q, n)
            for _ in range(3):
                tms.pause()
                tms.resume()
            os._exit(0 if read(q, n) == e and read(p, n) == d else 1)
        except BaseException:
            os._exit(2)
    deadline = time.monotonic() + 60  # a hang, not a slow machine
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)                               # paces the poll
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        raise AssertionError("the forked child hung in a backed-up pause/resume")
    assert os.waitstatus_to_exitcode(status) == 0, status
    tms.pause()
    tms.resume()                                       # the parent's pool still works
    assert read(p, n) == d
    print("done")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
