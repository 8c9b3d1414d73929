# Tests the native module too: get_cpu_backup on raw pointers (a paused allocation's backup).
"""Group pause and resume (torch_memory_saver.distributed) across host-backend
processes joined by gloo (tests/test_distributed.py). The scenario process imports
torch once and forks one process per rank (--world, default 4), each with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set, and TMS_FAULT where --fault RANK=SPEC
names it (set before the rank's core loads). Every rank runs the case, writes
"rank R: ..." lines the test checks, and exits 0; a rank that fails stops the
others. By hand, from the repository root:

    PYTHONPATH=. TMS_BACKEND=host python tests/host_scenarios/distributed.py pause_fault 2 --fault 2=copy_to_host:1
"""
import ctypes
import datetime
import os
import signal
import socket
import sys
import time

import torch.distributed as dist
import torch.multiprocessing

import torch_memory_saver
from _prelude import MiB, core, expect, fill, read, tms
from torch_memory_saver import Report, distributed as tmsd

KiB = 1 << 10


def join():
    """(rank, world size) of this process, once the gloo group is up. The group's
    timeout is short: a rank left waiting fails the case rather than the test's clock."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    return dist.get_rank(), dist.get_world_size()


def say(rank, line):
    """One line of this rank's, in one write: the ranks share the launcher's stdout."""
    os.write(1, f"rank {rank}: {line}\n".encode())


def leave(rank, line):
    """Says this rank's last line once every rank got there, and leaves the group."""
    dist.barrier()
    dist.destroy_process_group()
    say(rank, line)


def allocate(tag, rank, extra=0):
    """Two backed-up allocations under tag, of sizes that differ by rank (each one
    copy block either way), and `extra` more of 1 MiB, filled with random bytes:
    [(ptr, size, bytes)]."""
    out = []
    with tms.region(tag, enable_cpu_backup=True):
        for n in (MiB + rank * 256 * KiB + 4 * KiB, 3 * MiB - 1) + (MiB,) * extra:
            p = tms.malloc(n)
            out.append((p, n, fill(p, n)))
    return out


def reserved(allocs):
    rows = {r["ptr"]: r for r in tms.allocations()}
    return sum(rows[p]["reserved"] for p, _, _ in allocs)


def state_of(allocs):
    """The one state all of allocs are in (asserts they agree)."""
    rows = {r["ptr"]: r for r in tms.allocations()}
    states = {rows[p]["state"] for p, _, _ in allocs}
    assert len(states) == 1, [rows[p] for p, _, _ in allocs]
    return states.pop()


def check_bytes(allocs):
    """Every allocation active, its bytes those filled."""
    assert state_of(allocs) == "active"
    for p, n, data in allocs:
        assert read(p, n) == data, hex(p)


def check_backups(allocs):
    """Every allocation paused, its backup holding the bytes filled."""
    assert state_of(allocs) == "paused"
    for p, n, data in allocs:
        assert core().get_cpu_backup(p, n).tobytes() == data, hex(p)


def check_reports(reports, op, want):
    """reports: one Report per rank, in rank order, each of op, released bytes as want[rank]."""
    assert len(reports) == len(want), reports
    for rank, (report, n) in enumerate(zip(reports, want)):
        assert isinstance(report, Report), (rank, report)
        assert report.op == op and report.released_bytes == n, (rank, report, n)
        assert report.as_dict()["released_bytes"] == n and sum(d.released_bytes for d in report.devices.values()) == n


