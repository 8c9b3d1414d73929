"""The core on the host backend (TMS_BACKEND=host: VMM emulated on memfd/mmap).

Every case runs in a fresh process (`in_child`): the backend, the TMS_*
environment, the fault-injection counters and the allocation table are per
process. The cases are functions of the scenario modules in tests/host_scenarios/,
one per topic: pause_resume.py, cpu_backup.py, regions.py, capacity.py, faults.py
and lifecycle.py (helpers in _prelude.py). Memory is counted as the library holds
it (the emulated device's bytes in use, the backups' bytes), never read from RSS.
"""
import os
import signal

import pytest

from conftest import HOOK_MODES, MiB
from host_scenarios import capacity, cpu_backup, faults, import_env, lifecycle, pause_resume, regions

# ---- allocation, pause/resume, memory given back --------------------------------


def test_alloc_in_region_holds_random_bytes(in_child):
    in_child(pause_resume.random_bytes_in_a_region)


def test_pause_returns_pages_and_resume_maps_them_back(in_child):
    n = 64 * MiB
    steps, usable = in_child(pause_resume.pages_go_and_come_back, n)
    assert steps == {"allocated": (n, "active", None), "paused": (0, "paused", n), "resumed": (n, "active", n),
                     "freed": (0, None, None)}
    assert usable


@pytest.mark.parametrize("access", ["read", "write"])
def test_touching_paused_memory_faults(in_child, access):
    child = in_child.run(pause_resume.touch_paused_memory, access)
    assert child.returncode == -signal.SIGSEGV, child.describe()
    assert child.stdout == "paused\n"


def test_pause_resume_by_tag(in_child):
    in_child(pause_resume.by_tag)


@pytest.mark.parametrize("threads", ["1", "3"])
@pytest.mark.parametrize("kind", ["pinned", "mmap"])
def test_cpu_backup_restores_random_bytes_exactly(in_child, kind, threads):
    # Copies move in 8 MiB blocks spread over TMS_BACKUP_THREADS workers:
    # sizes below, at and across block boundaries.
    in_child(cpu_backup.restores_exactly, kind, env={"TMS_BACKUP_THREADS": threads})


@pytest.mark.parametrize("kind", ["pinned", "mmap"])
def test_retain_cpu_backup_keeps_the_host_copy(in_child, kind):
    in_child(cpu_backup.retained, kind)


def test_retained_mmap_backup_is_page_locked_by_its_first_pause(in_child):
    # A retained backup is copied every cycle; page-locked (by the pause that makes
    # it, or on a thread of its own for one kept later) its copies skip the staging.
    # Without retain the backup goes at resume and is never page-locked. The host backend's
    # "page-locking" is a no-op, so this checks the bookkeeping and the direct
    # copies' contents (blocks of 32 MiB plus a tail), not the speed.
    in_child(cpu_backup.retained_mmap_is_page_locked)


def test_retained_mmap_pause_survives_a_page_lock_out_of_memory(in_child):
    in_child(cpu_backup.retained_mmap_lock_refused, env={"TMS_FAULT": "host_alloc:5"})


def test_copy_workers_warm_up_beside_the_caller(in_child):
    # The staging is pinned on a thread of the library's own, started by the first
    # backed-up allocation (TMS_INIT_ENABLE and the C ABI have no Python region), so
    # neither that allocation nor the first pause waits for it.
    in_child(cpu_backup.workers_warm_up_beside_the_caller)


