# Tests the native module too: the members share and open raw allocations (no torch to import).
"""Lending within a job on the host backend (tests/test_job.py): member processes (this
file again, case `member`, driven over stdin/stdout) pause, keep memory for each other,
resume into what another lent, are killed or stopped at each step; an outsider gets
nothing. Which process's memory backs an address is read from /proc: a chunk of the
host backend is a memfd, the same inode in the process that made it (its descriptor)
and in every process that maps it."""
import atexit
import os
import pickle
import resource
import signal
import socket
import struct
import subprocess
import sys
import time

import torch_memory_saver
from _prelude import MiB, core, expect, fill, read, run_cases, tms
from share_peers import job_hash, place

CHUNK = 2 * MiB  # the host backend's granularity: every chunk lends to any allocation
PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "share_peers.py")  # attackers, without the library
SETTLE_S = 30    # the most a case waits for what a member's thread does on its own
# The case's own job names: cases running at once (pytest-xdist) never meet.
J, OTHER = f"j-{os.getpid()}", f"other-{os.getpid()}"
MEMBERS = []     # every member started, ended (stopped or not) when the case ends


@atexit.register
def _end_members():
    for m in MEMBERS:
        if m.proc.poll() is None:
            os.kill(m.pid, signal.SIGCONT)
            m.proc.kill()
            m.proc.wait()


def send(pipe, obj):
    data = pickle.dumps(obj)
    pipe.write(struct.pack("<I", len(data)) + data)
    pipe.flush()


def take(pipe):
    head = pipe.read(4)
    assert len(head) == 4, "the other side hung up"
    return pickle.loads(pipe.read(struct.unpack("<I", head)[0]))


class Member:
    """This file run as case `member` in a child process: one job (None: outside any)."""

    def __init__(self, job, wait_ms=5000, hold_ms=60000, nofile=None, **env):
        full = dict(os.environ, TMS_CHUNK_BYTES=str(CHUNK), TMS_JOB_WAIT_MS=str(wait_ms), TMS_JOB_HOLD_MS=str(hold_ms))
        full.update(env)
        full.pop("TMS_JOB", None)
        if job is not None:
            full["TMS_JOB"] = job
        limit = (lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))) if nofile else None
        self.proc = subprocess.Popen([sys.executable, __file__, "member"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=full, preexec_fn=limit)
        self.pid = self.proc.pid
        MEMBERS.append(self)
        assert self.ask("ready") == "ready"

    def ask(self, *request):
        send(self.proc.stdin, request)
        kind, answer = take(self.proc.stdout)
        assert kind == "ok", answer
        return answer

    def alloc(self, tag, size, backup=False):
        return self.ask("alloc", tag, size, backup)

    def pause(self, tag=None):
        return self.ask("pause", tag)

    def resume(self, tag=None):
        return self.ask("resume", tag)

    def memory(self):
        return self.ask("memory")

    def stop(self):
        """SIGSTOP, returning once every thread of it has stopped: a stop reaches the other
        threads only when the one that took it runs, and until then they answer."""
        os.kill(self.pid, signal.SIGSTOP)
        until(f"pid {self.pid} stopped", lambda: all(state == "T" for state in self.thread_states()))

    def thread_states(self):
        out = []
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            try:
                with open(f"/proc/{self.pid}/task/{tid}/stat") as f:
                    out.append(f.read().rsplit(")", 1)[1].split()[0])
            except OSError:  # a thread that ended meanwhile
                pass
        return out

    def go_on(self):
        os.kill(self.pid, signal.SIGCONT)

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=60)

    def finish(self):
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0, self.proc.returncode


def member():
    """A member: allocates, fills, reads, pauses, resumes and reports on request."""
    tms.memory_report()  # the core loaded, as a framework's process has it
    children = []
    while True:
        head = sys.stdin.buffer.read(4)
        if len(head) < 4:
            return
        op, *args = pickle.loads(sys.stdin.buffer.read(struct.unpack("<I", head)[0]))
        try:
            if op == "ready":
                answer = "ready"
            elif op == "alloc":
                tag, size, backup = args
                with tms.region(tag, enable_cpu_backup=backup):
                    answer = tms.malloc(size)
            elif op == "try_alloc":  # an error is the answer
                tag, size = args
                try:
                    with tms.region(tag):
                        answer = tms.malloc(size)
                except Exception as e:
                    answer = f"{type(e).__name__}: {e}"
            elif op == "fill":
                answer = fill(*args)
            elif op == "read":
                answer = read(*args)
            elif op in ("pause", "resume"):
                answer = getattr(tms, op)(args[0]).as_dict()
            elif op == "share":  # the allocation at ptr, whole: its handle
                answer = core().share(args[0])[0]
            elif op == "open":  # its bytes, held open until "close"
                opened, size = core().open_shared(args[0])
                answer = read(opened, size)
            elif op == "close":
                core().close_shared(opened)
                answer = None
            elif op == "fork":  # a child that waits for "unfork" (the end of its pipe)
                r, w = os.pipe()
                ready_r, ready_w = os.pipe()
                pid = os.fork()
                if pid == 0:  # its fork handlers have run once fork() returns here
                    os.close(w)
                    os.write(ready_w, b"r")
                    os.read(r, 1)
                    os._exit(0)
                os.close(r)
                os.close(ready_w)
                assert os.read(ready_r, 1) == b"r"
                os.close(ready_r)
                children.append((pid, w))
                answer = pid
            elif op == "unfork":
                for pid, w in children:
                    os.close(w)
                    os.waitpid(pid, 0)
                children.clear()
                answer = None
            elif op == "budget":
                answer = tms.host_budget()
            elif op == "backups":
                answer = sorted((r["has_cpu_backup"], r["has_disk_backup"]) for r in tms.allocations())
            elif op == "memory":
                report = tms.memory_report()[0]
                active = sum(r["reserved"] for r in tms.allocations() if r["state"] == "active")
                answer = dict(report, active=active)
            else:
                raise ValueError(op)
            reply = ("ok", answer)
        except Exception as e:  # the case checks what failed
            reply = ("error", f"{type(e).__name__}: {e}")
        send(sys.stdout.buffer, reply)


