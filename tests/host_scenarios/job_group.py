"""A group pause and resume (torch_memory_saver.distributed) whose ranks, on one device,
are members of one job (tests/test_job.py), run by distributed.py's launcher: the ranks
keep and borrow each other's memory as they pause and resume together, a fault on one
rank still rolls every rank back, and every byte is exact. By hand, from the repository
root:

    PYTHONPATH=. TMS_BACKEND=host TMS_JOB=g python tests/host_scenarios/job_group.py lend_in_a_group 3 --fault 3=copy_to_device:3
"""
import sys
import time

import distributed
from _prelude import MiB, fill, tms
from distributed import check_bytes, gather, join, leave
from torch_memory_saver import distributed as tmsd


def discarded(tag, n):
    with tms.region(tag):
        return tms.malloc(n)


def lend_in_a_group(failing):
    """Two group pauses (a discarded tag, then a backed-up one) keep memory for the ranks
    whose memory is paused by then, whatever order the ranks run in; the group resume
    maps it again (its keeper's own, or borrowed), bytes exact; a fault in one rank's
    next resume rolls every rank back to paused, backups intact, and a retry resumes
    every byte; the last pause gives every borrowed byte back."""
    failing = int(failing)
    rank, world = join()
    w = distributed.allocate("w", rank)
    kv = discarded("kv", 8 * MiB)
    fill(kv, 8 * MiB)
    kept = [r.kept_bytes for r in tmsd.pause(["kv"])] + [r.kept_bytes for r in tmsd.pause(["w"])]
    # By the second pause every rank's kv is paused: each rank keeps some for the others.
    assert sum(kept) > 0, kept
    reports = tmsd.resume(["w", "kv"])
    mapped = [r.devices[0].reused_bytes + r.devices[0].borrowed_bytes for r in reports]
    assert sum(mapped) > 0, reports  # what was kept was mapped again, by its keeper or a borrower
    check_bytes(w)
    tmsd.pause(["w", "kv"])
    e = distributed.expect(tmsd.GroupError, tmsd.resume, ["w", "kv"])  # TMS_FAULT: rank `failing`'s restore
    msg = distributed.check_same_error(e, rank)
    assert list(e.failures) == [failing] and "restore copy" in msg, msg
    distributed.check_backups(w)
    tmsd.resume(["w", "kv"])
    check_bytes(w)
    tmsd.pause(["w", "kv"])  # what was borrowed goes back to its lender
    end = time.monotonic() + 30
    while tms.memory_report()[0]["job_lent"] and time.monotonic() < end:
        time.sleep(0.01)
    assert gather(tms.memory_report()[0]["job_lent"]) == [0] * world
    leave(rank, "kept, mapped again, rolled back, bytes exact")


if __name__ == "__main__":
    distributed.lend_in_a_group = lend_in_a_group  # the launcher runs the case of its own module
    distributed.main(sys.argv)