def _mbind_permitted():
    """Can this process set a memory policy (no CONFIG_NUMA, or Docker's default
    seccomp profile, say no)? The library then leaves backups where they fall."""
    import ctypes
    import mmap

    if not os.path.exists("/proc/self/numa_maps"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    buf = mmap.mmap(-1, mmap.PAGESIZE)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    mask = ctypes.c_ulong(1)
    ok = libc.syscall(237, ctypes.c_void_p(addr), ctypes.c_size_t(mmap.PAGESIZE), 1, ctypes.byref(mask),
                      ctypes.c_ulong(2), 0) == 0  # SYS_mbind (x86_64), MPOL_PREFERRED, node 0
    return ok


@pytest.mark.parametrize("kind", ["mmap", "pinned"])
@pytest.mark.parametrize("node", [None, "0"])
def test_backup_placed_on_the_devices_numa_node(in_child, kind, node):
    # A backup's host pages are preferred on the GPU's NUMA node (the
    # host backend's devices sit on TMS_HOST_NUMA_NODE); the kernel lists the
    # policy in /proc/self/numa_maps. Where the node is unknown, no policy.
    import platform

    if platform.machine() != "x86_64" or not _mbind_permitted():
        pytest.skip("mbind not permitted here (no NUMA support or a seccomp profile): placement is skipped")
    placed = in_child(cpu_backup.numa_placement, kind, env={"TMS_HOST_NUMA_NODE": node} if node else None)
    assert placed == (1 if node else 0)


@pytest.mark.parametrize("kind", ["mmap", "pinned"])
def test_resume_releases_each_backup_on_its_copy_worker(in_child, kind):
    # Each restored backup's memory goes on the worker that restored it, while
    # the resume still runs (logged before the resume's own line); one a
    # zero-copy view holds stays, with its bytes, until the view goes.
    child = in_child.run(cpu_backup.released_on_the_copy_worker, kind, env={"TMS_LOG": "debug"})
    child.result(stderr_empty=False)
    first, second = child.stderr.split("--- second cycle")
    for log, released in ((first, 3), (second, 2)):
        lines = [line for line in log.splitlines() if "restored and released by its copy worker" in line
                 or "resume w:" in line]
        assert len(lines) == released + 1 and "resume w:" in lines[-1], log


@pytest.mark.parametrize("kind", ["mmap", "pinned"])
def test_backup_memory_returned_after_resume_unless_retained(in_child, kind):
    # The library's counters of its backups' host memory, at each step.
    n = 24 * MiB
    steps = in_child(cpu_backup.returned_unless_retained, kind, n)
    assert steps == {"paused": (n, n), "resumed": (0, 0, False), "retained": (n, n, True, n), "freed": (0, 0)}


def test_get_cpu_backup_native(in_child):
    in_child(cpu_backup.native_get_cpu_backup)


def test_free_while_paused(in_child):
    in_child(pause_resume.free_while_paused, env={"TMS_HOST_DEVICE_BYTES": 64 * MiB})


def test_double_pause_and_double_resume_raise_naming_the_tag(in_child):
    in_child(pause_resume.double_pause_and_resume)


def test_pause_resume_of_unknown_tag_is_a_noop(in_child):
    in_child(pause_resume.unknown_tags)


def test_nested_regions_restore_outer_settings(in_child):
    in_child(regions.nested)


def test_threads_have_independent_region_state(in_child):
    in_child(regions.per_thread)


# ---- environment defaults -------------------------------------------------------


@pytest.mark.parametrize("value,active", [("1", True), ("true", True), ("YES", True), ("TRUE", True),
                                          ("0", False), ("NO", False)])
def test_init_enable_makes_fresh_threads_active(in_child, value, active):
    in_child(regions.init_enable, active, env={"TMS_INIT_ENABLE": value})


def test_pause_default_tag_without_regions(in_child):
    in_child(regions.default_tag_without_regions, env={"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"})


def test_init_cpu_backup_env_and_retain_env_are_honoured(in_child):
    in_child(regions.init_backup_and_retain_env, env={
        "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "true", "TMS_INIT_CPU_BACKUP_BACKEND": "pinned",
        "TMS_RETAIN_CPU_BACKUP": "yes"})


def test_init_backup_env_without_init_enable(in_child):
    in_child(regions.init_backup_without_init_enable, env={
        "TMS_INIT_ENABLE_CPU_BACKUP": "1", "TMS_INIT_CPU_BACKUP_BACKEND": "mmap", "TMS_RETAIN_CPU_BACKUP": "0"})


@pytest.mark.parametrize("var,value,fragment", [
    ("TMS_FAULT", "explode:1", "TMS_FAULT='explode:1' is malformed"),
    ("TMS_FAULT", "create:0", "TMS_FAULT='create:0' is malformed"),
    ("TMS_HOST_DEVICE_BYTES", "lots", "TMS_HOST_DEVICE_BYTES='lots'"),
    ("TMS_HOST_DEVICES", "9", "TMS_HOST_DEVICES='9'"),
    ("TMS_BACKEND", "tpu", "TMS_BACKEND='tpu'"),
])
def test_malformed_backend_env_raises_at_import(in_child, var, value, fragment):
    # The backend's own variables are checked at import too, before the backend loads.
    in_child(import_env.backend_variable, fragment, env={var: value})


# ---- out of memory --------------------------------------------------------------


def test_memory_margin_bytes_gives_out_of_memory_error(in_child):
    in_child(capacity.margin, env={"TMS_HOST_DEVICE_BYTES": 64 * MiB})


def test_device_capacity_gives_out_of_memory_and_resume_recovers(in_child):
    in_child(capacity.device_capacity, env={"TMS_HOST_DEVICE_BYTES": 32 * MiB})


# ---- devices and chunks ---------------------------------------------------------


@pytest.mark.parametrize("devices,good,bad", [(None, 1, 2), ("1", 0, 1), ("4", 3, 4)])
def test_allocations_on_other_devices(in_child, devices, good, bad):
    n_devices = int(devices or 2)
    in_child(capacity.other_devices, good, bad, n_devices, env={"TMS_HOST_DEVICES": devices})


@pytest.mark.parametrize("kind", ["pinned", "mmap"])
def test_chunked_allocations_are_byte_exact_across_chunk_boundaries(in_child, kind):
    in_child(capacity.chunked, kind, env={"TMS_CHUNK_BYTES": "4MiB"})


# ---- fault injection ------------------------------------------------------------
#
# TMS_FAULT="op:n": the n-th call (1-based, per process) of a host-backend op
# fails once. Allocations here are made through raw_region (core.set_region):
# region(enable_cpu_backup=True) would also start the copy workers, whose
# pinned staging takes host_alloc calls of its own.

# One chunked allocation of 70 MiB - 1 in 32 MiB chunks (3 chunks: create/map
# calls 1-3 happen at allocation time). Its backup is pinned: the pause locks
# it and copies straight into it a 64 MiB piece at a time (two pieces), the
# resume copies from it in 32 MiB blocks (three).
_ONE_ALLOCATION_FAULTS = [
    # (TMS_FAULT, failing op, exception name, message fragment, state after the failed call)
    ("create:5", "resume", "OutOfMemoryError", "create of", "paused"),      # chunk 2 of 3
    ("map:4", "resume", "OutOfMemoryError", "map of", "paused"),            # chunk 1 of 3
    ("copy_to_device:2", "resume", "Error", "restore copy", "paused"),      # second copy block
    ("unmap:2", "pause", "Error", "unmap of allocation", "active"),         # chunk 2 of 3
    ("copy_to_host:2", "pause", "Error", "backup copy", "active"),
    # The copy workers' staging is host allocations 1-4 (TMS_BACKUP_THREADS=2);
    # locking the pinned backup's pieces is calls 5 and 6 (in the order the two
    # workers get there).
    ("host_alloc:1", "pause", "OutOfMemoryError", "staging", "active"),    # the copy workers' staging
    ("host_alloc:5", "pause", "OutOfMemoryError", "pinned backup", "active"),   # locking a piece of the backup
    ("host_alloc:6", "pause", "OutOfMemoryError", "pinned backup", "active"),   # and the other piece
]


@pytest.mark.parametrize("fault,op,exc,fragment,state", _ONE_ALLOCATION_FAULTS,
                         ids=[f[0] for f in _ONE_ALLOCATION_FAULTS])
def test_fault_in_one_chunked_allocation_loses_nothing(in_child, fault, op, exc, fragment, state):
    in_child(faults.one_chunked_allocation, op, exc, fragment, state,
                                env={"TMS_CHUNK_BYTES": "32MiB", "TMS_FAULT": fault})


def test_failed_unmap_keeps_no_backup(in_child):
    in_child(faults.failed_unmap, env={"TMS_CHUNK_BYTES": "4MiB", "TMS_FAULT": "unmap:2"})


def test_a_failing_rollback_is_reported_in_the_error(in_child):
    # Creating chunk 2 of 3 fails; undoing it, unmapping chunk 1 fails too:
    # both are in the message, and the emulated device gets every byte back.
    in_child(faults.failing_rollback, env={"TMS_CHUNK_BYTES": "2MiB", "TMS_FAULT": "map:2,unmap:1"})


# Four allocations, two pinned and two mmap backups, of 1-3 copy blocks each
# (host_scenarios/faults.py: several).
@pytest.mark.parametrize("fault,exc,fragment", [
    ("copy_to_host:1", "Error", "backup copy"),
    ("copy_to_host:3", "Error", "backup copy"),
    ("host_alloc:1", "OutOfMemoryError", "staging"),                   # workers start for the first copy
    ("host_alloc:5", "OutOfMemoryError", "pinned backup"),             # locking one pinned backup (a piece each)
    ("host_alloc:6", "OutOfMemoryError", "pinned backup"),             # locking the other
])
def test_fault_during_backed_up_pause_leaves_every_allocation_active(in_child, fault, exc, fragment):
    in_child(faults.backed_up_pause, exc, fragment, env={"TMS_FAULT": fault})


def test_failed_pause_drops_stale_retained_copies(in_child):
    # copy_to_host calls with 8 MiB blocks: the first pause copies
    # 1 + 3 + 1 + 1 = 6 blocks; the second pause fails on its second block.
    in_child(faults.stale_retained_copies, env={"TMS_FAULT": "copy_to_host:8", "TMS_BACKUP_BLOCK_BYTES": "8MiB"})


@pytest.mark.parametrize("failing", [0, 1, 3])
def test_create_fault_during_resume_keeps_the_failed_allocation_paused(in_child, failing):
    # One create per allocation at allocation time (calls 1-4); resume maps in
    # address order (calls 5-8: the order the driver is fastest in) and stops
    # at the first failure.
    in_child(faults.create_fault_in_resume, failing,
                                env={"TMS_FAULT": f"create:{5 + failing}"})


def test_restore_fault_during_resume_keeps_unrestored_allocations_paused(in_child):
    # copy_to_device blocks: 1 + 3 + 1 + 1; the 4th fails and the copy job
    # stops: an allocation is active only if all its bytes came back.
    in_child(faults.restore_fault_in_resume, env={"TMS_FAULT": "copy_to_device:4"})


# ---- hook variants and teardown -------------------------------------------------


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_both_hook_variants_work_on_the_host_backend(in_child, mode):
    in_child(lifecycle.variant, mode)


@pytest.mark.parametrize("mode,env", [
    ("preload", {}),
    ("torch", {}),
    ("preload", {"TMS_RETAIN_CPU_BACKUP": "1", "TMS_CHUNK_BYTES": "4MiB"}),
    ("torch", {"TMS_RETAIN_CPU_BACKUP": "1", "TMS_CHUNK_BYTES": "4MiB"}),
], ids=["preload", "torch", "preload-retain-chunked", "torch-retain-chunked"])
def test_process_exits_cleanly_with_live_allocations(in_child, mode, env):
    child = in_child.run(lifecycle.exit_with_live_allocations, mode, env=env)
    assert (child.returncode, child.stderr, child.stdout) == (0, "", "bye\n"), child.describe()


def test_backed_up_pause_in_a_forked_child(in_child):
    # The parent starts the copy workers; a forked child (multiprocessing's
    # default start method on Linux) then pauses and resumes with backups.
    in_child(lifecycle.backed_up_pause_in_a_forked_child)