# ---- what /proc says ---------------------------------------------------------------

def descriptors_of(pid, inodes):
    """How many of a process's descriptors name one of these chunks."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.stat(f"/proc/{pid}/fd/{fd}").st_ino in inodes
        except OSError:
            pass
    return n


def made_by(pid):
    """Inodes of the chunks a process holds a descriptor of: those it made, and what it imported."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/memfd:tms-host-device"):
                out.add(os.stat(f"/proc/{pid}/fd/{fd}").st_ino)
        except OSError:
            pass
    return out


def mapped_in(pid, start, size):
    """Inodes of the chunks mapped in [start, start + size) of a process."""
    out = set()
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo < start + size and hi > start and "memfd:tms-host-device" in line:
                out.add(int(fields[4]))
    return out


def alive_anywhere(inodes):
    """Of these chunks, those any process (that this user may read) still holds or maps."""
    left = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            left |= (made_by(pid) | mapped_in(pid, 0, 1 << 64)) & inodes
        except OSError:
            pass
    return left


def until(what, check):
    """Waits for check() to hold (the member's thread acts on its own time): its last value."""
    end = time.monotonic() + SETTLE_S
    while True:
        got = check()
        if got or time.monotonic() > end:
            assert got, f"{what}: not within {SETTLE_S} s"
            return got
        time.sleep(0.01)


def device(report):
    return report["devices"][0]


def member_sockets(*pids):
    """Paths of the job sockets these members listen on, in the user's place."""
    found = os.listdir(place()) if os.path.isdir(place()) else []
    return [os.path.join(place(), n) for n in found if n.startswith("j-") and any(f"-{p}-" in n for p in pids)]


def check_exit_frees(members, inodes):
    for m in members:
        m.finish()
    assert not alive_anywhere(inodes), "chunks still allocated after every member exited"


# ---- cases -------------------------------------------------------------------------------

def lend_and_reuse():
    """A keeps what B will ask for; B's backed-up tag is restored byte-exact into A's chunks,
    its discarded tag holds A's bytes there; outsiders get nothing; B's pause gives it all back."""
    a, b = Member(J), Member(J)
    outsider, other_job = Member(None), Member(OTHER)
    a_kv = a.alloc("kv", 16 * MiB)
    a_bytes = a.ask("fill", a_kv, 16 * MiB)
    b_w, b_kv = b.alloc("w", 12 * MiB, backup=True), b.alloc("kv", 8 * MiB)
    b_bytes = b.ask("fill", b_w, 12 * MiB)
    x = [m.alloc("x", 8 * MiB) for m in (outsider, other_job)]
    assert device(b.pause())["kept_bytes"] == 0  # nobody else has paused anything: nothing to keep
    for m in (outsider, other_job):
        m.pause("x")
    r = a.pause("kv")
    assert device(r)["kept_bytes"] == 16 * MiB == r["released_bytes"], r  # B will ask for 20
    lent = made_by(a.pid)
    assert a.memory()["job_kept"] == 16 * MiB

    # Outside the job: its own memory from the driver, none of A's.
    for m, why, ptr in ((outsider, None, x[0]), (other_job, "no member", x[1])):
        d = device(m.resume("x"))
        assert (d["borrowed_bytes"], d["fallback"], d["lenders"]) == (0, why, {}), d
        assert not mapped_in(m.pid, ptr, 8 * MiB) & lent
    assert (a.memory()["job_kept"], a.memory()["job_lent"]) == (16 * MiB, 0)

    d = device(b.resume("w"))
    assert (d["borrowed_bytes"], d["lenders"], d["fallback"]) == (12 * MiB, {a.pid: 12 * MiB}, None), d
    assert mapped_in(b.pid, b_w, 12 * MiB) <= lent  # every chunk A's
    assert b.ask("read", b_w, 12 * MiB) == b_bytes  # the restore wrote over A's bytes
    memory = a.memory()
    assert (memory["job_kept"], memory["job_lent"]) == (4 * MiB, 12 * MiB), memory
    assert b.memory()["job_borrowed"] == 12 * MiB
    assert a.ask("open", b.ask("share", b_w)) == b_bytes  # shared again: A maps its own chunks
    a.ask("close")

    d = device(b.resume("kv"))  # 4 MiB more of A's, 4 from the driver
    assert (d["borrowed_bytes"], d["fallback"]) == (4 * MiB, "nothing to lend"), d
    got = b.ask("read", b_kv, 8 * MiB)
    pieces = {got[i:i + CHUNK] for i in range(0, 8 * MiB, CHUNK)}
    assert pieces & {a_bytes[i:i + CHUNK] for i in range(0, 16 * MiB, CHUNK)}  # a discarded tag: A's bytes

    d = device(a.resume("kv"))  # its kept chunks are B's now: memory from elsewhere
    assert (d["reused_bytes"], d["borrowed_bytes"], d["fallback"]) == (0, 0, "nothing to lend"), d
    assert not mapped_in(a.pid, a_kv, 16 * MiB) & lent

    r = b.pause()
    assert (device(r)["returned_bytes"], device(r)["kept_bytes"]) == (16 * MiB, 0), r
    assert not made_by(b.pid) & lent  # released here before A was told
    memory = until("A has its chunks back", lambda: (m := a.memory())["job_lent"] == 0 and m)
    assert memory["job_kept"] == 16 * MiB and memory["used"] == memory["active"] + 16 * MiB, memory
    check_exit_frees((a, b, outsider, other_job), lent | made_by(b.pid))
    print("done")


