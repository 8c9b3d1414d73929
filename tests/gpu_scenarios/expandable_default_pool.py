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
                     mapped_bytes, owner, random_tensor, say, tag_bytes)


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
    report = tms.pause()
    check_states("default", "paused")
    check_released(report, held, "pause()")

    # PyTorch shrinks the paused segment: b's pages are unmapped by PyTorch itself.
    rows_paused = len(allocations("default"))
    del b
    torch.cuda.empty_cache()
    rows_after = len(allocations("default"))
    say(f"  empty_cache while paused: {rows_paused} -> {rows_after} allocations")
    check(rows_after <= rows_paused - 4, "empty_cache while paused did not give back b's pages (100 MiB)")
    check(mapped_bytes() == 0, f"empty_cache while paused mapped {mapped_bytes()} bytes of the library's")

    check_taken(tms.resume(), tag_bytes("default"), "resume()")
    check(a.data_ptr() == ptrs["a"] and c.data_ptr() == ptrs["c"], "tensors moved")
    check_equal(a, refs["a"], "a after resume")
    check_equal(c, refs["c"], "c after resume")

    # PyTorch shrinks the active segment: at least every page wholly inside a goes.
    a_end = ptrs["a"] + a.nbytes
    a_pages = sum(r["reserved"] for r in allocations("default") if ptrs["a"] <= r["ptr"] and r["ptr"] + r["reserved"] <= a_end)
    del a
    before = mapped_bytes()
    torch.cuda.empty_cache()
    gained = before - mapped_bytes()
    say(f"  empty_cache while active: the library maps {gained / MiB:.0f} MiB less (a's pages: {a_pages / MiB:.0f} MiB)")
    check(a_pages >= 296 * MiB and gained >= a_pages,
          f"empty_cache while active gave back {gained} bytes; the pages wholly inside a hold {a_pages}")

    # The segment grows again after the resume; the new pages pause with the tag.
    d = random_tensor(150 * MiB, torch.uint8)
    d_ref = d.cpu()
    check(owner(d) is not None and owner(d)["adopted"], "a tensor allocated after resume is not pauseable")
    check_released(tms.pause(), tag_bytes("default"), "second pause()")
    tms.resume()
    check_equal(c, refs["c"], "c after the second resume")
    check_equal(d, d_ref, "d after the second resume")
    tms.pause()  # exits paused
    say("OK")


if __name__ == "__main__":
    main(sys.argv[1])
