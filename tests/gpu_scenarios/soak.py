"""A load test: 200 pause/resume cycles over mixed tags and backups, with a
content check every cycle, every pause and resume releasing and mapping exactly
what the tags hold, and nothing left behind between cycles (the library's counts
of what it maps, its allocations and its host backups stay where they were)."""
import sys

import torch

from _common import MiB, allocations, begin, check, core, free_bytes, mapped_bytes, say, tag_bytes

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
    held = {tag: tag_bytes(tag) for tag in tags}
    moved = []  # (op, tags, report) of every call of a cycle

    def call(op, *tag):
        moved.append((op, tag[0] if tag else tags, getattr(tms, op)(*tag)))

    def held_now():
        return mapped_bytes(), len(allocations()), core().host_budget()["mine"]

    start = held_now()
    for cycle in range(CYCLES):
        for t in w_mmap:
            t.uniform_(generator=gen)
        w_pinned.random_(generator=gen)
        kv.fill_(cycle % 251)
        expect = [t.clone() for t in w_mmap] + [w_pinned.clone()]
        # Mixed orders: all at once, one by one, and partial sets.
        which = cycle % 3
        moved.clear()
        if which == 0:
            call("pause")
            call("resume")
        elif which == 1:
            for tag in tags:
                call("pause", tag)
            for tag in reversed(tags):
                call("resume", tag)
        else:
            call("pause", "w_mmap")
            call("pause", "w_pinned")
            call("resume", "w_mmap")
            call("resume", "w_pinned")
        for op, covered, report in moved:
            want = held[covered] if isinstance(covered, str) else sum(held.values())
            check(report.released_bytes == want, f"cycle {cycle}: {op}({covered}) moved {report.released_bytes} "
                                                 f"bytes, the tags hold {want}")
        got = list(w_mmap) + [w_pinned]
        for i, (e, g) in enumerate(zip(expect, got)):
            check(torch.equal(e, g), f"cycle {cycle}: tensor {i} differs after pause/resume")
        del expect
        kv.fill_(1)                                              # discarded memory is usable again
        check(int(kv[-1]) == 1, f"cycle {cycle}: kv unusable after resume")
        check(held_now() == start, f"cycle {cycle}: (bytes mapped, allocations, host backup bytes) "
                                   f"{held_now()}, before the cycles {start}")
    stats = tms.stats()[torch.cuda.current_device()]
    check(stats["w_mmap"]["pauses"] == CYCLES and stats["w_mmap"]["resumes"] == CYCLES,
          f"stats count {stats['w_mmap']['pauses']} pauses, {stats['w_mmap']['resumes']} resumes")
    say(f"{CYCLES} cycles, contents exact every cycle")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
