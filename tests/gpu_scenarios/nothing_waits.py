"""Scenario: nothing waits for a pause in progress.

One thread pauses 4 GiB of random data with backup. While the table shows it
"pausing", another thread frees memory of a different tag through the hook's
own entry points (what PyTorch calls), reads stats(), in preload mode makes
and frees a pass-through cudaMalloc outside any region, and frees an
allocation of the tag being paused. Each of these completes while the big
allocation is still moving (the table lock never spans the pause's copies or
synchronisation); the free of the moving allocation returns at once and the
pause finishes it. Then every byte of the big tensor comes back."""
import sys
import threading
import time

import torch

from _common import (GiB, MiB, begin, check, check_states, free_bytes, owner, random_tensor, raw_cuda_free,
                     raw_cuda_malloc, say)
from free_while_paused import HookEntryPoints


def main(hook_mode):
    tms = begin("nothing_waits", hook_mode)
    hook = HookEntryPoints(hook_mode)
    with tms.region(tag="big", enable_cpu_backup=True):
        big = random_tensor(4 * GiB // 4, torch.int32)
    expected = big.cpu()
    with tms.region(tag="small"):
        small = hook.malloc(64 * MiB)
    with tms.region(tag="big"):
        doomed = hook.malloc(2 * MiB)
    free_bytes()

    outcome = {}

    def pause():
        t0 = time.perf_counter()
        tms.pause("big")
        outcome["seconds"] = time.perf_counter() - t0

    latency = {}

    def timed(name, fn):
        t0 = time.perf_counter()
        fn()
        latency[name] = (time.perf_counter() - t0) * 1e3

    thread = threading.Thread(target=pause)
    thread.start()
    while owner(big)["state"] == "active":
        pass                                                   # claimed: the pause is under way
    timed("free in another tag", lambda: hook.free(small, 64 * MiB))
    timed("stats()", tms.stats)
    if hook_mode == "preload":
        timed("pass-through cudaMalloc+cudaFree", lambda: raw_cuda_free(raw_cuda_malloc(2 * MiB)))
    timed("free of an allocation being paused", lambda: hook.free(doomed, 2 * MiB))
    state_after = owner(big)["state"]
    thread.join()
    say(f"  pause of 4 GiB took {outcome['seconds'] * 1e3:.0f} ms; meanwhile (ms): "
        + ", ".join(f"{k} {v:.2f}" for k, v in latency.items()))
    check(state_after == "pausing",
          f"the calls above waited for the pause: the big allocation was {state_after!r} after them")
    check(owner(doomed) is None, "the allocation freed while its tag was being paused is still in the table")
    check(owner(small) is None, "the allocation freed in another tag is still in the table")
    check_states("big", "paused")
    tms.resume("big")
    check(torch.equal(big.cpu(), expected), "the big tensor's contents changed across the pause")
    say("every call completed while the pause was moving memory; contents intact")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
