"""Disk backup on the host backend (issue 11): files, their lifecycle and owners,
failures with every byte kept, the page cache left alone, environment and API."""
import os
import subprocess
import sys
import importlib.util
import inspect
import textwrap

import pytest

from conftest import CHILD_PRELUDE, HOOK_MODES, REPO, check_ok, child_env

_spec = importlib.util.spec_from_file_location("_pagecache", REPO / "tests" / "gpu_scenarios" / "_pagecache.py")
_pagecache = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_pagecache)

# The child snippets' helpers for disk backups: the backup files of a directory,
# their inodes, and how many of a file's pages sit in the page cache.
DISK_PRELUDE = """
import stat
D = sys.argv[1]

def bins():
    return sorted(n for n in os.listdir(D) if n.endswith(".bin"))

def inodes():
    return {n: os.stat(os.path.join(D, n)).st_ino for n in bins()}

""" + inspect.getsource(_pagecache.cached_bytes)


@pytest.fixture
def run_disk(run_py, tmp_path):
    """run_disk(code, env=None, mode="torch", directory=None): run_py with the disk
    prelude, `D` = the backup directory (set with set_disk_backup_dir first)."""

    def run(code, env=None, mode="torch", directory=None, set_dir=True, timeout=60):
        d = str(directory or tmp_path / "backups")
        head = f"tms.hook_mode = {mode!r}\n" + DISK_PRELUDE
        if set_dir:
            head += "tms.set_disk_backup_dir(D)\n"
        head += "core = tms._core\n"
        return run_py(head + textwrap.dedent(code), env=env, load_core=False, args=(d,), timeout=timeout)

    return run


def _bins(d):
    return sorted(n for n in os.listdir(d) if n.endswith(".bin")) if os.path.isdir(d) else []


@pytest.mark.parametrize("mode", HOOK_MODES)
def test_file_per_allocation_rewritten_in_place_and_bit_exact(run_disk, tmp_path, mode):
    # 1 MiB blocks: the 5 MiB + 12345 allocation moves in six blocks with an odd tail.
    out = check_ok(run_disk("""
        sizes = [1000, 5 * MiB + 12345, 3 * MiB]
        with tms.region("w", enable_disk_backup=True):
            ptrs = [core.malloc(n) for n in sizes]
        rows = {r["ptr"]: r for r in core.allocations()}
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
            assert all(core.get_cpu_backup(p, 8) is None for p in ptrs)    # a file is no CPU backup
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
            assert flags & 0o2000000, oct(flags)                             # O_CLOEXEC
        print("done")
    """, mode=mode, env={"TMS_DISK_BACKUP_CHUNK_MB": "1"}))
    assert out == "done\n"
    assert os.listdir(tmp_path / "backups") == []                          # nothing left at exit, lock included


def test_many_allocations_under_a_low_descriptor_limit(run_disk):
    # A file is open only while a pause or resume moves it, at most 64 at once: 300
    # disk-backed allocations cycle with RLIMIT_NOFILE 100 above what the process
    # holds (on the host backend each active allocation holds a memfd itself).
    out = check_ok(run_disk("""
        import resource
        n, size = 300, 8192 + 17
        with tms.region("w", enable_disk_backup=True):
            ptrs = [core.malloc(size) for _ in range(n)]
        data = [fill(p, size) for p in ptrs]
        held = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (held + 100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        for _ in range(2):
            tms.pause("w")
            assert len(bins()) == n
            tms.resume("w")
            assert [read(p, size) for p in ptrs] == data
        print("done")
    """, env={"TMS_HOST_DEVICE_BYTES": "2GiB"}))
    assert out == "done\n"


def test_free_removes_the_file_paused_or_active(run_disk):
    check_ok(run_disk("""
        with tms.region("w", enable_disk_backup=True):
            a, b = core.malloc(2 * MiB), core.malloc(3 * MiB)
        fill(a, 2 * MiB), fill(b, 3 * MiB)
        tms.pause("w")
        assert len(bins()) == 2
        core.free(a)                                   # paused
        assert len(bins()) == 1
        tms.resume("w")
        assert len(bins()) == 1                        # kept while active
        core.free(b)                                   # active
        assert bins() == []
        assert tms.stats() == {} or tms.stats()[0]["w"]["bytes_backup_disk"] == 0
    """))


def test_page_cache_and_rss_stay_flat(run_disk):
    # 96 MiB backed up: the file's pages must not stay in the page cache, and the
    # process's RSS must not grow by the backup (only by the staging, warm already).
    out = check_ok(run_disk("""
        n = 96 * MiB
        with tms.region("w", enable_disk_backup=True):
            p = core.malloc(n)
        data = fill(p, n)
        rss0 = rss_bytes()
        tms.pause("w")
        rss1 = rss_bytes()
        (name,) = bins()
        cached = cached_bytes(os.path.join(D, name))
        assert cached <= 8 * MiB, f"{cached} bytes of the backup cached"
        assert rss1 < rss0 - n + 16 * MiB, (rss0, rss1)  # the device memory went, nothing came back
        tms.resume("w")
        assert read(p, n) == data
        print("done")
    """))
    assert out == "done\n"


