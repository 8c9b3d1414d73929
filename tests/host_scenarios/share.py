# Tests the native module too: open_shared_count, and share() of raw pointers for forged handles.
"""Sharing pauseable memory with another process on the host backend
(tests/test_share.py): a sender shares a tensor over its region memory, a receiver
(this file again, case `receive`) opens it from a pipe, reads and writes it; the
sender's pause is refused while the receiver holds it and frees the pages once the
receiver closes, is killed or was never given the memory; forged, replayed and
foreign handles are errors, never bytes."""
import ctypes
import dataclasses
import fcntl
import gc
import os
import pickle
import signal
import struct
import subprocess
import sys
import time

import torch

from torch_memory_saver import Error
from torch_memory_saver import _share as tms_share
from torch_memory_saver._share import MAGIC

from _prelude import MiB, core, device_used, expect, fill, read, run_cases, tms
from share_peers import place, sender_socket

N = 6 * MiB
PEERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "share_peers.py")  # attackers, without torch


def region_tensor(tag, n=N):
    """A uint8 tensor over n bytes of region memory (the host backend's "device" memory is host memory)."""
    with tms.region(tag):
        p = tms.malloc(n)
    return p, torch.frombuffer((ctypes.c_char * n).from_address(p), dtype=torch.uint8)


def send(pipe, obj):
    data = pickle.dumps(obj)
    pipe.write(struct.pack("<I", len(data)) + data)
    pipe.flush()


def take(pipe):
    head = pipe.read(4)
    assert len(head) == 4, "the other side hung up"
    return pickle.loads(pipe.read(struct.unpack("<I", head)[0]))


