"""Expandable segments, the launcher way (slime, AReaL): preload mode with TMS_INIT_ENABLE=1
and TMS_INIT_ENABLE_CPU_BACKUP=1 and PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
(the harness sets them). Every allocation of the process lands in PyTorch's
default pool, one expandable segment that PyTorch itself grows and shrinks:
torch.cuda.empty_cache() unmaps the pages of freed tensors while the tag is paused
(nothing is mapped there: the library finishes the unmap and drops their backup)
and while it is active, and the live tensors come back bit-exact either way."""
import os
import sys

import torch

from _common import (MiB, allocations, begin, check, check_equal, check_released, check_states, check_taken,
                     free_bytes, owner, random_tensor, say, tag_bytes)


def main(hook_mode):
    check(hook_mode == "preload", "the default pool reaches the library in preload mode only")
    check(os.environ.get("TMS_INIT_ENABLE") == "1" and "expandable_segments:True" in
          os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""), "run with TMS_INIT_ENABLE=1 and expandable segments")
    tms = begin("expandable_default_pool", hook_mode)
    a = random_tensor(300 * MiB, torch.uint8)
    b = random_tensor(100 * MiB, torch.uint8)
    c = random_tensor(200 * MiB + 3, torch.uint8)
    refs = {"a": a.cpu(), "c": c.cpu()}
    ptrs = {"a": a.data_ptr(), "c": c.data_ptr()}
    for name, t in (("a", a), ("b", b), ("c", c)):
        row = owner(t)
        check(row is not None and row["tag"] == "default" and row["adopted"],
              f"{name}: not adopted under tag 'default': {row}")

    held = tag_bytes("default")
    before = free_bytes()
    tms.pause()
    paused = free_bytes()
    check_states("default", "paused")
    check_released(before, paused, held, "pause()")

    # PyTorch shrinks the paused segment: b's pages are unmapped by PyTorch itself.
    rows_paused = len(allocations("default"))
    del b
    torch.cuda.empty_cache()
    rows_after = len(allocations("default"))
    say(f"  empty_cache while paused: {rows_paused} -> {rows_after} allocations")
    check(rows_after <= rows_paused - 4, "empty_cache while paused did not give back b's pages (100 MiB)")
    check(abs(free_bytes() - paused) <= 64 * MiB, "empty_cache while paused changed device memory")

    tms.resume()
    check_taken(paused, free_bytes(), tag_bytes("default"), "resume()")
    check(a.data_ptr() == ptrs["a"] and c.data_ptr() == ptrs["c"], "tensors moved")
    check_equal(a, refs["a"], "a after resume")
    check_equal(c, refs["c"], "c after resume")

    # PyTorch shrinks the active segment.
    del a
    before = free_bytes()
    torch.cuda.empty_cache()
    gained = free_bytes() - before
    say(f"  empty_cache while active: free memory +{gained / MiB:.0f} MiB")
    check(gained >= 260 * MiB, f"empty_cache while active gave back {gained / MiB:.0f} MiB of a's 300 MiB")

    # The segment grows again after the resume; the new pages pause with the tag.
    d = random_tensor(150 * MiB, torch.uint8)
    d_ref = d.cpu()
    check(owner(d) is not None and owner(d)["adopted"], "a tensor allocated after resume is not pauseable")
    held = tag_bytes("default")
    before = free_bytes()
    tms.pause()
    check_released(before, free_bytes(), held, "second pause()")
    tms.resume()
    check_equal(c, refs["c"], "c after the second resume")
    check_equal(d, d_ref, "d after the second resume")
    tms.pause()  # exits paused
    say("OK")


if __name__ == "__main__":
    main(sys.argv[1])