def _sleeper(run_disk_env, tmp_path, d, code):
    """A child that backs up to d, then waits: returns the Popen once it is paused."""
    script = tmp_path / f"owner_{len(os.listdir(tmp_path))}.py"
    script.write_text(CHILD_PRELUDE + DISK_PRELUDE + "tms.hook_mode = 'torch'\ntms.set_disk_backup_dir(D)\n"
                      "core = tms._core\n" + code)
    p = subprocess.Popen([sys.executable, str(script), str(d)], env=run_disk_env, stdout=subprocess.PIPE,
                         stdin=subprocess.PIPE, text=True)
    assert p.stdout.readline() == "paused\n"
    return p


def test_files_of_a_killed_process_are_removed_by_the_next(run_disk, tmp_path):
    d = tmp_path / "shared"
    env = child_env()
    holder = """
        with tms.region("w", enable_disk_backup=True):
            p = core.malloc(4 * MiB)
        data = fill(p, 4 * MiB)
        tms.pause("w")
        print("paused", flush=True)
        sys.stdin.readline()
        tms.resume("w")
        assert read(p, 4 * MiB) == data
        print("resumed", flush=True)
    """
    holder = textwrap.dedent(holder)
    killed = _sleeper(env, tmp_path, d, holder)
    alive = _sleeper(env, tmp_path, d, holder)
    killed.kill()                                                     # SIGKILL: no exit handler runs
    killed.wait()
    names = sorted(os.listdir(d))
    assert len(_bins(d)) == 2 and sum(n.endswith(".lock") for n in names) == 2, names
    (d / "tms-999999-00000000deadbeef-00000000000000aa.bin").write_bytes(b"x")  # no lock: not proof of death
    (d / "unrelated.bin").write_bytes(b"y")                                     # not ours: never touched
    out = check_ok(run_disk("""
        print(sorted(os.listdir(D)))
    """, directory=d))
    left = eval(out)
    killed_prefix = f"tms-{killed.pid}-"
    alive_prefix = f"tms-{alive.pid}-"
    assert not any(n.startswith(killed_prefix) for n in left), left           # the dead owner's files went
    assert sum(n.startswith(alive_prefix) for n in left) == 2, left           # the live owner's stay
    assert "unrelated.bin" in left and "tms-999999-00000000deadbeef-00000000000000aa.bin" in left, left
    alive.stdin.write("\n")
    alive.stdin.flush()
    assert alive.stdout.readline() == "resumed\n"
    assert alive.wait(timeout=30) == 0
    assert sorted(os.listdir(d)) == ["tms-999999-00000000deadbeef-00000000000000aa.bin", "unrelated.bin"]


def test_write_error_keeps_every_allocation_active_and_removes_partial_files(run_disk):
    out = check_ok(run_disk("""
        sizes = [3 * MiB, 2 * MiB + 7, 5 * MiB]
        with tms.region("w", enable_disk_backup=True):
            ptrs = [core.malloc(n) for n in sizes]
        data = [fill(p, n) for p, n in zip(ptrs, sizes)]
        e = expect(tms.Error if hasattr(tms, "Error") else Exception, tms.pause, "w")
        import torch_memory_saver
        assert isinstance(e, torch_memory_saver.Error), type(e)
        assert "disk backup: write" in str(e) and D in str(e) and "errno 5" in str(e), str(e)
        assert {r["state"] for r in core.allocations()} == {"active"}
        assert [read(p, n) for p, n in zip(ptrs, sizes)] == data          # every byte kept
        assert bins() == []                                                 # partial files removed
        tms.pause("w")                                                      # a retry works
        tms.resume("w")
        assert [read(p, n) for p, n in zip(ptrs, sizes)] == data
        print("done")
    """, env={"TMS_FAULT": "disk_write:3", "TMS_DISK_BACKUP_CHUNK_MB": "1"}))
    assert out == "done\n"


def test_write_error_on_a_rewrite_drops_the_stale_file(run_disk):
    # The second pause rewrites the files in place; a failure then must not leave
    # a half-old, half-new file that a later resume could read.
    check_ok(run_disk("""
        with tms.region("w", enable_disk_backup=True):
            p = core.malloc(4 * MiB)
        fill(p, 4 * MiB)
        tms.pause("w"); tms.resume("w")
        assert len(bins()) == 1
        data = fill(p, 4 * MiB)
        expect(Exception, tms.pause, "w", match="disk backup: write")
        assert bins() == [] and read(p, 4 * MiB) == data
        tms.pause("w"); tms.resume("w")
        assert read(p, 4 * MiB) == data
    """, env={"TMS_FAULT": "disk_write:6", "TMS_DISK_BACKUP_CHUNK_MB": "1"}))


