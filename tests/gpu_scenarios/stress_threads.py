"""Concurrency on the GPU: threads allocate and free tensors in regions of
their own tags while the main thread pauses and resumes another tag with backups;
contents are checked every cycle, nothing deadlocks, no allocation is lost."""
import sys
import threading

import torch

from _common import MiB, begin, check, core, say

CYCLES = 40
THREADS = 3


def main(hook_mode):
    tms = begin("stress_threads", hook_mode)
    torch.cuda.synchronize()
    with tms.region(tag="shared", enable_cpu_backup=True):
        shared = torch.randn(32 * MiB, device="cuda")
    expect = shared.cpu()
    stop = threading.Event()
    errors = []
    kept = {}

    def worker(i):
        try:
            torch.cuda.set_device(0)
            tag = f"worker{i}"
            mine = []
            n = 0
            while not stop.is_set() or n < 10:
                with tms.region(tag=tag):
                    mine.append(torch.full((MiB + 4096 * (n % 7),), float(n), device="cuda"))
                if len(mine) > 4:
                    old = mine.pop(0)
                    check(float(old[-1]) == float(old[0]), f"{tag}: a live tensor lost its contents")
                    del old
                n += 1
            kept[tag] = mine
        except BaseException as e:  # reported by the main thread
            errors.append(f"worker {i}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for cycle in range(CYCLES):
        tms.pause("shared")
        tms.resume("shared")
        check(torch.equal(shared.cpu(), expect), f"cycle {cycle}: shared tensor differs after resume")
    stop.set()
    for t in threads:
        t.join(timeout=120)
        check(not t.is_alive(), "a worker thread is stuck (deadlock?)")
    check(not errors, "; ".join(errors))
    for tag, tensors in kept.items():
        rows = [r for r in core().allocations() if r["tag"] == tag]
        check(rows, f"{tag}: its live tensors have no allocation in the table")
        for x in tensors:
            check(any(r["ptr"] <= x.data_ptr() < r["ptr"] + r["reserved"] for r in rows),
                  f"{tag}: live tensor 0x{x.data_ptr():x} not found in the table")
    say(f"{CYCLES} pause/resume cycles beside {THREADS} allocating threads")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
