"""Safe on a machine shared with other users: the disk backup directory and its files,
the sweep of dead processes' files, the relocation hooks, and input from outside (C ABI
arguments, environment, Python arguments). Each test is one way in that an attack
review found; tests/host_scenarios/disk_attacks.py plays the victim (and another user
where the test runs as root)."""
import os
import subprocess
import sys

import pytest

from conftest import HOST_SCENARIOS, check_ok, child_env
from host_scenarios import bad_input

IS_ROOT = os.geteuid() == 0


def _private(path):
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


@pytest.fixture
def shared_dir():
    """A directory everyone can write, that another user can reach (under /tmp:
    pytest's own directories are private to this user)."""
    import shutil
    import tempfile

    d = tempfile.mkdtemp(prefix="tms-shared-", dir="/tmp")
    os.chmod(d, 0o777)
    yield d
    shutil.rmtree(d, ignore_errors=True)


# ---- the directory -----------------------------------------------------------------


def test_a_directory_others_can_write_is_refused_naming_owner_and_mode(run_scenario, tmp_path):
    out = check_ok(run_scenario("disk_attacks", "untrusted_dirs", _private(tmp_path / "base")))
    assert out == "refused and accepted as expected\n"


def test_the_user_may_vouch_for_a_shared_directory(run_scenario, tmp_path):
    out = check_ok(run_scenario("disk_attacks", "vouched", _private(tmp_path / "base"),
                                env={"TMS_DISK_BACKUP_TRUST_DIR": "1"}))
    assert out == "vouched\n"


def test_a_replaced_backup_file_is_an_error_never_data(run_scenario, tmp_path, shared_dir):
    # A directory others can write (vouched for): files are replaced after the pause by
    # a link, a copy, another user's file; the header changed, the file cut short.
    out = check_ok(run_scenario("disk_attacks", "replaced_file", shared_dir, _private(tmp_path / "own") / "precious",
                                env={"TMS_DISK_BACKUP_TRUST_DIR": "1"}))
    assert out == "every replacement refused\n"


def test_a_link_under_the_hidden_lock_name_truncates_nothing(run_scenario, tmp_path):
    out = check_ok(run_scenario("disk_attacks", "lock_link", _private(tmp_path / "d1"), tmp_path / "d2",
                                _private(tmp_path / "own") / "precious"))
    assert out == "nothing truncated\n"


def test_fifos_under_our_names_hang_neither_the_sweep_nor_fork(run_scenario, tmp_path):
    out = check_ok(run_scenario("disk_attacks", "fifos", tmp_path / "d", timeout=90))
    assert out == "no hang\n"


def test_predictable_names_made_in_advance_do_not_stop_a_pause(run_scenario, tmp_path):
    out = check_ok(run_scenario("disk_attacks", "squat", _private(tmp_path / "d")))
    assert out == "made its files\n"


def test_a_relative_directory_is_resolved_once(run_scenario, tmp_path):
    start, elsewhere = _private(tmp_path / "start"), _private(tmp_path / "elsewhere")
    out = check_ok(run_scenario("disk_attacks", "relative", start, elsewhere, env={"TMS_DISK_BACKUP_DIR": "rel"}))
    assert out == "stayed\n"


def test_a_failed_write_back_fails_the_pause(run_scenario, tmp_path):
    out = check_ok(run_scenario("disk_attacks", "write_back", _private(tmp_path / "d"),
                                env={"TMS_FAULT": "disk_no_direct:1,disk_sync:1"}))
    assert out == "reported\n"


# ---- the sweep -------------------------------------------------------------------------


