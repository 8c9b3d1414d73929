"""Checked restores and restore modes on the host backend (uses core(): the native
backup views and copy progress). A pause records each 2 MiB chunk's fingerprint as its
copy carried it; a resume fingerprints what came back and compares: a byte changed in a
backup while paused raises IntegrityError and the allocation stays paused with that
backup, so a repaired backup resumes. Memory paused without backup comes back as its
region asks: zeros or 0xFF in every byte."""
import ctypes
import glob
import os
import sys
import threading

sys.path.insert(1, os.path.dirname(os.path.abspath(__file__)))
from _prelude import *  # noqa: E402,F401,F403

import torch_memory_saver  # noqa: E402

CHUNK = 2 * MiB


def backup_address(p, n):
    """The address of the host backup of [p, p+n), through the read-only view the package
    copies out of (copy_out: the backup stays trusted): a write there is what bit rot or a
    bad page would do, unseen by the library."""
    view = core().get_cpu_backup(p, n, False, True)
    assert view is not None and view.readonly, view
    return ctypes.addressof(view.obj), view


def flip(address):
    byte = ctypes.c_ubyte.from_address(address)
    byte.value ^= 0x5A


def check_refused(tag, p, size, offset):
    """A resume of tag raises IntegrityError naming the tag, pointer, size and the
    chunk at offset; nothing stays active or mapped."""
    used = device_used()
    e = expect(torch_memory_saver.IntegrityError, tms.resume, tag)
    for part in (f"'{tag}'", hex(p), f"{size} bytes", f"offset {hex(offset // CHUNK * CHUNK)}", "stays paused"):
        assert part in str(e), (part, str(e))
    assert isinstance(e, torch_memory_saver.Error)
    assert tms.is_paused(tag) and row(p)["state"] == "paused", row(p)
    assert device_used() == used, (device_used(), used)   # what the resume mapped went back


def flipped_host_backup(kind):
    """A byte flipped in a host backup while paused: the resume raises and the allocation
    stays paused; repaired, the next resume restores every byte and says it checked them."""
    size = 7 * MiB + 4096
    with tms.region("w", enable_cpu_backup=True, cpu_backup_backend=kind):
        p = tms.malloc(size)
    data = fill(p, size)
    r = tms.pause("w")
    assert r.why_not_verified is None, r.why_not_verified
    address, view = backup_address(p, size)
    offset = 3 * MiB + 5
    flip(address + offset)
    check_refused("w", p, size, offset)
    check_refused("w", p, size, offset)       # the backup is kept as it is: a retry says the same
    flip(address + offset)                    # repaired
    del view
    r = tms.resume("w")
    assert read(p, size) == data
    assert (r.verified_bytes, r.copied_bytes, r.why_not_verified) == (size, size, None), r.as_dict()
    assert r.verify_seconds > 0
    assert tms.stats()[0]["w"]["bytes_verified"] == size
    print("done")


def flipped_disk_backup():
    """A byte flipped in a disk backup file while paused: the same."""
    size = 6 * MiB
    with tms.region("d", enable_disk_backup=True):
        p = tms.malloc(size)
    data = fill(p, size)
    tms.pause("d")
    files = glob.glob(os.path.join(tms.disk_backup_dir, f"tms-{os.getpid()}-*.bin"))
    assert len(files) == 1, files
    offset = 4 * MiB + 17
    at = 4096 + offset                        # after the file's header
    with open(files[0], "r+b") as f:
        f.seek(at)
        good = f.read(1)
        f.seek(at)
        f.write(bytes([good[0] ^ 0xFF]))
    check_refused("d", p, size, offset)
    with open(files[0], "r+b") as f:
        f.seek(at)
        f.write(good)
    r = tms.resume("d")
    assert read(p, size) == data and r.verified_bytes == size, r.as_dict()
    print("done")