def shared_on_memory_is_never_lent_again():
    """B shares memory A lent it with a third process C: once B returns it, A releases those
    chunks and never lends or maps them again (C may still map them); the chunks B did not
    share A keeps. The lender itself opening the share changes nothing (lend_and_reuse)."""
    a, b, c = Member(J), Member(J), Member(None)
    w, kv = b.alloc("w", 8 * MiB, backup=True), b.alloc("kv", 4 * MiB)
    data = b.ask("fill", w, 8 * MiB)
    b.pause()
    a.alloc("kv", 12 * MiB)
    assert device(a.pause("kv"))["kept_bytes"] == 12 * MiB
    assert device(b.resume())["borrowed_bytes"] == 12 * MiB
    shared = mapped_in(b.pid, w, 8 * MiB)
    assert c.ask("open", b.ask("share", w)) == data
    c.ask("close")
    assert device(b.pause())["returned_bytes"] == 12 * MiB
    until("the shared chunks released everywhere", lambda: not alive_anywhere(shared))
    memory = until("A keeps only what was not shared on",
                   lambda: (m := a.memory())["job_lent"] == 0 and m["job_kept"] == 4 * MiB and m)
    assert memory["used"] == memory["active"] + 4 * MiB, memory
    print("done")


def own_memory_back():
    """A member's resume maps the chunks its pause kept, all of them, when nobody borrowed them."""
    a, b = Member(J), Member(J)
    b.alloc("kv", 8 * MiB)
    b.pause()
    p = a.alloc("w", 8 * MiB, backup=True)
    data = a.ask("fill", p, 8 * MiB)
    assert device(a.pause("w"))["kept_bytes"] == 8 * MiB
    kept = made_by(a.pid)
    d = device(a.resume("w"))
    assert (d["reused_bytes"], d["borrowed_bytes"], d["fallback"]) == (8 * MiB, 0, None), d
    assert mapped_in(a.pid, p, 8 * MiB) <= kept and a.ask("read", p, 8 * MiB) == data
    assert a.memory()["job_kept"] == 0
    check_exit_frees((a, b), kept)
    print("done")


def a_larger_handle_is_not_lent():
    """The driver maps a handle whole: A's 32 MiB chunk, kept, does not serve B's 30 MiB need,
    whose resume takes the driver's memory; a 30 MiB one does (the host backend refuses a part
    of a handle as the CUDA driver does)."""
    a, b = Member(J, TMS_CHUNK_BYTES="0"), Member(J)
    p = b.alloc("w", 30 * MiB, backup=True)
    data = b.ask("fill", p, 30 * MiB)
    b.pause()
    a.alloc("kv", 32 * MiB)
    assert device(a.pause("kv"))["kept_bytes"] == 32 * MiB  # B has paused: A keeps all it releases
    d = device(b.resume())
    assert (d["borrowed_bytes"], d["fallback"]) == (0, "nothing to lend"), d
    assert b.ask("read", p, 30 * MiB) == data and a.memory()["job_lent"] == 0
    b.pause()
    a.alloc("kv2", 30 * MiB)
    assert device(a.pause("kv2"))["kept_bytes"] == 30 * MiB
    kept = made_by(a.pid) - mapped_in(a.pid, 0, 1 << 64)  # held, mapped nowhere: the kept chunks
    assert len(kept) == 2, kept
    d = device(b.resume())
    assert (d["borrowed_bytes"], d["lenders"], d["fallback"]) == (30 * MiB, {a.pid: 30 * MiB}, None), d
    assert len(mapped_in(b.pid, p, 30 * MiB) & kept) == 1 and b.ask("read", p, 30 * MiB) == data
    assert device(b.pause())["returned_bytes"] == 30 * MiB
    assert until("A has its chunk back", lambda: a.memory()["job_lent"] == 0)
    check_exit_frees((a, b), kept)
    print("done")


def descriptors_kept_within_a_quarter_of_the_limit():
    """A borrowed piece keeps the descriptor it came as (a share passes it on) while fewer
    than a quarter of the process's limit are kept: with 64, the first 16 of B's 24 borrowed
    chunks. The allocation first in address order shares; the other names the limit. B's
    pause closes them and counts them off: after the next borrow the same holds again."""
    a, b = Member(J), Member(J, nofile=64)
    ptrs = {b.alloc("w", n * CHUNK, backup=True): n for n in (16, 8)}
    b.pause()
    (first, n_first), (second, n_second) = sorted(ptrs.items())
    for i in range(2):  # shared, B's chunks are released, never lent again: A keeps new ones each time
        a.alloc(f"kv{i}", 24 * CHUNK)
        assert device(a.pause(f"kv{i}"))["kept_bytes"] == 24 * CHUNK
        assert device(b.resume())["borrowed_bytes"] == 24 * CHUNK
        assert a.ask("open", b.ask("share", first)) == b.ask("read", first, n_first * CHUNK)
        a.ask("close")
        send(a.proc.stdin, ("open", b.ask("share", second)))
        kind, answer = take(a.proc.stdout)
        assert kind == "error" and "whose descriptor this process did not keep (it keeps at most 16" in answer, answer
        assert device(b.pause())["returned_bytes"] == 24 * CHUNK
        until("A has its chunks back", lambda: a.memory()["job_lent"] == 0)
    print("done")


