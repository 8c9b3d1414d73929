"""Drop-in, SGLang's call shapes through its adapter: region(tag="weights",
enable_cpu_backup=True); region(tag="kv_cache") around torch.cuda.use_mem_pool(custom_pool)
(preload mode: the custom pool's cudaMalloc is still ours); cuda_graph(cuda_graph=g, pool=...,
stream=..., tag="cuda_graph") (preload mode, as SGLang captures); disable();
configure_subprocess() around a scheduler process start. Release kv_cache -> weights ->
cuda_graph, resume in reverse, synchronize; the graph replays with the restored weights and
gives the same output as before; the weights are bit-exact."""
import multiprocessing
import sys

import torch
import torch_memory_saver

from _common import (MiB, begin, check, check_equal, check_installed, check_owned, check_released, check_states,
                     check_taken, free_bytes, owner, say, tag_bytes, warm_up)


def scheduler_child(queue):
    """What a scheduler process started under configure_subprocess() checks."""
    try:
        import torch_memory_saver as m
        core = m.torch_memory_saver._core
        active, winner = core.preload_active()
        with m.torch_memory_saver.region(tag="kv_cache"):
            t = torch.ones(64 * MiB, dtype=torch.uint8, device="cuda")
        owned = any(r["ptr"] == t.data_ptr() for r in core.allocations())
        m.torch_memory_saver.pause("kv_cache")
        m.torch_memory_saver.resume("kv_cache")
        queue.put((active, winner, owned))
    except BaseException as e:  # reported by the parent
        queue.put(("error", repr(e), None))


def forward(w1, w2, x):
    return torch.relu(x @ w1) @ w2


def main(hook_mode):
    tms = begin("compat_sglang", hook_mode)
    check_installed()
    free_bytes()

    with tms.region(tag="weights", enable_cpu_backup=True):
        w1 = torch.randn(8192, 16384, device="cuda")           # 512 MiB each
        w2 = torch.randn(16384, 8192, device="cuda")
    expected_w1, expected_w2 = w1.cpu(), w2.cpu()
    check_owned(w1, "weights", "weight")

    custom_pool = torch.cuda.MemPool() if hook_mode == "preload" else None
    with tms.region(tag="kv_cache"):
        if custom_pool is not None:
            with torch.cuda.use_mem_pool(custom_pool):
                kv = torch.empty(1024 * MiB, dtype=torch.uint8, device="cuda")
        else:
            kv = torch.empty(1024 * MiB, dtype=torch.uint8, device="cuda")
    check_owned(kv, "kv_cache", "KV cache" + (" (custom pool)" if custom_pool is not None else ""))

    with tms.disable():
        scratch = torch.randn(16 * MiB, device="cuda")
    check(owner(scratch) is None, "a tensor allocated under disable() is pauseable")

    x = torch.randn(256, 8192, device="cuda")
    graph = None
    if hook_mode == "preload":
        warm_up(forward, w1, w2, x)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with tms.cuda_graph(cuda_graph=graph, pool=torch.cuda.graph_pool_handle(), stream=stream, tag="cuda_graph"):
            out = forward(w1, w2, x)
        graph.replay()
        torch.cuda.synchronize()
        expected_out = out.cpu()
        check(tag_bytes("cuda_graph") > 0, "the graph's memory is not in tag 'cuda_graph'")
    else:
        expected_out = forward(w1, w2, x).cpu()

    if hook_mode == "preload":
        queue = multiprocessing.get_context("spawn").Queue()
        with torch_memory_saver.configure_subprocess():
            proc = multiprocessing.get_context("spawn").Process(target=scheduler_child, args=(queue,))
            proc.start()
        active, winner, owned = queue.get(timeout=240)
        proc.join(60)
        check(active is True, f"scheduler child: preload not active ({winner})")
        check(owned is True, "scheduler child: the region allocation is not pauseable")
        check(proc.exitcode == 0, f"scheduler child exited {proc.exitcode}")
        say("scheduler process started under configure_subprocess() has the hook")

    order = ["kv_cache", "weights"] + (["cuda_graph"] if graph is not None else [])
    for tag in order:
        held = tag_bytes(tag)
        check_released(tms.pause(tag), held, f"release {tag}")
        check_states(tag, "paused")
    check(tms.paused_tags() == sorted(order), f"paused_tags() {tms.paused_tags()}")
    for tag in reversed(order):
        held = tag_bytes(tag)
        check_taken(tms.resume(tag), held, f"resume {tag}")
    torch.cuda.synchronize()

    check_equal(w1, expected_w1, "w1 after resume")
    check_equal(w2, expected_w2, "w2 after resume")
    if graph is not None:
        graph.replay()
        torch.cuda.synchronize()
        check_equal(out, expected_out, "graph replay after resume")
    else:
        check_equal(forward(w1, w2, x), expected_out, "forward after resume")
    kv.fill_(7)
    check(int(kv[::4096].min()) == 7, "KV cache not writable after resume")
    say("weights bit-exact; output equal after resume")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
