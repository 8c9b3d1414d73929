"""stats() agrees with the device's free memory (torch.cuda.mem_get_info)
through pause and resume, and memory_summary() shows the tags."""
import sys

import torch

from _common import MiB, begin, check, free_bytes, say

import torch_memory_saver


def main(hook_mode):
    tms = begin("stats_match", hook_mode)
    free_bytes()
    with tms.region(tag="kv"):
        kv = torch.empty(512 * MiB, dtype=torch.uint8, device="cuda")
    with tms.region(tag="weights", enable_cpu_backup=True):
        w = torch.randn(64 * MiB, device="cuda")                 # 256 MiB
    device = torch.cuda.current_device()

    def tag_stats(tag):
        return torch_memory_saver.stats()[device][tag]

    kv_mapped = tag_stats("kv")["bytes_mapped"]
    check(kv_mapped >= kv.numel(), f"kv maps {kv_mapped} bytes, less than its tensor")
    before = free_bytes()
    tms.pause("kv")
    after = free_bytes()
    s = tag_stats("kv")
    check(s["bytes_mapped"] == 0 and s["bytes_paused"] == kv_mapped, f"kv stats after pause: {s}")
    check(abs((after - before) - kv_mapped) <= 32 * MiB,
          f"mem_get_info rose by {(after - before) / MiB:.1f} MiB, stats say {kv_mapped / MiB:.1f} MiB were released")
    w_mapped = tag_stats("weights")["bytes_mapped"]
    before = free_bytes()
    tms.pause("weights")
    after = free_bytes()
    s = tag_stats("weights")
    check(s["bytes_backup_mmap"] == w.numel() * 4 and s["bytes_to_host"] == w.numel() * 4, f"weights stats: {s}")
    check(abs((after - before) - w_mapped) <= 32 * MiB,
          f"mem_get_info rose by {(after - before) / MiB:.1f} MiB, stats say {w_mapped / MiB:.1f} MiB")
    say(torch_memory_saver.memory_summary())
    tms.resume()
    s = tag_stats("weights")
    check(s["bytes_backup_mmap"] == 0 and s["resumes"] == 1 and s["bytes_to_device"] == w.numel() * 4,
          f"weights stats after resume: {s}")
    check(s["pause_ns"] > 0 and s["resume_ns"] > 0, f"no time counted: {s}")
    say(torch_memory_saver.memory_summary())
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
