# Tests the native module too: get_cpu_backup, get_region/set_region and defaults() where the environment sets them.
"""Disk backups on the host backend (tests/test_disk_backup.py): a file per allocation,
rewritten in place, its lifecycle and owners, failures with every byte kept, the page
cache left alone, environment and API.

Every case takes the backup directory and the hook mode first: `begin` sets the mode,
then the directory (set_disk_backup_dir), and starts the core."""
import ctypes
import importlib.util
import os
import stat
import sys

import torch_memory_saver
from _prelude import MiB, backup_bytes, core, device_used, expect, fill, read, run_cases, start, tms

_spec = importlib.util.spec_from_file_location(
    "_pagecache", os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "gpu_scenarios", "_pagecache.py"))
_pagecache = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_pagecache)
cached_bytes = _pagecache.cached_bytes   # bytes of a file in the page cache

D = None  # the backup directory of this case


def begin(d, mode, set_dir=True):
    global D
    D = d
    tms.hook_mode = mode
    if set_dir:
        tms.set_disk_backup_dir(D)
    start()


def bins():
    """The backup files in D."""
    return sorted(n for n in os.listdir(D) if n.endswith(".bin"))


def inodes():
    return {n: os.stat(os.path.join(D, n)).st_ino for n in bins()}


def file_per_allocation(d, mode):
    """One file per allocation, mode 0600, rewritten in place and kept across resume;
    bit-exact; between cycles only the directory and the lock are open, close-on-exec."""
    begin(d, mode)
    sizes = [1000, 5 * MiB + 12345, 3 * MiB]
    with tms.region("w", enable_disk_backup=True):
        ptrs = [tms.malloc(n) for n in sizes]
    rows = {r["ptr"]: r for r in tms.allocations()}
    assert all(rows[p]["disk_backup"] and not rows[p]["cpu_backup"] for p in ptrs)
    first = None
    for cycle in range(3):
        data = [fill(p, n) for p, n in zip(ptrs, sizes)]
        tms.pause("w")
        names = bins()
        assert len(names) == 3, names                                   # one file per allocation
        for n in names:
            st = os.stat(os.path.join(D, n))
            assert stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
            assert n.startswith(f"tms-{os.getpid()}-"), n
        if first is None:
            first = inodes()
        assert inodes() == first                                        # rewritten in place
        st = tms.stats()[0]["w"]
        assert st["bytes_backup_disk"] == sum(sizes) and st["bytes_backup_mmap"] == 0
        assert all(core().get_cpu_backup(p, 8) is None for p in ptrs)   # a file is no CPU backup
        tms.resume("w")
        assert [read(p, n) for p, n in zip(ptrs, sizes)] == data        # bit-exact
        assert inodes() == first                                        # kept across resume
    # between pauses and resumes only the directory and the lock file are open, close-on-exec
    fds = [int(f) for f in os.listdir("/proc/self/fd")]
    ours = sorted((os.path.realpath(f"/proc/self/fd/{f}"), f) for f in fds
                  if os.path.realpath(f"/proc/self/fd/{f}").startswith(D))
    assert [p == D or p.endswith(".lock") for p, _ in ours] == [True, True], ours
    for _, fd in ours:
        with open(f"/proc/self/fdinfo/{fd}") as info:
            flags = int(info.read().split("flags:")[1].split()[0], 8)
        assert flags & 0o2000000, oct(flags)                            # O_CLOEXEC
    print("done")


