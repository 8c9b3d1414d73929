"""Checked restores on the GPU: every backup kind (mmap, pinned, disk, retained, skip_unchanged,
spilled to disk) comes back exact and checked by the device's fingerprints; a byte flipped in a
host backup or in a disk backup file while paused is caught by the resume, which raises
IntegrityError and leaves the tag paused with its backup, and a repaired backup resumes; memory
paused without backup comes back as zeros or 0xFF (NaN) after its memory was really released."""
import ctypes
import glob
import os
import sys
import tempfile

import torch

import torch_memory_saver
from _common import (GiB, MiB, begin, check, check_equal, check_released, check_taken, core, expect_error,
                     mapped_bytes, random_tensor, say, tag_bytes)

SIZE = 96 * MiB + 4096  # a size that is not whole chunks: the last one's tail is zeroed on both sides


def round_trip(tms, tag, **region):
    with tms.region(tag=tag, **region):
        t = random_tensor(SIZE // 4, torch.float32)
    expected = t.cpu()
    held = tag_bytes(tag)
    check_released(tms.pause(tag), held, f"pause '{tag}'")
    r = tms.resume(tag)
    check_taken(r, held, f"resume '{tag}'")
    check_equal(t, expected, f"tag {tag!r} after resume")
    check(r.verified_bytes == r.copied_bytes > 0 and r.why_not_verified is None,
          f"tag {tag!r}: verified {r.verified_bytes} of {r.copied_bytes} copied bytes ({r.why_not_verified})")
    say(f"  {tag}: {r.verified_bytes} bytes restored and checked in {r.verify_seconds * 1e3:.2f} ms")
    return t, expected


def every_kind(tms, disk_dir):
    say("-- every backup kind, checked")
    tms.set_disk_backup_dir(disk_dir)
    kept = [round_trip(tms, "k-mmap", enable_cpu_backup=True),
            round_trip(tms, "k-pinned", enable_cpu_backup=True, cpu_backup_backend="pinned"),
            round_trip(tms, "k-disk", enable_disk_backup=True),
            round_trip(tms, "k-skip", enable_cpu_backup=True, skip_unchanged=True)]
    tms.retain_cpu_backup = True
    kept.append(round_trip(tms, "k-retained", enable_cpu_backup=True))
    kept.append(round_trip(tms, "k-retained", enable_cpu_backup=True))  # the second pause reuses the backup
    tms.retain_cpu_backup = False
    r = tms.pause("k-skip")
    check(r.unchanged_bytes > 0, f"the unchanged pause copied {r.copied_bytes} bytes")
    r = tms.resume("k-skip")
    check(r.verified_bytes == r.copied_bytes, f"k-skip again: verified {r.verified_bytes} of {r.copied_bytes}")
    for t, expected in kept:
        check_equal(t, expected, "an earlier tag after the others' cycles")


def backup_address(ptr, n):
    view = core().get_cpu_backup(ptr, n, False, True)  # copied out of (copy_out): the backup stays trusted
    check(view is not None and view.readonly, f"no read-only backup view of 0x{ptr:x}: {view!r}")
    return ctypes.addressof(view.obj), view


def flip(address):
    b = ctypes.c_ubyte.from_address(address)
    b.value ^= 0x5A


def refused(tms, tag, ptr):
    mapped = mapped_bytes()
    e = expect_error(torch_memory_saver.IntegrityError, lambda: tms.resume(tag), f"'{tag}'", hex(ptr), "offset 0x")
    check(tms.is_paused(tag), f"tag {tag!r} is not paused after the refused resume")
    check(mapped_bytes() == mapped, f"the refused resume kept device memory: {mapped_bytes() - mapped} bytes more mapped")
    return e


def flipped(tms, disk_dir):
    say("-- a byte flipped in a host backup while paused")
    with tms.region(tag="flip", enable_cpu_backup=True):
        t = random_tensor(SIZE // 4, torch.float32)
    expected, ptr = t.cpu(), t.data_ptr()
    row = next(r for r in core().allocations() if r["tag"] == "flip")
    tms.pause("flip")
    address, view = backup_address(row["ptr"], row["size"])
    at = address + (ptr - row["ptr"]) + 33 * MiB + 3
    flip(at)
    refused(tms, "flip", row["ptr"])
    flip(at)
    del view
    r = tms.resume("flip")
    check_equal(t, expected, "the repaired tag")
    check(r.verified_bytes == r.copied_bytes, f"repaired: verified {r.verified_bytes} of {r.copied_bytes}")

    say("-- a byte flipped in a disk backup file while paused")
    with tms.region(tag="flip-disk", enable_disk_backup=True):
        d = random_tensor(SIZE // 4, torch.float32)
    expected = d.cpu()
    rows = [r for r in core().allocations() if r["tag"] == "flip-disk"]
    pattern = os.path.join(disk_dir, f"tms-{os.getpid()}-*.bin")
    before = set(glob.glob(pattern))  # the files of tags backed up to disk earlier
    tms.pause("flip-disk")
    files = sorted(set(glob.glob(pattern)) - before)
    check(len(files) == len(rows) == 1, f"{len(files)} new backup files for {len(rows)} allocations")
    offset = 4096 + (d.data_ptr() - rows[0]["ptr"]) + 40 * MiB + 9  # after the file's header
    with open(files[0], "r+b") as f:
        f.seek(offset)
        good = f.read(1)
        f.seek(offset)
        f.write(bytes([good[0] ^ 0xFF]))
    refused(tms, "flip-disk", rows[0]["ptr"])
    with open(files[0], "r+b") as f:
        f.seek(offset)
        f.write(good)
    tms.resume("flip-disk")
    check_equal(d, expected, "the repaired disk-backed tag")


def restore_modes(tms):
    say("-- restore='zero' and 'poison' after the memory was really released")
    for mode, check_value in (("zero", lambda x: bool((x == 0).all())), ("poison", lambda x: bool(torch.isnan(x).all()))):
        tag = f"mode-{mode}"
        with tms.region(tag=tag, restore=mode):
            x = torch.randn(GiB // 4, device="cuda")  # 1 GiB of float32
        held = tag_bytes(tag)
        r = tms.pause(tag, measure_free=True)
        check_released(r, held, f"pause '{tag}'")
        dev = r.devices[torch.cuda.current_device()]
        check(dev.free_after > dev.free_before, f"{tag}: free memory did not rise ({dev.free_before} -> {dev.free_after})")
        check_taken(tms.resume(tag), held, f"resume '{tag}'")
        check(check_value(x), f"{tag}: not every element is what restore={mode!r} writes")
        check(bool((x.view(torch.int32) == (0 if mode == "zero" else -1)).all()), f"{tag}: the bytes")
        say(f"  {mode}: every byte as asked")


def main(hook_mode):
    tms = begin("integrity", hook_mode)
    torch.cuda.mem_get_info()
    with tempfile.TemporaryDirectory() as disk_dir:
        every_kind(tms, disk_dir)
        flipped(tms, disk_dir)
        restore_modes(tms)
    say("OK")


if __name__ == "__main__":
    main(sys.argv[1])
