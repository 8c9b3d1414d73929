"""Scenario 11: freeing memory while its tag is paused.

Part A, through PyTorch tensors: pause a tag, delete its tensors and empty the
cache; nothing is held physically, resume() is fine and the tag serves new
tensors. (PyTorch keeps a region's segments cached in the region's MemPool,
which the library keeps alive, so empty_cache() does not cudaFree them.)

Part B, through the hook's own entry points (what PyTorch calls:
cudaMalloc/cudaFree in preload mode, tms_torch_malloc/tms_torch_free in torch
mode): an allocation freed while paused leaves the table, resume() of its tag
is a no-op, and what the library holds is back at the baseline: no leak.

Part C (preload mode): a CUDA graph's private pool is freed by PyTorch
(cudaFree of every segment) while its tag is paused."""
import ctypes
import gc
import sys

import torch

from _common import (MiB, begin, check, check_filled, check_owned, check_released, check_states, core,
                     free_bytes, graph_body, mapped_bytes, owner, say, tag_bytes, warm_up)


def check_holds(base, what, more=0):
    """The library maps exactly base + more bytes (stats() counters)."""
    now = mapped_bytes()
    check(now == base + more, f"{what}: the library maps {now - base} bytes more than at the baseline, expected {more}")


def part_a_tensors(tms):
    say("-- A: delete a paused tag's tensors")
    base = mapped_bytes()
    with tms.region(tag="f"):
        tensors = [torch.empty(256 * MiB, dtype=torch.uint8, device="cuda"),
                   torch.randn(64 * MiB, device="cuda")]
    held = tag_bytes("f")
    check_holds(base, "allocating tag 'f'", held)
    check_released(tms.pause("f"), held, "pause('f')")
    del tensors
    gc.collect()
    torch.cuda.empty_cache()
    left = [r["state"] for r in core().allocations() if r["tag"] == "f"]
    check(set(left) <= {"paused"}, f"tag 'f' after its tensors were deleted while paused: {left}")
    check_holds(base, "paused, tensors deleted, cache emptied vs before the region")   # nothing mapped
    tms.resume("f")
    with tms.region(tag="f"):
        fresh = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    check_owned(fresh, "f", "new tensor in tag 'f'")
    fresh.fill_(5)
    check_filled(fresh, 5, "new tensor in tag 'f'")
    tms.pause("f")
    tms.resume("f")
    fresh.fill_(6)
    check_filled(fresh, 6, "new tensor in tag 'f' after a cycle")
    say("resume after the deletion fine; the tag serves and cycles new tensors")


class HookEntryPoints:
    """The allocator entry points of the loaded library variant, as PyTorch calls them."""

    def __init__(self, hook_mode):
        self.hook_mode = hook_mode
        lib = ctypes.CDLL(core().library_path())
        if hook_mode == "preload":
            self._malloc, self._free = lib.cudaMalloc, lib.cudaFree
            self._malloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t]
            self._free.argtypes = [ctypes.c_void_p]
            self._malloc.restype = self._free.restype = ctypes.c_int
        else:
            self._malloc, self._free = lib.tms_torch_malloc, lib.tms_torch_free
            self._malloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
            self._malloc.restype = ctypes.c_void_p
            self._free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
            self._free.restype = None

    def malloc(self, size):
        if self.hook_mode == "preload":
            ptr = ctypes.c_void_p()
            rc = self._malloc(ctypes.byref(ptr), size)
            check(rc == 0 and ptr.value, f"cudaMalloc({size}) in a region failed: {rc}")
            return ptr.value
        ptr = self._malloc(size, torch.cuda.current_device(), None)
        check(ptr, f"tms_torch_malloc({size}) failed: {core().last_hook_error()}")
        return ptr

    def free(self, ptr, size):
        if self.hook_mode == "preload":
            rc = self._free(ptr)
            check(rc == 0, f"cudaFree(0x{ptr:x}) returned {rc}: {core().last_hook_error()}")
        else:
            self._free(ptr, size, torch.cuda.current_device(), None)


def part_b_hook(tms, hook_mode):
    say("-- B: free through the hook while paused")
    hook = HookEntryPoints(hook_mode)
    size = 96 * MiB + 4096
    base = mapped_bytes()
    for tag, backup in (("raw", False), ("raw_backup", True)):
        with tms.region(tag=tag, enable_cpu_backup=backup):
            ptr = hook.malloc(size)
            row = owner(ptr)
            check(row is not None and row["tag"] == tag and row["state"] == "active",
                  f"hook allocation not recorded as active in tag {tag!r}: {row}")
            check_holds(base, f"hook allocation in '{tag}'", row["reserved"])
            report = tms.pause(tag)
            check(owner(ptr)["state"] == "paused", f"hook allocation in {tag!r} not paused")
            check_released(report, row["reserved"], f"pause('{tag}')")
            hook.free(ptr, size)
            check(owner(ptr) is None, f"allocation in {tag!r} freed while paused is still in the table")
            check(core().host_budget()["mine"] == 0, f"the backup of the allocation freed while paused is still held: "
                                                     f"{core().host_budget()}")
            for report in (tms.resume(tag), tms.pause(tag), tms.resume(tag)):   # nothing left in the tag: no-ops
                check(report.released_bytes == 0 and report.allocations == 0, f"{report.op} of an emptied tag did "
                                                                              f"something: {report!r}")
            check(tag_bytes(tag) == 0, f"tag {tag!r} still holds {tag_bytes(tag)} bytes")
            check_holds(base, f"after freeing the paused allocation of '{tag}' vs the baseline")

            again = hook.malloc(size)
            check(owner(again)["tag"] == tag, f"new hook allocation not in tag {tag!r}")
            check_holds(base, f"new allocation in '{tag}'", owner(again)["reserved"])
            hook.free(again, size)     # active this time
            check(owner(again) is None, "allocation freed while active is still in the table")
            check_holds(base, f"after freeing the active allocation of '{tag}' vs the baseline")
    say("freed while paused: gone from the table, resume a no-op, no memory leaked")


def part_c_graph_pool(tms):
    say("-- C: PyTorch frees a CUDA graph's pool while its tag is paused")
    x = torch.randn(32 * MiB, device="cuda")
    warm_up(graph_body, x)
    torch.cuda.empty_cache()
    base = mapped_bytes()
    graph = torch.cuda.CUDAGraph()
    with tms.cuda_graph(graph, tag="gfree"):
        out = graph_body(x)
    graph.replay()
    torch.cuda.synchronize()
    held = tag_bytes("gfree")
    check(held >= x.nbytes, f"graph pool in tag 'gfree' holds {held} bytes, less than one intermediate")
    report = tms.pause("gfree")
    check_states("gfree", "paused")
    check_released(report, held, "pause('gfree')")
    del out
    graph.reset()
    del graph
    gc.collect()
    torch.cuda.empty_cache()   # the pool is unreferenced now: PyTorch cudaFrees its segments
    left = tag_bytes("gfree")
    check(left == 0, f"{left} bytes of the graph's pool are still in the table after PyTorch freed it")
    tms.resume("gfree")        # nothing left in the tag: a no-op
    check_holds(base, "after the graph and its paused pool were freed vs before the capture")
    say("graph pool freed while paused; nothing leaked")


def main(hook_mode):
    tms = begin("free_while_paused", hook_mode)
    free_bytes()
    part_a_tensors(tms)
    part_b_hook(tms, hook_mode)
    if hook_mode == "preload":
        part_c_graph_pool(tms)
    else:
        say("-- C skipped: in torch mode a graph captured with cuda_graph() uses the tag's MemPool, which the "
            "library keeps")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
