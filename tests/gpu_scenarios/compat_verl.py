"""Drop-in, verl's staged wake-up: everything is released, then the weights are
resumed (and updated) while the KV cache stays paused, and the KV cache comes back later.
State queries answer each stage without raising."""
import sys

import torch

from _common import (MiB, begin, check, check_equal, check_installed, check_released, check_taken, free_bytes,
                     say, tag_bytes)


def main(hook_mode):
    tms = begin("compat_verl", hook_mode)
    check_installed()
    free_bytes()
    with tms.region(tag="weights", enable_cpu_backup=True):
        weights = [torch.randn(32 * MiB, device="cuda") for _ in range(4)]
    with tms.region(tag="kv_cache"):
        kv = torch.empty(256 * MiB, dtype=torch.uint8, device="cuda")
    expected = [w.cpu() for w in weights]
    w_bytes, kv_bytes = tag_bytes("weights"), tag_bytes("kv_cache")

    check_released(tms.pause(), w_bytes + kv_bytes, "release everything")   # release_memory_occupation()
    check(tms.paused_tags() == ["kv_cache", "weights"], f"paused_tags() {tms.paused_tags()}")

    check_taken(tms.resume("weights"), w_bytes, "resume('weights')")   # stage 1: weights, not the KV cache
    check(tms.is_paused("kv_cache") and not tms.is_paused("weights"), "states after stage 1")
    for i, w in enumerate(weights):
        check_equal(w, expected[i], f"weight {i} after stage 1")
        w.add_(1.0)                               # the weight update happens here
    say("weights resumed and updated while the KV cache stays paused")

    check_taken(tms.resume("kv_cache"), kv_bytes, "resume('kv_cache')")   # stage 2: KV cache
    check(tms.paused_tags() == [], f"paused_tags() {tms.paused_tags()}")
    kv.fill_(3)
    check(int(kv[::4096].max()) == 3, "KV cache not writable")
    for i, w in enumerate(weights):
        check_equal(w, expected[i] + 1.0, f"updated weight {i}")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
