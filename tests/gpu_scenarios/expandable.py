"""PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (the harness sets it).

Region memory is pauseable: pause frees >= 95 % of what the region's tags hold,
a backed-up tag comes back bit-exact at the same addresses (get_cpu_backup of a
tensor spanning several expandable-segment pages included), tensors allocated
after a resume grow the same segment and pause with it, freeing a tensor and
calling empty_cache while paused and while active loses nothing live (PyTorch
2.11 does not shrink a live MemPool's segment: expandable_default_pool.py is
where PyTorch really unmaps pages under a paused tag), memory outside regions
keeps expandable segments and never moves. Preload mode must
show the region memory as adopted (PyTorch mapped it itself); torch mode serves
it through the MemPool's allocator, which this scenario reports."""
import os
import sys

import torch

from _common import (MiB, begin, check, check_equal, check_released, check_states, check_taken,
                     owner, random_tensor, say, tag_bytes)


def segment_of(ptr):
    for seg in torch.cuda.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    return None


def main(hook_mode):
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    check("expandable_segments:True" in conf, f"run with expandable segments on (PYTORCH_CUDA_ALLOC_CONF={conf!r})")
    tms = begin("expandable", hook_mode)

    outside = random_tensor(40 * MiB, torch.uint8)  # the default pool: expandable, never the library's
    outside_ref = outside.cpu()
    check(owner(outside) is None, "memory outside regions is the library's")
    seg = segment_of(outside.data_ptr())
    check(seg is not None and seg.get("is_expandable"), f"memory outside regions is not in an expandable segment: {seg}")

    sizes = [300 * MiB + 17, 50 * MiB, 3 * MiB + 5, 1000, 120 * MiB, 7 * MiB]
    with tms.region(tag="exp_weights", enable_cpu_backup=True):
        weights = [random_tensor(n, torch.uint8) for n in sizes]
        matrix = torch.randn(2048, 3001, device="cuda")[:, 5:]  # a strided view over several pages
    with tms.region(tag="exp_kv"):
        kv = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    refs = [w.cpu() for w in weights]
    matrix_ref = matrix.cpu()
    ptrs = [w.data_ptr() for w in weights]

    rows = [owner(w) for w in weights] + [owner(kv)]
    check(all(r is not None for r in rows), f"region tensors are not the library's: {rows}")
    adopted = {r["adopted"] for r in rows}
    region_seg = segment_of(weights[0].data_ptr())
    say(f"{hook_mode}: region memory adopted={adopted}, segment expandable={region_seg.get('is_expandable')}, "
        f"{len(tms._core.allocations())} allocations")
    if hook_mode == "preload":
        check(adopted == {True}, "preload mode: region memory was not adopted from PyTorch's expandable segments")
        check(region_seg.get("is_expandable"), "preload mode: the region's pool is not an expandable segment")

    check_released(tms.pause("exp_weights"), tag_bytes("exp_weights"), "pause of the weights")
    check_released(tms.pause("exp_kv"), tag_bytes("exp_kv"), "pause of the KV cache")
    check_states("exp_weights", "paused")

    host = tms.get_cpu_backup(weights[0])
    check(host is not None, "get_cpu_backup of a paused backed-up tensor is None")
    check_equal(host, refs[0], "get_cpu_backup of a 300 MiB tensor")
    check_equal(tms.get_cpu_backup(matrix), matrix_ref, "get_cpu_backup of a strided view")
    check(tms.get_cpu_backup(kv) is None, "get_cpu_backup of a tag without backup is not None")

    # A tensor freed and empty_cache while paused: nothing live is lost.
    dropped = weights.pop(1), refs.pop(1), ptrs.pop(1)
    del dropped
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    say(f"  empty_cache while paused: {len(tms._core.allocations())} allocations left")

    check_taken(tms.resume("exp_weights"), tag_bytes("exp_weights"), "resume of the weights")
    check_taken(tms.resume("exp_kv"), tag_bytes("exp_kv"), "resume of the KV cache")
    for i, (w, ref) in enumerate(zip(weights, refs)):
        check(w.data_ptr() == ptrs[i], f"weights[{i}] moved from 0x{ptrs[i]:x} to 0x{w.data_ptr():x}")
        check_equal(w, ref, f"weights[{i}] after resume")
    check_equal(matrix, matrix_ref, "strided view after resume")
    kv.fill_(3)  # usable again

    # New tensors after a resume: the same segment grows, and they pause with it.
    with tms.region(tag="exp_weights", enable_cpu_backup=True):
        grown = random_tensor(200 * MiB, torch.uint8)
    grown_ref = grown.cpu()
    check(owner(grown) is not None and owner(grown)["tag"] == "exp_weights", "a tensor grown after resume is not pauseable")
    if hook_mode == "preload":
        seg = segment_of(grown.data_ptr())
        check(seg["address"] == region_seg["address"], "a tensor after resume is not in the region's segment")

    # The same while active.
    del weights[0], refs[0], ptrs[0]
    torch.cuda.synchronize()
    before_shrink = torch.cuda.memory_reserved()
    torch.cuda.empty_cache()
    say(f"  empty_cache while active: PyTorch reserves {(before_shrink - torch.cuda.memory_reserved()) / MiB:.1f} MiB "
        f"less")

    check_released(tms.pause("exp_weights"), tag_bytes("exp_weights"), "second pause")
    tms.resume("exp_weights")
    check_equal(grown, grown_ref, "tensor grown after resume")
    for i, (w, ref) in enumerate(zip(weights, refs)):
        check_equal(w, ref, f"weights[{i}] after the second resume")
    check_equal(outside, outside_ref, "memory outside regions")

    tms.pause("exp_kv")  # exits with a tag paused
    say("OK")


if __name__ == "__main__":
    main(sys.argv[1])