def write_racing_the_copy():
    """skip_unchanged: a write that lands after a pause's fingerprints and before its copy
    leaves the backup's record of that chunk untrusted: the resume restores what the copy
    carried (unchecked, and says so), and a later cycle that writes the old bytes back
    copies the chunk again instead of finding it unchanged."""
    gate_path = os.environ["TMS_HOST_COPY_GATE"]
    gate = os.open(gate_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)   # shut until a byte is in it
    size = 4 * CHUNK
    with tms.region("s", enable_cpu_backup=True, skip_unchanged=True):
        p = tms.malloc(size)
    old = fill(p, size)
    t = threading.Thread(target=tms.pause, args=("s",))
    t.start()
    while core().copy_progress()[1] != size:  # the copies are posted: the fingerprints were taken
        pass
    racing = fill(p + CHUNK, 4096)            # the first copy waits at the gate: this lands in the backup
    os.write(gate, b"x")
    t.join()
    r = tms.resume("s")
    carried = old[:CHUNK] + racing + old[CHUNK + 4096:]
    assert read(p, size) == carried
    assert r.why_not_verified and "written while it copied them" in r.why_not_verified, r.why_not_verified
    assert r.verified_bytes == size - CHUNK, r.as_dict()
    ctypes.memmove(p + CHUNK, old[CHUNK:CHUNK + 4096], 4096)   # the old bytes back: the device holds `old`
    r = tms.pause("s")
    assert (r.copied_bytes, r.unchanged_bytes) == (CHUNK, size - CHUNK), r.as_dict()
    r = tms.resume("s")
    assert read(p, size) == old and (r.verified_bytes, r.why_not_verified) == (size, None), r.as_dict()
    print("done")


def double_fault():
    """A restore copy that fails, and the unmap that would pause it again fails too: the
    allocation stays active marked wrong_bytes, the error says so, and its next pause
    keeps the good backup (copying nothing), so the resume after restores every byte."""
    size = 4 * MiB
    with tms.region("x", enable_cpu_backup=True, skip_unchanged=True):
        p = tms.malloc(size)
    data = fill(p, size)
    tms.pause("x")
    e = expect(torch_memory_saver.Error, tms.resume, "x", match="holding bytes that are not its own")
    assert hex(p) in str(e) and "'x'" in str(e), str(e)
    assert e.report.wrong_bytes == [p] and e.report.op == "resume", e.report.as_dict()
    assert row(p)["state"] == "active" and row(p)["wrong_bytes"], row(p)
    r = tms.pause("x")
    assert r.copied_bytes == 0 and r.unchanged_bytes == 0 and r.wrong_bytes == [p], r.as_dict()
    assert not row(p)["wrong_bytes"]
    r = tms.resume("x")
    assert read(p, size) == data and r.verified_bytes == size, r.as_dict()
    print("done")


def read_only_native_view():
    """The package's get_cpu_backup(x) copies out of a read-only view and leaves the backup's
    fingerprints trusted; any view the native call hands out (zero_copy False or True) can be
    written through, so the backup is trusted no more: a resume restores what was written
    there unchecked, saying why, and the next pause copies everything."""
    import torch

    size = 4 * CHUNK
    with tms.region("v", enable_cpu_backup=True, skip_unchanged=True):
        p = tms.malloc(size)
    t = torch.frombuffer((ctypes.c_char * size).from_address(p), dtype=torch.uint8)
    data = fill(p, size)
    tms.pause("v")
    copy = tms.get_cpu_backup(t)                   # the package's: a copy
    assert copy.numpy().tobytes() == data
    tms.resume("v")
    r = tms.pause("v")
    assert r.unchanged_bytes == size, r.as_dict()  # the copy changed nothing trusted
    view = core().get_cpu_backup(p, size, False)   # read-only, but its buffer can be written
    assert view.readonly and bytes(view) == data
    expect(TypeError, view.__setitem__, 0, 1)
    ctypes.c_ubyte.from_address(ctypes.addressof(view.obj)).value ^= 0xFF
    del view
    r = tms.resume("v")
    assert read(p, 1) == bytes([data[0] ^ 0xFF]) and read(p + 1, size - 1) == data[1:]
    assert r.verified_bytes == 0 and "can be written" in r.why_not_verified, r.as_dict()
    r = tms.pause("v")
    assert r.unchanged_bytes == 0 and r.copied_bytes == size, r.as_dict()
    view = core().get_cpu_backup(p, size, True)    # writable: the same
    assert not view.readonly
    print("done")


