"""Concurrency (issue 5): no lost allocation, no deadlock, no data race.

- ThreadSanitizer: the C tests built with CMake -DTMS_SANITIZE=thread; the
  `threads` scenario of test_core_host (workers allocating, freeing, pausing and
  resuming their own tags while the main thread cycles a backed-up tag) and the
  plain fuzz driver (the copy workers under every backup size). Skipped where
  the compiler or the kernel cannot run ThreadSanitizer.
- A Python-level stress on the host backend: threads in different regions and
  tags allocate and free through the native module while others pause/resume
  other tags with backups (contents checked every cycle), read the table and
  the statistics with the GIL held, and toggle retain. A watchdog ends a hung
  child with every thread's stack; the parent's timeout is the backstop.
"""
import shutil
import subprocess
import sys
import textwrap

import pytest

import cbuild
from conftest import check_ok

# ---- ThreadSanitizer ---------------------------------------------------------------


def _tsan_usable(tmp):
    cc = cbuild.compiler()
    if not cc:
        pytest.skip("no C compiler (cc, or $CC)")
    probe = tmp / "probe.c"
    probe.write_text("#include <pthread.h>\nstatic void *f(void *a) { return a; }\n"
                     "int main(void) { pthread_t t; pthread_create(&t, 0, f, 0); return pthread_join(t, 0); }\n")
    build = subprocess.run([*cc, "-fsanitize=thread", "-pthread", str(probe), "-o", str(tmp / "probe")],
                           capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"the C compiler cannot build with -fsanitize=thread: {build.stderr.strip()[:300]}")
    run = subprocess.run([str(tmp / "probe")], capture_output=True, text=True, timeout=60)
    if run.returncode != 0:  # e.g. "unexpected memory mapping" on kernels with high mmap entropy
        pytest.skip(f"ThreadSanitizer programs do not run here: {run.stderr.strip()[-300:]}")


@pytest.fixture(scope="module")
def tsan_build(tmp_path_factory):
    if not shutil.which("cmake"):
        pytest.skip("cmake not installed")
    tmp = tmp_path_factory.mktemp("tsan")
    _tsan_usable(tmp)
    build = tmp / "build"
    for cmd in (["cmake", "-S", cbuild.ROOT, "-B", build, "-DTMS_SANITIZE=thread",
                 f"-DPython3_EXECUTABLE={sys.executable}"],
                ["cmake", "--build", build, "-j", "2", "--target", "test_core_host", "fuzz_core"]):
        proc = cbuild.run(cmd, timeout=300)
        assert proc.returncode == 0, cbuild.detail(proc)
    return build


TSAN_ENV = {"TSAN_OPTIONS": "halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0"}


def test_threads_scenarios_under_thread_sanitizer(tsan_build):
    proc = cbuild.run([tsan_build / "test_core_host", "threads", "nowait"], timeout=300,
                      env=cbuild.tool_env(**TSAN_ENV))
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