def low_descriptor_limit(d, mode):
    """300 disk-backed allocations cycle with RLIMIT_NOFILE 100 above what the process holds."""
    import resource

    begin(d, mode)
    n, size = 300, 8192 + 17
    with tms.region("w", enable_disk_backup=True):
        ptrs = [tms.malloc(size) for _ in range(n)]
    data = [fill(p, size) for p in ptrs]
    held = len(os.listdir("/proc/self/fd"))
    resource.setrlimit(resource.RLIMIT_NOFILE, (held + 100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    for _ in range(2):
        tms.pause("w")
        assert len(bins()) == n
        tms.resume("w")
        assert [read(p, size) for p in ptrs] == data
    print("done")


def free_removes_the_file(d, mode):
    """free removes an allocation's file, paused or active."""
    begin(d, mode)
    with tms.region("w", enable_disk_backup=True):
        a, b = tms.malloc(2 * MiB), tms.malloc(3 * MiB)
    fill(a, 2 * MiB), fill(b, 3 * MiB)
    tms.pause("w")
    assert len(bins()) == 2
    tms.free(a)                                        # paused
    assert len(bins()) == 1
    tms.resume("w")
    assert len(bins()) == 1                            # kept while active
    tms.free(b)                                        # active
    assert bins() == []
    assert tms.stats() == {} or tms.stats()[0]["w"]["bytes_backup_disk"] == 0


def page_cache_and_host_memory_flat(d, mode, n):
    """n bytes backed up to disk: (bytes of the file in the page cache, device bytes the
    pause released, host backup bytes by kind, host backup bytes this process holds)."""
    begin(d, mode)
    with tms.region("w", enable_disk_backup=True):
        p = tms.malloc(n)
    data = fill(p, n)
    before = device_used()
    tms.pause("w")
    (name,) = bins()
    held = (cached_bytes(os.path.join(D, name)), before - device_used(), backup_bytes("w"),
            core().host_budget()["mine"])
    tms.resume("w")
    assert read(p, n) == data
    return held


def hold(d, mode):
    """An owner: pauses 4 MiB to d, prints "paused", waits for a line, resumes (bit-exact), prints "resumed"."""
    begin(d, mode)
    with tms.region("w", enable_disk_backup=True):
        p = tms.malloc(4 * MiB)
    data = fill(p, 4 * MiB)
    tms.pause("w")
    print("paused", flush=True)
    sys.stdin.readline()
    tms.resume("w")
    assert read(p, 4 * MiB) == data
    print("resumed", flush=True)


def listing(d, mode):
    """Prepares D (which sweeps it): what is left."""
    begin(d, mode)
    return sorted(os.listdir(D))


def write_error(d, mode):
    """A failed write keeps every allocation active with its bytes and removes the partial files."""
    begin(d, mode)
    sizes = [3 * MiB, 2 * MiB + 7, 5 * MiB]
    with tms.region("w", enable_disk_backup=True):
        ptrs = [tms.malloc(n) for n in sizes]
    data = [fill(p, n) for p, n in zip(ptrs, sizes)]
    e = expect(torch_memory_saver.Error, tms.pause, "w")
    assert isinstance(e, torch_memory_saver.Error), type(e)
    assert "disk backup: write" in str(e) and D in str(e) and "errno 5" in str(e), str(e)
    assert {r["state"] for r in tms.allocations()} == {"active"}
    assert [read(p, n) for p, n in zip(ptrs, sizes)] == data          # every byte kept
    assert bins() == []                                                # partial files removed
    tms.pause("w")                                                     # a retry works
    tms.resume("w")
    assert [read(p, n) for p, n in zip(ptrs, sizes)] == data
    print("done")


def write_error_on_a_rewrite(d, mode):
    """A failed rewrite in place drops the file: no half-old, half-new file for a later resume."""
    begin(d, mode)
    with tms.region("w", enable_disk_backup=True):
        p = tms.malloc(4 * MiB)
    fill(p, 4 * MiB)
    tms.pause("w")
    tms.resume("w")
    assert len(bins()) == 1
    data = fill(p, 4 * MiB)
    expect(Exception, tms.pause, "w", match="disk backup: write")
    assert bins() == [] and read(p, 4 * MiB) == data
    tms.pause("w")
    tms.resume("w")
    assert read(p, 4 * MiB) == data


def read_error(d, mode):
    """A failed read leaves the allocation paused with its file; a retry resumes it."""
    begin(d, mode)
    sizes = [3 * MiB, 2 * MiB + 7]
    with tms.region("w", enable_disk_backup=True):
        ptrs = [tms.malloc(n) for n in sizes]
    data = [fill(p, n) for p, n in zip(ptrs, sizes)]
    tms.pause("w")
    before = inodes()
    expect(Exception, tms.resume, "w", match="disk backup: read")
    states = sorted(r["state"] for r in tms.allocations())
    assert "paused" in states, states                                  # the failed one stays paused
    assert inodes() == before                                          # its file intact
    tms.resume("w")                                                    # the retry
    assert [read(p, n) for p, n in zip(ptrs, sizes)] == data
    print("done")


def short_writes(d, mode):
    begin(d, mode)
    n = 6 * MiB + 4095
    with tms.region("w", enable_disk_backup=True):
        p = tms.malloc(n)
    data = fill(p, n)
    tms.pause("w")
    tms.resume("w")
    assert read(p, n) == data


def disk_full(d, mode):
    """A file size limit stands in for a full disk: the 8 MiB file cannot be made."""
    import resource

    begin(d, mode)
    sizes = [1 * MiB, 8 * MiB]
    with tms.region("w", enable_disk_backup=True):
        ptrs = [tms.malloc(n) for n in sizes]
    data = [fill(p, n) for p, n in zip(ptrs, sizes)]
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 * MiB, resource.RLIM_INFINITY))
    e = expect(Exception, tms.pause, "w")
    assert "File too large" in str(e) and D in str(e), str(e)
    assert {r["state"] for r in tms.allocations()} == {"active"}
    assert [read(p, n) for p, n in zip(ptrs, sizes)] == data
    assert bins() == []
    print("done")


