"""The host backup budget on the host backend (tests/test_budget.py): processes sharing
one ledger (TMS_HOST_BACKUP_LIMIT, TMS_HOST_BACKUP_LIMIT_NAME), spilling to disk,
errors that change nothing, and the 5 % of host memory kept available without one.

hold <count> <mib>: allocates count allocations of mib MiB with CPU backup, fills them
with random bytes, pauses, prints one JSON line (pause error or not, where each backup
went, host_budget()), then waits for a line on stdin: "resume" resumes and checks
every byte (all of them, or those of a pause that failed: nothing moved), prints
"done" and waits for one more line; "stay" exits at once, paused.

hold_as <uid> <gid> <count> <mib>: hold, as another user. Started by root, it loads
what a pause needs first (the interpreter may lie where that user cannot read), then
becomes uid:gid for good."""
import json
import os
import sys
import tempfile

import torch_memory_saver
from _prelude import MiB, fill, read, run_cases, start, tms


def hold(count, mib):
    count, size = int(count), int(mib) * MiB
    tms.set_disk_backup_dir(tempfile.mkdtemp())
    with tms.region("w", enable_cpu_backup=True):
        ptrs = [tms.malloc(size) for _ in range(count)]
    data = [fill(p, size) for p in ptrs]
    error = None
    try:
        tms.pause("w")
    except torch_memory_saver.Error as e:
        error = f"{type(e).__name__}: {e}"
    rows = {r["ptr"]: r for r in tms.allocations()}
    print(json.dumps({"error": error, "states": [rows[p]["state"] for p in ptrs],
                      "disk": sum(rows[p]["has_disk_backup"] for p in ptrs),
                      "cpu": sum(rows[p]["has_cpu_backup"] for p in ptrs),
                      "budget": torch_memory_saver.host_budget()}), flush=True)
    if sys.stdin.readline().strip() != "resume":
        return
    if error is None:
        tms.resume("w")
    assert all(read(p, size) == d for p, d in zip(ptrs, data)), "bytes differ after resume"
    assert torch_memory_saver.host_budget()["mine"] == 0
    print("done", flush=True)
    sys.stdin.readline()  # alive until told: its record must say it holds nothing now


def hold_as(uid, gid, count, mib):
    start()
    with tms.region("warm-up"):                        # the pause path's imports, with no backup: no ledger
        p = tms.malloc(MiB)
    tms.pause("warm-up")
    tms.resume("warm-up")
    tms.free(p)
    tempfile.gettempdir()
    os.setgroups([])
    os.setresgid(int(gid), int(gid), int(gid))
    os.setresuid(int(uid), int(uid), int(uid))
    hold(count, mib)


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