def _holder(d):
    p = subprocess.Popen([sys.executable, str(HOST_SCENARIOS / "disk_attacks.py"), "hold", str(d)],
                         env=child_env(), stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "paused\n"
    return p


def test_a_live_owner_whose_lock_was_removed_keeps_its_backups(run_scenario, tmp_path):
    d = _private(tmp_path / "d")
    holder = _holder(d)
    try:
        (lock,) = [n for n in os.listdir(d) if n.endswith(".lock")]
        (backup,) = [n for n in os.listdir(d) if n.endswith(".bin")]
        os.unlink(d / lock)                                   # a /tmp cleaner: not proof of death
        left = eval(check_ok(run_scenario("disk_attacks", "sweep", d)))
        assert backup in left, left
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline() == "resumed, lock 1\n"   # bit-exact, and its lock made again
    finally:
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0


def test_the_sweep_removes_only_what_is_dead_and_ours(run_scenario, tmp_path):
    d = _private(tmp_path / "d")
    dead_lock, dead_bin = "tms-999999-00000000000000aa.lock", "tms-999999-00000000000000aa-00000000000000bb.bin"
    foreign = ["tms-2024-01-quarterly-report.bin", "tms-1-zz.lock", "tms-12-00000000000000aa-x.bin",
               "tms-0999-00000000000000aa.lock", "tms-7-00000000000000AA.lock"]
    for name in [dead_lock, dead_bin, *foreign]:
        (d / name).write_bytes(b"x")
    if IS_ROOT:                                               # a dead owner's files, but another user's
        theirs = ["tms-999998-00000000000000cc.lock", "tms-999998-00000000000000cc-00000000000000dd.bin"]
        for name in theirs:
            (d / name).write_bytes(b"y")
            os.chown(d / name, 65534, -1)
        foreign += theirs
    left = eval(check_ok(run_scenario("disk_attacks", "sweep", d)))
    assert dead_lock not in left and dead_bin not in left, left   # dead (its lock could be taken) and ours
    assert all(name in left for name in foreign), left


# ---- relocation hooks ----------------------------------------------------------------
# (tests/test_reloc.py: a dlopen returns patched; two runtimes each keep their own; a
# store keeps a protection someone changed since its pass began.)


def test_the_library_stays_mapped_after_its_last_dlclose_while_its_threads_live(run_py, built_libs):
    # Loaded with dlopen alone (as a C program or ctypes may), its copy workers started by a
    # backed-up pause, then closed: they stay parked in its code, so it must stay mapped.
    out = check_ok(run_py(f"""
        import _ctypes, ctypes, os
        path = {str(built_libs["preload"])!r}
        before = set(os.listdir("/proc/self/task"))
        lib = ctypes.CDLL(path)
        assert lib.tms_set_interesting_region(True) == 0 and lib.tms_set_enable_cpu_backup(True) == 0
        ptr = ctypes.c_void_p()
        assert lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(4 << 20)) == 0 and ptr.value
        assert lib.tms_set_interesting_region(False) == 0
        assert lib.tms_pause(None) == 0 and lib.tms_resume(None) == 0
        threads = set(os.listdir("/proc/self/task")) - before
        assert threads, "no thread of the library's"
        _ctypes.dlclose(lib._handle)                    # its only reference
        ctypes.CDLL(path, mode=os.RTLD_NOLOAD)          # raises if it was unloaded
        assert path in open("/proc/self/maps").read()
        assert threads <= set(os.listdir("/proc/self/task"))
        pid = os.fork()                                 # its fork handlers still run
        if pid == 0:
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        print("mapped")
        """, prelude=False))
    assert out == "mapped\n"


# ---- input from outside ----------------------------------------------------------------


def test_a_tag_that_is_not_utf8_is_refused_where_it_enters(in_child):
    in_child(bad_input.tag_not_utf8)


def test_cudamalloc_of_null_in_a_region_is_invalid_value_with_nothing_kept(in_child):
    in_child(bad_input.cudamalloc_of_null)


def test_many_distinct_tags_are_reclaimed_and_looked_up_by_name(in_child):
    in_child(bad_input.many_distinct_tags, timeout=120)


@pytest.mark.parametrize("value", [" 1", "+1", "\n1", "1 ", "0x2"])
def test_numbers_in_the_environment_are_digits_only(run_py, value):
    proc = run_py("import torch_memory_saver", prelude=False, env={"TMS_BACKUP_THREADS": value})
    assert proc.returncode != 0 and "ValueError" in proc.stderr, proc.stderr
    assert "is not a number from 1 to 32" in proc.stderr, proc.stderr


def test_a_fault_count_past_the_range_is_refused(run_py):
    proc = run_py("import torch_memory_saver", prelude=False, env={"TMS_FAULT": "create:99999999999999999999"})
    assert proc.returncode != 0 and "TMS_FAULT='create:99999999999999999999' is malformed" in proc.stderr, proc.stderr


def test_python_arguments_are_value_errors_naming_them(in_child):
    in_child(bad_input.python_arguments)
