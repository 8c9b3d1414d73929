"""The one prelude of the host-backend children: the public singleton, random fill and
read-back of pauseable memory through ctypes, the allocation table, and counts of what
the library holds (device bytes in use, host backup bytes).

A child is a fresh Python process on the host backend (TMS_BACKEND=host) that runs a
function: a test hands one of its own module or of a scenario module here to the
`in_child` fixture (tests/child.py runs it and returns what it returned). A scenario
module holds the cases of one topic, each a function with a docstring, and can still be
run by hand or by `run_scenario` with the case's name and arguments on the command
line, from the repository root:

    PYTHONPATH=. TMS_BACKEND=host python tests/host_scenarios/pause_resume.py by_tag

`run_py` snippets start with `from _prelude import *`. Cases go through the public
singleton `tms`; core() (the native module) is for what only the native layer has, and
a file that uses it says so in its first line.

Counts, not RSS: the host backend's mem_get_info is exact (its capacity less what the
library created and has not released), so device_used() says what the library holds on
the emulated device whatever else the process or the machine does; backup_bytes()
says what its backups hold in host memory."""
import contextlib
import ctypes
import os
import random
import sys
import threading

from torch_memory_saver import torch_memory_saver as tms

MiB = 1 << 20


def core():
    """The native module in use (loads the core: set hook_mode before). For what only
    the native layer has; the rest goes through the public singleton `tms`."""
    return tms._core


def start():
    """Starts the core now, as the first use of `tms` would: what follows (settings,
    measurements) then meets a running core."""
    core()


def fill(ptr, n):
    """n random bytes written at ptr; returns them."""
    data = os.urandom(n)
    ctypes.memmove(ptr, data, n)
    return data


def read(ptr, n):
    return ctypes.string_at(ptr, n)


def row(ptr):
    """The allocations() row of the allocation at ptr."""
    rows = [r for r in tms.allocations() if r["ptr"] == ptr]
    assert len(rows) == 1, (hex(ptr), tms.allocations())
    return rows[0]


def states():
    """Sorted (tag, state) pairs of every allocation."""
    return sorted((r["tag"], r["state"]) for r in tms.allocations())


def device_used(device=0):
    """Bytes of the emulated device the library holds now: what it created and has not
    released (the host backend counts each create and release exactly)."""
    free, total = core().mem_get_info(device)
    return total - free


def backup_bytes(tag=None, device=0):
    """Bytes of host memory the backups of `tag` (None: every tag) hold now, by the
    library's own counters: {"pinned": n, "mmap": n, "disk": n}."""
    out = {"pinned": 0, "mmap": 0, "disk": 0}
    for r in core().stats():
        if r["device"] == device and (tag is None or r["tag"] == tag):
            for kind in out:
                out[kind] += r[f"bytes_backup_{kind}"]
    return out


def resident_bytes(buffer):
    """Bytes of the pages under a writable buffer (a backup's view) that are in memory,
    by mincore(2): what that mapping holds, whatever else the process does."""
    page = os.sysconf("SC_PAGE_SIZE")
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    start = addr - addr % page
    n = (addr + len(buffer) - start + page - 1) // page
    vec = (ctypes.c_ubyte * n)()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(n * page), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(v & 1 for v in vec) * page


def expect(exc_type, fn, *args, match=None, **kwargs):
    """Calls fn; asserts it raises exc_type (with match in its message); returns the exception."""
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        if match is not None:
            assert match in str(e), (match, str(e))
        return e
    raise AssertionError(f"{fn!r}{args!r} did not raise {exc_type.__name__}")


@contextlib.contextmanager
def raw_region(tag, backup=False, kind="mmap", disk=False):
    """A region set through the native API only (no Python-side warm-up)."""
    previous = core().get_region()
    core().set_region(True, tag, backup, kind, disk)
    try:
        yield
    finally:
        core().set_region(*previous)


def run_cases(cases, argv):
    """Runs the case named by argv[1] (a function of cases), with argv[2:]."""
    name, *args = argv[1:]
    cases[name](*args)
