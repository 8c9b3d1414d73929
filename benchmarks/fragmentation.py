"""Fragmentation with and without PyTorch's expandable segments (issue 15):
`python -m benchmarks.fragmentation [--steps N] [--out DIR]`.

One worker process per (hook mode, expandable segments on/off) runs the same
seeded churn inside one region: each step allocates a tensor of log-uniform
size from 1 MiB to 512 MiB (while under --live-gib live); the "steady" churn
then frees a random live one with probability 0.45, the "bursty" one a random
30 % of the live ones with probability 0.3. It then reports what the region
costs: live tensor bytes, PyTorch's reserved bytes, the bytes the library
holds for the tag, device memory taken since the start; and what a pause of
the tag gives back (free memory gained / tag bytes) and how long pause and
resume take. The table goes to stdout and to DIR/<date>_<device>-fragmentation.md.
"""
import argparse
import datetime
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 1 << 20
GiB = 1 << 30
PATTERNS = ("steady", "bursty")


def worker(hook_mode, pattern, steps, live_gib, seed):
    import random

    import torch

    from torch_memory_saver import torch_memory_saver as tms

    tms.hook_mode = hook_mode
    if hook_mode == "preload":
        _ = tms.preload_method  # hooks in place before the first CUDA allocation
    torch.cuda.init()
    torch.cuda.synchronize()
    free0 = torch.cuda.mem_get_info()[0]
    rng = random.Random(seed)
    live, live_bytes = [], 0
    with tms.region(tag="frag"):
        for _ in range(steps):
            n = int(2 ** rng.uniform(20, 29))  # 1 MiB .. 512 MiB
            if live_bytes + n <= live_gib * GiB:
                live.append(torch.empty(n, dtype=torch.uint8, device="cuda"))
                live_bytes += n
            if pattern == "steady" and live and rng.random() < 0.45:
                live_bytes -= live.pop(rng.randrange(len(live))).numel()
            elif pattern == "bursty" and rng.random() < 0.3:
                for i in sorted(rng.sample(range(len(live)), k=int(len(live) * 0.3)), reverse=True):
                    live_bytes -= live.pop(i).numel()
    torch.cuda.synchronize()
    rows = [r for r in tms._core.allocations() if r["tag"] == "frag"]
    tag_bytes = sum(r["reserved"] for r in rows)
    used = free0 - torch.cuda.mem_get_info()[0]
    reserved = torch.cuda.memory_reserved()
    before = torch.cuda.mem_get_info()[0]
    t0 = time.perf_counter()
    tms.pause("frag")
    t1 = time.perf_counter()
    freed = torch.cuda.mem_get_info()[0] - before
    tms.resume("frag")
    t2 = time.perf_counter()
    return {
        "hook_mode": hook_mode, "pattern": pattern,
        "expandable": "expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "live_tensors": len(live), "live_bytes": live_bytes, "torch_reserved": reserved, "tag_bytes": tag_bytes,
        "allocations": len(rows), "adopted": sum(1 for r in rows if r["adopted"]), "device_used": used,
        "freed_by_pause": freed, "pause_ms": (t1 - t0) * 1e3, "resume_ms": (t2 - t1) * 1e3,
    }


def run_worker(hook_mode, pattern, expandable, args):
    from torch_memory_saver import configure_subprocess

    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_") and k != "PYTORCH_CUDA_ALLOC_CONF"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    if expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if hook_mode == "preload":
        with configure_subprocess():
            env["LD_PRELOAD"] = os.environ["LD_PRELOAD"]
    else:
        env.pop("LD_PRELOAD", None)
    cmd = [sys.executable, "-m", "benchmarks.fragmentation", "--worker", hook_mode, "--pattern", pattern,
           "--steps", str(args.steps),
           "--live-gib", str(args.live_gib), "--seed", str(args.seed)]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        return {"hook_mode": hook_mode, "pattern": pattern, "expandable": expandable,
                "error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(results):
    def gib(n):
        return f"{n / GiB:.2f}"

    lines = ["| churn | hook mode | expandable segments | live tensors | live GiB | PyTorch reserved GiB | tag GiB "
             "(allocations, adopted) | reserved / live | pause frees (of tag) | pause ms | resume ms |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['pattern']} | {r['hook_mode']} | {'on' if r['expandable'] else 'off'} | "
                         f"error: {r['error'][:200]} "
                         "| | | | | | | |")
            continue
        lines.append(
            f"| {r['pattern']} | {r['hook_mode']} | {'on' if r['expandable'] else 'off'} | {r['live_tensors']} | {gib(r['live_bytes'])} "
            f"| {gib(r['torch_reserved'])} | {gib(r['tag_bytes'])} ({r['allocations']}, {r['adopted']}) "
            f"| {r['torch_reserved'] / max(r['live_bytes'], 1):.2f}× "
            f"| {r['freed_by_pause'] / max(r['tag_bytes'], 1):.1%} | {r['pause_ms']:.1f} | {r['resume_ms']:.1f} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--live-gib", type=float, default=24)
    parser.add_argument("--seed", type=int, default=15)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    parser.add_argument("--worker", choices=("preload", "torch"))
    parser.add_argument("--pattern", choices=PATTERNS, default="steady")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.pattern, args.steps, args.live_gib, args.seed)))
        return
    import torch

    device = torch.cuda.get_device_name(0).replace(" ", "-") if torch.cuda.is_available() else "no-GPU"
    results = [run_worker(mode, pattern, expandable, args)
               for pattern in PATTERNS for mode in ("preload", "torch") for expandable in (False, True)]
    now = datetime.datetime.now(datetime.timezone.utc)
    text = "\n".join([
        "# Fragmentation: one region's churn with and without expandable segments", "",
        f"device {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}, "
        f"torch {torch.__version__}, {now:%Y-%m-%dT%H:%M:%SZ}", "",
        f"command: `python -m benchmarks.fragmentation --steps {args.steps} --live-gib {args.live_gib} "
        f"--seed {args.seed}`", "",
        "Same seeded sequence in every row of a churn: each step allocates a tensor of 1 MiB to 512 MiB "
        "(log-uniform) while under the live cap; *steady* then frees a random live tensor with probability 0.45, "
        "*bursty* frees a random 30 % of the live ones with probability 0.3. *reserved / live*: PyTorch's "
        "reserved bytes per live tensor byte (fragmentation). *pause frees*: device memory a pause of the "
        "tag gave back, as a share of the bytes the library held for it.", "",
        table(results), ""])
    print(text)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"{now:%Y%m%d-%H%M%S}_{device}-fragmentation.md")
    with open(path, "w") as f:
        f.write(text)
    with open(path[:-3] + ".json", "w") as f:
        json.dump(results, f, indent=1)
    print(f"written: {path}")
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
