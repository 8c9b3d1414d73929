"""What every host-backend scenario imports: the public singleton, random fill and
read-back of pauseable memory through ctypes, the allocation table and RSS.

A scenario file holds the cases of one topic, each a function with a docstring; the
test runs one in a fresh process (tests/conftest.py: run_scenario) with its name and
arguments on the command line and TMS_BACKEND=host. A case asserts, prints what the
test checks, and exits 0. To run one by hand, from the repository root:

    PYTHONPATH=. TMS_BACKEND=host python tests/host_scenarios/pause_resume.py by_tag

Cases go through the public singleton `tms`; core() (the native module) is for what
only the native layer has, and a file that uses it says so in its first line."""
import contextlib
import ctypes
import os

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


def rss_bytes(pid="self"):
    """VmRSS of a process, in bytes (the host backend's memfd pages count in it)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS in /proc/{pid}/status")


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
