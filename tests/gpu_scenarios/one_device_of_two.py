"""Needs 2 GPUs, both visible: a process that calls torch.cuda.set_device(1), as a
rank of a tensor-parallel group does, uses every public call (regions of each backup
kind, retained backups, cuda_graph, disable(), pause and resume, get_cpu_backup,
stats, memory_report, a torch.distributed group pause over NCCL) and then has no
primary context of its own on GPU 0, as the driver reports it
(cuDevicePrimaryCtxGetState, asked through libcuda directly). Then the same process
starts using GPU 0 as well: a region entered after set_device(0) pauses and resumes
there, and GPU 1's tensors stay exact."""
import ctypes
import os
import socket
import sys
import tempfile

import torch

from _common import (MiB, begin, check, check_equal, check_released, check_states, graph_body,
                     random_tensor, say, tag_bytes, warm_up)


def primary_context_active(device):
    """The driver's word on whether this process holds a primary context on device."""
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    check(cuda.cuDeviceGet(ctypes.byref(dev), device) == 0, f"cuDeviceGet({device}) failed")
    check(cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0,
          f"cuDevicePrimaryCtxGetState({device}) failed")
    return bool(active.value)


def every_call_on_gpu_1(tms):
    import torch.distributed as dist

    from torch_memory_saver import distributed as tmsd

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 1))
    dist.all_gather_object([None], 0)  # NCCL takes its buffers at the first collective, not inside a count
    tensors = {}
    with tempfile.TemporaryDirectory() as disk_dir:
        tms.set_disk_backup_dir(disk_dir)
        for tag, kwargs in (("mmap", {"enable_cpu_backup": True}),
                            ("pinned", {"enable_cpu_backup": True, "cpu_backup_backend": "pinned"}),
                            ("disk", {"enable_disk_backup": True}), ("kv", {})):
            with tms.region(tag, **kwargs):
                tensors[tag] = random_tensor(256 * MiB + 7, torch.uint8)
        check(all(t.device == torch.device("cuda", 1) for t in tensors.values()), "a tensor is not on cuda:1")
        expected = {tag: t.cpu() for tag, t in tensors.items()}
        x = torch.randn(8 * MiB, device="cuda")
        warm_up(graph_body, x)
        graph = torch.cuda.CUDAGraph()
        with tms.cuda_graph(graph, tag="graph"):
            out = graph_body(x)
        with tms.disable():
            scratch = torch.ones(16 * MiB, device="cuda")
            del scratch
        tms.retain_cpu_backup = True
        for cycle in range(2):
            held = sum(tag_bytes(t) for t in ("mmap", "pinned", "disk", "kv", "graph"))
            reports = tmsd.pause(["mmap", "pinned", "disk", "kv", "graph"])
            check(sorted(reports[0].devices) == [1], f"the group pause touched devices {sorted(reports[0].devices)}")
            check_released(reports[0], held, f"cycle {cycle}: group pause on cuda:1", device=1)
            check(tms.get_cpu_backup(tensors["mmap"]) is not None, "no CPU view of the paused mmap tensor")
            tmsd.resume(stages=[["mmap", "pinned", "disk", "graph"], ["kv"]])
            for tag in ("mmap", "pinned", "disk"):
                check_equal(tensors[tag], expected[tag], f"cycle {cycle}: {tag}")
            graph.replay()
            check_equal(out, graph_body(x).cpu(), f"cycle {cycle}: graph replay")
        tms.stats(), tms.memory_summary(), tms.allocations()
        report = tms.memory_report()
        check(sorted(report) == [1], f"memory_report() covers devices {sorted(report)}")
        dist.destroy_process_group()
    return tensors, expected


def main(hook_mode):
    tms = begin("one_device_of_two", hook_mode)
    check(torch.cuda.device_count() >= 2, "needs 2 GPUs")
    check(not primary_context_active(0) and not primary_context_active(1), "a context exists before any work")
    torch.cuda.set_device(1)
    tensors, expected = every_call_on_gpu_1(tms)
    torch.cuda.synchronize()
    check(primary_context_active(1), "no context on GPU 1 after all that work")
    check(not primary_context_active(0), "the process made a context on GPU 0, which it never used")
    say("every call on GPU 1: no context on GPU 0")

    # The same process now uses GPU 0 as well: a region entered there is pauseable there.
    torch.cuda.set_device(0)
    with tms.region("zero", enable_cpu_backup=True):
        zero = random_tensor(128 * MiB, torch.int32)
    check(zero.device == torch.device("cuda", 0), f"allocated on {zero.device}")
    want = zero.cpu()
    report = tms.pause("zero")
    check(sorted(report.devices) == [0], f"pause('zero') touched devices {sorted(report.devices)}")
    check_released(report, tag_bytes("zero", 0), "pause on cuda:0", device=0)
    check_states("zero", "paused")
    tms.resume("zero")
    check_equal(zero, want, "cuda:0 tensor after resume")
    for tag in ("mmap", "pinned", "disk"):
        check_equal(tensors[tag], expected[tag], f"cuda:1 {tag} after GPU 0's cycle")
    say("a second GPU in the same process: paused and resumed there")
    print("OK")


if __name__ == "__main__":
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    main(sys.argv[1])