def a_forked_child_keeps_no_lent_descriptor():
    """The descriptor a borrowed chunk keeps would hold the lender's memory alive in a forked
    child: the child closes its copies (B holds two descriptors per chunk, the import and the
    kept one; its child at most the import's, which the backend's fork handling owns)."""
    a, b = Member(J), Member(J)
    b.alloc("w", 8 * MiB, backup=True)
    b.pause()
    a.alloc("kv", 8 * MiB)
    assert device(a.pause("kv"))["kept_bytes"] == 8 * MiB
    lent = made_by(a.pid)
    assert device(b.resume())["borrowed_bytes"] == 8 * MiB
    assert descriptors_of(b.pid, lent) == 2 * len(lent)
    child = b.ask("fork")
    assert descriptors_of(child, lent) <= len(lent), descriptors_of(child, lent)
    b.ask("unfork")
    print("done")


def many_pieces():
    """More kept chunks than one answer carries: the borrower asks the same member again."""
    a, b = Member(J), Member(J)
    p = b.alloc("kv", 300 * CHUNK)
    b.pause()
    a.alloc("kv", 300 * CHUNK)
    assert device(a.pause("kv"))["kept_bytes"] == 300 * CHUNK
    d = device(b.resume())
    assert (d["borrowed_bytes"], d["lenders"], d["fallback"]) == (300 * CHUNK, {a.pid: 300 * CHUNK}, None), d
    assert len(mapped_in(b.pid, p, 300 * CHUNK)) == 300
    assert device(b.pause())["returned_bytes"] == 300 * CHUNK
    assert until("A has every chunk back", lambda: a.memory()["job_lent"] == 0)
    check_exit_frees((a, b), made_by(a.pid))
    print("done")


def kept_memory_gives_way():
    """Memory kept for the job never makes a member's allocation run out: the member
    releases what it keeps, and one whose device is full asks the others to release theirs."""
    a, b = Member(J, TMS_HOST_DEVICE_BYTES="32MiB"), Member(J)
    b.alloc("w", 16 * MiB)
    b.pause()
    a.alloc("kv", 16 * MiB)
    assert device(a.pause("kv"))["kept_bytes"] == 16 * MiB
    got = a.ask("try_alloc", "x", 24 * MiB)  # 16 kept + 24 > 32: fits once 8 of the kept 16 are released
    assert isinstance(got, int), got
    memory = a.memory()
    assert (memory["job_kept"], memory["used"]) == (8 * MiB, 32 * MiB), memory  # what it needed, no more
    # The members' side: C's device is full; the others release what it asks of what they keep (on a
    # GPU, room for C).
    c, d = Member(J, TMS_HOST_DEVICE_BYTES="8MiB"), Member(J)
    d.alloc("kv", 16 * MiB)
    assert device(d.pause("kv"))["kept_bytes"] == 16 * MiB
    kept = lambda: a.memory()["job_kept"] + d.memory()["job_kept"]  # noqa: E731
    assert kept() == 24 * MiB
    got = c.ask("try_alloc", "y", 16 * MiB)  # its 5th chunk finds the device full
    assert got.startswith("OutOfMemoryError"), got  # the host backend counts each process's own device
    assert kept() == 22 * MiB  # the members released the chunk it asked for
    check_exit_frees((a, b, c, d), made_by(a.pid) | made_by(d.pid))
    print("done")


def kept_memory_expires():
    """Memory kept for a member that never asks goes back to the driver after the bound."""
    a, b = Member(J, hold_ms=200), Member(J)
    b.alloc("kv", 8 * MiB)
    b.pause()
    a.alloc("w", 8 * MiB)
    assert device(a.pause("w"))["kept_bytes"] == 8 * MiB
    memory = until("the kept memory expires", lambda: (m := a.memory())["job_kept"] == 0 and m)
    assert memory["used"] == memory["active"] == 0, memory
    check_exit_frees((a, b), set())
    print("done")


def lender_killed(step):
    """A lender killed after keeping, while its memory is borrowed, or after it came back:
    the borrower's bytes stay intact while it maps them, and none of the lender's chunks
    outlives the borrower's release."""
    a, b = Member(J), Member(J)
    b_w = b.alloc("w", 8 * MiB, backup=True)
    data = b.ask("fill", b_w, 8 * MiB)
    b.pause()
    a.alloc("kv", 8 * MiB)
    assert device(a.pause("kv"))["kept_bytes"] == 8 * MiB
    lent = made_by(a.pid)
    if step == "kept":
        a.kill()
        d = device(b.resume())
        assert (d["borrowed_bytes"], d["fallback"]) == (0, "no member"), d
    else:
        assert device(b.resume())["borrowed_bytes"] == 8 * MiB
        if step == "returned":
            b.pause()
        a.kill()
        if step == "returned":
            assert device(b.resume())["fallback"] == "no member"
    assert b.ask("read", b_w, 8 * MiB) == data
    again = b.ask("fill", b_w, 8 * MiB)  # still usable: its import keeps A's memory alive
    r = b.pause()
    assert device(r)["returned_bytes"] == (8 * MiB if step == "lent" else 0), r
    assert not (made_by(b.pid) | mapped_in(b.pid, 0, 1 << 64)) & lent, "B holds A's chunks after its pause"
    b.resume()
    assert b.ask("read", b_w, 8 * MiB) == again
    check_exit_frees((b,), lent | made_by(b.pid))
    print("done")


