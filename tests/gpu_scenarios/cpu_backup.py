"""Scenario 2: with enable_cpu_backup=True (backends "pinned" and "mmap"), random
data of several dtypes, at odd offsets inside PyTorch's segments, comes back
bit-exact after pause/resume at the same addresses. A region without backup in
the same process keeps its addresses (its contents are undefined)."""
import sys

import torch

from _common import (MiB, allocations, begin, check, check_equal, check_owned, check_released, check_states,
                     check_taken, free_bytes, random_tensor, say, tag_bytes)


def make_tensors():
    """Allocates the scenario's tensors (call inside the region). Returns name -> tensor;
    views are included next to their bases."""
    t = {}
    for name, numel, dtype in [
        ("float32", 3_000_017, torch.float32),    # 12 MB: a segment of its own
        ("bfloat16", 2_000_003, torch.bfloat16),  # 4 MB: inside a shared 20 MiB segment
        ("int64", 1_500_001, torch.int64),
        ("uint8 odd size", 1_000_003, torch.uint8),  # < 1 MiB: packed into a 2 MiB segment
        ("bool", 777_777, torch.bool),            # next to the uint8 one, at an odd offset
        # Keeps the fixed device-memory cost of a process's first backed-up
        # pause (the copy workers' streams: up to ~16 MiB measured on an H200)
        # well under 5 % of the region.
        ("float32 large", 128 * MiB + 5, torch.float32),
    ]:
        t[name] = random_tensor(numel, dtype)
    base = torch.randn(4_000_037, device="cuda")
    t["slice base"] = base
    t["slice [3:]"] = base[3:]                   # storage_offset 3: 12 bytes into the block
    mat = torch.randint(-1000, 1000, (1000, 1003), dtype=torch.int32, device="cuda")
    t["matrix"] = mat
    t["matrix view [5:, 7:]"] = mat[5:, 7:]      # storage offset, non-contiguous
    return t


def round_trip(tms, tag, backend):
    say(f"-- backend {backend!r}, tag {tag!r}")
    with tms.region(tag=tag, enable_cpu_backup=True, cpu_backup_backend=backend):
        tensors = make_tensors()
    expected = {name: t.cpu() for name, t in tensors.items()}
    ptrs = {name: t.data_ptr() for name, t in tensors.items()}
    for name, t in tensors.items():
        row = check_owned(t, tag, name)
        check(row["cpu_backup"] and row["cpu_backup_backend"] == backend,
              f"{name}: allocation records backup={row['cpu_backup']} backend={row['cpu_backup_backend']!r}, "
              f"expected backup with {backend!r}")
    held = tag_bytes(tag)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors.values()}
    check(held >= sum(storages.values()), f"tag {tag!r} holds {held} bytes, less than its tensors' storage")

    report = tms.pause(tag)
    check_states(tag, "paused")
    check_released(report, held, f"pause '{tag}'")
    # A pinned backup is page-locked by the pause that fills it; an mmap one stays pageable.
    locked = [r["cpu_backup_page_locked"] for r in allocations(tag)]
    check(locked == [backend == "pinned"] * len(locked),
          f"tag {tag!r} ({backend}): cpu_backup_page_locked after pause is {locked}")
    check_taken(tms.resume(tag), held, f"resume '{tag}'")
    check_states(tag, "active")

    for name, t in tensors.items():
        check(t.data_ptr() == ptrs[name], f"{name}: data_ptr() changed across pause/resume")
        check_equal(t, expected[name], f"{name} ({backend}) after resume")
    say(f"all {len(tensors)} tensors restored bit-exact at the same addresses")
    return tensors, expected


def main(hook_mode):
    tms = begin("cpu_backup", hook_mode)
    free_bytes()  # CUDA context up before the regions

    kept = [round_trip(tms, f"backup_{backend}", backend) for backend in ("pinned", "mmap")]

    say("-- region without backup")
    with tms.region(tag="discard"):
        plain = torch.randn(32 * MiB, device="cuda")
    check_owned(plain, "discard", "tensor without backup")
    ptr = plain.data_ptr()
    check_released(tms.pause("discard"), tag_bytes("discard"), "pause 'discard'")
    tms.resume("discard")
    check(plain.data_ptr() == ptr, "data_ptr() of the tensor without backup changed")
    plain.fill_(2.5)
    check(bool((plain == 2.5).all()), "tensor without backup not writable after resume")
    say("tensor without backup: same address, usable after resume")

    # Cycles of the other tags left the backed-up ones alone.
    for tensors, expected in kept:
        for name, t in tensors.items():
            check_equal(t, expected[name], f"{name} after the other tags' cycles")
    say("backed-up tensors unchanged by the other tags' pause/resume")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
