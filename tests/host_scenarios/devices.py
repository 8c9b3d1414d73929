# Reads the native module's device_active(): which devices the process has touched.
"""Which devices a process touches (tests/test_devices.py): the host backend makes a
device's "context" at the first operation that names the device, as the CUDA backend
retains a primary context at a device's first use. A process whose runtime's current
device is 1 (TMS_HOST_CURRENT_DEVICE=1, as after torch.cuda.set_device(1)) uses every
public call and must leave device 0 untouched; one that uses two devices keeps both."""
import sys
import tempfile

import torch_memory_saver
from _prelude import MiB, core, expect, fill, read, row, run_cases, tms


def active():
    return [d for d in range(2) if core().device_active(d)]


def every_call_on_one_device():
    """Regions of every backup kind (mmap, pinned, disk, retained), pause and resume
    with and without backup, a list of tags, a failed pause, disable(), stats,
    memory_report, host_budget, allocations, get_cpu_backup: device 0 is never touched."""
    assert active() == [], active()                    # loading the library touches nothing
    kept = []
    with tempfile.TemporaryDirectory() as disk_dir:
        tms.set_disk_backup_dir(disk_dir)
        for tag, kwargs in (("mmap", {"enable_cpu_backup": True}),
                            ("pinned", {"enable_cpu_backup": True, "cpu_backup_backend": "pinned"}),
                            ("disk", {"enable_disk_backup": True}), ("kv", {})):
            with tms.region(tag, **kwargs):
                p = tms.malloc(3 * MiB + 1)
            assert row(p)["device"] == 1, row(p)
            kept.append((tag, p, fill(p, 3 * MiB + 1)))
        tms.retain_cpu_backup = True
        for _ in range(2):                             # the second cycle reuses retained backups
            report = tms.pause(["mmap", "pinned", "disk"])
            assert sorted(report.devices) == [1], report
            tms.pause("kv")
            assert core().get_cpu_backup(kept[0][1], 4096) is not None
            tms.resume()
            for tag, p, data in kept[:3]:
                assert read(p, len(data)) == data, tag
        expect(torch_memory_saver.Error, tms.resume, "mmap", match="'mmap'")
        with tms.region("mmap", enable_cpu_backup=True):
            with tms.disable():
                pass
        tms.stats(), tms.memory_summary(), tms.allocations(), tms.host_budget()
        assert sorted(tms.memory_report()) == [1], tms.memory_report()
        for _, p, _ in kept:
            tms.free(p)
    assert active() == [1], active()
    print("only device 1")


def two_devices_in_one_process():
    """Allocations on the current device and on another, named: each pauses and
    resumes with its bytes, and the process has used exactly those two."""
    with tms.region("w", enable_cpu_backup=True):
        mine = tms.malloc(2 * MiB)                     # the current device, 1
        other = tms.malloc(2 * MiB, 0)
    assert (row(mine)["device"], row(other)["device"]) == (1, 0)
    data = fill(mine, 2 * MiB), fill(other, 2 * MiB)
    report = tms.pause("w")
    assert sorted(report.devices) == [0, 1] and report.released_bytes == 4 * MiB, report
    tms.resume("w")
    assert (read(mine, 2 * MiB), read(other, 2 * MiB)) == data
    assert active() == [0, 1], active()
    print("both devices")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