def borrower_killed(step):
    """A borrower killed after returning lent memory, or while its borrow waits on a stopped
    lender: the lender gets every chunk back for itself. Killed while it maps it: the lender
    releases every chunk (the borrower may have shared it on) and resumes on new memory."""
    a, b = Member(J), Member(J, wait_ms=300)
    b.alloc("w", 8 * MiB, backup=True)
    b.pause()
    a_kv = a.alloc("kv", 8 * MiB)
    assert device(a.pause("kv"))["kept_bytes"] == 8 * MiB
    kept = made_by(a.pid)
    if step == "asking":
        a.stop()  # B's request waits in A's socket
        d = device(b.resume())
        assert (d["fallback"], d["timed_out"], d["borrowed_bytes"]) == ("member timed out", [a.pid], 0), d
        b.kill()
        a.go_on()  # A answers a request whose asker is gone
    else:
        assert device(b.resume())["borrowed_bytes"] == 8 * MiB
        if step == "returned":
            b.pause()
        b.kill()
    spent = step == "lent"
    memory = until("A has its chunks back", lambda: (m := a.memory())["job_lent"] == 0 and
                   m["job_kept"] == (0 if spent else 8 * MiB) and m)
    d = device(a.resume("kv"))
    assert d["reused_bytes"] == (0 if spent else 8 * MiB), d  # its own chunks, back from the dead borrower
    if spent:
        assert not alive_anywhere(kept) and not mapped_in(a.pid, a_kv, 8 * MiB) & kept
    else:
        assert mapped_in(a.pid, a_kv, 8 * MiB) <= kept
    memory = a.memory()
    assert memory["used"] == memory["active"] == 8 * MiB and memory["job_kept"] == 0, memory
    check_exit_frees((a,), kept)
    print("done")


def stuck_member():
    """A stopped member blocks neither a pause nor a resume past the bound: each goes on
    while it stays stopped, the report naming it; once it runs again, it lends nothing to
    the asker that gave up."""
    a, b = Member(J), Member(J, wait_ms=300)
    b.alloc("kv", 8 * MiB)
    b.pause("kv")  # B's demand: A keeps for it
    p = b.alloc("w", 8 * MiB, backup=True)
    data = b.ask("fill", p, 8 * MiB)
    a.alloc("kv", 8 * MiB)
    assert device(a.pause("kv"))["kept_bytes"] == 8 * MiB
    a.stop()
    r = b.pause("w")
    assert (device(r)["timed_out"], device(r)["kept_bytes"]) == ([a.pid], 0), r
    d = device(b.resume())
    assert (d["fallback"], d["timed_out"], d["borrowed_bytes"]) == ("member timed out", [a.pid], 0), d
    assert b.ask("read", p, 8 * MiB) == data
    a.go_on()
    memory = until("A answered what waited", lambda: (m := a.memory())["job_kept"] == 8 * MiB and m)
    assert memory["job_lent"] == 0, memory  # B gave up on it: nothing of A's is B's
    check_exit_frees((a, b), made_by(a.pid) | made_by(b.pid))
    print("done")


def without_a_job():
    """Without a job nothing is kept, asked or listened on: a pause releases every chunk."""
    a, b = Member(None), Member(None)
    a.alloc("kv", 8 * MiB)
    p = b.alloc("w", 8 * MiB, backup=True)
    data = b.ask("fill", p, 8 * MiB)
    b.pause()
    made = made_by(a.pid)
    assert len(made) == 4
    d = device(a.pause())
    assert (d["kept_bytes"], d["timed_out"]) == (0, []) and not made_by(a.pid), d
    d = device(b.resume())
    assert (d["reused_bytes"], d["borrowed_bytes"], d["fallback"]) == (0, 0, None), d
    assert b.ask("read", p, 8 * MiB) == data and not mapped_in(b.pid, p, 8 * MiB) & made
    assert not member_sockets(a.pid, b.pid)  # other tests' members may listen: only these two count
    assert (a.memory()["job_kept"], b.memory()["job_borrowed"]) == (0, 0)
    check_exit_frees((a, b), made)
    print("done")


def budget_in_a_job():
    """Members under one host backup budget: a pause keeps device memory for the others
    and spills its backups past the budget to disk all the same; a resume into another
    member's memory gives its reservation back; every byte comes back."""
    env = dict(TMS_HOST_BACKUP_LIMIT="24MiB", TMS_SPILL_TO_DISK="1", TMS_HOST_BACKUP_LIMIT_NAME=f"job-{os.getpid()}")
    a, b = Member(J, **env), Member(J, **env)
    data = {}
    for m in (a, b):
        ptrs = [m.alloc("w", 8 * MiB, backup=True) for _ in range(2)]
        data[m.pid] = [(p, m.ask("fill", p, 8 * MiB)) for p in ptrs]
    assert device(a.pause())["kept_bytes"] == 0
    assert a.ask("budget")["mine"] == 16 * MiB
    r = b.pause()  # 8 MiB of the budget left: one backup in host memory, one on disk
    assert device(r)["kept_bytes"] == 16 * MiB, r
    assert b.ask("backups") == [(False, True), (True, False)]
    assert (b.ask("budget")["mine"], b.ask("budget")["reserved"]) == (8 * MiB, 24 * MiB)
    d = device(a.resume())
    assert (d["borrowed_bytes"], d["lenders"]) == (16 * MiB, {b.pid: 16 * MiB}), d
    assert a.ask("budget")["mine"] == 0
    d = device(b.resume())  # its kept memory is A's now
    assert (d["reused_bytes"], d["borrowed_bytes"]) == (0, 0), d
    for m in (a, b):
        assert all(m.ask("read", p, 8 * MiB) == x for p, x in data[m.pid])
    assert (b.ask("budget")["mine"], b.ask("budget")["reserved"]) == (0, 0)
    check_exit_frees((a, b), made_by(a.pid) | made_by(b.pid))
    print("done")


