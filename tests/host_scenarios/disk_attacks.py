"""Disk backups in a directory other users can reach (tests/test_security.py).

Each case plays the victim (and, where the test runs as root, also another
user, through a forked child that drops to uid 65534): the directory is
checked, files are found by descriptor and checked on every reopen, and the
sweep removes only what it can prove is dead and ours."""
import ctypes
import faulthandler
import os
import stat
import sys
import threading

import torch_memory_saver
from _prelude import MiB, core, expect, fill, read, row, run_cases, tms

faulthandler.dump_traceback_later(45, exit=True)  # a hang fails here, with a traceback
OTHER_UID = 65534


def bins(d):
    """This process's backup files in d."""
    return sorted(n for n in os.listdir(d) if n.startswith(f"tms-{os.getpid()}-") and n.endswith(".bin"))


def as_other_user(fn):
    """Runs fn in a child with another uid (root only); returns its exit code."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgid(OTHER_UID)
            os.setuid(OTHER_UID)
            fn()
            os._exit(0)
        except BaseException as e:  # noqa: BLE001 - the parent reads the code
            print("other user:", repr(e), file=sys.stderr)
            os._exit(3)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def untrusted_dirs(base):
    """Directories another user could write are refused, naming path, owner and mode."""
    def made(name, mode, uid=None):
        path = os.path.join(base, name)
        os.makedirs(path, exist_ok=True)
        os.chmod(path, mode)
        if uid is not None:
            os.chown(path, uid, -1)
        return path

    me = os.geteuid()
    for path, at, mode in [(made("open", 0o777), "open", "0777"), (made("group", 0o770), "group", "0770"),
                           (os.path.join(made("open", 0o777), "sub"), "open", "0777")]:
        e = expect(torch_memory_saver.DiskBackupDirError, tms.set_disk_backup_dir, path, match="is not safe")
        assert isinstance(e, ValueError) and isinstance(e, OSError), type(e).__mro__
        assert os.path.join(base, at) in str(e) and f"uid {me}" in str(e) and f"mode {mode}" in str(e), str(e)
        assert "TMS_DISK_BACKUP_TRUST_DIR=1" in str(e), str(e)
    if me == 0:
        path = made("theirs", 0o700, uid=OTHER_UID)
        e = expect(torch_memory_saver.DiskBackupDirError, tms.set_disk_backup_dir, path, match="is not safe")
        assert f"uid {OTHER_UID}" in str(e), str(e)
    for path, what in [("/etc/passwd", "Not a directory"), ("/proc/x/y", "No such file")]:
        e = expect(torch_memory_saver.DiskBackupDirError, tms.set_disk_backup_dir, path, match=path)
        assert what in str(e), str(e)
    cdll = tms._impl._binary_wrapper.cdll
    assert cdll.tms_set_disk_backup_dir(os.path.join(base, "open").encode()) == 6       # TMS_STATUS_ARG
    assert b"is not safe" in cdll.tms_get_last_error()
    # Safe: mine and private, a sticky one of mine, and a link in a safe place to one.
    for path in (made("mine", 0o700), made("sticky", 0o1777)):
        tms.set_disk_backup_dir(path)
        assert tms.disk_backup_dir == path
    os.symlink(os.path.join(base, "mine"), os.path.join(base, "link"))
    tms.set_disk_backup_dir(os.path.join(base, "link"))
    assert tms.disk_backup_dir == os.path.join(base, "mine")
    print("refused and accepted as expected")


def vouched(base):
    """TMS_DISK_BACKUP_TRUST_DIR=1: the user vouches for a directory others can write."""
    path = os.path.join(base, "open")
    os.makedirs(path, exist_ok=True)
    os.chmod(path, 0o777)
    tms.set_disk_backup_dir(path)
    with tms.region("w", enable_disk_backup=True):
        p = core().malloc(MiB)
    data = fill(p, MiB)
    tms.pause("w")
    tms.resume("w")
    assert read(p, MiB) == data
    print("vouched")


def _paused_file(d, size=3 * MiB):
    tms.set_disk_backup_dir(d)
    with tms.region("w", enable_disk_backup=True):
        p = core().malloc(size)
    data = fill(p, size)
    tms.pause("w")
    (name,) = bins(d)
    return p, data, os.path.join(d, name)


def _resume_fails(p, match):
    e = expect(torch_memory_saver.Error, tms.resume, "w", match=match)
    assert row(p)["state"] == "paused" and row(p)["has_disk_backup"], row(p)
    return e


def replaced_file(d, precious):
    """A backup file replaced after the pause (a link, another file, another user's,
    a changed header, cut short) is an error naming it: the allocation stays paused
    and its next resume, with the file back, restores every byte."""
    with open(precious, "wb") as f:
        f.write(b"keep me")
    p, data, path = _paused_file(d)
    aside = path + ".aside"
    os.rename(path, aside)

    os.symlink(precious, path)                                           # a link to a file of the victim's
    e = _resume_fails(p, path)
    assert "replaced" in str(e) or "No such file" in str(e) or "Too many levels" in str(e), str(e)
    os.unlink(path)
    with open(aside, "rb") as src, open(path, "wb") as dst:              # the same bytes, another file
        dst.write(src.read())
    _resume_fails(p, "replaced meanwhile")
    os.unlink(path)
    if os.geteuid() == 0:                                                # another user's file
        assert as_other_user(lambda: open(path, "wb").write(b"\0" * (4 * MiB))) == 0
        assert os.stat(path).st_uid == OTHER_UID
        _resume_fails(p, "replaced meanwhile")
        os.unlink(path)

    os.rename(aside, path)                                               # the very file again
    with open(path, "r+b") as f:                                         # same inode, header changed
        f.seek(9)
        byte = f.read(1)
        f.seek(9)
        f.write(bytes([byte[0] ^ 0xFF]))
    _resume_fails(p, "does not hold the header")
    with open(path, "r+b") as f:
        f.seek(9)
        f.write(byte)
    whole = open(path, "rb").read()
    os.truncate(path, 4096 + MiB)                                        # cut short: never bytes not written
    _resume_fails(p, "ends at data offset")
    with open(path, "r+b") as f:
        f.write(whole)
    tms.resume("w")
    assert read(p, 3 * MiB) == data

    # Active, the file is kept for the next pause to rewrite; replaced by a link
    # meanwhile, the pause must not write through it: it makes a new file.
    os.rename(path, aside)
    os.symlink(precious, path)
    data = fill(p, 3 * MiB)
    tms.pause("w")
    assert open(precious, "rb").read() == b"keep me"
    assert os.path.islink(path)                                          # not ours: left alone
    tms.resume("w")
    assert read(p, 3 * MiB) == data
    print("every replacement refused")


def lock_link(d1, d2, precious):
    """A link planted under the hidden name this process's lock file would have in a
    second directory (its token is public once the first lock exists) truncates
    nothing: each directory has a token of its own."""
    with open(precious, "wb") as f:
        f.write(b"keep me")
    _paused_file(d1)
    (lock,) = [n for n in os.listdir(d1) if n.endswith(".lock")]
    os.makedirs(d2, mode=0o700, exist_ok=True)
    os.symlink(precious, os.path.join(d2, "." + lock + ".new"))
    tms.resume("w")
    tms.set_disk_backup_dir(d2)
    tms.pause("w")
    tms.resume("w")
    assert open(precious, "rb").read() == b"keep me"
    locks = [n for n in os.listdir(d2) if n.startswith(f"tms-{os.getpid()}-") and n.endswith(".lock")]
    assert len(locks) == 1 and locks[0] != lock and stat.S_ISREG(os.lstat(os.path.join(d2, locks[0])).st_mode)
    print("nothing truncated")


def fifos(d):
    """FIFOs (and a directory) under names of locks and backups hang nothing: not the
    sweep, not a disk-backed pause, not a fork from another thread meanwhile."""
    os.makedirs(d, mode=0o700, exist_ok=True)
    os.mkfifo(os.path.join(d, "tms-1-0000000000000001.lock"))
    os.mkfifo(os.path.join(d, "tms-1-0000000000000001-0000000000000002.bin"))
    os.mkfifo(os.path.join(d, ".tms-1-0000000000000001.lock.new"))
    os.mkdir(os.path.join(d, "tms-2-0000000000000002.lock"))
    stop = threading.Event()
    forks = []

    def forker():
        while not stop.is_set():
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            forks.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))

    import warnings
    warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork() of a process with threads
    t = threading.Thread(target=forker)
    t.start()
    try:
        p, data, _ = _paused_file(d, MiB)
        tms.resume("w")
        assert read(p, MiB) == data
    finally:
        stop.set()
        t.join()
    assert forks and set(forks) == {0}, forks
    left = sorted(os.listdir(d))
    assert "tms-1-0000000000000001.lock" in left and "tms-2-0000000000000002.lock" in left, left
    print("no hang")


def hold(d):
    """A live owner: pauses, waits for a line, resumes (bit-exact), pauses again."""
    p, data, _ = _paused_file(d, 4 * MiB)
    print("paused", flush=True)
    sys.stdin.readline()
    tms.resume("w")
    assert read(p, 4 * MiB) == data
    tms.pause("w")
    locks = [n for n in os.listdir(d) if n.startswith(f"tms-{os.getpid()}-") and n.endswith(".lock")]
    print("resumed, lock", len(locks), flush=True)
    sys.stdin.readline()


def sweep(d):
    """Prepares d (which sweeps it) and lists what is left."""
    tms.set_disk_backup_dir(d)
    print(sorted(os.listdir(d)))


def squat(d):
    """Names made in advance (the old predictable ones, and guesses at the new) do not
    stop a pause from making its file."""
    p, data, path = _paused_file(d, MiB)
    tms.resume("w")
    pid, token = os.path.basename(path).split("-")[1:3]
    with tms.region("w", enable_disk_backup=True):
        q = core().malloc(MiB)
    for seq in range(1, 200):
        open(os.path.join(d, f"tms-{pid}-{token}-{q:x}-{seq}.bin"), "w").close()
        open(os.path.join(d, f"tms-{pid}-{token}-{seq:016x}.bin"), "w").close()
    more = fill(q, MiB)
    tms.pause("w")
    tms.resume("w")
    assert read(q, MiB) == more and read(p, MiB) == data
    print("made its files")


def relative(start, elsewhere):
    """A relative TMS_DISK_BACKUP_DIR is resolved once: a chdir does not move it."""
    os.chdir(start)
    with tms.region("w", enable_disk_backup=True):
        p = core().malloc(MiB)
    fill(p, MiB)
    tms.pause("w")
    tms.resume("w")
    os.chdir(elsewhere)
    with tms.region("v", enable_disk_backup=True):
        q = core().malloc(MiB)
    data = fill(q, MiB)
    tms.pause("v")
    assert len(bins(os.path.join(start, "rel"))) == 2 and not os.path.exists(os.path.join(elsewhere, "rel"))
    assert tms.disk_backup_dir == os.path.join(start, "rel")
    tms.resume("v")
    assert read(q, MiB) == data
    print("stayed")


def write_back(d):
    """On the buffered path (no O_DIRECT), a failed write-back fails the pause: the
    allocation stays active with its bytes, and the next pause succeeds."""
    tms.set_disk_backup_dir(d)
    with tms.region("w", enable_disk_backup=True):
        p = core().malloc(2 * MiB)
    data = fill(p, 2 * MiB)
    e = expect(torch_memory_saver.Error, tms.pause, "w", match="write-back")
    assert d in str(e) and "errno 5" in str(e), str(e)
    assert row(p)["state"] == "active" and read(p, 2 * MiB) == data and bins(d) == []
    tms.pause("w")
    tms.resume("w")
    assert read(p, 2 * MiB) == data
    print("reported")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
