"""Scenario 7 (run with TMS_INIT_ENABLE=1): regions nest and restore the outer
settings on exit. In preload mode, where every cudaMalloc of the process goes
through the library, an allocation outside any region is pauseable under tag
"default", also before any region was ever entered. In torch mode only region
pools reach the library, so the "default" part does not apply there."""
import os
import sys

import torch

from _common import (MiB, begin, check, check_filled, check_owned, check_released, check_states, check_taken,
                     core, free_bytes, owner, say, tag_bytes)


def pause_default_before_any_region(tms):
    """Preload + TMS_INIT_ENABLE=1: a plain allocation is pauseable as "default"."""
    say("-- allocation outside any region, before any region was entered")
    plain = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    plain.fill_(3)
    check_owned(plain, "default", "tensor allocated outside any region")
    held = tag_bytes("default")
    check(held >= plain.nbytes, f"tag 'default' holds {held} bytes, less than the tensor's {plain.nbytes}")
    report = tms.pause("default")
    check_states("default", "paused")
    check_released(report, held, "pause('default')")
    check_taken(tms.resume("default"), held, "resume('default')")
    plain.fill_(4)
    check_filled(plain, 4, "tensor outside any region after resume")
    return plain


def main(hook_mode):
    tms = begin("nested_init_enable", hook_mode)
    check(os.environ.get("TMS_INIT_ENABLE") == "1", "run this scenario with TMS_INIT_ENABLE=1")
    free_bytes()  # CUDA context up
    covers_default = hook_mode == "preload"
    if covers_default:
        plain = pause_default_before_any_region(tms)
    else:
        say("-- torch mode: allocations outside regions do not reach the library; 'default' part skipped")

    say("-- nested regions")
    # Sizes >= 10 MiB, multiples of 2 MiB, no frees: every tensor gets a fresh
    # segment, allocated with the region settings current at that moment.
    with tms.region(tag="outer"):
        outer_1 = torch.empty(96 * MiB, dtype=torch.uint8, device="cuda")
        with tms.region(tag="inner"):
            inner_1 = torch.empty(160 * MiB, dtype=torch.uint8, device="cuda")
        outer_2 = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
    after_outer = torch.empty(48 * MiB, dtype=torch.uint8, device="cuda")
    check_owned(outer_1, "outer", "tensor in the outer region")
    check_owned(inner_1, "inner", "tensor in the inner region")
    check_owned(outer_2, "outer", "tensor in the outer region after the inner one exited")
    if covers_default:
        check_owned(after_outer, "default", "tensor after the outer region exited")
        region = core().get_region()
        check(region[0] is True and region[1] == "default",
              f"after the regions exited the thread's settings are {region}, expected active tag 'default'")
    else:
        say(f"  torch mode: tensor after the regions is {'owned' if owner(after_outer) else 'not owned'} "
            f"by the library (not checked)")
    say("allocations landed in inner/outer/default as the nesting says")

    for value, t in ((1, outer_1), (2, outer_2), (5, after_outer)):
        t.fill_(value)
    held_inner = tag_bytes("inner")
    report = tms.pause("inner")
    check_states("inner", "paused")
    check_states("outer", "active")
    check_released(report, held_inner, "pause('inner')")   # exactly inner's: nothing of outer's
    for value, t, what in ((1, outer_1, "outer tensor 1"), (2, outer_2, "outer tensor 2"),
                           (5, after_outer, "tensor after the regions")):
        check_filled(t, value, f"{what} while 'inner' is paused")
        t.add_(1)
    tms.resume("inner")
    inner_1.fill_(9)
    check_filled(inner_1, 9, "inner tensor after resume")
    check_filled(outer_1, 2, "outer tensor 1 after the inner cycle")

    if covers_default:
        say("-- pause() of everything, 'default' included")
        total = tag_bytes("default") + tag_bytes("outer") + tag_bytes("inner")
        check_released(tms.pause(), total, "pause()")
        tms.resume()
        plain.fill_(7)
        check_filled(plain, 7, "tensor outside any region after resume()")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