def disk_full_midway(d, mode):
    """The file size limit is hit by a write midway (on tmpfs no space is reserved up front)."""
    import resource

    begin(d, mode)
    with tms.region("w", enable_disk_backup=True):
        p = tms.malloc(8 * MiB)
    data = fill(p, 8 * MiB)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 * MiB, resource.RLIM_INFINITY))
    expect(Exception, tms.pause, "w", match="disk backup: write")
    assert read(p, 8 * MiB) == data and bins() == []
    print("done")


def environment(d, mode):
    """TMS_DISK_BACKUP_DIR, TMS_INIT_ENABLE_DISK_BACKUP=1 and TMS_DISK_BACKUP_CHUNK_MB=3 (d unused)."""
    begin(d, mode, set_dir=False)
    native = core()
    assert tms.disk_backup_dir == os.environ["TMS_DISK_BACKUP_DIR"]
    assert native.get_region()[4] is True                             # TMS_INIT_ENABLE_DISK_BACKUP
    assert native.defaults()["disk_backup_chunk_bytes"] == 3 * MiB
    native.set_region(True, "w", False, "mmap", True)
    p = tms.malloc(MiB)
    data = fill(p, MiB)
    tms.pause("w")
    assert len(os.listdir(os.environ["TMS_DISK_BACKUP_DIR"])) == 2   # its file and the lock
    tms.resume("w")
    assert read(p, MiB) == data
    print("done")


def default_dir(d, mode):
    """disk_backup_dir as the environment sets it (d unused)."""
    begin(d, mode, set_dir=False)
    return tms.disk_backup_dir


