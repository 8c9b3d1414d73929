"""One GPU shared by an RL trainer and its rollout engine, step by step.

The trainer's model and optimizer state live under one tag with a CPU backup (a real
optimizer makes its state at its first step: take that step inside the region): paused,
they wait in host memory and come back whole at the same addresses. The rollout's
weights and its KV cache live under tags of their own, without a backup: the weights
are refreshed from the trainer at every step and the KV cache is rebuilt by every
generation, so nothing of them needs keeping. Each step:

    resume rollout_weights -> refresh them from the trainer -> pause trainer ->
    torch.cuda.empty_cache() -> resume kv_cache -> generate ->
    pause [kv_cache, rollout_weights] -> resume trainer -> train

Memory PyTorch allocated outside every region (here a checkpoint staged before the first
region, and each training step's temporaries) is PyTorch's, not the library's: no pause
releases it, and PyTorch keeps it cached after the tensors go. torch.cuda.empty_cache()
hands the cached part back to the driver, so the KV cache can have it.

Frameworks run the two engines in two processes, each pausing and resuming its own tags
in this order (a job lends the memory between them: README, "Lending within a job");
one process does both here.

    python examples/rl_loop.py                      # on a GPU
    TMS_BACKEND=host python examples/rl_loop.py     # without one: the host backend
"""
import ctypes
import os

import torch

from torch_memory_saver import torch_memory_saver as tms

HOST = os.environ.get("TMS_BACKEND", "").lower() == "host"
MiB = 1 << 20
# Bytes of each part: the model, each of Adam's two moments, the KV cache.
MODEL, KV = (16 * MiB, 64 * MiB) if HOST else (512 * MiB, 2048 * MiB)
STEPS = 2


def alloc(nbytes):
    """A float32 tensor of nbytes under this thread's region: on a GPU an ordinary CUDA
    tensor; on the host backend, memory from tms.malloc (what the library emulates as
    device memory there), seen by torch.frombuffer."""
    if not HOST:
        return torch.empty(nbytes // 4, device="cuda")
    return torch.frombuffer((ctypes.c_char * nbytes).from_address(tms.malloc(nbytes)), dtype=torch.float32)


def mib(n):
    return f"{n / MiB:.2f} MiB"


def mapped(tag):
    """Bytes of tag's memory mapped now, on every device (the library's counters)."""
    return sum(tags[tag]["bytes_mapped"] for tags in tms.stats().values() if tag in tags)


def cached_outside():
    """Bytes PyTorch holds cached, free, outside the library's regions (on a GPU)."""
    return sum(d["torch_outside_free"] for d in tms.memory_report().values())


def main():
    if not HOST and not torch.cuda.is_available():
        raise SystemExit("examples/rl_loop.py: PyTorch sees no GPU; TMS_BACKEND=host runs it on the host backend")
    if not HOST:
        # Before the first region: a checkpoint staged on the GPU is ordinary PyTorch memory.
        staged = torch.randn(MODEL // 4, device="cuda")
    with tms.region("trainer", enable_cpu_backup=True):   # model and optimizer: kept across pauses
        weights, exp_avg, exp_avg_sq = alloc(MODEL), alloc(MODEL), alloc(MODEL)
    with tms.region("rollout_weights"):                   # refreshed every step: no backup
        rollout = alloc(MODEL)
    with tms.region("kv_cache"):                          # rebuilt every generation: no backup
        kv = alloc(KV)
    if HOST:
        weights.normal_()
    else:
        weights.copy_(staged)
        del staged                                        # its memory stays in PyTorch's cache
    exp_avg.zero_()
    exp_avg_sq.zero_()
    tms.pause(["kv_cache", "rollout_weights"])            # the rollout starts asleep
    print(f"setup: trainer {mib(3 * MODEL)} (model and optimizer, CPU backup), rollout weights {mib(MODEL)}, "
          f"KV cache {mib(KV)}")
    for step in range(1, STEPS + 1):
        print(f"step {step}")
        tms.resume("rollout_weights")
        print(f"  resume rollout_weights: {mib(mapped('rollout_weights'))} mapped, contents undefined")
        rollout.copy_(weights)
        print(f"  refresh: {mib(rollout.numel() * 4)} copied from the trainer")
        kept = [t.to("cpu", copy=True) for t in (weights, exp_avg, exp_avg_sq)]  # to check the resume against
        r = tms.pause("trainer")
        print(f"  pause trainer: {mib(r.released_bytes)} released, {mib(r.copied_bytes)} copied to the host")
        if HOST:
            print("  empty_cache: the host backend has no PyTorch cache to empty")
        else:
            cached = cached_outside()
            torch.cuda.empty_cache()
            print(f"  empty_cache: {mib(cached)} PyTorch held cached outside the regions, "
                  f"{mib(cached_outside())} after")
        tms.resume("kv_cache")
        print(f"  resume kv_cache: {mib(mapped('kv_cache'))} mapped, contents undefined")
        kv.fill_(step)                                    # generate: the KV cache fills
        assert bool(torch.equal(rollout[:1024].cpu(), kept[0][:1024]))   # the refresh arrived
        r = tms.pause(["kv_cache", "rollout_weights"])
        print(f"  pause kv_cache, rollout_weights: {mib(r.released_bytes)} released, {mib(r.copied_bytes)} copied")
        r = tms.resume("trainer")
        same = all(bool(torch.equal(t.to("cpu"), k)) for t, k in zip((weights, exp_avg, exp_avg_sq), kept))
        print(f"  resume trainer: {mib(mapped('trainer'))} mapped, {mib(r.copied_bytes)} restored, same bytes: {same}")
        # train: one Adam step on a stand-in gradient; its temporaries are PyTorch's
        grad = weights * 0.01
        exp_avg.mul_(0.9).add_(grad, alpha=0.1)
        exp_avg_sq.mul_(0.999).addcmul_(grad, grad, value=0.001)
        weights.sub_(1e-3 * exp_avg / (exp_avg_sq.sqrt() + 1e-8))
        del grad
        print("  train: one optimizer step")
    print(f"paused now: {tms.paused_tags()}")


if __name__ == "__main__":
    main()