_STRESS = """
    import faulthandler, time
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)   # a hang prints every stack and exits 1
    ALLOCATORS, ITERATIONS, CYCLES = 3, ITERATIONS_, CYCLES_

    def fill(ptr, n):                  # random.randbytes: os.urandom would dominate the run
        data = random.randbytes(n)
        ctypes.memmove(ptr, data, n)
        return data
    errors, done = [], threading.Event()
    start = threading.Barrier(ALLOCATORS + 3)

    def guarded(fn):
        def run(*args):
            try:
                fn(*args)
            except BaseException as e:
                import traceback
                errors.append(f"{fn.__name__}{args}: {traceback.format_exc()}")
        return run

    # Tags the pauser cycles: set up before the threads start; only it touches them.
    fixed = {}
    for tag, backup, kind in (("p-pinned", True, "pinned"), ("p-mmap", True, "mmap"), ("p-discard", False, None)):
        with tms.region(tag, enable_cpu_backup=backup, cpu_backup_backend=kind):
            fixed[tag] = [(core.malloc(n), n) for n in (1, 3 * MiB + 17, 5 * MiB)]
    data = {tag: [fill(p, n) for p, n in ptrs] for tag, ptrs in fixed.items()}
    live = {}                       # allocator index -> its live (ptr, n, bytes)

    @guarded
    def allocator(i):
        tag, backup = f"a{i}", i != 2
        kind = ("pinned", "mmap", None)[i]
        mine = live.setdefault(i, [])
        rnd = random.Random(i)
        with tms.region(tag, enable_cpu_backup=backup, cpu_backup_backend=kind):
            start.wait()
            for it in range(ITERATIONS):
                n = rnd.choice([1, 4095, 2 * MiB - 1, 2 * MiB + 1, rnd.randrange(1, 3 * MiB)])
                p = core.malloc(n)
                mine.append((p, n, fill(p, n)))
                if len(mine) > 4:
                    p, n, d = mine.pop(rnd.randrange(len(mine)))
                    assert read(p, n) == d, (tag, it, "contents changed before free")
                    core.free(p)
                if it % 10 == 9:           # its own tag: nobody else touches this memory
                    tms.pause(tag)
                    tms.resume(tag)
                    for j, (p, n, d) in enumerate(mine):
                        if backup:
                            assert read(p, n) == d, (tag, it, "backup lost bytes")
                        else:
                            mine[j] = (p, n, fill(p, n))
                for p, n, d in mine[-2:]:
                    assert read(p, n) == d, (tag, it)

    @guarded
    def churner():
        # Allocates and frees in a tag the pauser pauses and resumes at the same
        # time (never touching the memory): frees of paused allocations, pauses
        # of tags that change under them.
        rnd, mine = random.Random(9), []
        with tms.region("churn"):
            start.wait()
            while not done.is_set():
                if len(mine) < 6 and rnd.random() < 0.6:
                    mine.append(core.malloc(rnd.randrange(1, 4 * MiB)))
                elif mine:
                    core.free(mine.pop(rnd.randrange(len(mine))))
        live["churn"] = mine

    @guarded
    def pauser():
        start.wait()
        for cycle in range(CYCLES):
            for tag in fixed:
                tms.pause(tag)
            for tag in ("p-pinned", "p-mmap"):
                for (p, n), d in zip(fixed[tag], data[tag]):
                    assert bytes(core.get_cpu_backup(p, n)) == d, (tag, cycle, "backup differs")
            for tag in fixed:
                tms.resume(tag)
            for tag in ("p-pinned", "p-mmap"):
                assert [read(p, n) for p, n in fixed[tag]] == data[tag], (tag, cycle, "restore differs")
            for tag in fixed:
                data[tag] = [fill(p, n) for p, n in fixed[tag]]
            for op in (tms.pause, tms.resume):
                try:
                    op("churn")
                except core.Error as e:     # the churner changed the tag under us: defined errors only
                    assert "'churn'" in str(e) and ("already paused" in str(e) or "not paused" in str(e)), e

    @guarded
    def reader():
        # Reads the table and the statistics while the others change them.
        start.wait()
        k = 0
        while not done.is_set():
            rows, stats = core.allocations(), core.stats()
            for r in rows:                  # one consistent snapshot, whatever moves meanwhile
                assert r["state"] in ("active", "paused", "pausing", "resuming"), r
                if r["state"] == "paused" and r["cpu_backup"]:
                    assert r["has_cpu_backup"], r            # a backed-up paused allocation keeps its copy
            for st in stats:                # gauges equal the sum over the table at every instant
                assert st["bytes_mapped"] + st["bytes_paused"] == st["bytes_reserved"], st
                assert st["bytes_requested"] <= st["bytes_reserved"] <= 2 * MiB * st["allocations"] + (64 << 20), st
            tms.retain_cpu_backup = bool(k % 2)
            k += 1
            time.sleep(0.001)

    threads = [threading.Thread(target=allocator, args=(i,), daemon=True) for i in range(ALLOCATORS)]
    others = [threading.Thread(target=f, daemon=True) for f in (churner, pauser, reader)]
    for t in threads + others:
        t.start()
    for t in threads + [others[1]]:
        t.join()
    done.set()
    for t in others:
        t.join()
    faulthandler.cancel_dump_traceback_later()
    assert not errors, "\\n".join(errors)

    # No lost allocation: the table holds exactly what the threads kept, all
    # active (every tag was resumed last).
    expected = {p for ptrs in fixed.values() for p, _ in ptrs}
    expected |= {p for i in range(ALLOCATORS) for p, _, _ in live[i]}
    expected |= set(live["churn"])
    rows = core.allocations()
    assert len(rows) == len(expected) and {r["ptr"] for r in rows} == expected, (len(rows), len(expected))
    assert all(r["state"] == "active" for r in rows), [r for r in rows if r["state"] != "active"]
    gauges = {}
    for s in core.stats():
        gauges[s["tag"]] = gauges.get(s["tag"], 0) + s["allocations"]
    for tag in {r["tag"] for r in rows}:
        assert gauges[tag] == sum(r["tag"] == tag for r in rows), tag
    for i in range(ALLOCATORS):
        for p, n, d in live[i]:
            assert read(p, n) == d
    for p in expected:
        core.free(p)
    assert core.allocations() == []
    assert all(s["allocations"] == s["bytes_mapped"] == s["bytes_paused"] == 0 for s in core.stats())
    print("done")
"""


def test_threads_allocate_while_others_pause_and_resume(run_py):
    code = textwrap.dedent(_STRESS).replace("WATCHDOG_S", "60") \
        .replace("ITERATIONS_", "60").replace("CYCLES_", "12")
    out = check_ok(run_py(code, timeout=120, env={"TMS_BACKUP_THREADS": "3"}))
    assert out == "done\n"


