# Tests the native module too: warm_backups, get_cpu_backup on raw pointers, set_region (raw_region).
"""Interpreter exit on the host backend, in both hook variants (tests/test_teardown.py):
each case leaves something live or in flight at exit (threads in regions, a pause on
another thread, tensors over allocations and backups, atexit handlers, an uncaught
exception, a forked child); the test checks the exit status and that stderr is empty."""
import atexit
import ctypes
import os
import sys
import threading
import warnings

from _prelude import MiB, core, fill, raw_region, run_cases, start, tms

AT_EXIT = []  # what must still be alive when the interpreter exits


def threads_in_regions(mode):
    """Threads pausing and resuming backed-up tags, allocating, blocked inside a region, and
    one (not a daemon) that allocates and pauses once the interpreter has begun to exit."""
    tms.hook_mode = mode
    native = core()
    native.warm_backups()              # what region(enable_cpu_backup=True) does first
    N = 16 * MiB
    with raw_region("busy-pinned", True, "pinned"):   # the thread settings region() sets on the host backend
        bp = [tms.malloc(N + i) for i in range(2)]
    with raw_region("busy-mmap", True, "mmap"):
        bm = [tms.malloc(N + 7 * i) for i in range(2)]
    for p in bp + bm:
        ctypes.memset(p, 0x5A, N)
    cycles, started, never, in_call = [0], threading.Event(), threading.Event(), [False]

    def pauser():                      # backed-up pause/resume in flight at exit
        while True:
            in_call[0] = True
            tms.pause("busy-pinned")
            tms.pause("busy-mmap")
            tms.resume()
            in_call[0] = False
            cycles[0] += 1
            if cycles[0] >= 2:
                started.set()

    def allocator():                   # allocating and freeing inside a region at exit
        with raw_region("churn", True, "mmap"):
            mine = []
            while True:
                mine.append(tms.malloc(3 * MiB))
                if len(mine) > 3:
                    tms.free(mine.pop(0))

    def blocked():                     # inside a region, holding memory, waiting forever
        with raw_region("blocked", True, "pinned"):
            p = tms.malloc(5 * MiB)
            fill(p, 5 * MiB)
            tms.pause("blocked")
            never.wait()

    def late():                        # not a daemon: runs on while the interpreter shuts down
        if not started.wait(60):
            return
        # The main thread counts as finished once the interpreter begins to exit
        # (threading's shutdown, which then waits for this thread).
        threading.main_thread().join()
        with raw_region("late", True, "mmap"):
            q = tms.malloc(4 * MiB)
            fill(q, 4 * MiB)
            tms.pause("late")

    for f in (pauser, allocator, blocked):
        threading.Thread(target=f, daemon=True).start()
    threading.Thread(target=late).start()
    assert started.wait(60), "the pauser never completed two cycles"
    print("bye")


def torch_tensors_and_atexit(mode):
    """torch's own atexit handlers; tensors over device memory and over host backups
    (zero-copy) freed during finalization; a user atexit handler driving the core while
    the interpreter shuts down (prints "cleaned")."""
    import torch

    tms.hook_mode = mode
    start()
    n = 6 * MiB + 3
    with tms.region("w", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        p = tms.malloc(n)
    with tms.region("kv"):
        q = tms.malloc(n)
    with tms.region("x", enable_cpu_backup=True):
        tms.malloc(n)
    w = torch.frombuffer((ctypes.c_uint8 * n).from_address(p), dtype=torch.uint8)   # a tensor over p
    w.copy_(torch.arange(n, dtype=torch.int64).to(torch.uint8))
    tms.retain_cpu_backup = True
    tms.pause("w")
    alias = tms.get_cpu_backup(w, zero_copy=True)                    # aliases the host backup
    clone = tms.get_cpu_backup(w)
    assert torch.equal(alias, clone) and int(alias[n - 1]) == (n - 1) % 256
    AT_EXIT.extend([w, alias, clone])
    tms.resume("w")
    tms.pause("w")                                                   # paused at exit, w not touched
    tms.pause("kv")

    def at_exit():                                                   # frameworks clean up at exit
        tms.resume("w")
        assert torch.equal(w, clone)
        tms.pause("w")
        tms.resume("kv")
        tms.free(q)
        tms.pause("x")
        print("cleaned", flush=True)

    atexit.register(at_exit)
    print("bye")


def uncaught_exception(mode):
    """Raises RuntimeError("boom") inside a region, with paused allocations."""
    tms.hook_mode = mode
    start()
    with raw_region("w", True, "pinned"):
        p = tms.malloc(9 * MiB)
    with raw_region("kv"):
        tms.malloc(9 * MiB)
    fill(p, 9 * MiB)
    tms.pause()
    with raw_region("inside"):
        tms.malloc(MiB)
        raise RuntimeError("boom")


def forked_child():
    """The parent's copy workers do not exist in the child; the child pauses with backups
    (its own pool), then leaves through normal interpreter exit (not os._exit) with
    everything still paused."""
    warnings.simplefilter("ignore", DeprecationWarning)
    native = core()
    with raw_region("w", True, "pinned"):
        p = tms.malloc(12 * MiB)
    with raw_region("m", True, "mmap"):
        tms.malloc(12 * MiB)
    d = fill(p, 12 * MiB)
    tms.pause()
    tms.resume()                                       # the parent's pool is started
    pid = os.fork()
    if pid == 0:
        with raw_region("c", True, "mmap"):
            tms.malloc(5 * MiB)
        tms.pause()
        assert bytes(native.get_cpu_backup(p, 12 * MiB)) == d
        sys.exit(0)                                    # atexit, finalization, exit
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    tms.pause()
    print("bye")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
