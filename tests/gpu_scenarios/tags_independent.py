"""Scenario 5: tags pause and resume independently; pause()/resume() without a
tag act on all. Misuse (double pause, resume of an active tag) raises the
library's Error (a RuntimeError) naming the tag, and the process carries on.
A tag that was never used is a no-op."""
import sys

import torch

from _common import (MiB, allocations, begin, check, check_equal, check_released, check_states, check_taken, core,
                     expect_error, free_bytes, mapped_bytes, random_tensor, say, tag_bytes)


def main(hook_mode):
    tms = begin("tags_independent", hook_mode)
    free_bytes()  # CUDA context up before the regions

    with tms.region(tag="a", enable_cpu_backup=True):
        a = {"a float": torch.randn(32 * MiB, device="cuda"),             # 128 MiB
             "a int": random_tensor(2 * MiB, torch.int64)}               # 16 MiB
    with tms.region(tag="b", enable_cpu_backup=True):
        # Small values: the arithmetic below must not overflow.
        b = {"b int": torch.randint(-2**20, 2**20, (8 * MiB,), dtype=torch.int32, device="cuda"),  # 32 MiB
             "b float": torch.randn(4 * MiB, device="cuda")}             # 16 MiB
    expect_a = {k: v.cpu() for k, v in a.items()}
    expect_b = {k: v.cpu() for k, v in b.items()}
    bytes_a, bytes_b = tag_bytes("a"), tag_bytes("b")
    say(f"tag a holds {bytes_a / MiB:.0f} MiB, tag b {bytes_b / MiB:.0f} MiB")

    say("-- pause('a') releases a's memory only")
    report = tms.pause("a")
    check_states("a", "paused")
    check_states("b", "active")
    check_released(report, bytes_a, "pause('a')")   # exactly a's: nothing of b's
    check(report.allocations == len(allocations("a")),
          f"pause('a') paused {report.allocations} allocations, tag a has {len(allocations('a'))}")

    # b is fully usable meanwhile: compute on it and keep the result.
    b["b int"].mul_(3).add_(7)
    b["b float"].mul_(0.5)
    expect_b["b int"] = expect_b["b int"] * 3 + 7
    expect_b["b float"] = expect_b["b float"] * 0.5
    for k, v in b.items():
        check_equal(v, expect_b[k], f"{k} computed on while a is paused")
    say("b computed on while a is paused")

    say("-- misuse raises and names the tag")
    err = expect_error(RuntimeError, lambda: tms.pause("a"), "tag 'a'", "already paused")
    check(type(err) is core().Error, f"double pause raised {type(err)!r}, expected {core().Error!r}")
    tms.resume("a")
    check_states("a", "active")
    for k, v in a.items():
        check_equal(v, expect_a[k], f"{k} after resume('a')")
    err = expect_error(RuntimeError, lambda: tms.resume("a"), "tag 'a'", "not paused")
    check(type(err) is core().Error, f"resume of an active tag raised {type(err)!r}, expected {core().Error!r}")

    say("-- a tag never used: no-op")
    mapped = mapped_bytes()
    for report in (tms.pause("nope"), tms.resume("nope")):
        check((report.released_bytes, report.allocations, report.devices) == (0, 0, {}),
              f"{report.op} of an unused tag did something: {report!r}")
    check_states("a", "active")
    check_states("b", "active")
    check(mapped_bytes() == mapped, "pause/resume of an unused tag changed what the library holds mapped")

    say("-- pause()/resume() with no tag act on every tag")
    report = tms.pause()
    check_states("a", "paused")
    check_states("b", "paused")
    check_released(report, bytes_a + bytes_b, "pause()")
    expect_error(RuntimeError, lambda: tms.pause("b"), "tag 'b'", "already paused")
    check_taken(tms.resume(), bytes_a + bytes_b, "resume()")
    check_states("a", "active")
    check_states("b", "active")
    for k, v in a.items():
        check_equal(v, expect_a[k], f"{k} after resume()")
    for k, v in b.items():
        check_equal(v, expect_b[k], f"{k} after resume()")

    say("-- the process carries on after the errors")
    tms.pause("b")
    tms.resume("b")
    a["a float"].add_(1.0)
    check_equal(a["a float"], expect_a["a float"] + 1.0, "a computed on after the cycles")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