def gather(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def check_same_error(e, rank):
    """The GroupError is one error, raised alike on every rank."""
    assert isinstance(e, torch_memory_saver.Error) and isinstance(e, RuntimeError), type(e).__mro__
    seen = gather((str(e), e.failures, [r is None for r in e.reports], e.stage))
    assert all(s == seen[0] for s in seen), seen
    return str(e)


def pause_and_resume():
    """Group pause, then resume, of a tag, by name, list and None: every rank's
    report comes back in rank order with the bytes each rank reserved; in
    between, every rank's allocations are paused with their backups; after, the
    bytes are exact. Then a subgroup of two ranks, reports by group rank."""
    rank, world = join()
    w = allocate("w", rank, extra=rank)
    sizes = gather(reserved(w))
    copied = gather(sum(n for _, n, _ in w))
    assert len(set(sizes)) > 1, sizes                  # the ranks differ: a report in the wrong place shows
    for tags_pause, tags_resume in (("w", ["w"]), (None, None)):
        reports = tmsd.pause(tags_pause)
        check_reports(reports, "pause", sizes)
        assert [r.copied_bytes for r in reports] == copied, reports
        check_backups(w)
        reports = tmsd.resume(tags_resume)
        check_reports(reports, "resume", sizes)
        check_bytes(w)
    e = expect(tmsd.GroupError, tmsd.resume, "w")        # a state error on every rank: nothing to undo
    msg = check_same_error(e, rank)
    assert msg.startswith(f"torch_memory_saver: resume of 'w' failed on {world} of {world} ranks: rank 0: Error: "), msg
    assert msg.endswith("; no rank had resumed anything to undo") and sorted(e.failures) == list(range(world)), msg
    check_bytes(w)
    pair = dist.new_group([1, 3])                       # every rank makes it; only its members use it
    if rank in (1, 3):
        check_reports(tmsd.pause(["w"], group=pair), "pause", [sizes[1], sizes[3]])
        assert state_of(w) == "paused"
        check_reports(tmsd.resume("w", group=pair), "resume", [sizes[1], sizes[3]])
    check_bytes(w)
    leave(rank, f"{world} reports each way, bytes exact")


def pause_fault(failing):
    """A fault in one rank's pause: every rank raises the same GroupError naming
    it; every rank's allocations are active again with their bytes; the next
    group pause and resume work."""
    failing = int(failing)
    rank, world = join()
    w = allocate("w", rank)
    e = expect(tmsd.GroupError, tmsd.pause, ["w"])
    msg = check_same_error(e, rank)
    want = f"torch_memory_saver: pause of ['w'] failed on rank {failing} of {world}: Error: "
    assert msg.startswith(want), msg
    assert list(e.failures) == [failing] and e.op == "pause" and e.tags == ["w"], (e.failures, e.op, e.tags)
    assert [r is None for r in e.reports] == [r == failing for r in range(world)], e.reports
    check_bytes(w)
    say(rank, msg.split("; ")[-1])
    tmsd.pause("w")                                     # each fault fires once
    assert state_of(w) == "paused"
    tmsd.resume("w")
    check_bytes(w)
    leave(rank, "rolled back, then paused and resumed")


def resume_fault(failing):
    """A fault in one rank's resume: every rank raises the same GroupError naming
    it; every rank's allocations are paused again, backups intact; the next
    group resume works and the bytes are exact."""
    failing = int(failing)
    rank, world = join()
    w = allocate("w", rank)
    tmsd.pause("w")
    e = expect(tmsd.GroupError, tmsd.resume, "w")
    msg = check_same_error(e, rank)
    want = f"torch_memory_saver: resume of 'w' failed on rank {failing} of {world}: Error: "
    assert msg.startswith(want) and "restore copy" in msg, msg
    assert list(e.failures) == [failing], e.failures
    check_backups(w)
    say(rank, msg.split("; ")[-1])
    tmsd.resume("w")
    check_bytes(w)
    leave(rank, "paused again, then resumed")


def undo_fault(failing, undoing):
    """A pause fails on one rank, and undoing it (a resume) fails on another: every
    rank raises the same GroupError naming both; what that rank could not resume
    stays paused with its backup, and a local resume brings it back."""
    failing, undoing = int(failing), int(undoing)
    rank, world = join()
    w = allocate("w", rank)
    e = expect(tmsd.GroupError, tmsd.pause, "w")
    msg = check_same_error(e, rank)
    assert list(e.failures) == [failing] and list(e.undo_failures) == [undoing], (e.failures, e.undo_failures)
    others = ", ".join(str(r) for r in range(world) if r not in (failing, undoing))
    want = f"; ranks {others} resumed what they had paused; undoing it failed on rank {undoing} of {world}: Error: "
    assert want in msg and msg.endswith(" (what it could not resume stays paused)"), msg
    if rank == undoing:
        rows = {r["ptr"]: r for r in tms.allocations()}
        paused = [a for a in w if rows[a[0]]["state"] == "paused"]
        assert paused, rows
        check_backups(paused)
        tms.resume("w")                                 # the rank's own call: the others are whole
    check_bytes(w)
    leave(rank, "the failed undo named; resumed on its own")


def staged_resume(failing):
    """resume(stages=[["w"], ["kv"]]) returns a list of reports per stage; a second
    one, failing in stage 2 on one rank, leaves both tags paused on every rank
    with their backups; a retry resumes both."""
    failing = int(failing)
    rank, world = join()
    w, kv = allocate("w", rank), allocate("kv", rank)
    sizes = {"w": gather(reserved(w)), "kv": gather(reserved(kv))}
    stages = [["w"], ["kv"]]
    tmsd.pause(["w", "kv"])
    reports = tmsd.resume(stages=stages)
    assert len(reports) == 2, reports
    check_reports(reports[0], "resume", sizes["w"])
    check_reports(reports[1], "resume", sizes["kv"])
    check_bytes(w + kv)
    tmsd.pause(["w", "kv"])
    e = expect(tmsd.GroupError, tmsd.resume, stages=stages)
    msg = check_same_error(e, rank)
    want = f"torch_memory_saver: resume of stage 2 of 2 (['kv']) failed on rank {failing} of {world}: Error: "
    assert msg.startswith(want), msg
    assert e.stage == 1 and e.tags == ["kv"] and list(e.failures) == [failing], (e.stage, e.tags, e.failures)
    check_backups(w)
    check_backups(kv)
    say(rank, msg.split("; ")[-1])
    reports = tmsd.resume(stages=stages)
    check_reports(reports[1], "resume", sizes["kv"])
    check_bytes(w + kv)
    leave(rank, "both stages paused again, then resumed")


def bad_arguments():
    """Bad arguments raise on the rank that passed them, before any collective:
    only rank 0 makes these calls, so one that waited for the group would hang.
    Ranks that called with different arguments all raise, releasing nothing."""
    expect(RuntimeError, tmsd.pause, "w", match="torch.distributed is not initialized")
    rank, world = join()
    w = allocate("w", rank)
    if rank == 0:
        expect(TypeError, tmsd.pause, 3, match="tags must be None, a str or a list of str, not int")
        expect(TypeError, tmsd.resume, ["w", b"kv"], match="not a list holding a bytes")
        expect(ValueError, tmsd.pause, "", match="non-empty")
        expect(ValueError, tmsd.pause, ["w", "w"], match="listed twice")
        expect(TypeError, tmsd.resume, "w", stages=[["w"]], match="tags or stages, not both")
        expect(ValueError, tmsd.resume, stages=[], match="stages must be a non-empty list")
        expect(TypeError, tmsd.resume, stages="w", match="stages must be a non-empty list")
        expect(ValueError, tmsd.resume, stages=[["w"], []], match="stages[1] is empty")
        expect(TypeError, tmsd.resume, stages=[["w"], "kv"], match="stages[1] must be a list of str")
        expect(ValueError, tmsd.resume, stages=[["w"], ["kv", "w"]], match="'w' is in stages[0] and stages[1]")
    alone = dist.new_group([1])
    if rank == 0:
        expect(RuntimeError, tmsd.pause, "w", group=alone, match="not a member of the group")
    else:
        check_reports(tmsd.pause("w", group=alone), "pause", [reserved(w)])
        tmsd.resume("w", group=alone)
    e = expect(ValueError, tmsd.pause, ["w"] if rank == 0 else ["w", "kv"], match="different arguments")
    assert "rank 0: pause(['w']); rank 1: pause(['w', 'kv'])" in str(e), str(e)
    check_bytes(w)
    leave(rank, "raised before any collective")


def rank_dies(dying, when):
    """Rank `dying` is killed (SIGKILL) inside the group pause: before the call
    (when="call") or in its own pause (when="pause"). The others raise a GroupError
    of a broken group naming it as lost and what each of them keeps paused, their
    backups whole; a local resume brings their bytes back."""
    dying = int(dying)
    # The survivors wait this long for a slow live rank's marker before naming the
    # lost ones; every live rank here is at its marker within milliseconds.
    tmsd._Exchange.GRACE_S = 2.0
    rank, world = join()
    w = allocate("w", rank)
    if rank == dying:
        if when == "call":
            os.kill(os.getpid(), signal.SIGKILL)
        tms.pause = lambda tags: os.kill(os.getpid(), signal.SIGKILL)   # the group pause's local call
    e = expect(tmsd.GroupError, tmsd.pause, "w")
    msg = str(e)
    assert e.broken and e.lost == [dying] and e.op == "pause", (e.broken, e.lost, msg)
    assert f"rank {dying} of {world} did not reach it (lost)" in msg and "nothing was undone by the group" in msg, msg
    if when == "call":
        assert "the group broke while the ranks agreed on the call" in msg and e.moved == [], msg
        assert f"this rank (rank {rank}) had paused nothing" in msg, msg
        check_bytes(w)
    else:
        assert "the group broke while the ranks exchanged their outcomes" in msg and e.moved == ["w"], msg
        assert f"this rank (rank {rank}) paused ['w'] and keeps it paused" in msg, msg
        check_backups(w)
        tms.resume("w")
        check_bytes(w)
    say(rank, f"rank {dying} lost at the {when}: named, nothing undone")
    sys.stdout.flush()
    os._exit(0)                                        # the group is broken: no orderly leave


def rank_main(rank, world, port, faults, case, args):
    """One rank: its environment, then the case (in a process forked by main)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with the launcher
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if rank in faults:
        os.environ["TMS_FAULT"] = faults[rank]
    globals()[case](*args)


def main(argv, timeout=40):
    """distributed.py CASE [ARG...] [--world N] [--fault RANK=SPEC]...: forks the
    ranks (after torch's import, which they share) and waits for them all."""
    world, faults, rest, dies = 4, {}, [], None
    it = iter(argv[1:])
    for a in it:
        if a == "--world":
            world = int(next(it))
        elif a == "--dies":                            # this rank is to end by SIGKILL, the others by exit 0
            dies = int(next(it))
        elif a == "--fault":
            r, spec = next(it).split("=", 1)
            faults[int(r)] = spec
        else:
            rest.append(a)
    case, *args = rest
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ranks = torch.multiprocessing.start_processes(rank_main, args=(world, port, faults, case, args), nprocs=world,
                                                  join=False, start_method="fork")
    deadline = time.monotonic() + timeout
    if dies is not None:
        for r, p in enumerate(ranks.processes):
            p.join(max(0.0, deadline - time.monotonic()))
            if p.exitcode != (-signal.SIGKILL if r == dies else 0):
                for q in ranks.processes:
                    q.kill()
                sys.exit(f"rank {r} ended with {p.exitcode}")
        return
    while not ranks.join(timeout=0.2):  # raises, having stopped the others, once a rank fails
        if time.monotonic() > deadline:
            for p in ranks.processes:
                p.kill()
            sys.exit(f"ranks still running after {timeout} s")


if __name__ == "__main__":
    main(sys.argv)
