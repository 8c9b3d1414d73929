"""Scenario 12 (needs 2 GPUs): one tag with backup holds tensors on cuda:0 and
cuda:1, allocated in one region. Pause releases memory on both devices; resume
restores every tensor on its own device, bit-exact at the same address.
Entering the same region again later adds to the same tag on both devices."""
import sys

import torch

from _common import (MiB, begin, check, check_equal, check_owned, check_released, check_states, check_taken,
                     free_bytes, random_tensor, say, tag_bytes)

TAG = "mg"
DEVICES = (0, 1)


def cycle_and_verify(tms, tensors, expected, what):
    held = {d: tag_bytes(TAG, d) for d in DEVICES}
    for d in DEVICES:
        check(held[d] > 0, f"{what}: tag {TAG!r} holds nothing on cuda:{d}")
    report = tms.pause(TAG)
    check_states(TAG, "paused")
    for d in DEVICES:
        check_released(report, held[d], f"{what}: pause on cuda:{d}", device=d)
    report = tms.resume(TAG)
    for d in DEVICES:
        check_taken(report, held[d], f"{what}: resume on cuda:{d}", device=d)
    for name, (t, device, ptr) in tensors.items():
        check(t.device == torch.device("cuda", device), f"{name}: now on {t.device}, expected cuda:{device}")
        check(t.data_ptr() == ptr, f"{name}: data_ptr() changed")
        check_equal(t, expected[name], f"{what}: {name} after resume")
    say(f"{what}: every tensor restored on its own device")


def main(hook_mode):
    tms = begin("multi_gpu", hook_mode)
    check(torch.cuda.device_count() >= 2, "needs 2 GPUs")
    for d in DEVICES:
        free_bytes(d)  # contexts up on both devices before the regions

    with tms.region(tag=TAG, enable_cpu_backup=True):
        made = {
            "cuda:0 float": torch.randn(32 * MiB, device="cuda:0"),                  # 128 MiB
            "cuda:1 int64": random_tensor(16 * MiB, torch.int64, device="cuda:1"),   # 128 MiB
            "cuda:1 bfloat16": random_tensor(3_000_017, torch.bfloat16, device="cuda:1"),
            "cuda:0 uint8": random_tensor(1_000_003, torch.uint8, device="cuda:0"),
        }
    tensors = {}
    for name, t in made.items():
        device = int(name[5])
        check_owned(t, TAG, name, device=device)
        tensors[name] = (t, device, t.data_ptr())
    expected = {name: t.cpu() for name, t in made.items()}
    say("allocations recorded on the device each tensor lives on")

    cycle_and_verify(tms, tensors, expected, "cycle 1")

    # Work on both devices after resume, then a second cycle keeps the results.
    made["cuda:1 int64"].add_(1)
    made["cuda:0 float"].mul_(2.0)
    expected["cuda:1 int64"] = expected["cuda:1 int64"] + 1
    expected["cuda:0 float"] = expected["cuda:0 float"] * 2.0
    cycle_and_verify(tms, tensors, expected, "cycle 2")

    say("-- the same region entered again")
    with tms.region(tag=TAG, enable_cpu_backup=True):
        more = {"cuda:1 more": torch.randn(16 * MiB, device="cuda:1"),
                "cuda:0 more": torch.randn(16 * MiB, device="cuda:0")}
    for name, t in more.items():
        device = int(name[5])
        check_owned(t, TAG, name, device=device)
        tensors[name] = (t, device, t.data_ptr())
        expected[name] = t.cpu()
    cycle_and_verify(tms, tensors, expected, "cycle 3 (after re-entering the region)")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
