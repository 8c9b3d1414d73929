"""Needs 2 GPUs: one process per GPU, both GPUs visible, a torch.distributed group
over NCCL, as SGLang's and Megatron's ranks run. Each rank holds backed-up weights
and a discarded KV cache. A group pause releases both on every rank, and an
all_reduce works while paused. Then rank 1's GPU is filled with ordinary memory, so
its KV cache cannot come back: a staged group resume raises the same GroupError on
every rank (naming rank 1 and stage 2) and leaves every rank paused, weights
included. Rank 1 frees its filler, the resume is retried and succeeds, the weights
are exact on both ranks, and an all_reduce works again. Neither rank makes a
context on the other's GPU."""
import ctypes
import json
import os
import socket
import sys
import tempfile

import torch
import torch.multiprocessing as mp

from _common import GiB, begin, check, say

WEIGHTS = 1 * GiB
KV = 4 * GiB


def context_on(device):
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
    cuda.cuDeviceGet(ctypes.byref(dev), device)
    cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active))
    return bool(active.value)


def states(tms):
    return sorted({(r["tag"], r["state"]) for r in tms.allocations()})


def rank_main(rank, hook_mode, port, out):
    import torch.distributed as dist

    from torch_memory_saver import distributed as tmsd
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = hook_mode
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    result = {"rank": rank}
    with tms.region("weights", enable_cpu_backup=True):
        weights = [torch.randint(-2**31, 2**31 - 1, (WEIGHTS // 4 // 8,), dtype=torch.int32, device="cuda")
                   for _ in range(8)]
    with tms.region("kv_cache"):
        kv = torch.empty(KV, dtype=torch.uint8, device="cuda")
    kv.fill_(rank + 1)
    want = [w.cpu() for w in weights]
    ones = torch.ones(1024, device="cuda")
    # NCCL takes its buffers at a group's first collectives: before the count starts.
    dist.all_gather_object([None, None], rank)
    dist.all_reduce(ones.clone())
    torch.cuda.synchronize()
    held = sum(r["reserved"] for r in tms.allocations() if r["tag"] in ("weights", "kv_cache"))
    reports = tmsd.pause(["weights", "kv_cache"])
    result["released"] = [r.released_bytes for r in reports]
    check(held >= WEIGHTS + KV and reports[rank].released_bytes == held,
          f"rank {rank}: the pause released {reports[rank].released_bytes} bytes, the two tags hold {held}")
    s = ones.clone()
    dist.all_reduce(s)
    check(s[0].item() == 2.0, f"rank {rank}: all_reduce while paused gave {s[0].item()}")

    filler = None
    if rank == 1:  # ordinary memory takes the room the KV cache needs
        free = torch.cuda.mem_get_info()[0]
        filler = torch.empty(free - KV // 2, dtype=torch.uint8, device="cuda")
    dist.barrier()
    try:
        tmsd.resume(stages=[["weights"], ["kv_cache"]])
    except tmsd.GroupError as e:
        result["error"] = str(e)
        result["failed"] = sorted(e.failures)
        result["stage"] = e.stage
    else:
        raise AssertionError(f"rank {rank}: the staged resume succeeded with GPU 1 full")
    result["after_failure"] = states(tms)
    del filler
    torch.cuda.empty_cache()
    dist.barrier()
    tmsd.resume(stages=[["weights"], ["kv_cache"]])
    result["after_retry"] = states(tms)
    result["exact"] = all(torch.equal(w.cpu(), x) for w, x in zip(weights, want))
    kv.fill_(0)  # contents undefined after a discard: the cache is written before use
    s = ones.clone()
    dist.all_reduce(s)
    result["all_reduce"] = s[0].item()
    torch.cuda.synchronize()
    result["other_gpu_context"] = context_on(1 - rank)
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def main(hook_mode):
    begin("nccl_group", hook_mode)
    check(torch.cuda.device_count() >= 2, "needs 2 GPUs")
    out = tempfile.mkdtemp()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    mp.start_processes(rank_main, args=(hook_mode, port, out), nprocs=2, start_method="spawn")
    results = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]
    for r in results:
        say(json.dumps({k: v for k, v in r.items() if k != "error"}))
    check(results[0]["error"] == results[1]["error"], "the ranks raised different errors")
    msg = results[0]["error"]
    say(f"every rank raised: {msg}")
    check("resume of stage 2 of 2 (['kv_cache']) failed on rank 1 of 2" in msg, msg)
    check("ranks 0, 1 paused again what they had resumed" in msg, msg)
    for r in results:
        check(r["failed"] == [1] and r["stage"] == 1, f"rank {r['rank']}: failures {r['failed']}, stage {r['stage']}")
        check([tuple(x) for x in r["after_failure"]] == [("kv_cache", "paused"), ("weights", "paused")],
              f"rank {r['rank']} after the failed resume: {r['after_failure']}")
        check([tuple(x) for x in r["after_retry"]] == [("kv_cache", "active"), ("weights", "active")],
              f"rank {r['rank']} after the retry: {r['after_retry']}")
        check(r["exact"], f"rank {r['rank']}: weights differ after the retried resume")
        check(r["all_reduce"] == 2.0, f"rank {r['rank']}: all_reduce after resume gave {r['all_reduce']}")
        check(not r["other_gpu_context"], f"rank {r['rank']} made a context on the other rank's GPU")
        check(r["released"][0] >= WEIGHTS + KV and r["released"][1] >= WEIGHTS + KV, f"released {r['released']}")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
