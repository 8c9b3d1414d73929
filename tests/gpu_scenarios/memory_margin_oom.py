"""Scenario 9: memory_margin_bytes makes a region allocation that would leave
less than the margin free fail with out-of-memory, which PyTorch raises as its
own torch.OutOfMemoryError; the program catches it, lowers the margin, and the
same allocation then succeeds. The process exits 0."""
import sys

import torch

from _common import GiB, MiB, allocations, begin, check, check_filled, check_owned, free_bytes, mapped_bytes, say, tag_bytes

TorchOOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)
TAG = "m"


def main(hook_mode):
    tms = begin("memory_margin_oom", hook_mode)
    free0 = free_bytes()
    check(free0 > 4 * GiB, f"needs more than 4 GiB free on the device, has {free0 / GiB:.1f} GiB")
    margin = free0 - GiB
    tms.memory_margin_bytes = margin
    check(tms.memory_margin_bytes == margin, "memory_margin_bytes did not read back")
    say(f"free {free0 / GiB:.2f} GiB, margin set to {margin / GiB:.2f} GiB (free - 1 GiB)")

    # One region entry for the whole scenario.
    with tms.region(tag=TAG):
        small = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")   # leaves ~768 MiB above the margin
        small.fill_(1)
        check_owned(small, TAG, "256 MiB allocation within the margin")
        say("256 MiB allocation (within the margin) succeeded")

        before = (mapped_bytes(), len(allocations()))
        try:
            torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
        except TorchOOM as e:
            say(f"2 GiB allocation (past the margin) raised {type(e).__module__}.{type(e).__name__}: "
                f"{str(e).splitlines()[0][:160]}")
        else:
            raise AssertionError("a 2 GiB allocation that crosses memory_margin_bytes did not raise "
                                 "torch.OutOfMemoryError")
        check(tag_bytes(TAG) == check_owned(small, TAG, "small tensor")["reserved"],
              f"the failed allocation left something behind in tag {TAG!r}: {tag_bytes(TAG)} bytes")
        check((mapped_bytes(), len(allocations())) == before,
              f"the failed allocation changed what the library holds: (mapped bytes, allocations) {before} -> "
              f"{(mapped_bytes(), len(allocations()))}")

        tms.memory_margin_bytes = 0
        big = torch.empty(2 * GiB, dtype=torch.uint8, device="cuda")
        check_owned(big, TAG, "2 GiB allocation after lowering the margin")
        say("with margin 0 the same 2 GiB allocation succeeded")

    big.fill_(7)
    check_filled(big, 7, "2 GiB tensor")
    check_filled(small, 1, "256 MiB tensor")
    tms.pause(TAG)
    tms.resume(TAG)
    big.fill_(8)
    check_filled(big, 8, "2 GiB tensor after a pause/resume cycle")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
