# Tests the native module too: get_cpu_backup on raw pointers, copy_progress, library_path's cudaFree.
"""Threads and processes at the same time as pauses (tests/test_concurrency.py): a
stress of allocators, a churner, a pauser and a reader; nothing waits for a pause in
progress; a fork during a pause gives a child that works."""
import ctypes
import faulthandler
import os
import random
import signal
import sys
import threading
import traceback
import warnings

import torch_memory_saver
from _prelude import MiB, core, fill, read, row, run_cases, tms


def stress(watchdog_s, iterations, cycles):
    """Threads in different regions and tags allocate and free while others pause and
    resume other tags with backups (contents checked every cycle), read the table and
    the statistics, and toggle retain; then the table holds exactly what they kept."""
    faulthandler.dump_traceback_later(int(watchdog_s), exit=True)   # a hang prints every stack and exits 1
    ALLOCATORS, ITERATIONS, CYCLES = 3, int(iterations), int(cycles)
    native = core()

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
            except BaseException:
                errors.append(f"{fn.__name__}{args}: {traceback.format_exc()}")
        return run

    # Tags the pauser cycles: set up before the threads start; only it touches them.
    fixed = {}
    for tag, backup, kind in (("p-pinned", True, "pinned"), ("p-mmap", True, "mmap"), ("p-discard", False, None)):
        with tms.region(tag, enable_cpu_backup=backup, cpu_backup_backend=kind):
            fixed[tag] = [(tms.malloc(n), n) for n in (1, 3 * MiB + 17, 5 * MiB)]
    data = {tag: [fill(p, n) for p, n in ptrs] for tag, ptrs in fixed.items()}
    live = {}                          # allocator index -> its live (ptr, n, bytes)

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
                p = tms.malloc(n)
                mine.append((p, n, fill(p, n)))
                if len(mine) > 4:
                    p, n, d = mine.pop(rnd.randrange(len(mine)))
                    assert read(p, n) == d, (tag, it, "contents changed before free")
                    tms.free(p)
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
                    mine.append(tms.malloc(rnd.randrange(1, 4 * MiB)))
                elif mine:
                    tms.free(mine.pop(rnd.randrange(len(mine))))
        live["churn"] = mine

    @guarded
    def pauser():
        start.wait()
        for cycle in range(CYCLES):
            for tag in fixed:
                tms.pause(tag)
            for tag in ("p-pinned", "p-mmap"):
                for (p, n), d in zip(fixed[tag], data[tag]):
                    assert bytes(native.get_cpu_backup(p, n)) == d, (tag, cycle, "backup differs")
            for tag in fixed:
                tms.resume(tag)
            for tag in ("p-pinned", "p-mmap"):
                assert [read(p, n) for p, n in fixed[tag]] == data[tag], (tag, cycle, "restore differs")
            for tag in fixed:
                data[tag] = [fill(p, n) for p, n in fixed[tag]]
            for op in (tms.pause, tms.resume):
                try:
                    op("churn")
                except torch_memory_saver.Error as e:   # the churner changed the tag under us: defined errors only
                    assert "'churn'" in str(e) and ("already paused" in str(e) or "not paused" in str(e)), e

    @guarded
    def reader():
        # Reads the table and the statistics while the others change them.
        start.wait()
        k = 0
        while not done.is_set():
            rows, stats = tms.allocations(), tms.stats()
            for r in rows:                  # one consistent snapshot, whatever moves meanwhile
                assert r["state"] in ("active", "paused", "pausing", "resuming"), r
                if r["state"] == "paused" and r["cpu_backup"]:
                    assert r["has_cpu_backup"], r            # a backed-up paused allocation keeps its copy
            for per_tag in stats.values():  # gauges equal the sum over the table at every instant
                for st in per_tag.values():
                    assert st["bytes_mapped"] + st["bytes_paused"] == st["bytes_reserved"], st
                    assert st["bytes_requested"] <= st["bytes_reserved"] <= 2 * MiB * st["allocations"] + (64 << 20), st
            tms.retain_cpu_backup = bool(k % 2)
            k += 1
            done.wait(0.001)                # paces the reads: no result depends on how many

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
    assert not errors, "\n".join(errors)

    # No lost allocation: the table holds exactly what the threads kept, all
    # active (every tag was resumed last).
    expected = {p for ptrs in fixed.values() for p, _ in ptrs}
    expected |= {p for i in range(ALLOCATORS) for p, _, _ in live[i]}
    expected |= set(live["churn"])
    rows = tms.allocations()
    assert len(rows) == len(expected) and {r["ptr"] for r in rows} == expected, (len(rows), len(expected))
    assert all(r["state"] == "active" for r in rows), [r for r in rows if r["state"] != "active"]
    gauges = {}
    for per_tag in tms.stats().values():
        for tag, s in per_tag.items():
            gauges[tag] = gauges.get(tag, 0) + s["allocations"]
    for tag in {r["tag"] for r in rows}:
        assert gauges[tag] == sum(r["tag"] == tag for r in rows), tag
    for i in range(ALLOCATORS):
        for p, n, d in live[i]:
            assert read(p, n) == d
    for p in expected:
        tms.free(p)
    assert tms.allocations() == []
    assert all(s["allocations"] == s["bytes_mapped"] == s["bytes_paused"] == 0
               for per_tag in tms.stats().values() for s in per_tag.values())
    print("done")


