"""stats() agrees with what pause and resume report they released and mapped and
with the allocation table, and memory_summary() shows the tags."""
import sys

import torch

from _common import MiB, begin, check, check_released, check_taken, free_bytes, say, tag_bytes

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
    check(kv_mapped >= kv.numel() and kv_mapped == tag_bytes("kv"),
          f"kv maps {kv_mapped} bytes; its tensor has {kv.numel()}, its rows reserve {tag_bytes('kv')}")
    check_released(tms.pause("kv"), kv_mapped, "pause('kv') against stats()")
    s = tag_stats("kv")
    check(s["bytes_mapped"] == 0 and s["bytes_paused"] == kv_mapped, f"kv stats after pause: {s}")
    w_mapped = tag_stats("weights")["bytes_mapped"]
    report = tms.pause("weights")
    check_released(report, w_mapped, "pause('weights') against stats()")
    s = tag_stats("weights")
    check(s["bytes_backup_mmap"] == w.numel() * 4 and s["bytes_to_host"] == w.numel() * 4 == report.copied_bytes,
          f"weights stats: {s}, report: {report!r}")
    say(torch_memory_saver.memory_summary())
    check_taken(tms.resume(), kv_mapped + w_mapped, "resume() against stats()")
    s = tag_stats("weights")
    check(s["bytes_backup_mmap"] == 0 and s["resumes"] == 1 and s["bytes_to_device"] == w.numel() * 4,
          f"weights stats after resume: {s}")
    check(s["pause_ns"] > 0 and s["resume_ns"] > 0, f"no time counted: {s}")
    say(torch_memory_saver.memory_summary())
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