def tail_not_zeroed():
    """skip_unchanged on a size that is not whole chunks, and the zeroing of the last chunk's
    bytes past the allocation fails at the second pause (TMS_FAULT=fill:3): that chunk,
    copied all the same, is not trusted, so the resume restores every byte, says why it did
    not check that chunk, and the next cycle checks it again."""
    size = 3 * MiB
    with tms.region("t", enable_cpu_backup=True, skip_unchanged=True):
        p = tms.malloc(size)
    fill(p, size)
    tms.pause("t")                                 # fill 1: the tail zeroed before the fingerprints
    tms.resume("t")                                # fill 2
    fill(p + 2 * MiB + 10, 100)                    # the last chunk changes
    data = read(p, size)
    r = tms.pause("t")                             # fill 3 fails: the last chunk goes unlisted
    assert "could not be zeroed" in r.why_not_verified and r.copied_bytes == MiB, r.as_dict()
    r = tms.resume("t")
    assert read(p, size) == data and r.verified_bytes == 2 * MiB, r.as_dict()
    assert "could not zero" in r.why_not_verified, r.as_dict()
    tms.pause("t")
    r = tms.resume("t")
    assert read(p, size) == data and (r.verified_bytes, r.why_not_verified) == (size, None), r.as_dict()
    print("done")


def verify_off():
    """verify_restore = False: a flipped byte comes back as the backup holds it, and the
    report says nothing was checked and why."""
    assert tms.verify_restore is (os.environ.get("TMS_VERIFY_RESTORE") != "0")
    tms.verify_restore = False
    size = 2 * MiB
    with tms.region("o", enable_cpu_backup=True):
        p = tms.malloc(size)
    data = fill(p, size)
    r = tms.pause("o")
    assert r.why_not_verified == "verify_restore is off", r.as_dict()
    address, view = backup_address(p, size)
    flip(address)
    del view
    r = tms.resume("o")
    assert read(p, 1) == bytes([data[0] ^ 0x5A]) and r.verified_bytes == 0
    assert r.why_not_verified == "verify_restore is off", r.as_dict()
    print("done")


def fingerprint_fails_at_pause():
    """A fingerprint that fails at the pause (TMS_FAULT=fingerprint:1): the pause goes on
    and says why nothing is recorded; the resume restores every byte unchecked, saying why."""
    size = 4 * MiB
    with tms.region("f", enable_cpu_backup=True):
        p = tms.malloc(size)
    data = fill(p, size)
    r = tms.pause("f")
    assert "fingerprinting" in r.why_not_verified and "failed" in r.why_not_verified, r.as_dict()
    r = tms.resume("f")
    assert read(p, size) == data and r.verified_bytes == 0 and "recorded no fingerprints" in r.why_not_verified
    print("done")


def restore_modes():
    """restore="zero" and "poison": after a pause that really released the memory, every
    byte is 0 or 0xFF; "none" (the default) writes nothing; TMS_RESTORE gives the default."""
    size = 3 * MiB + 512
    default = os.environ.get("TMS_RESTORE", "none")
    ptrs = {}
    for mode in ("zero", "poison", None):
        with tms.region(f"m-{mode}", restore=mode):
            ptrs[mode] = tms.malloc(size)
        fill(ptrs[mode], size)
        assert row(ptrs[mode])["restore"] == (mode or default)
    for mode, p in ptrs.items():
        used = device_used()
        r = tms.pause(f"m-{mode}")
        assert r.released_bytes == 4 * MiB and device_used() == used - 4 * MiB, (r.as_dict(), used)
        r = tms.resume(f"m-{mode}")
        assert r.mapped_bytes == 4 * MiB and r.released_bytes == 4 * MiB
        expected = {"zero": {0}, "poison": {0xFF}}.get(mode or default)
        if expected is not None:
            assert set(read(p, size)) == expected, (mode, set(read(p, size)))
    expect(ValueError, tms.region("bad", restore="zeros").__enter__, match="'zeros'")
    expect(TypeError, tms.region("bad", restore=0).__enter__, match="restore")
    print("done")