def forged_requests(uid=None, gid=None):
    """A process outside the job that finds a member's socket and asks it anyway, naming
    another job or another device (or running as another user), gets no memory."""
    a, b = Member(J), Member(J)
    b.alloc("w", 8 * MiB)
    b.pause()
    a.alloc("kv", 8 * MiB)
    assert device(a.pause("kv"))["kept_bytes"] == 8 * MiB
    names = member_sockets(a.pid)
    assert names, "A's socket is not in the place"
    identity = None
    with open("/proc/sys/kernel/random/boot_id") as f:
        identity = f"host-{f.read().strip()}-0"
    if uid is not None:
        os.setgroups([])
        os.setgid(int(gid))
        os.setuid(int(uid))
    for job, dev in ((OTHER, identity), (J, "host-0-0"), (J, identity)):
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            try:
                s.connect(names[0])
                head = b"TMSJOB01" + struct.pack("<II", 2, 1) + job.encode().ljust(72, b"\0") + dev.encode().ljust(96, b"\0")
                s.send(head + struct.pack("<Q", 8 * MiB))
                msg, fds, _, _ = socket.recv_fds(s, 1 << 16, 300)
            except (ConnectionResetError, BrokenPipeError, ConnectionRefusedError, PermissionError):
                msg, fds = b"", []  # another user cannot even reach the place
        for fd in fds:
            os.close(fd)
        if uid is not None or job != J or dev != identity:
            status = struct.unpack_from("<i", msg)[0] if len(msg) >= 4 else None
            assert not fds and status != 0, (job, dev, status, fds)
        else:  # the same user naming the job and the device is a member, by definition
            assert fds, "a member of the job got nothing"
            s.close()
    # The honest request hung up without returning: counted lent while this process lives.
    assert a.memory()["job_lent"] == (8 * MiB if uid is None else 0)
    a.finish()
    b.finish()
    print("done")


# ---- trust: other users, stopped members, forged lenders ---------------------------------------

