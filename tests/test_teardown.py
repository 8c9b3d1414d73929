"""Interpreter exit (issue 5: teardown) on the host backend, in both hook variants:
the process exits with its own status and writes nothing to stderr, whatever
is live at exit.

test_host_backend.py already exits with active, paused, pinned/mmap-backed,
retained and chunked allocations and a live backup view. Here, what it leaves
out: threads still inside regions (allocating, blocked, or finishing during
interpreter shutdown), a backed-up pause or resume in flight on another thread
(copy workers busy) at exit, atexit handlers that pause/resume/free, torch
tensors over allocations and over host backups (zero-copy) at exit, an uncaught
exception with paused allocations, and a forked child that exits normally.
"""
import textwrap

import pytest

from conftest import HOOK_MODES


def _exits_cleanly(proc, stdout="bye\n"):
    detail = f"rc={proc.returncode}\n--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
    assert proc.returncode == 0, detail
    assert proc.stderr == "", detail
    assert proc.stdout == stdout, detail


_THREADS_AT_EXIT = """
    import time
    tms.hook_mode = MODE
    core = tms._core
    core.warm_backups()                # what region(enable_cpu_backup=True) does first
    N = 16 * MiB
    with raw_region("busy-pinned", True, "pinned"):   # the thread settings region() sets on the host backend
        bp = [core.malloc(N + i) for i in range(2)]
    with raw_region("busy-mmap", True, "mmap"):
        bm = [core.malloc(N + 7 * i) for i in range(2)]
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
                mine.append(core.malloc(3 * MiB))
                if len(mine) > 3:
                    core.free(mine.pop(0))

    def blocked():                     # inside a region, holding memory, waiting forever
        with raw_region("blocked", True, "pinned"):
            p = core.malloc(5 * MiB)
            fill(p, 5 * MiB)
            tms.pause("blocked")
            never.wait()

    def late():                        # not a daemon: runs on while the interpreter shuts down
        if not started.wait(60):
            return
        time.sleep(0.05)
        with raw_region("late", True, "mmap"):
            q = core.malloc(4 * MiB)
            fill(q, 4 * MiB)
            tms.pause("late")

    for f in (pauser, allocator, blocked):
        threading.Thread(target=f, daemon=True).start()
    threading.Thread(target=late).start()
    assert started.wait(60), "the pauser never completed two cycles"
    print("bye")
"""


@pytest.mark.parametrize("env", [{}, {"TMS_RETAIN_CPU_BACKUP": "1", "TMS_CHUNK_BYTES": "4MiB"}],
                         ids=["plain", "retain-chunked"])
@pytest.mark.parametrize("mode", HOOK_MODES)
def test_exit_with_threads_in_regions_and_a_pause_in_flight(run_py, mode, env):
    code = textwrap.dedent(_THREADS_AT_EXIT).replace("MODE", repr(mode))
    _exits_cleanly(run_py(code, load_core=False, env={"TMS_BACKUP_THREADS": "3", **env}))


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_exit_with_torch_tensors_and_atexit_handlers(run_py, mode):
    # torch's own atexit handlers; tensors over device memory and over host
    # backups (zero-copy) freed during finalization; a user atexit handler
    # driving the core while the interpreter shuts down.
    proc = run_py(f"""
        import atexit
        import torch
        tms.hook_mode = {mode!r}
        core = tms._core
        n = 6 * MiB + 3
        with tms.region("w", enable_cpu_backup=True, cpu_backup_backend="pinned"):
            p = core.malloc(n)
        with tms.region("kv"):
            q = core.malloc(n)
        with tms.region("x", enable_cpu_backup=True):
            r = core.malloc(n)
        w = torch.frombuffer((ctypes.c_uint8 * n).from_address(p), dtype=torch.uint8)   # a tensor over p
        w.copy_(torch.arange(n, dtype=torch.int64).to(torch.uint8))
        tms.retain_cpu_backup = True
        tms.pause("w")
        alias = tms.get_cpu_backup(w, zero_copy=True)                    # aliases the host backup
        clone = tms.get_cpu_backup(w)
        assert torch.equal(alias, clone) and int(alias[n - 1]) == (n - 1) % 256
        tms.resume("w")
        tms.pause("w")                                                   # paused at exit, w not touched
        tms.pause("kv")

        def at_exit():                                                   # frameworks clean up at exit
            tms.resume("w")
            assert torch.equal(w, clone)
            tms.pause("w")
            tms.resume("kv")
            core.free(q)
            tms.pause("x")
            print("cleaned", flush=True)

        atexit.register(at_exit)
        print("bye")
    """, load_core=False)
    _exits_cleanly(proc, stdout="bye\ncleaned\n")


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_uncaught_exception_with_paused_allocations_prints_only_the_traceback(run_py, mode):
    proc = run_py(f"""
        tms.hook_mode = {mode!r}
        core = tms._core
        with raw_region("w", True, "pinned"):
            p = core.malloc(9 * MiB)
        with raw_region("kv"):
            q = core.malloc(9 * MiB)
        fill(p, 9 * MiB)
        tms.pause()
        with raw_region("inside"):
            core.malloc(MiB)
            raise RuntimeError("boom")
    """, load_core=False)
    assert proc.returncode == 1, proc
    assert proc.stdout == ""
    assert proc.stderr.startswith("Traceback (most recent call last):"), proc.stderr
    assert proc.stderr.endswith("RuntimeError: boom\n") and proc.stderr.count("Traceback") == 1, proc.stderr


def test_forked_child_exits_normally_with_paused_backups(run_py):
    # The parent's copy workers do not exist in the child; the child pauses
    # with backups (its own pool), then leaves through normal interpreter exit
    # (not os._exit) with everything still paused.
    proc = run_py("""
        import warnings; warnings.simplefilter("ignore", DeprecationWarning)
        with raw_region("w", True, "pinned"):
            p = core.malloc(12 * MiB)
        with raw_region("m", True, "mmap"):
            q = core.malloc(12 * MiB)
        d = fill(p, 12 * MiB)
        tms.pause(); tms.resume()                          # the parent's pool is started
        pid = os.fork()
        if pid == 0:
            with raw_region("c", True, "mmap"):
                r = core.malloc(5 * MiB)
            tms.pause()
            assert bytes(core.get_cpu_backup(p, 12 * MiB)) == d
            sys.exit(0)                                    # atexit, finalization, exit
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        tms.pause()
        print("bye")
    """)
    _exits_cleanly(proc)
