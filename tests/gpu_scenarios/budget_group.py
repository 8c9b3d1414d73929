"""Two processes sharing the GPU and one host backup budget, paused and resumed as a
gloo group (torch_memory_saver.distributed).

Each process backs up 2 GiB; with a budget of 2 GiB and spilling on, one process's
backup goes to host memory and the other's to disk; every byte is exact after the
group resume. The same run without a budget puts both in host memory; the times of
both runs are printed side by side.
"""
import json
import os
import socket
import sys
import tempfile
import time
import uuid

import torch
import torch.multiprocessing as mp

from _common import GiB, begin, check, say

TENSORS = 16
SIZE = 2 * GiB  # each process's backed-up bytes, and the budget: room for one of the two


def child(rank, hook_mode, port, env, out):
    import torch.distributed as dist

    from torch_memory_saver import distributed as tmsd
    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = hook_mode
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    tms.set_disk_backup_dir(env["TEST_DISK_DIR"])
    with tms.region(tag="w", enable_cpu_backup=True):
        block = [torch.empty(SIZE // TENSORS, dtype=torch.uint8, device="cuda") for _ in range(TENSORS)]
    for t in block:
        t.random_(0, 256)
    want = [t.cpu() for t in block]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    reports = tmsd.pause("w")
    t1 = time.perf_counter()
    rows = [r for r in tms.allocations() if r["tag"] == "w"]
    on_disk = sum(r["size"] for r in rows if r["has_disk_backup"])
    in_ram = sum(r["size"] for r in rows if r["has_cpu_backup"])
    tmsd.resume("w")
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    exact = all(torch.equal(t.cpu(), w) for t, w in zip(block, want))
    result = {"rank": rank, "disk": on_disk, "ram": in_ram, "pause_s": t1 - t0, "resume_s": t2 - t1,
              "exact": exact, "reports": len(reports), "budget": tms.host_budget()}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_run(hook_mode, env):
    out = tempfile.mkdtemp()
    env = dict(env, TEST_DISK_DIR=tempfile.mkdtemp(prefix="tms-budget-"))
    saved = dict(os.environ)
    os.environ.update(env)  # the children read their settings when they start
    try:
        mp.start_processes(child, args=(hook_mode, free_port(), env, out), nprocs=2, start_method="spawn")
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(2)]


def main(hook_mode):
    begin("budget_group", hook_mode)
    name = f"gpu-test-{uuid.uuid4().hex[:12]}"
    limited = group_run(hook_mode, {"TMS_HOST_BACKUP_LIMIT": f"{SIZE // GiB}GiB", "TMS_SPILL_TO_DISK": "1",
                                    "TMS_HOST_BACKUP_LIMIT_NAME": name})
    free = group_run(hook_mode, {"TMS_HOST_BACKUP_LIMIT_NAME": name + "-none"})
    for label, run in ((f"budget {SIZE // GiB} GiB, spill on", limited), ("no budget", free)):
        for r in run:
            say(f"{label}: rank {r['rank']}: {r['ram'] / GiB:.2f} GiB in RAM, {r['disk'] / GiB:.2f} GiB on disk, "
                f"pause {r['pause_s']:.2f} s, resume {r['resume_s']:.2f} s, exact {r['exact']}")
        check(all(r["exact"] for r in run) and all(r["reports"] == 2 for r in run), f"{label}: {run}")
    check(sorted((r["ram"], r["disk"]) for r in limited) == [(0, SIZE), (SIZE, 0)],
          f"with the budget, one process in RAM and the other on disk: {limited}")
    check(all((r["ram"], r["disk"]) == (SIZE, 0) for r in free), f"without a budget, both in RAM: {free}")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
