"""Scenario 13: the process exits with status 0 and writes nothing to stderr
whatever state its region memory is in at exit:

    active            tensors allocated in a region, in use
    paused            the tag paused, no backup
    paused_backup     the tag paused with a host backup
    backup_first_use  as paused_backup, but entering the region is the
                      process's very first CUDA work (no context made yet)

Usage: exit_states.py <hook_mode> <case>. The tensors stay referenced from
module globals until the interpreter tears down.
"""
import sys

import torch

from _common import MiB, begin, check, check_states, free_bytes, say

CASES = ("active", "paused", "paused_backup", "backup_first_use")
KEEP = []   # alive until interpreter shutdown


def main(hook_mode, case):
    check(case in CASES, f"case must be one of {CASES}, got {case!r}")
    tms = begin(f"exit_states[{case}]", hook_mode)
    if case != "backup_first_use":
        free_bytes()  # CUDA context up before the region
    with tms.region(tag="exit", enable_cpu_backup=case in ("paused_backup", "backup_first_use")):
        KEEP.append(torch.randn(32 * MiB, device="cuda"))              # 128 MiB
        KEEP.append(torch.arange(1000, device="cuda"))                  # a small segment too
    KEEP.append(torch.ones(1000, device="cuda"))                        # ordinary memory
    KEEP[0].add_(1.0)
    torch.cuda.synchronize()
    if case != "active":
        tms.pause("exit")
        check_states("exit", "paused")
    say(f"exiting with the region {case}")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