# ---- nothing waits for a pause in progress (issue 12) -------------------------------

_DURING_PAUSE = """
    import faulthandler, time
    faulthandler.dump_traceback_later(60, exit=True)
    # The pause's first copy waits at the gate (TMS_HOST_COPY_GATE) until this
    # thread opens it: everything below runs while the pause is provably in
    # progress, however fast or busy the machine.
    gate_path = os.environ["TMS_HOST_COPY_GATE"]
    os.mkfifo(gate_path)
    gate = os.open(gate_path, os.O_RDWR)                  # a writer, so the core's open does not block
    BIG = 64 * MiB
    with tms.region("big", enable_cpu_backup=True):
        big = core.malloc(BIG)
        doomed = core.malloc(MiB)
    head, tail = fill(big, MiB), fill(big + BIG - MiB, MiB)
    with tms.region("other"):
        kept = core.malloc(MiB)
    kept_data = fill(kept, MiB)
    foreign = ctypes.create_string_buffer(64)            # memory the library does not own
    hook = ctypes.CDLL(core.library_path())              # this very library's cudaFree
    outcome = {}

    def read_backup():
        outcome["backup"] = bytes(core.get_cpu_backup(big, MiB))

    def other_tag():
        with tms.region("other"):
            p = core.malloc(3 * MiB)
        fill(p, 3 * MiB)
        core.free(p)

    t = threading.Thread(target=tms.pause, args=("big",))
    t.start()
    while row(big)["state"] == "active":
        pass                                              # claimed: the pause is under way
    reader = threading.Thread(target=read_backup)
    reader.start()
    for _ in range(20):                                   # each returns although the pause cannot end
        hook.cudaFree(ctypes.cast(foreign, ctypes.c_void_p))
        core.stats()
        tms.memory_summary()
        core.allocations()
        other_tag()
    core.free(doomed)                                     # an allocation being paused: its mover frees it
    with tms.region("big"):
        newcomer = core.malloc(MiB)                       # into the tag being paused
    assert row(big)["state"] == "pausing" and reader.is_alive()   # get_cpu_backup waits for the backup
    os.write(gate, b"x")
    t.join()
    reader.join()
    assert outcome["backup"] == head                      # ... and got all of it
    assert all(r["ptr"] != doomed for r in core.allocations())   # the pause finished the free
    assert row(big)["state"] == "paused" and row(newcomer)["state"] == "active"
    assert read(kept, MiB) == kept_data
    tms.pause("big")                                      # pauses the newcomer
    tms.resume("big")
    assert read(big, MiB) == head and read(big + BIG - MiB, MiB) == tail
    print("done")
"""


def test_nothing_waits_for_a_backed_up_pause_in_progress(run_py, tmp_path):
    out = check_ok(run_py(_DURING_PAUSE, timeout=120, env={"TMS_HOST_COPY_GATE": tmp_path / "gate"}))
    assert out == "done\n", out


_FORK_DURING_PAUSE = """
    import faulthandler, signal, time, traceback, warnings
    warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork() of a process with threads
    faulthandler.dump_traceback_later(60, exit=True)
    BIG = 1 << 30
    with tms.region("big", enable_cpu_backup=True):
        big = core.malloc(BIG)
    head, tail = fill(big, MiB), fill(big + BIG - MiB, MiB)
    t = threading.Thread(target=tms.pause, args=("big",))
    t.start()
    # copy_progress() reads counters without any lock: wait for the backup copy
    # to be under way (the table itself may not be readable with a broken lock)
    while not 0 < core.copy_progress()[0] < BIG:
        assert t.is_alive(), "the pause finished before the fork"
    pid = os.fork()
    if pid == 0:
        try:
            signal.alarm(20)        # a hung child dies (faulthandler's watchdog thread is the parent's)
            mine = [r for r in core.allocations() if r["ptr"] == big]
            # moving at the fork: dropped from the child's table; settled just before: paused
            assert mine == [] or mine[0]["state"] == "paused", mine
            with tms.region("child", enable_cpu_backup=True):
                p = core.malloc(3 * MiB + 5)
            data = fill(p, 3 * MiB + 5)
            tms.pause("child")
            assert row(p)["state"] == "paused"
            tms.resume("child")
            assert read(p, 3 * MiB + 5) == data
            core.free(p)
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    t.join()
    t0 = time.perf_counter()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert row(big)["state"] == "paused"
    tms.resume("big")
    assert read(big, MiB) == head and read(big + BIG - MiB, MiB) == tail
    print("done")
"""


def test_fork_during_a_pause_gives_a_child_that_works(run_py):
    out = check_ok(run_py(_FORK_DURING_PAUSE, timeout=120, env={"TMS_BACKUP_THREADS": "1"}))
    assert out == "done\n"
