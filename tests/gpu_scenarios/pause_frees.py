"""Scenario 1: pausing a region of ~1 GiB frees its device memory; resuming maps
it back at the same addresses and the tensors are usable again."""
import sys

import torch

from _common import (MiB, allocations, begin, check, check_filled, check_owned, check_released, check_states,
                     check_taken, free_bytes, say, tag_bytes)

TAG = "kv"


def main(hook_mode):
    tms = begin("pause_frees", hook_mode)
    free_bytes()  # CUDA context up before the region

    # Sizes >= 10 MiB and multiples of 2 MiB: PyTorch gives each its own segment.
    with tms.region(tag=TAG):
        tensors = [
            torch.empty(512 * MiB, dtype=torch.uint8, device="cuda"),
            torch.empty(64 * MiB, dtype=torch.float32, device="cuda"),   # 256 MiB
            torch.empty(32 * MiB, dtype=torch.float64, device="cuda"),   # 256 MiB
        ]
    nbytes = sum(t.nbytes for t in tensors)
    for i, t in enumerate(tensors):
        check_owned(t, TAG, f"tensor {i}")
        t.fill_(i + 1)
    held = tag_bytes(TAG)
    say(f"region '{TAG}': {len(tensors)} tensors, {nbytes / MiB:.0f} MiB of data, {held / MiB:.0f} MiB mapped")
    check(held >= nbytes, f"the library holds {held} bytes for tag {TAG!r}, less than the tensors' {nbytes}")
    ptrs = [t.data_ptr() for t in tensors]

    report = tms.pause(TAG)
    check_states(TAG, "paused")
    check_released(report, held, "pause")
    rows = len(allocations(TAG))
    check(report.allocations == rows, f"the pause covered {report.allocations} allocations, the tag has {rows}")

    report = tms.resume(TAG)
    check_states(TAG, "active")
    check_taken(report, held, "resume")

    check([t.data_ptr() for t in tensors] == ptrs, "data_ptr() changed across pause/resume")
    say("data_ptr() unchanged")
    # Each tensor is mapped at its own address again: write all, then read all.
    for i, t in enumerate(tensors):
        t.fill_(10 + i)
    for i, t in enumerate(tensors):
        check_filled(t, 10 + i, f"tensor {i} after resume")
    say("tensors writable and readable after resume")

    # A second cycle behaves the same.
    check_released(tms.pause(TAG), held, "second pause")
    tms.resume(TAG)
    tensors[0].fill_(99)
    check_filled(tensors[0], 99, "tensor 0 after the second resume")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
