"""Disk backup: with enable_disk_backup=True, random data of several
dtypes comes back bit-exact after three pause/resume cycles (new data each
cycle) at the same addresses. Each allocation has one file in the backup
directory, rewritten in place; the page cache does not keep the backup and no
host backup memory holds it (the library's counters); get_cpu_backup is None; an allocation freed while paused takes
its file with it; at exit nothing is left (the harness checks the directory)."""
import os
import sys

import torch

from _common import (MiB, begin, check, check_equal, check_owned, check_released, check_states, check_taken, core,
                     free_bytes, random_tensor, say, tag_bytes)
from _pagecache import cached_bytes
from free_while_paused import HookEntryPoints


def backup_files(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".bin"))


def make_tensors():
    t = {}
    for name, numel, dtype in [
        ("float32 multi-block, odd tail", 96 * MiB + 5, torch.float32),  # 384 MB: 8 MiB blocks and a tail
        ("bfloat16", 2_000_003, torch.bfloat16),
        ("int64", 1_500_001, torch.int64),
        ("uint8 odd size", 1_000_003, torch.uint8),
        ("float16 large", 64 * MiB + 3, torch.float16),
    ]:
        t[name] = random_tensor(numel, dtype)
    mat = torch.randint(-1000, 1000, (1000, 1003), dtype=torch.int32, device="cuda")
    t["matrix"] = mat
    t["matrix view [5:, 7:]"] = mat[5:, 7:]
    return t


def refill(tensors):
    """New random contents in place (views follow their bases)."""
    for name, t in tensors.items():
        if "view" in name:
            continue
        t.copy_(random_tensor(t.numel(), t.dtype).view(t.shape))
    return {name: t.cpu() for name, t in tensors.items()}


def cycles(tms, d, tag):
    with tms.region(tag=tag, enable_disk_backup=True):
        tensors = make_tensors()
    ptrs = {name: t.data_ptr() for name, t in tensors.items()}
    for name, t in tensors.items():
        row = check_owned(t, tag, name)
        check(row["disk_backup"] and not row["cpu_backup"], f"{name}: allocation not recorded as disk-backed: {row}")
    n_allocs = len([r for r in tms._core.allocations() if r["tag"] == tag])
    held = tag_bytes(tag)
    backed = sum(r["size"] for r in tms._core.allocations() if r["tag"] == tag)
    inodes = None
    for cycle in range(3):
        expected = refill(tensors)
        report = tms.pause(tag)
        check_states(tag, "paused")
        check_released(report, held, f"pause '{tag}' cycle {cycle + 1}")
        files = backup_files(d)
        check(len(files) == n_allocs, f"{len(files)} backup files for {n_allocs} allocations: {files}")
        now = {f: os.stat(os.path.join(d, f)).st_ino for f in files}
        check(inodes is None or now == inodes, f"files not rewritten in place: {inodes} -> {now}")
        inodes = now
        cached = sum(cached_bytes(os.path.join(d, f)) for f in files)
        check(cached <= backed // 10, f"{cached} bytes of the {backed}-byte backup sit in the page cache")
        host = core().host_budget()["mine"]
        check(host == 0, f"{host} bytes of host backups held backing up {backed} bytes to disk")
        stats = tms.stats()[torch.cuda.current_device()][tag]
        check(stats["bytes_backup_disk"] == backed and stats["bytes_backup_pinned"] + stats["bytes_backup_mmap"] == 0,
              f"stats: {stats}")
        big = tensors["float32 multi-block, odd tail"]
        check(tms.get_cpu_backup(big) is None, "get_cpu_backup of a disk-backed tensor is not None")
        check_taken(tms.resume(tag), held, f"resume '{tag}' cycle {cycle + 1}")
        for name, t in tensors.items():
            check(t.data_ptr() == ptrs[name], f"{name}: data_ptr() changed")
            check_equal(t, expected[name], f"{name} after cycle {cycle + 1}")
        say(f"cycle {cycle + 1}: {n_allocs} files, {cached / MiB:.1f} MiB cached, all tensors bit-exact")
    return tensors


def free_while_paused(tms, d, hook_mode):
    hook = HookEntryPoints(hook_mode)
    size = 64 * MiB + 4096
    with tms.region(tag="disk_free", enable_disk_backup=True):
        ptr = hook.malloc(size)
    before = set(backup_files(d))
    tms.pause("disk_free")
    mine = set(backup_files(d)) - before
    check(len(mine) == 1, f"pause of one allocation made {len(mine)} files: {mine}")
    hook.free(ptr, size)
    check(not (mine & set(backup_files(d))), f"{mine} still there after the free")
    tms.resume("disk_free")
    say("an allocation freed while paused took its file with it")


def main(hook_mode):
    tms = begin("disk_backup", hook_mode)
    d = os.environ.get("TMS_TEST_DISK_DIR") or os.path.join(os.environ.get("TMPDIR", "/tmp"),
                                                             f"tms-disk-scenario-{os.getpid()}")
    tms.set_disk_backup_dir(d)
    free_bytes()
    tensors = cycles(tms, d, "disk")
    free_while_paused(tms, d, hook_mode)
    del tensors
    print(d)
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
