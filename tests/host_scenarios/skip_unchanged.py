# Tests the native module too: fingerprint_bytes, the raw pause with free spans, get_cpu_backup.
"""skip_unchanged on the host backend (tests/test_skip_unchanged.py): a pause copies only
the 2 MiB chunks whose fingerprint changed since the kept backup was written; a forked
child, a writable zero-copy view or a failed fingerprint makes the next pause copy
everything; the setting, its variable and a region that says otherwise."""
import ctypes
import os
import random
import struct

from _prelude import MiB, core, fill, read, row, tms

CHUNK = 2 * MiB


def fingerprints(data, key):
    """The native fingerprints of data, and of data with the last byte of chunk 0 flipped."""
    flipped = bytearray(data)
    flipped[CHUNK - 1] ^= 0x80
    return core().fingerprint_bytes(data, CHUNK, key), core().fingerprint_bytes(bytes(flipped), CHUNK, key)


def copies_only_changed_chunks():
    """The first save copies everything; an unchanged pause copies nothing; one byte
    changed (first, middle, last of a chunk) copies that chunk alone."""
    tms.retain_cpu_backup = False          # skip_unchanged keeps the backup by itself
    with tms.region("w", enable_cpu_backup=True, skip_unchanged=True):
        p = core().malloc(8 * CHUNK)
    data = bytearray(fill(p, 8 * CHUNK))
    r = tms.pause("w")
    assert (r.copied_bytes, r.unchanged_bytes) == (8 * CHUNK, 0), r   # the first save records
    assert r.why_not_skipped is None and r.fingerprint_seconds > 0, r
    tms.resume("w")
    assert read(p, 8 * CHUNK) == bytes(data)
    assert row(p)["has_cpu_backup"], "skip_unchanged keeps the backup while active"
    assert tms.memory_report()[0]["host_retained"] == 8 * CHUNK, tms.memory_report()
    r = tms.pause("w")
    assert (r.copied_bytes, r.unchanged_bytes, r.skipped_bytes) == (0, 8 * CHUNK, 0), r
    tms.resume("w")
    assert read(p, 8 * CHUNK) == bytes(data)
    for chunk, at in ((0, 0), (3, CHUNK // 2 + 1), (7, CHUNK - 1)):   # first, middle, last byte of a chunk
        off = chunk * CHUNK + at
        data[off] ^= 0x5A
        ctypes.memmove(p + off, bytes([data[off]]), 1)
        r = tms.pause("w")
        assert (r.copied_bytes, r.unchanged_bytes) == (CHUNK, 7 * CHUNK), (chunk, r)
        tms.resume("w")
        assert read(p, 8 * CHUNK) == bytes(data), chunk
    core().free(p)


def scattered_changes():
    """Every other chunk changed: one copy per chunk, many more than the allocation's one range."""
    n = 16                                 # eight ranges to copy where the allocation has one
    with tms.region("s", enable_cpu_backup=True, skip_unchanged=True):
        p = core().malloc(n * CHUNK)
    data = bytearray(fill(p, n * CHUNK))
    tms.pause("s")
    tms.resume("s")
    for cycle in range(3):
        for c in range(cycle % 2, n, 2):
            off = c * CHUNK + 7 * c
            data[off] ^= 0xA5
            ctypes.memmove(p + off, bytes([data[off]]), 1)
        r = tms.pause("s")
        assert (r.copied_bytes, r.unchanged_bytes) == (n // 2 * CHUNK, n // 2 * CHUNK), (cycle, r)
        tms.resume("s")
        assert read(p, n * CHUNK) == bytes(data), cycle
    core().free(p)


def random_writes(cycles):
    """Random small writes and chunks the caller calls free, over many cycles: every byte
    that was not free comes back; returns (bytes copied, bytes unchanged) over the cycles."""
    rng = random.Random(11)
    sizes = [CHUNK, 3 * CHUNK - 4096, 2 * CHUNK]   # one chunk, a short last chunk, two whole ones
    with tms.region("f", enable_cpu_backup=True, skip_unchanged=True):
        ptrs = [core().malloc(n) for n in sizes]
    want = [bytearray(fill(p, n)) for p, n in zip(ptrs, sizes)]
    copied = unchanged = 0
    for cycle in range(cycles):
        for _ in range(rng.randrange(4)):
            i = rng.randrange(len(ptrs))
            off = rng.randrange(sizes[i])
            n = min(rng.randrange(1, 300), sizes[i] - off)
            new = os.urandom(n)
            ctypes.memmove(ptrs[i] + off, new, n)
            want[i][off:off + n] = new
        # Sometimes a whole chunk is free in the caller's cache: skipped, back undefined.
        free = []
        if rng.random() < 0.3:
            i = rng.randrange(len(ptrs))
            c = rng.randrange(sizes[i] // CHUNK)
            free.append((i, c * CHUNK))
        spans = b"".join(struct.pack("=QQ", ptrs[i] + off, CHUNK) for i, off in free)
        r = core().pause("f", spans or None)
        dev = r["devices"][0]
        assert dev["copied_bytes"] + dev["unchanged_bytes"] + dev["skipped_bytes"] == sum(sizes), (cycle, dev)
        copied += dev["copied_bytes"]
        unchanged += dev["unchanged_bytes"]
        core().resume("f")
        for i, off in free:   # what comes back there is whatever the new memory holds
            want[i][off:off + CHUNK] = read(ptrs[i] + off, CHUNK)
        for i, p in enumerate(ptrs):
            assert read(p, sizes[i]) == bytes(want[i]), (cycle, i)
    return copied, unchanged


def forked_child():
    """(the forked child's copied and unchanged bytes, then the parent's): a child's pause
    cannot trust the parent's fingerprints, the parent's own next pause can."""
    with tms.region("w", enable_cpu_backup=True, skip_unchanged=True):
        p = core().malloc(4 * CHUNK)
    data = fill(p, 4 * CHUNK)
    tms.pause("w")
    tms.resume("w")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        rep = tms.pause("w")   # the parent's fingerprints are another process's
        os.write(w, f"{rep.copied_bytes} {rep.unchanged_bytes}".encode())
        os._exit(0)
    os.close(w)
    child = os.read(r, 100).decode()
    os.waitpid(pid, 0)
    rep = tms.pause("w")
    tms.resume("w")
    assert read(p, 4 * CHUNK) == data
    return child.split() + [str(rep.copied_bytes), str(rep.unchanged_bytes)]


def zero_copy_view():
    """A backup copied out at once keeps the fingerprints trusted; a view that may be written never again."""
    with tms.region("w", enable_cpu_backup=True, skip_unchanged=True):
        p = core().malloc(4 * CHUNK)
    data = fill(p, 4 * CHUNK)
    tms.pause("w")
    core().get_cpu_backup(p, 4 * CHUNK, False, True)   # copied out at once (the package's way): still trusted
    tms.resume("w")
    assert tms.pause("w").unchanged_bytes == 4 * CHUNK
    view = core().get_cpu_backup(p, 4 * CHUNK)   # may be written: never trusted again
    view[5] ^= 1                                 # the host copy no longer holds what was fingerprinted
    del view
    tms.resume("w")
    assert read(p, 4 * CHUNK)[6:] == data[6:]
    for _ in range(2):
        r = tms.pause("w")
        assert (r.copied_bytes, r.unchanged_bytes) == (4 * CHUNK, 0), r
        tms.resume("w")
    assert read(p, 4 * CHUNK)[6:] == data[6:]


def failed_fingerprint():
    """With TMS_FAULT=fingerprint:4: that pause copies everything and says why, and the
    next one too (what was recorded was forgotten); the one after skips again."""
    with tms.region("w", enable_cpu_backup=True, skip_unchanged=True):
        p = core().malloc(2 * CHUNK)
    data = fill(p, 2 * CHUNK)
    tms.pause("w")                                       # fingerprints 1, 2 (after the copy), 3 (the check)
    tms.resume("w")
    r = tms.pause("w")                                   # fingerprint 4 fails
    assert (r.copied_bytes, r.unchanged_bytes) == (2 * CHUNK, 0), r
    assert "fingerprinting 2 chunks on device 0 failed" in r.why_not_skipped, r.why_not_skipped
    tms.resume("w")
    r = tms.pause("w")                                   # what was recorded was forgotten
    assert (r.copied_bytes, r.unchanged_bytes, r.why_not_skipped) == (2 * CHUNK, 0, None), r
    tms.resume("w")
    assert tms.pause("w").unchanged_bytes == 2 * CHUNK
    tms.resume("w")
    assert read(p, 2 * CHUNK) == data


def the_setting():
    """With TMS_SKIP_UNCHANGED=1: on by default, off where a region says so, off for all
    once set False; a non-bool is a TypeError, and without a CPU backup a ValueError."""
    assert tms.skip_unchanged is True                   # TMS_SKIP_UNCHANGED=1
    with tms.region("a", enable_cpu_backup=True):
        a = core().malloc(CHUNK)
    with tms.region("b", enable_cpu_backup=True, skip_unchanged=False):
        b = core().malloc(CHUNK)
    fill(a, CHUNK)
    fill(b, CHUNK)
    for _ in range(2):
        r = tms.pause()
        tms.resume()
    assert (r.copied_bytes, r.unchanged_bytes) == (CHUNK, CHUNK), r
    tms.skip_unchanged = False
    r = tms.pause()
    tms.resume()
    assert (r.copied_bytes, r.unchanged_bytes) == (2 * CHUNK, 0), r
    try:
        with tms.region("c", enable_cpu_backup=True, skip_unchanged="yes"):
            pass
    except TypeError:
        pass
    else:
        raise AssertionError("skip_unchanged='yes'")
    try:
        with tms.region("c", skip_unchanged=True):
            pass
    except ValueError as e:
        assert "enable_cpu_backup=True" in str(e), e
    else:
        raise AssertionError("skip_unchanged without a CPU backup")