def fill_fails():
    """A fill that fails (TMS_FAULT=fill:1): the resume raises naming the allocation,
    which stays paused; the next resume fills it."""
    with tms.region("z", restore="zero"):
        p = tms.malloc(2 * MiB)
    fill(p, 2 * MiB)
    tms.pause("z")
    e = expect(torch_memory_saver.Error, tms.resume, "z", match="restore='zero'")
    assert hex(p) in str(e) and tms.is_paused("z"), str(e)
    tms.resume("z")
    assert set(read(p, 2 * MiB)) == {0}
    print("done")


def unconfirmed_memory_is_never_lent():
    """In a job, memory a receiver of share() may still map (it hung up without saying it
    let go, and its process lives) is released at the pause, never kept for the members:
    another member's resume borrows only this process's other memory."""
    import subprocess

    import job
    import share

    tms.job = job.J
    other = job.Member(job.J)
    other.alloc("kv", 10 * MiB)
    other.pause("kv")                          # a member with paused memory: a pause keeps what it can
    p, t = share.region_tensor("h", CHUNK)     # one chunk: the taker maps one descriptor
    taker = subprocess.Popen([sys.executable, share.PEERS, "taker", tms.share(t).handle.hex(), "stay"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert taker.stdout.readline() == "hung up\n"
    with tms.region("own"):
        tms.malloc(4 * MiB)
    r = tms.pause(["h", "own"])
    assert [u["ptr"] for u in r.unconfirmed] == [p], r.unconfirmed
    assert (r.released_bytes, r.kept_bytes) == (4 * MiB, 4 * MiB), r.as_dict()
    back = other.resume("kv")
    assert back["borrowed_bytes"] == 4 * MiB and back["lenders"] == {os.getpid(): 4 * MiB}, back
    taker.stdin.close()
    assert taker.wait(timeout=60) == 0
    other.finish()
    print("done")


def spilled_backup_verified():
    """A host backup budget (TMS_HOST_BACKUP_LIMIT=4MiB, TMS_SPILL_TO_DISK=1) that holds the
    2 MiB backup of a tag but not its 6 MiB one: that one spills to disk, and the resume
    checks both, the spilled one's bytes as the disk gave them back."""
    with tms.region("b", enable_cpu_backup=True):
        small, big = tms.malloc(2 * MiB), tms.malloc(6 * MiB)
    data = {p: fill(p, n) for p, n in ((small, 2 * MiB), (big, 6 * MiB))}
    r = tms.pause("b")
    assert r.why_not_verified is None, r.as_dict()
    kept = [(row(p)["has_cpu_backup"], row(p)["has_disk_backup"]) for p in (small, big)]
    assert kept == [(True, False), (False, True)], kept   # the 6 MiB one spilled
    r = tms.resume("b")
    assert all(read(p, len(d)) == d for p, d in data.items())
    assert (r.verified_bytes, r.copied_bytes, r.why_not_verified) == (8 * MiB, 8 * MiB, None), r.as_dict()
    assert tms.stats()[0]["b"]["bytes_verified"] == 8 * MiB
    print("done")


def verify_from_the_environment():
    """TMS_VERIFY_RESTORE=0 in the environment turns checking off before anything is set:
    the pause records nothing and the resume checks nothing, both saying why; =1 checks
    every byte."""
    on = {"0": False, "1": True}[os.environ["TMS_VERIFY_RESTORE"]]
    assert tms.verify_restore is on
    size = 4 * MiB + 4096
    with tms.region("e", enable_cpu_backup=True):
        p = tms.malloc(size)
    data = fill(p, size)
    why = None if on else "verify_restore is off"
    r = tms.pause("e")
    assert r.why_not_verified == why, r.as_dict()
    r = tms.resume("e")
    assert read(p, size) == data
    assert (r.verified_bytes, r.copied_bytes, r.why_not_verified) == (size if on else 0, size, why), r.as_dict()
    assert tms.stats()[0]["e"]["bytes_verified"] == (size if on else 0)
    print("done")


def written_through_the_packages_zero_copy_view():
    """The package's get_cpu_backup(x, zero_copy=True) aliases the backup: bytes written
    through it while paused come back at the resume, unchecked for that allocation (the
    report says why) and never refused, while the tag's other allocation is checked; the
    mark goes with that backup, so the next cycle checks both again."""
    import torch

    size = 2 * CHUNK
    with tms.region("z", enable_cpu_backup=True):
        p, q = tms.malloc(size), tms.malloc(size)
    t = torch.frombuffer((ctypes.c_char * size).from_address(p), dtype=torch.uint8)
    data = {p: fill(p, size), q: fill(q, size)}
    tms.pause("z")
    host = tms.get_cpu_backup(t, zero_copy=True)
    assert host.numpy().tobytes() == data[p]
    host[CHUNK + 7] ^= 0xFF                        # written through the view, in the backup
    host[0] = 1
    del host
    r = tms.resume("z")
    written = bytes([1]) + data[p][1:CHUNK + 7] + bytes([data[p][CHUNK + 7] ^ 0xFF]) + data[p][CHUNK + 8:]
    assert read(p, size) == written and read(q, size) == data[q]
    assert (r.verified_bytes, r.copied_bytes) == (size, 2 * size), r.as_dict()   # q's, not p's
    assert "get_cpu_backup zero_copy=True" in r.why_not_verified and "restored as written" in r.why_not_verified, \
        r.as_dict()
    tms.pause("z")
    r = tms.resume("z")
    assert read(p, size) == written and (r.verified_bytes, r.why_not_verified) == (2 * size, None), r.as_dict()
    print("done")


def restore_onto_lent_memory_verified():
    """In a job, a backed-up tag resumed onto memory another member kept and lends it: the
    resume checks every byte it restored there, as on the driver's memory."""
    import job

    tms.job = job.J
    with tms.region("w", enable_cpu_backup=True):
        p = tms.malloc(8 * MiB)
    data = fill(p, 8 * MiB)
    tms.pause("w")                                 # a member with paused memory: the other keeps for it
    lender = job.Member(job.J)
    lender.alloc("kv", 8 * MiB)
    assert job.device(lender.pause("kv"))["kept_bytes"] == 8 * MiB
    lent = job.made_by(lender.pid)
    r = tms.resume("w")
    assert (r.borrowed_bytes, r.lenders) == (8 * MiB, {lender.pid: 8 * MiB}), r.as_dict()
    assert job.mapped_in(os.getpid(), p, 8 * MiB) <= lent and read(p, 8 * MiB) == data
    assert (r.verified_bytes, r.copied_bytes, r.why_not_verified) == (8 * MiB, 8 * MiB, None), r.as_dict()
    tms.pause("w")
    lender.finish()
    print("done")


def zero_and_poison_over_lent_memory():
    """In a job, tags paused without backup resume onto another member's kept memory, which
    holds its bytes: restore="zero" and "poison" show only 0 or 0xFF there, never the
    member's bytes; restore="none" (the control) shows them."""
    import job

    tms.job = job.J
    size = 2 * CHUNK
    ptrs = {}
    for mode in ("zero", "poison", "none"):
        with tms.region(mode, restore=mode):
            ptrs[mode] = tms.malloc(size)
        fill(ptrs[mode], size)
    tms.pause()
    lender = job.Member(job.J)
    kv = lender.alloc("kv", 3 * size)
    theirs = lender.ask("fill", kv, 3 * size)
    assert job.device(lender.pause("kv"))["kept_bytes"] == 3 * size
    lent = job.made_by(lender.pid)
    r = tms.resume()
    assert (r.borrowed_bytes, r.lenders) == (3 * size, {lender.pid: 3 * size}), r.as_dict()
    for mode, p in ptrs.items():
        assert job.mapped_in(os.getpid(), p, size) <= lent, mode
    assert set(read(ptrs["zero"], size)) == {0} and set(read(ptrs["poison"], size)) == {0xFF}
    their_chunks = {theirs[i:i + CHUNK] for i in range(0, 3 * size, CHUNK)}
    got = read(ptrs["none"], size)
    assert {got[:CHUNK], got[CHUNK:]} <= their_chunks   # what "zero" and "poison" were filled over
    tms.pause()
    lender.finish()
    print("done")


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
