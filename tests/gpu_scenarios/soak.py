"""A load test: 200 pause/resume cycles over mixed tags and backups, with a
content check every cycle and no growth of host RSS or device memory between
cycles once warm."""
import sys

import torch

from _common import MiB, begin, check, free_bytes, rss_bytes, say

CYCLES = 200


def main(hook_mode):
    tms = begin("soak", hook_mode)
    free_bytes()
    with tms.region(tag="kv"):                                   # discarded on pause
        kv = torch.empty(128 * MiB, dtype=torch.uint8, device="cuda")
    with tms.region(tag="w_mmap", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        w_mmap = [torch.empty(n, dtype=torch.float32, device="cuda") for n in (7 * MiB, 3 * MiB + 5)]
    with tms.region(tag="w_pinned", enable_cpu_backup=True, cpu_backup_backend="pinned"):
        w_pinned = torch.empty(5 * MiB, dtype=torch.int64, device="cuda")
    tags = ("kv", "w_mmap", "w_pinned")
    gen = torch.Generator(device="cuda").manual_seed(7)
    samples = {}
    for cycle in range(CYCLES):
        for t in w_mmap:
            t.uniform_(generator=gen)
        w_pinned.random_(generator=gen)
        kv.fill_(cycle % 251)
        expect = [t.clone() for t in w_mmap] + [w_pinned.clone()]
        # Mixed orders: all at once, one by one, and partial sets.
        which = cycle % 3
        if which == 0:
            tms.pause()
            tms.resume()
        elif which == 1:
            for tag in tags:
                tms.pause(tag)
            for tag in reversed(tags):
                tms.resume(tag)
        else:
            tms.pause("w_mmap")
            tms.pause("w_pinned")
            tms.resume("w_mmap")
            tms.resume("w_pinned")
        got = list(w_mmap) + [w_pinned]
        for i, (e, g) in enumerate(zip(expect, got)):
            check(torch.equal(e, g), f"cycle {cycle}: tensor {i} differs after pause/resume")
        del expect
        kv.fill_(1)                                              # discarded memory is usable again
        check(int(kv[-1]) == 1, f"cycle {cycle}: kv unusable after resume")
        if cycle in (20, CYCLES - 1):
            torch.cuda.synchronize()
            samples[cycle] = (rss_bytes(), free_bytes())
            say(f"cycle {cycle}: RSS {samples[cycle][0] / MiB:.1f} MiB, device free {samples[cycle][1] / MiB:.1f} MiB")
    (rss0, free0), (rss1, free1) = samples[20], samples[CYCLES - 1]
    check(rss1 - rss0 <= 64 * MiB, f"host RSS grew by {(rss1 - rss0) / MiB:.1f} MiB over {CYCLES - 20} cycles")
    check(free0 - free1 <= 64 * MiB, f"device free memory shrank by {(free0 - free1) / MiB:.1f} MiB")
    stats = tms.stats()[torch.cuda.current_device()]
    check(stats["w_mmap"]["pauses"] == CYCLES and stats["w_mmap"]["resumes"] == CYCLES,
          f"stats count {stats['w_mmap']['pauses']} pauses, {stats['w_mmap']['resumes']} resumes")
    say(f"{CYCLES} cycles, contents exact every cycle")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
