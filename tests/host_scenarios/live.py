# Tests the native module too: pause(tag, skip), the ranges a caller says are free.
"""Live-only backups on the host backend (tests/test_live.py): a pause told which
device ranges are free copies only the rest, to every backup kind; resume brings
back those bytes exactly; reports, allocations() rows and stats() say what was
copied and skipped; bad skip arguments are errors naming what is wrong."""
import os
import sys
import tempfile
from array import array

import torch_memory_saver
from _prelude import MiB, core, device_used, expect, fill, read, resident_bytes, run_cases, tms


def spans(*pairs):
    """skip bytes from (start, length) pairs."""
    return array("Q", [x for p in pairs for x in p]).tobytes()


def live_bytes(ptr, data, live):
    """The bytes of data (filled at ptr) at the offsets ranges live: [(off, len)]."""
    return [(off, data[off:off + n]) for off, n in live]


def check_live(ptr, expected):
    for off, want in expected:
        assert read(ptr + off, len(want)) == want, (hex(ptr), off, len(want))


def kind_region(kind, tag):
    if kind == "disk":
        return tms.region(tag, enable_disk_backup=True)
    return tms.region(tag, enable_cpu_backup=True, cpu_backup_backend=kind)


def only_live_bytes_are_copied(kind):
    """Allocations backed up as kind: one with two free ranges inside (their
    granule-aligned parts skipped), one free throughout, one with nothing free;
    the pause copies the rest, resume restores those bytes exactly."""
    if kind == "disk":
        tms.set_disk_backup_dir(tempfile.mkdtemp())
    g = 64 * MiB if kind == "pinned" else 2 * MiB          # the kind's granule
    size = 8 * g
    with kind_region(kind, "w"):
        a = tms.malloc(size)
        b = tms.malloc(2 * g)
        c = tms.malloc(2 * g)                                # all live: its size is not the point
    da, db, dc = fill(a, size), fill(b, 2 * g), fill(c, 2 * g)
    # a: [1.5g, 4.5g) skips [2g, 4g); [6g, 8g + g) runs past its end: skips [6g, 8g).
    skip = spans((a + 3 * g // 2, 3 * g), (a + 6 * g, 3 * g), (b - g, 4 * g))
    skip_order = sorted(array("Q", skip)[i:i + 2].tolist() for i in range(0, len(array("Q", skip)), 2))
    skip = spans(*skip_order)
    live_a = [(0, 2 * g), (4 * g, 2 * g)]
    want_a, want_c = live_bytes(a, da, live_a), [(0, dc)]
    report = core().pause("w", skip)
    [dev] = report["devices"]
    assert dev["copied_bytes"] == 4 * g + 2 * g and dev["skipped_bytes"] == 4 * g + 2 * g, dev
    assert dev["allocations"] == 3 and dev["released_bytes"] == size + 4 * g, dev
    rows = {r["ptr"]: r for r in tms.allocations()}
    assert (rows[a]["backup_bytes"], rows[a]["skipped_bytes"]) == (4 * g, 4 * g), rows[a]
    assert (rows[b]["backup_bytes"], rows[b]["skipped_bytes"]) == (0, 2 * g), rows[b]
    assert (rows[c]["backup_bytes"], rows[c]["skipped_bytes"]) == (2 * g, 0), rows[c]
    assert torch_memory_saver.stats()[0]["w"]["bytes_skipped"] == 6 * g
    back = core().resume("w")
    assert back["devices"][0]["copied_bytes"] == 6 * g and back["devices"][0]["skipped_bytes"] == 6 * g, back
    check_live(a, want_a)
    check_live(c, want_c)
    assert db is not None  # b's bytes are undefined now: free in the caller's cache
    print("done")


def host_memory_holds_only_live_bytes():
    """A pageable backup of 64 MiB of which 48 MiB are free: (device bytes released, bytes
    copied, bytes of the backup's pages in memory, host bytes this process's backups hold
    as the host budget counts them); then the live bytes come back."""
    size = 64 * MiB
    with tms.region("w", enable_cpu_backup=True, cpu_backup_backend="mmap"):
        p = tms.malloc(size)
    data = fill(p, size)
    before = device_used()
    report = core().pause("w", spans((p + 16 * MiB, 48 * MiB)))
    view = core().get_cpu_backup(p, size)
    held = (before - device_used(), report["devices"][0]["copied_bytes"], resident_bytes(view), core().host_budget()["mine"])
    del view
    core().resume("w")
    check_live(p, [(0, data[:16 * MiB])])
    return held


def retained_backup_follows_the_live_ranges():
    """A retained backup written again by a pause with other free ranges: resume
    restores the bytes live at that pause, not those of the one before."""
    tms.retain_cpu_backup = True
    g, size = 2 * MiB, 16 * MiB
    with tms.region("w", enable_cpu_backup=True):
        p = tms.malloc(size)
    fill(p, size)
    core().pause("w", spans((p, 8 * MiB)))                  # first half free
    core().resume("w")
    data = fill(p, size)                                   # new contents everywhere
    report = core().pause("w", spans((p + 8 * MiB, 8 * MiB)))  # second half free now
    assert report["devices"][0]["copied_bytes"] == 8 * MiB, report
    core().resume("w")
    check_live(p, [(0, data[:8 * MiB])])
    row = [r for r in tms.allocations() if r["ptr"] == p][0]
    assert row["has_cpu_backup"] and row["backup_bytes"] == 8 * MiB and row["skipped_bytes"] == 8 * MiB, row
    assert g
    print("done")


def reports_of_the_public_calls():
    """pause() and resume() return a Report: per device bytes released, copied and
    skipped, seconds, the driver's free memory before and after (its change equals
    the bytes released); a call that finds nothing has no devices."""
    with tms.region("w", enable_cpu_backup=True):
        w = tms.malloc(6 * MiB)
    with tms.region("kv"):
        kv = tms.malloc(3 * MiB, 1)
    fill(w, 6 * MiB)
    r = tms.pause(measure_free=True)
    assert r.op == "pause" and sorted(r.devices) == [0, 1], r
    d0, d1 = r.devices[0], r.devices[1]
    assert (d0.allocations, d0.released_bytes, d0.copied_bytes, d0.skipped_bytes) == (1, 6 * MiB, 6 * MiB, 0), d0
    assert (d1.allocations, d1.released_bytes, d1.copied_bytes) == (1, 4 * MiB, 0), d1
    for d in (d0, d1):
        assert d.free_after - d.free_before == d.released_bytes, d
        assert d.seconds == r.seconds > 0
    assert r.released_bytes == 10 * MiB and r.copied_bytes == 6 * MiB and r.gb_per_s > 0, r
    assert r.as_dict()["devices"][0]["copied_bytes"] == 6 * MiB
    back = tms.resume(measure_free=True)
    assert back.op == "resume" and back.released_bytes == 10 * MiB and back.copied_bytes == 6 * MiB, back
    assert back.devices[1].free_before - back.devices[1].free_after == 4 * MiB, back.devices[1]
    with tms.region("nothing-here"):                  # a tag used, with nothing in it
        pass
    empty = tms.pause("nothing-here")
    assert empty.devices == {} and empty.copied_bytes == 0 and "Report(op='pause'" in repr(empty)
    assert kv
    print("done")


def memory_report_attributes_the_device():
    """memory_report(): the driver's total/free/used per device and who holds it;
    ours active and paused follow a pause."""
    with tms.region("w"):
        a = tms.malloc(6 * MiB)
    with tms.region("kv"):
        tms.malloc(4 * MiB)
    r = torch_memory_saver.memory_report()
    assert sorted(r) == [0], r
    d = r[0]
    free, total = core().mem_get_info(0)
    assert (d["total"], d["free"], d["used"]) == (total, free, total - free), d
    assert (d["ours_active"], d["ours_paused"], d["torch_outside"]) == (10 * MiB, 0, 0), d
    assert d["other"] == d["used"] - d["ours_active"], d
    tms.pause("w")
    d = torch_memory_saver.memory_report(devices=[1])
    assert (d[0]["ours_active"], d[0]["ours_paused"]) == (4 * MiB, 6 * MiB) and d[1]["ours_active"] == 0, d
    assert d[0]["used"] == d[0]["total"] - d[0]["free"] and a
    print("done")


def live_only_setting():
    """backup_live_only: on by default, TMS_BACKUP_LIVE_ONLY=0 turns it off, the
    attribute (on the singleton or the module) overrides, a bool only."""
    want = os.environ.get("TMS_BACKUP_LIVE_ONLY", "1") not in ("0", "false", "no", "off")
    assert tms.backup_live_only is want
    torch_memory_saver.backup_live_only = not want
    assert tms.backup_live_only is (not want)
    expect(TypeError, setattr, tms, "backup_live_only", 1, match="backup_live_only must be a bool")
    print("done")


def bad_skip_arguments():
    """Skip ranges that are not sorted, overlap or wrap, or are not whole pairs of
    bytes, are errors naming what is wrong; nothing is paused."""
    with tms.region("w", enable_cpu_backup=True):
        p = tms.malloc(4 * MiB)
    native = core()
    expect(ValueError, native.pause, "w", spans((p + 2 * MiB, MiB), (p, MiB)), match="skip range 1")
    expect(ValueError, native.pause, "w", spans((p, 2 * MiB), (p + MiB, MiB)), match="overlaps")
    expect(ValueError, native.pause, "w", spans((2**64 - MiB, 2 * MiB)), match="wraps around")
    expect(ValueError, native.pause, "w", b"\0" * 15, match="not whole (start, length) pairs")
    expect(TypeError, native.pause, "w", [p, MiB], match="skip")
    assert [r["state"] for r in tms.allocations()] == ["active"]
    native.pause("w", b"")                                  # no ranges: every byte
    assert tms.allocations()[0]["backup_bytes"] == 4 * MiB
    print("done")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