def test_read_error_leaves_the_allocation_paused_with_its_file_and_a_retry_resumes(run_disk):
    out = check_ok(run_disk("""
        sizes = [3 * MiB, 2 * MiB + 7]
        with tms.region("w", enable_disk_backup=True):
            ptrs = [core.malloc(n) for n in sizes]
        data = [fill(p, n) for p, n in zip(ptrs, sizes)]
        tms.pause("w")
        before = inodes()
        expect(Exception, tms.resume, "w", match="disk backup: read")
        states = sorted(r["state"] for r in core.allocations())
        assert "paused" in states, states                                   # the failed one stays paused
        assert inodes() == before                                           # its file intact
        tms.resume("w")                                                     # the retry
        assert [read(p, n) for p, n in zip(ptrs, sizes)] == data
        print("done")
    """, env={"TMS_FAULT": "disk_read:2", "TMS_DISK_BACKUP_CHUNK_MB": "1"}))
    assert out == "done\n"


def test_short_writes_are_continued(run_disk):
    check_ok(run_disk("""
        n = 6 * MiB + 4095
        with tms.region("w", enable_disk_backup=True):
            p = core.malloc(n)
        data = fill(p, n)
        tms.pause("w")
        tms.resume("w")
        assert read(p, n) == data
    """, env={"TMS_FAULT": "disk_short_write:1,disk_short_write:1", "TMS_DISK_BACKUP_CHUNK_MB": "2"}))


def test_disk_full_raises_and_keeps_every_byte(run_disk):
    # A file size limit stands in for a full disk: the 8 MiB file cannot be made.
    out = check_ok(run_disk("""
        import resource
        sizes = [1 * MiB, 8 * MiB]
        with tms.region("w", enable_disk_backup=True):
            ptrs = [core.malloc(n) for n in sizes]
        data = [fill(p, n) for p, n in zip(ptrs, sizes)]
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 * MiB, resource.RLIM_INFINITY))
        e = expect(Exception, tms.pause, "w")
        assert "File too large" in str(e) and D in str(e), str(e)
        assert {r["state"] for r in core.allocations()} == {"active"}
        assert [read(p, n) for p, n in zip(ptrs, sizes)] == data
        assert bins() == []
        print("done")
    """))
    assert out == "done\n"


def test_disk_full_during_the_writes_on_tmpfs(run_disk, tmp_path):
    # On tmpfs no space is reserved up front: the limit is hit by a write midway.
    if not os.path.isdir("/dev/shm") or not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    d = f"/dev/shm/tms-test-{os.getpid()}-{tmp_path.name}"
    try:
        proc = run_disk("""
            import resource
            with tms.region("w", enable_disk_backup=True):
                p = core.malloc(8 * MiB)
            data = fill(p, 8 * MiB)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4 * MiB, resource.RLIM_INFINITY))
            expect(Exception, tms.pause, "w", match="disk backup: write")
            assert read(p, 8 * MiB) == data and bins() == []
            print("done")
        """, directory=d, env={"TMS_DISK_BACKUP_CHUNK_MB": "1"})
        assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr
        assert "is on a tmpfs" in proc.stderr and d in proc.stderr, proc.stderr   # the warning line
    finally:
        import shutil

        shutil.rmtree(d, ignore_errors=True)


def test_environment_defaults(run_disk, tmp_path):
    d = tmp_path / "from-env"
    out = check_ok(run_disk("""
        assert tms.disk_backup_dir == os.environ["TMS_DISK_BACKUP_DIR"]
        assert core.get_region()[4] is True                       # TMS_INIT_ENABLE_DISK_BACKUP
        assert core.defaults()["disk_backup_chunk_bytes"] == 3 * MiB
        core.set_region(True, "w", False, "mmap", True)
        p = core.malloc(MiB)
        data = fill(p, MiB)
        tms.pause("w")
        assert len(os.listdir(os.environ["TMS_DISK_BACKUP_DIR"])) == 2   # its file and the lock
        tms.resume("w")
        assert read(p, MiB) == data
        print("done")
    """, set_dir=False, env={"TMS_DISK_BACKUP_DIR": d, "TMS_INIT_ENABLE_DISK_BACKUP": "1",
                            "TMS_DISK_BACKUP_CHUNK_MB": "3"}))
    assert out == "done\n"
    out = check_ok(run_disk("print(tms.disk_backup_dir)", set_dir=False, env={"TMPDIR": str(tmp_path)}))
    assert out == f"{tmp_path}\n"
    out = check_ok(run_disk("print(tms.disk_backup_dir)", set_dir=False, env={"TMPDIR": None}))
    assert out == "/tmp\n"


