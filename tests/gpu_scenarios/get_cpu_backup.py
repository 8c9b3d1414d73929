"""Scenario 4: get_cpu_backup while paused returns the pre-pause contents as a
CPU tensor (also for a slice and non-contiguous views); zero_copy=True aliases
the host backup, so writes into it are what resume restores. None for a region
without backup; ValueError for memory the library does not own."""
import sys

import torch

from _common import begin, check, check_equal, free_bytes, random_tensor, say


def check_backup(tms, t, expected, what):
    got = tms.get_cpu_backup(t)
    check(got is not None, f"{what}: get_cpu_backup returned None while paused")
    check(got.device.type == "cpu", f"{what}: backup is on {got.device}, expected cpu")
    check_equal(got, expected, f"{what}: backup while paused")
    return got


def main(hook_mode):
    tms = begin("get_cpu_backup", hook_mode)
    free_bytes()  # CUDA context up before the regions

    with tms.region(tag="g", enable_cpu_backup=True):
        base = torch.randn(1000, 1003, device="cuda")
        small = random_tensor(12_345, torch.int16)    # packed into a small segment
        flags = random_tensor(4_099, torch.bool)
    with tms.region(tag="g_plain"):
        no_backup = torch.randn(100_000, device="cuda")
    outside = torch.randn(100_000, device="cuda")

    views = {
        "base": base,
        "slice base[7:200]": base[7:200],
        "transpose base.t()": base.t(),
        "strided base[::2, 5::3]": base[::2, 5::3],
        "int16 tensor": small,
        "int16 slice [11:]": small[11:],
        "bool tensor": flags,
    }
    expected = {name: v.cpu() for name, v in views.items()}
    check(tms.get_cpu_backup(base) is None, "a backup exists for an active tensor before any pause")

    tms.pause("g")
    tms.pause("g_plain")
    for name, v in views.items():
        check_backup(tms, v, expected[name], name)
    say(f"{len(views)} tensors/views: CPU copies equal to the pre-pause contents")

    # Copies by default: writing into one changes nothing else.
    copy = tms.get_cpu_backup(base)
    copy.fill_(0.0)
    check_backup(tms, base, expected["base"], "base after writing into a returned copy")

    # zero_copy aliases the host backup.
    zc = tms.get_cpu_backup(base, zero_copy=True)
    check(zc is not None and zc.shape == base.shape and zc.dtype == base.dtype, "zero-copy backup of base")
    check_equal(zc, expected["base"], "zero-copy backup")
    again = tms.get_cpu_backup(base, zero_copy=True)
    check(again.data_ptr() == zc.data_ptr(), "two zero-copy calls do not share the host buffer")
    zc_slice = tms.get_cpu_backup(base[7:200], zero_copy=True)
    check(zc_slice.data_ptr() == zc.data_ptr() + 7 * 1003 * 4, "zero-copy slice does not alias the base's buffer "
                                                               "at the slice's offset")
    zc[1].fill_(42.0)           # row 1 of base
    zc_slice[0].fill_(-1.5)     # row 7 of base, through the slice's view
    modified = expected["base"].clone()
    modified[1] = 42.0
    modified[7] = -1.5
    say("wrote rows 1 and 7 through zero-copy views while paused")

    check(tms.get_cpu_backup(no_backup) is None, "region without backup: get_cpu_backup is not None")
    say("region without backup: None")
    check(tms.get_cpu_backup(outside) is None, "a tensor outside every allocation has a CPU backup")
    say("tensor outside any region: None")

    tms.resume("g")
    tms.resume("g_plain")
    check_equal(base, modified, "base after resume (zero-copy writes restored)")
    for name in ("int16 tensor", "bool tensor"):
        check_equal(views[name], expected[name], f"{name} after resume")
    check(tms.get_cpu_backup(base) is None, "get_cpu_backup after resume (retain off) is not None")
    # The zero-copy tensors keep the host bytes alive after the library let go.
    check_equal(zc, modified, "zero-copy tensor after resume")
    del zc, again, zc_slice
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
