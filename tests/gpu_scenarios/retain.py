"""Scenario 3: retain_cpu_backup keeps the host copy across resume. Each pause
refreshes it, so a second cycle restores the contents at the second pause; the
retained copy is what get_cpu_backup returns after resume. Without retain
(the default) the host copy is dropped at resume."""
import sys

import torch

from _common import (MiB, begin, check, check_equal, check_released, check_states, check_taken, free_bytes,
                     random_tensor, say, tag_bytes)


def cycle(tms, tag):
    """pause + resume of tag, checking that every byte of its device memory went and came back."""
    held = tag_bytes(tag)
    report = tms.pause(tag)
    check_states(tag, "paused")
    check_released(report, held, f"pause '{tag}'")
    check_taken(tms.resume(tag), held, f"resume '{tag}'")
    check_states(tag, "active")


def main(hook_mode):
    tms = begin("retain", hook_mode)
    free_bytes()  # CUDA context up before the regions

    say("-- default: retain_cpu_backup is False")
    check(tms.retain_cpu_backup is False, f"retain_cpu_backup defaults to {tms.retain_cpu_backup!r}, expected False "
                                          f"(is TMS_RETAIN_CPU_BACKUP set?)")
    with tms.region(tag="plain", enable_cpu_backup=True):
        plain = torch.randn(16 * MiB, device="cuda")
    ref = plain.cpu()
    check(tms.get_cpu_backup(plain) is None, "a backup exists before the first pause")
    tms.pause("plain")
    while_paused = tms.get_cpu_backup(plain)
    check(while_paused is not None, "no backup while paused")
    check_equal(while_paused, ref, "backup while paused")
    tms.resume("plain")
    check_equal(plain, ref, "contents after resume")
    check(tms.get_cpu_backup(plain) is None, "without retain, get_cpu_backup after resume is not None")
    say("without retain: backup served while paused, dropped at resume")

    say("-- retain_cpu_backup = True")
    tms.retain_cpu_backup = True
    check(tms.retain_cpu_backup is True, "retain_cpu_backup did not read back True")
    with tms.region(tag="kept", enable_cpu_backup=True):
        kept = torch.randn(64 * MiB, device="cuda")      # 256 MiB
        kept_ints = random_tensor(3_000_001, torch.int64)
    ptrs = (kept.data_ptr(), kept_ints.data_ptr())
    first = (kept.cpu(), kept_ints.cpu())

    cycle(tms, "kept")
    check_equal(kept, first[0], "float tensor after cycle 1")
    check_equal(kept_ints, first[1], "int tensor after cycle 1")
    retained = tms.get_cpu_backup(kept)
    check(retained is not None, "with retain, get_cpu_backup after resume is None")
    check_equal(retained, first[0], "retained backup after cycle 1")
    check_equal(tms.get_cpu_backup(kept_ints), first[1], "retained int backup after cycle 1")
    say("cycle 1: contents restored, backup retained")

    # New contents: the retained copy still shows the old ones until the next pause.
    kept.mul_(-3.0).add_(1.0)
    kept_ints.add_(12345)
    second = (kept.cpu(), kept_ints.cpu())
    check(not torch.equal(second[0], first[0]), "the modification did not change the float tensor")
    check_equal(tms.get_cpu_backup(kept), first[0], "retained backup after modifying the tensor (before pause)")

    tms.pause("kept")
    check_equal(tms.get_cpu_backup(kept), second[0], "backup while paused in cycle 2 (refreshed)")
    tms.resume("kept")
    check_equal(kept, second[0], "float tensor after cycle 2 (new contents)")
    check_equal(kept_ints, second[1], "int tensor after cycle 2 (new contents)")
    check_equal(tms.get_cpu_backup(kept), second[0], "retained backup after cycle 2")
    check_equal(tms.get_cpu_backup(kept_ints), second[1], "retained int backup after cycle 2")
    check((kept.data_ptr(), kept_ints.data_ptr()) == ptrs, "data_ptr() changed")
    say("cycle 2: the contents at the second pause restored and retained")

    # The retained copy is a snapshot of the last pause, not a live view.
    kept.add_(1.0)
    check_equal(tms.get_cpu_backup(kept), second[0], "retained backup after a write following resume")

    say("-- retain_cpu_backup = False again: the copy is dropped at the next resume")
    tms.retain_cpu_backup = False
    third = kept.cpu()
    cycle(tms, "kept")
    check_equal(kept, third, "float tensor after cycle 3")
    check(tms.get_cpu_backup(kept) is None, "retain off: get_cpu_backup after resume is not None")
    check(tms.get_cpu_backup(kept_ints) is None, "retain off: int backup after resume is not None")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