@pytest.mark.parametrize("var,value", [
    ("TMS_DISK_BACKUP_CHUNK_MB", "0"), ("TMS_DISK_BACKUP_CHUNK_MB", "256MiB"), ("TMS_DISK_BACKUP_CHUNK_MB", "5000"),
    ("TMS_INIT_ENABLE_DISK_BACKUP", "on"),
])
def test_malformed_environment_is_a_value_error_at_import(run_py, var, value):
    proc = run_py("import torch_memory_saver", prelude=False, env={var: value})
    assert proc.returncode != 0
    assert "ValueError" in proc.stderr and f"{var}='{value}'" in proc.stderr, proc.stderr


def test_api_shapes_and_errors(run_disk, tmp_path):
    d = tmp_path / "a" / "b" / "c"
    out = check_ok(run_disk(f"""
        import pathlib, torch_memory_saver
        expect(ValueError, tms.region("w", enable_cpu_backup=True, enable_disk_backup=True).__enter__,
               match="mutually exclusive")
        expect(TypeError, tms.region("w", enable_disk_backup=1).__enter__, match="enable_disk_backup must be a bool")
        expect(ValueError, tms.region("w", enable_disk_backup=True, cpu_backup_backend="pinned").__enter__,
               match="needs enable_cpu_backup=True")
        expect(TypeError, tms.set_disk_backup_dir, 3, match="expects a path")
        expect(ValueError, tms.set_disk_backup_dir, "", match="non-empty")
        tms.set_disk_backup_dir(pathlib.Path({str(d)!r}))           # os.PathLike, nested, created
        assert tms.disk_backup_dir == {str(d)!r}
        assert stat.S_IMODE(os.stat({str(d)!r}).st_mode) == 0o700
        blocker = os.path.join(D, "file")
        open(blocker, "w").close()
        e = expect(torch_memory_saver.DiskBackupDirError, tms.set_disk_backup_dir, os.path.join(blocker, "sub"),
                   match="Not a directory")
        assert isinstance(e, OSError) and isinstance(e, ValueError) and blocker in str(e)   # upstream raised OSError
        assert tms.disk_backup_dir == {str(d)!r}                    # unchanged by the failure
        # the C ABI, as upstream's callers use it
        cdll = tms._impl._binary_wrapper.cdll
        assert cdll.tms_set_disk_backup_dir(b"") == 6
        assert cdll.tms_set_disk_backup_dir(os.path.join(blocker, "sub").encode()) == 9   # TMS_STATUS_IO
        assert blocker.encode() in cdll.tms_get_last_error()
        assert cdll.tms_set_disk_backup_dir(D.encode()) == 0 and tms.disk_backup_dir == D
        cdll.tms_set_enable_disk_backup(True)
        cdll.tms_set_interesting_region(True)
        p = core.malloc(MiB)
        cdll.tms_set_interesting_region(False)
        cdll.tms_set_enable_disk_backup(False)
        data = fill(p, MiB)
        assert cdll.tms_pause(b"default") == 0 and len(bins()) == 1
        assert not cdll.tms_get_cpu_backup_pointer(ctypes.cast(p, ctypes.POINTER(ctypes.c_uint8)), 16)
        assert cdll.tms_resume(b"") == 0 and read(p, MiB) == data
        summary = torch_memory_saver.memory_summary()
        assert "disk" in summary, summary
        print("done")
    """))
    assert out == "done\n"


def test_forked_child_never_removes_or_rewrites_the_parents_files(run_disk):
    # After a fork the parent's next pause writes a new file instead of rewriting
    # the one the child may still read: the child's resume then gives the bytes of
    # the fork, or (the old file removed by the parent) raises, never the parent's
    # newer bytes. The child's free does not remove the parent's file.
    out = check_ok(run_disk("""
        import warnings
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)  # 3.12+
        with tms.region("w", enable_disk_backup=True):
            p = core.malloc(2 * MiB)
            q = core.malloc(MiB)
        data = fill(p, 2 * MiB)
        tms.pause("w")
        before = inodes()
        go_r, go_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                os.close(go_w)
                os.read(go_r, 1)                       # the parent has paused again (or died)
                try:
                    tms.resume("w")
                    code = 0 if read(p, 2 * MiB) == data else 3
                except Exception as e:
                    code = 0 if "disk backup: opening" in str(e) else 4
                core.free(q)                           # the child's record: not the parent's file
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
        tms.pause("w"); tms.resume("w")                # no fork since: rewritten in place
        assert inodes() == after
        print("done")
    """))
    assert out == "done\n"