class Receiver:
    """This file run as case `receive` in a child process, driven over its stdin/stdout."""

    def __init__(self, shared, user=None):
        # As another user: started as this one (the interpreter may be out of its
        # reach), it drops to that user before it opens anything.
        self.proc = subprocess.Popen([sys.executable, __file__, "receive", *map(str, user or ())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.open(shared)

    def open(self, shared):
        """Opens shared in the receiver (what it had open before stays open)."""
        self.opened = self.ask("open", shared)
        return self.opened

    def ask(self, *request):
        send(self.proc.stdin, request)
        return take(self.proc.stdout)

    def finish(self):
        self.proc.stdin.close()
        assert self.proc.wait(timeout=60) == 0, self.proc.returncode


def socket_name(shared):
    """The path of the sender's socket a handle names (any process of the user can list it)."""
    return sender_socket(shared.handle)


def thread_cpu(tid):
    """CPU seconds a thread of this process has used."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def socket_descriptors():
    """This process's descriptors that are sockets."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
        except OSError:
            pass
    return n


def raw_ask(shared):
    """What the sender answers a client that skips the library's own checks and asks
    with the right token: (bytes of the answer, descriptors received)."""
    import socket

    h = shared.handle
    va = struct.unpack_from("<Q", h, 24)[0]
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        try:
            s.connect(sender_socket(h))
            s.send(b"TMSSHR01" + struct.pack("<Q", va) + h[40:56])
            msg, fds, _, _ = socket.recv_fds(s, 1024, 64)
        except (ConnectionResetError, BrokenPipeError, PermissionError):  # hung up on, or not reachable
            msg, fds = b"", []
    for fd in fds:
        os.close(fd)
    return len(msg), len(fds)


def receive(*_):  # reads its arguments from sys.argv
    """The receiver: opens what it is sent, then reads, writes, closes or forks on request."""
    if len(sys.argv) > 2:
        os.setgroups([])
        os.setgid(int(sys.argv[3]))
        os.setuid(int(sys.argv[2]))
    x, kept, forks = None, [], []
    while True:
        head = sys.stdin.buffer.read(4)
        if len(head) < 4:
            for pid in forks:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            return
        op, *args = pickle.loads(sys.stdin.buffer.read(struct.unpack("<I", head)[0]))
        if op == "open":
            try:
                kept.append(x)
                x = tms.open_shared(args[0])
                answer = ("ok", tuple(x.shape), str(x.dtype), core().open_shared_count())
            except Exception as e:  # the sender's test checks the type and message
                answer = ("error", type(e).__name__, str(e), *(raw_ask(args[0]) if len(sys.argv) > 2 else ()))
        elif op == "read":
            answer = x.view(torch.uint8).numpy().tobytes()
        elif op == "write":
            data = os.urandom(x.numel() * x.element_size())
            x.view(torch.uint8).copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            answer = data
        elif op == "close":
            view = x[:1]  # a view keeps the mapping too
            x = None
            kept.clear()
            gc.collect()
            still = core().open_shared_count()
            del view
            gc.collect()
            answer = (still, core().open_shared_count())
        elif op == "fork":  # a child of the receiver does not hold the sender's memory
            ready_r, ready_w = os.pipe()
            pid = os.fork()
            if pid == 0:  # past the library's fork handlers once fork() returns here
                os.write(ready_w, b"r")
                time.sleep(120)  # killed by its parent when the test is done
                os._exit(0)
            os.read(ready_r, 1)
            os.close(ready_r), os.close(ready_w)
            forks.append(pid)
            reader = os.fork()
            if reader == 0:  # the mapping is not inherited: reading it faults
                x.view(torch.uint8)[0].item()
                os._exit(0)
            _, status = os.waitpid(reader, 0)
            answer = (pid, os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV)
        send(sys.stdout.buffer, answer)


def round_trip():
    """The receiver sees the bytes and the sender sees its writes; a pause is refused naming
    tag and pid while it holds them; after its close the pause frees the pages; resumed
    memory can be shared again. Then, with the same receiver: forged, paused and freed
    handles, and the sender's own refusals; a receiver killed, and one whose fork outlives its close."""
    p, t = region_tensor("w")
    data = fill(p, N)
    view = t[MiB:].view(torch.int32)
    r = Receiver(tms.share(view))
    assert r.opened == ("ok", ((N - MiB) // 4,), "torch.int32", 1), r.opened
    assert r.ask("read") == data[MiB:]
    written = r.ask("write")
    assert read(p + MiB, N - MiB) == written
    e = expect(Error, tms.pause, "w", match="is mapped by 1 other process")
    assert f"pid {r.proc.pid}" in str(e) and "tag 'w'" in str(e) and "nothing was paused" in str(e), str(e)
    assert tms.paused_tags() == []
    pid = os.fork()  # a fork of the sender holds nobody's claims: its own pause goes through
    if pid == 0:
        os._exit(0 if tms.pause("w").released_bytes == N else 1)
    assert os.waitpid(pid, 0)[1] == 0
    expect(Error, tms.pause, "w", match="is mapped by 1 other process")
    assert r.ask("close") == (1, 0)
    before = device_used()
    report = tms.pause("w")  # the close is complete when the receiver answers: nothing to wait for
    assert report.released_bytes == N and report.unconfirmed == [], report  # it said it let go
    assert before - device_used() == N, (before, device_used())
    tms.resume("w")
    again = fill(p, N)
    r.open(tms.share(t))
    assert r.ask("read") == again
    forged_token(r)
    replayed_after_free(r)
    refused_shapes()
    r.finish()
    tms.pause("w")  # the finished receiver's exit let go
    receiver_killed()
    forked_receiver_child_holds_nothing()
    print("done")


def receiver_killed():
    """A receiver killed by SIGKILL while holding the memory lets go: the sender pauses."""
    p, t = region_tensor("k")
    fill(p, N)
    r = Receiver(tms.share(t))
    assert r.opened[0] == "ok", r.opened
    expect(Error, tms.pause, "k", match="is mapped by 1 other process")
    r.proc.send_signal(signal.SIGKILL)
    r.proc.wait(timeout=60)  # its descriptors are closed once it is reaped
    report = tms.pause("k")  # it said nothing, but its process ended: nothing of it maps the memory
    assert report.released_bytes == N and report.unconfirmed == [], report
    assert "k" in tms.paused_tags()


def forked_receiver_child_holds_nothing():
    """A fork of the receiver does not keep the memory held after the receiver closes it."""
    p, t = region_tensor("f")
    fill(p, N)
    r = Receiver(tms.share(t))
    child, reader_faulted = r.ask("fork")
    assert reader_faulted  # a fork of the receiver does not see the sender's memory
    os.kill(child, 0)  # alive, and stays so until the receiver finishes
    assert r.ask("close") == (1, 0)
    assert tms.pause("f").released_bytes == N
    os.kill(child, 0)
    r.finish()


def replayed_after_free(r):
    """A handle of freed memory opens nothing: the receiver gets an error naming it."""
    p, t = region_tensor("r")
    fill(p, N)
    shared = tms.share(t)
    del t
    tms.free(p)
    opened = r.open(shared)
    assert opened[0] == "error" and opened[1] == "ValueError", opened
    assert "was freed (or never shared)" in opened[2], opened


def forged_token(r):
    """A handle with the right socket and a guessed token is refused; so is one of paused memory."""
    p, t = region_tensor("g")
    fill(p, N)
    shared = tms.share(t)
    handle = bytearray(shared.handle)
    handle[40:56] = os.urandom(16)  # the token
    opened = r.open(dataclasses.replace(shared, handle=bytes(handle)))
    assert opened[0] == "error" and "was freed (or never shared)" in opened[2], opened
    tms.pause("g")
    opened = r.open(shared)
    assert opened[0] == "error" and "is paused: resume it first" in opened[2], opened


def sender_exits_first(role=None):
    """The receiver's mapping outlives the sender; a new open then says the sender is gone."""
    if role == "sender":  # the sender, in a process of its own
        p, t = region_tensor("s")
        data = fill(p, N)
        sys.stdout.buffer.write(pickle.dumps((tms.share(t), data)))
        sys.stdout.flush()
        sys.stdin.read()  # until the test lets it go
        return
    sender = subprocess.Popen([sys.executable, __file__, "sender_exits_first", "sender"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE)
    shared, data = pickle.load(sender.stdout)
    x = tms.open_shared(shared)
    assert x.numpy().tobytes() == data
    sender.stdin.close()
    assert sender.wait(timeout=60) == 0
    assert x.numpy().tobytes() == data  # still mapped: the pages are this process's too
    del x
    gc.collect()
    expect(Error, tms.open_shared, shared, match="is gone")
    print("done")


def refused_shapes():
    """Not our memory, our own handle, a malformed handle, a non-tensor: errors naming what is wrong (in the sender)."""
    plain = torch.zeros(16, dtype=torch.uint8)
    expect(ValueError, tms.share, plain, match="is not memory of torch_memory_saver")
    expect(TypeError, tms.share, 5, match="share expects a torch.Tensor")
    p, t = region_tensor("o", 2 * MiB)
    shared = tms.share(t)
    expect(ValueError, tms.open_shared, shared, match="was shared by this process")
    expect(ValueError, core().open_shared, b"x" * 64, match="not a handle of torch_memory_saver")
    expect(ValueError, core().open_shared, shared.handle[:63], match="not a handle of torch_memory_saver")
    expect(TypeError, tms.open_shared, shared.handle, match="open_shared expects what share() returned")
    expect(ValueError, core().close_shared, p, match="is not an opened handle")


def fake_sender():
    """A same-user process that answers like a sender but hands over a file shorter than
    it says, or one it could still shrink: refused, never mapped (its reads would fault).
    The same fake with a sealed file of the right size opens, so the refusals are the checks'."""
    import socket
    import threading

    size = 2 * MiB
    sid = int.from_bytes(os.urandom(8), "little")
    handle = MAGIC + struct.pack("<IIQQQ", os.getpid(), 0, sid, 0x7000_0000_0000, size) + bytes(16) + bytes(8)
    shared = tms_share.SharedTensor(handle, 0, torch.uint8, (size,), (1,), None)
    os.makedirs(place(), mode=0o700, exist_ok=True)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(sender_socket(handle))
    listener.listen(4)
    data = os.urandom(size)

    def serve(file_bytes, seal):
        conn, _ = listener.accept()
        conn.recv(1024)
        fd = os.memfd_create("fake", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.write(fd, data[:file_bytes])
        if seal:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        reply = struct.pack("<iiiiQQQ", 0, 1, 0, 0, size, size, size) + bytes(448)
        socket.send_fds(conn, [reply], [fd])
        os.close(fd)
        return conn

    for file_bytes, seal, want in ((4096, True, "short"), (size, False, "unsealed"), (size, True, "ok")):
        conns = []
        t = threading.Thread(target=lambda: conns.append(serve(file_bytes, seal)))
        t.start()
        try:
            x = tms.open_shared(shared)
            got = "ok" if x.numpy().tobytes() == data else "wrong bytes"
            del x
            gc.collect()
        except RuntimeError as e:
            assert f"open_shared: map of pid {os.getpid()}'s allocation 0x700000000000 ({size} bytes)" in str(e), e
            assert "Bad file descriptor" in str(e), e
            got = "short" if file_bytes < size else "unsealed"
        t.join()
        conns[0].close()
        assert got == want, (file_bytes, seal, got)
        assert core().open_shared_count() == 0
    listener.close()
    os.unlink(sender_socket(handle))
    print("done")


def idle_flood():
    """A process of this user (no handle needed: the socket's name is in /proc/net/unix)
    opens 1,100 connections and asks nothing, against a sender limited to 1,024
    descriptors: the sender keeps a handful, its own file calls keep working, and a
    receiver with the handle opens the memory and reads its bytes."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
    p, t = region_tensor("i")
    data = fill(p, N)
    shared = tms.share(t)
    _, warm = region_tensor("j", 2 * MiB)
    r = Receiver(tms.share(warm))  # started and importing before the flood
    attacker = subprocess.Popen([sys.executable, PEERS, "flooder", socket_name(shared), "idle", "1100"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert attacker.stdout.readline() == "flooding\n"
    assert attacker.stdout.readline() == "held 1100\n"
    kept = socket_descriptors()
    assert kept <= 2 + 16, kept  # the listener, the warm receiver's and at most ASKING_MAX that have not asked
    files = [os.open("/dev/null", os.O_RDONLY) for _ in range(64)]  # this process's own calls
    for fd in files:
        os.close(fd)
    os.close(os.memfd_create("mine"))
    opened = r.open(shared)
    assert opened[0] == "ok", opened
    assert r.ask("read") == data
    r.finish()
    attacker.stdin.close()
    assert attacker.wait(timeout=60) == 0
    print("done")


def refusal_flood(*user):
    """A process (of this user, or of another given one) connects and hangs up as fast as
    it can for 1.5 s: the sender's thread refuses at most REFUSALS_PER_WINDOW connections
    per window, so the attacker gets at most that many connects through (plus the
    backlog) and the thread's CPU time stays a small share of the flood's; a receiver
    opens the memory while it runs."""
    p, t = region_tensor("c")
    data = fill(p, N)
    threads = set(os.listdir("/proc/self/task"))
    shared = tms.share(t)  # the first share starts the sender's thread
    (sender,) = set(os.listdir("/proc/self/task")) - threads
    _, warm = region_tensor("j", 2 * MiB)
    r = Receiver(tms.share(warm))  # started and importing before the flood
    before = thread_cpu(sender)
    attacker = subprocess.Popen([sys.executable, PEERS, "flooder", socket_name(shared), "churn", "1.5",
                                 *map(str, user)],
                                stdout=subprocess.PIPE, text=True)
    assert attacker.stdout.readline() == "flooding\n"
    opened = r.open(shared)  # while the flood runs
    assert opened[0] == "ok", opened
    connected, seconds = attacker.stdout.readline().split()
    connected, seconds = int(connected), float(seconds)
    assert attacker.wait(timeout=60) == 0
    cpu = thread_cpu(sender) - before
    windows = seconds / 0.1 + 2  # REFUSAL_WINDOW_MS; the first and last in part
    # Each refusal frees a place in the backlog (LISTEN_BACKLOG + 1); at most a wake's
    # accepts (ACCEPTS_PER_WAKE) pass the window's budget (REFUSALS_PER_WINDOW).
    assert connected <= (64 + 16) * windows + 65, (connected, seconds)
    assert cpu <= 0.25 * seconds + 0.05, (cpu, seconds)
    assert r.ask("read") == data
    r.finish()
    print("done")


def hung_up_receiver():
    """A receiver that hangs up without saying it let go, its process alive and still
    reading the memory: the sender's pause goes ahead, releases nothing it can vouch for
    and lists the allocation, the receiver's pid and bytes as unconfirmed. One that hangs
    up and ends before the pause: released. The library's own receiver says it let go."""
    p, t = region_tensor("h")
    data = fill(p, N)
    shared = tms.share(t)
    taker_proc = subprocess.Popen([sys.executable, PEERS, "taker", shared.handle.hex(), "stay"],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert taker_proc.stdout.readline() == "hung up\n"
    report = tms.pause("h")
    assert report.released_bytes == 0, report
    assert [(u["ptr"], u["bytes"], u["tag"], u["receivers"], u["pids"]) for u in report.unconfirmed] == \
        [(p, N, "h", 1, [taker_proc.pid])], report.unconfirmed
    taker_proc.stdin.write("read\n")
    taker_proc.stdin.flush()
    assert bytes.fromhex(taker_proc.stdout.readline()) == data  # what the pause did not free
    tms.resume("h")
    report = tms.pause("h")  # the marks went with the memory they were about
    assert report.released_bytes == N and report.unconfirmed == [], report
    taker_proc.stdin.close()
    assert taker_proc.wait(timeout=60) == 0
    tms.resume("h")
    data = fill(p, N)
    gone = subprocess.run([sys.executable, PEERS, "taker", shared.handle.hex(), "exit"], capture_output=True,
                          text=True, timeout=60)
    assert gone.returncode == 0 and gone.stdout == "hung up\n", gone.stderr
    report = tms.pause("h")  # its process ended: what it mapped went with it
    assert report.released_bytes == N and report.unconfirmed == [], report
    tms.resume("h")
    r = Receiver(tms.share(t))
    assert r.ask("close") == (1, 0)
    report = tms.pause("h")
    assert report.released_bytes == N and report.unconfirmed == [], report
    r.finish()
    print("done")


def one_peer_holds_its_share():
    """A process of this user with a handle takes the memory over 40 connections and keeps
    every one (half open, half hung up on while it lives: hang-ups the sender watches),
    against a sender whose descriptor limit lets it keep 32: it gets 16, half, and is told
    why; another process then gets the memory."""
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(128, hard), hard))  # a quarter: 32 kept
    p, t = region_tensor("o")
    fill(p, N)
    shared = tms.share(t)
    hoarder = subprocess.Popen([sys.executable, PEERS, "hoarder", shared.handle.hex(), "40"], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
    got, refusal = hoarder.stdout.readline().rstrip("\n").split(" ", 1)
    assert int(got) == 16 and f"keeps 16 connections and hang-ups of pid {hoarder.pid}, the most one process may " \
        "have of its 32" in refusal, (got, refusal)
    other = subprocess.run([sys.executable, PEERS, "taker", shared.handle.hex(), "exit"], capture_output=True,
                           text=True, timeout=60)  # another process of the user: it gets the memory
    assert other.returncode == 0 and other.stdout == "hung up\n", other.stderr
    hoarder.stdin.close()
    assert hoarder.wait(timeout=60) == 0
    print("done")


def sender_hung_up():
    """A sender that reads the request and hangs up without a reply: the open fails at once
    naming its pid, and does not connect again (only a sender that says it is busy is
    asked again)."""
    import select
    import socket
    import threading

    size = 2 * MiB
    sid = int.from_bytes(os.urandom(8), "little")
    handle = MAGIC + struct.pack("<IIQQQ", os.getpid(), 0, sid, 0x7000_0000_0000, size) + bytes(16) + bytes(8)
    shared = tms_share.SharedTensor(handle, 0, torch.uint8, (size,), (1,), None)
    os.makedirs(place(), mode=0o700, exist_ok=True)
    listeners = []
    for name in (sender_socket(handle), f"\0tms-share-{os.getpid()}-{sid:016x}"):  # and where a library looked before
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.bind(name)
        s.listen(4)
        listeners.append(s)
    accepted = []

    def hang_up():
        ready, _, _ = select.select(listeners, [], [], 60)
        conn, _ = ready[0].accept()
        conn.recv(1024)
        accepted.append(conn)
        conn.close()

    t = threading.Thread(target=hang_up)
    t.start()
    e = expect(Error, tms.open_shared, shared)
    t.join()
    assert f"open_shared: pid {os.getpid()} hung up without an answer" in str(e), e
    assert len(accepted) == 1 and not select.select(listeners, [], [], 0)[0]  # nothing connected again
    assert core().open_shared_count() == 0
    for s in listeners:
        s.close()
    os.unlink(sender_socket(handle))
    print("done")


def not_shareable():
    """TMS_SHAREABLE=0: memory is made plain, and share says why it cannot."""
    p, t = region_tensor("n", 2 * MiB)
    expect(NotImplementedError, tms.share, t, match="without an exportable handle (TMS_SHAREABLE=0")
    print("done")


def other_user(uid, gid):
    """A receiver running as another user gets nothing: the sender's socket is in a place it
    cannot enter, and it finds none of the sender's in its own."""
    p, t = region_tensor("u")
    fill(p, N)
    uid, gid = int(uid), int(gid)
    r = Receiver(tms.share(t), user=(uid, gid))
    assert r.opened[:2] == ("error", "Error") and f"(pid {os.getpid()}) is gone, or keeps its sockets in another " \
        "place than" in r.opened[2], r.opened
    assert r.opened[3:] == (0, 0), r.opened  # asking at the sender's socket itself: no bytes, no descriptor
    r.finish()
    tms.pause("u")  # nobody holds it
    print("done")


if __name__ == "__main__":
    run_cases({f.__name__: f for f in (receive, round_trip, sender_exits_first, fake_sender, not_shareable,
                                       other_user, idle_flood, refusal_flood, hung_up_receiver, one_peer_holds_its_share,
                                       sender_hung_up)},
              sys.argv)