def nothing_waits_for_a_pause():
    """The pause's first copy waits at the gate (TMS_HOST_COPY_GATE) until this thread
    opens it: everything below runs while the pause is provably in progress, however
    fast or busy the machine."""
    faulthandler.dump_traceback_later(60, exit=True)
    native = core()
    gate_path = os.environ["TMS_HOST_COPY_GATE"]
    gate = os.open(gate_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)   # empty: shut until a byte is in it
    BIG = 64 * MiB
    with tms.region("big", enable_cpu_backup=True):
        big = tms.malloc(BIG)
        doomed = tms.malloc(MiB)
    head, tail = fill(big, MiB), fill(big + BIG - MiB, MiB)
    with tms.region("other"):
        kept = tms.malloc(MiB)
    kept_data = fill(kept, MiB)
    foreign = ctypes.create_string_buffer(64)          # memory the library does not own
    hook = ctypes.CDLL(native.library_path())          # this very library's cudaFree
    outcome = {}

    def read_backup():
        outcome["backup"] = bytes(native.get_cpu_backup(big, MiB))

    def other_tag():
        with tms.region("other"):
            p = tms.malloc(3 * MiB)
        fill(p, 3 * MiB)
        tms.free(p)

    t = threading.Thread(target=tms.pause, args=("big",))
    t.start()
    while row(big)["state"] == "active":
        pass                                           # claimed: the pause is under way
    reader = threading.Thread(target=read_backup)
    reader.start()
    for _ in range(20):                                # each returns although the pause cannot end
        hook.cudaFree(ctypes.cast(foreign, ctypes.c_void_p))
        tms.stats()
        tms.memory_summary()
        tms.allocations()
        other_tag()
    tms.free(doomed)                                   # an allocation being paused: its mover frees it
    with tms.region("big"):
        newcomer = tms.malloc(MiB)                     # into the tag being paused
    assert row(big)["state"] == "pausing" and reader.is_alive()   # get_cpu_backup waits for the backup
    os.write(gate, b"x")
    t.join()
    reader.join()
    assert outcome["backup"] == head                   # ... and got all of it
    assert all(r["ptr"] != doomed for r in tms.allocations())   # the pause finished the free
    assert row(big)["state"] == "paused" and row(newcomer)["state"] == "active"
    assert read(kept, MiB) == kept_data
    tms.pause("big")                                   # pauses the newcomer
    tms.resume("big")
    assert read(big, MiB) == head and read(big + BIG - MiB, MiB) == tail
    print("done")


def fork_during_a_pause():
    """A fork while a 1 GiB backed-up pause copies: the child drops (or has settled) the
    moving allocation and pauses and resumes its own; the parent's pause completes."""
    warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork() of a process with threads
    faulthandler.dump_traceback_later(60, exit=True)
    native = core()
    BIG = 1 << 30
    with tms.region("big", enable_cpu_backup=True):
        big = tms.malloc(BIG)
    head, tail = fill(big, MiB), fill(big + BIG - MiB, MiB)
    t = threading.Thread(target=tms.pause, args=("big",))
    t.start()
    # copy_progress() reads counters without any lock: wait for the backup copy
    # to be under way (the table itself may not be readable with a broken lock)
    while not 0 < native.copy_progress()[0] < BIG:
        assert t.is_alive(), "the pause finished before the fork"
    pid = os.fork()
    if pid == 0:
        try:
            signal.alarm(20)        # a hung child dies (faulthandler's watchdog thread is the parent's)
            mine = [r for r in tms.allocations() if r["ptr"] == big]
            # moving at the fork: dropped from the child's table; settled just before: paused
            assert mine == [] or mine[0]["state"] == "paused", mine
            with tms.region("child", enable_cpu_backup=True):
                p = tms.malloc(3 * MiB + 5)
            data = fill(p, 3 * MiB + 5)
            tms.pause("child")
            assert row(p)["state"] == "paused"
            tms.resume("child")
            assert read(p, 3 * MiB + 5) == data
            tms.free(p)
            os._exit(0)
        except BaseException:
            traceback.print_exc()
            os._exit(1)
    t.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert row(big)["state"] == "paused"
    tms.resume("big")
    assert read(big, MiB) == head and read(big + BIG - MiB, MiB) == tail
    print("done")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
