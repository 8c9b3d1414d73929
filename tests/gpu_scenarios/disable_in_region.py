"""Scenario 6: inside a region, `with disable():` gives ordinary memory. Pausing
the region's tag releases the region tensor's memory but not the disabled one,
which stays usable with its contents intact while the tag is paused."""
import sys

import torch

from _common import (MiB, begin, check, check_equal, check_owned, check_released, check_states, free_bytes,
                     owner, say, tag_bytes)


def main(hook_mode):
    tms = begin("disable_in_region", hook_mode)
    free_bytes()  # CUDA context up before the region

    with tms.region(tag="x"):
        inside = torch.randn(64 * MiB, device="cuda")            # 256 MiB, pauseable
        with tms.disable():
            ordinary = torch.randn(48 * MiB, device="cuda")      # 192 MiB, ordinary memory
        after = torch.randn(16 * MiB, device="cuda")             # 64 MiB: the region again
    check_owned(inside, "x", "tensor allocated in the region")
    check_owned(after, "x", "tensor allocated in the region after disable()")
    check(owner(ordinary) is None, "the tensor allocated under disable() is a torch_memory_saver allocation")
    say("allocation under disable() is ordinary; the region resumes after it")

    expected = ordinary.cpu()
    expected_result = (ordinary * 2 + 1).sum().cpu()   # same kernels as below: bit-identical
    held = tag_bytes("x")

    report = tms.pause("x")
    check_states("x", "paused")
    check_released(report, held, "pause('x')")   # exactly the region's: the disabled tensor's memory stays

    # The disabled tensor is untouched by the pause: read it and compute on it.
    check_equal(ordinary, expected, "disabled tensor while the tag is paused")
    check_equal((ordinary * 2 + 1).sum(), expected_result, "computation on the disabled tensor while paused")
    ordinary.mul_(-1.0)
    check_equal(ordinary, -expected, "disabled tensor written while the tag is paused")
    say("disabled tensor readable, writable and intact while the tag is paused")

    tms.resume("x")
    inside.fill_(3.0)
    check(bool((inside == 3.0).all()), "region tensor not usable after resume")
    check_equal(ordinary, -expected, "disabled tensor after resume")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