def api(d, mode, nested):
    """Argument errors, a nested directory made 0700, DiskBackupDirError, and the C ABI."""
    import pathlib

    begin(d, mode)
    expect(ValueError, tms.region("w", enable_cpu_backup=True, enable_disk_backup=True).__enter__,
           match="mutually exclusive")
    expect(TypeError, tms.region("w", enable_disk_backup=1).__enter__, match="enable_disk_backup must be a bool")
    expect(ValueError, tms.region("w", enable_disk_backup=True, cpu_backup_backend="pinned").__enter__,
           match="needs enable_cpu_backup=True")
    expect(TypeError, tms.set_disk_backup_dir, 3, match="expects a path")
    expect(ValueError, tms.set_disk_backup_dir, "", match="non-empty")
    tms.set_disk_backup_dir(pathlib.Path(nested))     # os.PathLike, nested, created
    assert tms.disk_backup_dir == nested
    assert stat.S_IMODE(os.stat(nested).st_mode) == 0o700
    blocker = os.path.join(D, "file")
    open(blocker, "w").close()
    e = expect(torch_memory_saver.DiskBackupDirError, tms.set_disk_backup_dir, os.path.join(blocker, "sub"),
               match="Not a directory")
    assert isinstance(e, OSError) and isinstance(e, ValueError) and blocker in str(e)   # upstream raised OSError
    assert tms.disk_backup_dir == nested              # unchanged by the failure
    # the C ABI, as upstream's callers use it
    cdll = tms._impl._binary_wrapper.cdll
    assert cdll.tms_set_disk_backup_dir(b"") == 6
    assert cdll.tms_set_disk_backup_dir(os.path.join(blocker, "sub").encode()) == 9   # TMS_STATUS_IO
    assert blocker.encode() in cdll.tms_get_last_error()
    assert cdll.tms_set_disk_backup_dir(D.encode()) == 0 and tms.disk_backup_dir == D
    cdll.tms_set_enable_disk_backup(True)
    cdll.tms_set_interesting_region(True)
    p = tms.malloc(MiB)
    cdll.tms_set_interesting_region(False)
    cdll.tms_set_enable_disk_backup(False)
    data = fill(p, MiB)
    assert cdll.tms_pause(b"default") == 0 and len(bins()) == 1
    assert not cdll.tms_get_cpu_backup_pointer(ctypes.cast(p, ctypes.POINTER(ctypes.c_uint8)), 16)
    assert cdll.tms_resume(b"") == 0 and read(p, MiB) == data
    summary = torch_memory_saver.memory_summary()
    assert "disk" in summary, summary
    print("done")


def forked_child(d, mode):
    """After a fork the parent's next pause writes new files; the child's resume gives the
    bytes of the fork or raises, never the parent's newer bytes; its free removes nothing."""
    import warnings

    begin(d, mode)
    warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)  # 3.12+
    with tms.region("w", enable_disk_backup=True):
        p = tms.malloc(2 * MiB)
        q = tms.malloc(MiB)
    data = fill(p, 2 * MiB)
    tms.pause("w")
    before = inodes()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(go_w)
            os.read(go_r, 1)                           # the parent has paused again (or died)
            try:
                tms.resume("w")
                code = 0 if read(p, 2 * MiB) == data else 3
            except Exception as e:
                code = 0 if "disk backup: opening" in str(e) else 4
            tms.free(q)                                # the child's record: not the parent's file
            os._exit(code)
        except BaseException:
            os._exit(5)
    tms.resume("w")
    assert read(p, 2 * MiB) == data
    newer = fill(p, 2 * MiB)
    tms.pause("w")
    after = inodes()
    assert not set(after.values()) & set(before.values()), (before, after)   # new files, not rewritten
    os.write(go_w, b"x")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    assert inodes() == after
    tms.resume("w")
    assert read(p, 2 * MiB) == newer
    tms.pause("w")
    tms.resume("w")                                    # no fork since: rewritten in place
    assert inodes() == after
    print("done")


def unusable_dir_from_the_environment(d, mode):
    """The directory the environment names cannot be used: a backed-up pause raises
    DiskBackupDirError naming it, and keeps the allocation active and whole (d unused)."""
    begin(d, mode, set_dir=False)
    with tms.region("w", enable_disk_backup=True):
        p = tms.malloc(2 * MiB)
    data = fill(p, 2 * MiB)
    e = expect(torch_memory_saver.DiskBackupDirError, tms.pause, "w")
    assert isinstance(e, ValueError) and isinstance(e, OSError)
    assert tms.allocations()[0]["state"] == "active" and read(p, 2 * MiB) == data
    return str(e)


def files_while_paused(d, mode):
    """The names in the backup directory while one disk-backed allocation is paused (README names each)."""
    begin(d, mode)
    with tms.region("w", enable_disk_backup=True):
        tms.malloc(2 * MiB)
    tms.pause("w")
    names = sorted(os.listdir(D))
    tms.resume("w")
    return names


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