def squatted_names(uid, gid):
    """Another user binds 200 names a job's members would go by before the job starts:
    abstract names with the job's prefix (anyone can compute it from the user, the job and
    the boot id) and names in the user's place, which it cannot enter. The members find
    each other all the same: a pause keeps, a resume borrows, nobody times out."""
    os.makedirs(place(), mode=0o700, exist_ok=True)
    squatter = subprocess.Popen([sys.executable, PEERS, "squatter", str(os.geteuid()), f"{job_hash(J):016x}", "200",
                                 place(), str(uid), str(gid)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert squatter.stdout.readline().split() == ["200", "0"]  # every abstract name, none in the place
    a, b = Member(J), Member(J)
    p = b.alloc("w", 8 * MiB, backup=True)
    data = b.ask("fill", p, 8 * MiB)
    b.pause()
    a.alloc("kv", 8 * MiB)
    d = device(a.pause("kv"))
    assert (d["kept_bytes"], d["timed_out"]) == (8 * MiB, []), d
    d = device(b.resume())
    assert (d["borrowed_bytes"], d["lenders"], d["fallback"], d["timed_out"]) == (8 * MiB, {a.pid: 8 * MiB}, None, []), d
    assert b.ask("read", p, 8 * MiB) == data
    squatter.stdin.close()
    assert squatter.wait(timeout=60) == 0
    check_exit_frees((a, b), made_by(a.pid))
    print("done")


def flooded_members(uid, gid):
    """Another user connects to every socket of a lending member (its job socket and its
    share socket) and hangs up, as fast as it can,
    while the members pause and resume five times: it reaches none of them, and every
    resume borrows all it needs from the member."""
    a, b = Member(J), Member(J)
    p = b.alloc("w", 8 * MiB, backup=True)
    data = b.ask("fill", p, 8 * MiB)
    b.pause()
    a.alloc("kv", 8 * MiB)
    s = a.alloc("s", CHUNK)
    a.ask("share", s)  # its share socket too
    assert device(a.pause("kv"))["kept_bytes"] == 8 * MiB
    with open("/proc/net/unix") as f:  # where a library named them before, as anyone reads them
        names = [line.split()[-1][1:] for line in f if f"-{a.pid}-" in line and
                 line.split()[-1].startswith(("@tms-job-", "@tms-share-"))]
    names += member_sockets(a.pid) + [os.path.join(place(), n) for n in os.listdir(place()) if n.startswith(f"s-{a.pid}-")]
    assert len(names) == 2, names
    flood = subprocess.Popen([sys.executable, PEERS, "flooder", ",".join(names), "churn", "0", str(uid), str(gid)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert flood.stdout.readline() == "flooding\n"
    borrowed = []
    for _ in range(5):
        borrowed.append(device(b.resume())["borrowed_bytes"])
        assert device(b.pause())["kept_bytes"] == 0
    flood.stdin.close()
    connected = int(flood.stdout.readline().split()[0])
    assert flood.wait(timeout=60) == 0
    assert (connected, borrowed) == (0, [8 * MiB] * 5), (connected, borrowed)
    b.resume()
    assert b.ask("read", p, 8 * MiB) == data
    check_exit_frees((a, b), made_by(a.pid))
    print("done")


def lender_with_a_share_socket(a, b):
    """B's backed-up 8 MiB paused, A's 8 MiB kept for B and A's share socket listening:
    (a, b, B's pointer, its bytes, the path of A's share socket)."""
    p = b.alloc("w", 8 * MiB, backup=True)
    data = b.ask("fill", p, 8 * MiB)
    b.pause()
    a.alloc("kv", 8 * MiB)
    a.ask("share", a.alloc("s", CHUNK))  # its share socket listens
    assert device(a.pause("kv"))["kept_bytes"] == 8 * MiB
    (share_socket,) = [os.path.join(place(), n) for n in os.listdir(place()) if n.startswith(f"s-{a.pid}-")]
    return a, b, p, data, share_socket


def share_socket_flooded():
    """A process of this user keeps a lending member's share socket flooded (its backlog
    full: the listener spent its refusals and rests) while another member resumes and
    pauses ten times, each call waiting the default TMS_JOB_WAIT_MS (20 ms) for the
    members: the job socket, polled by the same thread, answers every call, so each
    resume borrows all it needs and nobody times out. (Had the listeners one refusal
    window, the job socket would rest with the share socket for most of each window,
    and the calls would time out.)"""
    a, b, p, data, share_socket = lender_with_a_share_socket(Member(J, wait_ms=20), Member(J, wait_ms=20))
    press = subprocess.Popen([sys.executable, PEERS, "presser", share_socket], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    assert press.stdout.readline() == "pressing\n"
    assert press.stdout.readline() == "pressed\n"  # the share socket's backlog is full

    def pressed():
        press.stdin.write("count\n")
        press.stdin.flush()
        return [int(x) for x in press.stdout.readline().split()]

    before = pressed()
    rounds = []
    for _ in range(10):
        r, q = device(b.resume()), device(b.pause())
        rounds.append((r["borrowed_bytes"], r["lenders"], r["fallback"], r["timed_out"], q["timed_out"]))
    after = pressed()
    press.stdin.close()
    assert press.wait(timeout=60) == 0
    assert rounds == [(8 * MiB, {a.pid: 8 * MiB}, None, [], [])] * 10, rounds
    # The flood went on through the rounds: connects got through, and found the backlog full again.
    assert after[0] > before[0] and after[1] > before[1], (before, after)
    b.resume()
    assert b.ask("read", p, 8 * MiB) == data
    check_exit_frees((a, b), made_by(a.pid))
    print("done")


def idle_connections_of_the_share_socket_leave_the_job_socket_room():
    """At the smallest descriptor limit (the sender keeps 16 connections), four
    processes of this user hold four idle connections each to a lending member's share
    socket: those that have not asked take at most their listener's share of the 16, so
    the member's job socket still takes the borrower's requests and every resume
    borrows all it needs."""
    a, b, p, data, share_socket = lender_with_a_share_socket(Member(J, nofile=64), Member(J))

    def sockets_of_a():
        n = 0
        for fd in os.listdir(f"/proc/{a.pid}/fd"):
            try:  # A's sender closes what it refuses while this looks
                n += os.readlink(f"/proc/{a.pid}/fd/{fd}").startswith("socket:")
            except FileNotFoundError:
                pass
        return n

    base = sockets_of_a()
    floods = []
    for _ in range(4):
        f = subprocess.Popen([sys.executable, PEERS, "flooder", share_socket, "idle", "4"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        assert f.stdout.readline() == "flooding\n"
        assert f.stdout.readline() == "held 4\n"
        floods.append(f)
    deadline = time.monotonic() + 30
    while sockets_of_a() < base + 4:  # the sender took idle connections in: the flood is on
        assert time.monotonic() < deadline, "the sender took none of the idle connections in"
    rounds = []
    for _ in range(3):
        r, q = device(b.resume()), device(b.pause())
        rounds.append((r["borrowed_bytes"], r["fallback"], r["timed_out"], q["timed_out"]))
    for f in floods:
        f.stdin.close()
        assert f.wait(timeout=60) == 0
    assert rounds == [(8 * MiB, None, [], [])] * 3, rounds
    b.resume()
    assert b.ask("read", p, 8 * MiB) == data
    check_exit_frees((a, b), made_by(a.pid))
    print("done")


def fake_members(count, answer=None):
    """count listening sockets under the names of members of job J on device 0, in the
    place and (for a library that looked there) in the abstract namespace, served by a
    thread of this process: never accepted (answer None: members that stopped), or each
    request answered by answer(request bytes) -> (reply bytes, descriptors to send)."""
    import socket
    import threading

    os.makedirs(place(), mode=0o700, exist_ok=True)
    listeners = []
    for i in range(count):  # pids no process has in the names: the library names each by its credentials
        for name in (os.path.join(place(), f"j-{job_hash(J):016x}-{4000000 + i}-{i:016x}"),
                     f"\0tms-job-{os.geteuid()}-{job_hash(J):016x}-{4000000 + i}-{i:016x}"):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            s.bind(name)
            s.listen(64)
            listeners.append(s)
    if answer is not None:
        kept = []  # a lend's connection stays open while it is borrowed

        def serve(listener):
            while True:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    return
                request = conn.recv(1 << 16)
                reply, fds = answer(request)
                socket.send_fds(conn, [reply], fds)
                kept.append(conn)

        for s in listeners:
            threading.Thread(target=serve, args=(s,), daemon=True).start()
    return listeners


def close_fakes(listeners):
    """Closes fake_members' sockets and removes their names from the place."""
    for s in listeners:
        name = s.getsockname()
        s.close()
        if isinstance(name, str):  # a path (an abstract name comes as bytes)
            os.unlink(name)


def stopped_members_cost_one_wait():
    """Sixteen members that never answer (their sockets listen, nothing accepts: stopped
    processes, as far as asking goes) cost a pause and a resume one TMS_JOB_WAIT_MS
    together, not one each: both go on, the report naming them."""
    wait_ms = 250
    a = Member(J, wait_ms=wait_ms)
    a.alloc("kv", 8 * MiB)
    stopped = fake_members(16)
    bound = 5 * wait_ms / 1000  # one wait and all else a pause does; one wait per member is 16
    r = a.pause("kv")
    assert r["seconds"] < bound, r["seconds"]
    assert (device(r)["timed_out"], device(r)["kept_bytes"]) == ([os.getpid()] * 4, 0), r  # the first four named
    r = a.resume("kv")
    assert r["seconds"] < bound, r["seconds"]
    d = device(r)
    assert (d["fallback"], d["timed_out"], d["borrowed_bytes"]) == ("member timed out", [os.getpid()] * 4, 0), d
    close_fakes(stopped)
    a.finish()
    print("done")


def bad_lends():
    """A process of this user posing as a member lends what no member would: one memfd as
    all four pieces, memfds it could still shrink, memfds shorter than it says, and a memfd
    this process has borrowed already. Each lend is refused whole: the resume takes the
    driver's memory, restores every byte, and says "bad lend"; lends that pass the checks
    are taken."""
    lent = []  # every memfd lent, kept open here

    def memfd(size, seal=True):
        fd = os.memfd_create("fake-lend", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(fd, size)
        if seal:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        lent.append(fd)
        return fd

    mode = ["same"]

    def answer(request):
        op, n = struct.unpack_from("<II", request, 8)
        if op == 1:  # STATUS: nothing paused, memory kept idle
            return struct.pack("<iiQQ", 0, 0, 0, 64 * MiB), []
        need = struct.unpack_from("<Q", request, 8 + 8 + 72 + 96)[0]
        k = need // CHUNK
        if mode[0] == "same":
            fds = [memfd(CHUNK)] * k
        elif mode[0] == "held again":
            fds = [lent[-1]] + [memfd(CHUNK) for _ in range(k - 1)]
        else:
            fds = [memfd(CHUNK // 2 if mode[0] == "short" else CHUNK, seal=mode[0] != "unsealed") for _ in range(k)]
        pieces = b"".join(struct.pack("<IIQQQ", 0, 0, CHUNK, CHUNK, 1000 + i) for i in range(k))
        return struct.pack("<iI", 0, k) + pieces, fds

    import fcntl

    b = Member(J)
    p = b.alloc("w", 8 * MiB, backup=True)
    q = b.alloc("v", 4 * MiB, backup=True)
    data = {p: b.ask("fill", p, 8 * MiB), q: b.ask("fill", q, 4 * MiB)}
    b.pause()
    servers = fake_members(1, answer)
    for mode[0] in ("same", "unsealed", "short"):
        d = device(b.resume("w"))
        assert (d["borrowed_bytes"], d["fallback"]) == (0, "bad lend"), (mode, d)
        assert b.ask("read", p, 8 * MiB) == data[p], mode
        b.pause("w")
    mode[0] = "fine"
    d = device(b.resume("w"))  # four sealed memfds of the size lent: taken
    assert (d["borrowed_bytes"], d["fallback"]) == (8 * MiB, None), d
    assert b.ask("read", p, 8 * MiB) == data[p]
    mode[0] = "held again"  # one of them again, while "w" maps it
    d = device(b.resume("v"))
    assert (d["borrowed_bytes"], d["fallback"]) == (0, "bad lend"), d
    assert b.ask("read", q, 4 * MiB) == data[q] and b.ask("read", p, 8 * MiB) == data[p]
    b.finish()
    close_fakes(servers)
    print("done")


def job_setting():
    """With TMS_JOB=from-env: the setting reads it, refuses a bad name or type, and a
    member alone in its job keeps nothing and borrows nothing; a member cannot move to
    another job, though naming its own again is fine."""
    assert tms.job == "from-env"
    expect(ValueError, setattr, tms, "job", "no spaces", match="is not a job name of 1 to 64")
    expect(TypeError, setattr, tms, "job", 3, match="job must be a str or None")
    tms.job = None
    assert tms.job is None and core().get_job() is None
    tms.job = f"j-{os.getpid()}"
    with tms.region("w"):
        tms.malloc(2 * MiB)
    r = tms.pause("w")
    assert (r.kept_bytes, r.devices[0].fallback) == (0, None), r  # alone in the job: nothing to keep
    expect(torch_memory_saver.Error, setattr, tms, "job", "k", match="member of job 'j-")
    tms.job = f"j-{os.getpid()}"  # the same name is fine
    r = tms.resume("w")
    assert (r.borrowed_bytes, r.devices[0].fallback) == (0, "no member"), r


def job_name_refused():
    """C would see "rl" of "rl\0other": the whole value is refused, as TMS_JOB refuses a space."""
    native = core()                  # the core first, as a running process meets the setting
    expect(ValueError, setattr, tms, "job", "rl\0other", match="job 'rl\\x00other' holds a NUL character")
    for bad in ("rl other", "rl/x", ".rl", "r\u00e9", "rl\n", "x" * 65):
        expect(ValueError, setattr, tms, "job", bad, match="is not a job name of 1 to 64")
    assert tms.job is None and native.get_job() is None


if __name__ == "__main__":
    run_cases({name: fn for name, fn in globals().items() if callable(fn)}, sys.argv)
