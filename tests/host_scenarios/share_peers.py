"""The other side of tests/host_scenarios/share.py's and job.py's attacks, in processes
that load neither torch nor torch_memory_saver (they start in a fraction of a second): a
flood of connections to a sender's or a member's sockets, a receiver that skips the
library, another user's process taking a job's names; and where the user's sockets are."""
import os
import struct
import sys
import time


def place():
    """The directory the library names this user's sockets in: the tests give every child
    a private runtime directory (XDG_RUNTIME_DIR), and its torch_memory_saver/ comes first."""
    return os.path.join(os.environ["XDG_RUNTIME_DIR"], "torch_memory_saver")


def sender_socket(handle):
    """The path of the sender's socket a handle names (pid and socket id), in place()."""
    pid, sid = struct.unpack_from("<I", handle, 8)[0], struct.unpack_from("<Q", handle, 16)[0]
    return os.path.join(place(), f"s-{pid}-{sid:016x}")


def address(name):
    """A socket's address: a path as it is, anything else as an abstract name."""
    return name if name.startswith("/") else "\0" + name


def fnv1a(data, h=0xCBF29CE484222325):
    for b in data:
        h = ((h ^ b) * 0x100000001B3) & (1 << 64) - 1
    return h


def job_hash(job, device=0):
    """The hash of a job and a device of the host backend that names its members' sockets."""
    with open("/proc/sys/kernel/random/boot_id") as f:
        identity = f"host-{f.read().strip()}-{device}"
    return fnv1a(identity.encode(), fnv1a(job.encode() + b"\0"))


def become(uid, gid):
    os.setgroups([])
    os.setresgid(int(gid), int(gid), int(gid))
    os.setresuid(int(uid), int(uid), int(uid))


def flooder(name, mode, amount, *user):
    """The attacker of share.py's floods: `idle` opens `amount` connections and holds
    them without asking (it says "held" once that many connects returned, then waits for
    its stdin to close); `churn` connects and hangs up as fast as it can for `amount`
    seconds (0: until its stdin closes) and says how many connects returned and in how
    many seconds. As another user if given one. name: a path, or an abstract name;
    several joined by ','."""
    import resource
    import select
    import socket

    if user:
        become(*user)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    names = [address(n) for n in name.split(",")]
    held, connected, tried = [], 0, 0
    print("flooding", flush=True)
    start = time.monotonic()
    until_eof = mode == "churn" and float(amount) == 0
    deadline = start + (float(amount) if mode == "churn" and not until_eof else 60)
    while time.monotonic() < deadline and (mode == "churn" or connected < int(amount)):
        if until_eof and tried % 64 == 0 and select.select([sys.stdin], [], [], 0)[0]:
            break
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        tried += 1
        try:
            s.connect(names[tried % len(names)])
            connected += 1
        except BlockingIOError:  # the backlog is full: only the sender's accepts free a place
            s.close()
            if mode == "idle":
                time.sleep(0.001)
            continue
        except OSError:  # not this user's to reach, or gone
            s.close()
            continue
        if mode == "idle":
            held.append(s)
        else:
            s.close()
    if mode == "idle":
        print(f"held {connected}", flush=True)
        sys.stdin.read()
    else:
        print(f"{connected} {time.monotonic() - start}", flush=True)


def presser(name):
    """A process of this user that keeps one listening socket's backlog full: it connects
    and hangs up, and where the backlog is full (the listener rests: it refused its
    window's budget) it waits a millisecond rather than spin, so it takes little of the
    CPUs it shares with the processes it floods. It says "pressed" once it first found
    the backlog full; for each line on its stdin it says how many connects returned and
    how many found the backlog full so far; it ends when its stdin closes."""
    import select
    import socket

    target, connected, full = address(name), 0, 0
    print("pressing", flush=True)
    while True:
        if select.select([sys.stdin], [], [], 0)[0]:
            if not sys.stdin.readline():
                return
            print(connected, full, flush=True)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect(target)
            connected += 1
        except BlockingIOError:
            full += 1
            if full == 1:
                print("pressed", flush=True)
            time.sleep(0.001)
        finally:
            s.close()


def taker(handle_hex, then):
    """A receiver of this user that skips the library: it asks with the handle's token, keeps
    the descriptor it gets, maps it and hangs up without saying it let go. Then it stays
    (`stay`: reads the bytes on request) or exits (`exit`)."""
    import mmap
    import socket

    h = bytes.fromhex(handle_hex)
    va, size = struct.unpack_from("<QQ", h, 24)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(sender_socket(h))
        s.send(b"TMSSHR01" + struct.pack("<Q", va) + h[40:56])
        msg, fds, _, _ = socket.recv_fds(s, 1024, 64)
    assert len(fds) == 1 and struct.unpack_from("<i", msg)[0] == 0, msg[:64]
    mapped = mmap.mmap(fds[0], size)
    os.close(fds[0])
    print("hung up", flush=True)
    if then == "exit":
        return
    for line in sys.stdin:
        sys.stdout.write(mapped[:].hex() + "\n")
        sys.stdout.flush()


def hoarder(handle_hex, count):
    """A process of this user with a handle that takes `count` connections' worth of the
    sender's memory and keeps every one: half it holds open, half it hangs up on without
    saying it let go (each a process the sender watches). It says how many answers gave it
    the memory and what the last refusal said, then waits for its stdin to close."""
    import socket

    h = bytes.fromhex(handle_hex)
    va = struct.unpack_from("<Q", h, 24)[0]
    held, got, refusal = [], 0, ""
    for i in range(int(count)):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            s.connect(sender_socket(h))
        except FileNotFoundError:  # where a library named it before
            pid, sid = struct.unpack_from("<IxxxxQ", h, 8)
            s.connect(f"\0tms-share-{pid}-{sid:016x}")
        try:
            s.send(b"TMSSHR01" + struct.pack("<Q", va) + h[40:56])
        except BrokenPipeError:  # refused before it asked: the reply waits all the same
            pass
        msg, fds = b"", []
        for _ in range(2):  # a reset (it closed with the request unread) comes before the reply
            try:
                msg, fds, _, _ = socket.recv_fds(s, 1024, 64, socket.MSG_DONTWAIT if _ else 0)
                break
            except (ConnectionResetError, BlockingIOError):
                pass
        got += bool(fds)
        if not fds and len(msg) >= 16:
            refusal = msg[40:40 + 448].split(b"\0")[0].decode()
        for fd in fds:
            os.close(fd)
        if i % 2:
            s.close()  # hung up while this process lives: the sender watches it
        else:
            held.append(s)
    print(f"{got} {refusal}", flush=True)
    sys.stdin.read()


def squatter(victim, job_hash_hex, count, place_dir, uid, gid):
    """Another user's process that takes `count` names the members of a job of user
    `victim` would go by, before the job starts: abstract names with the job's prefix
    (anyone can bind those, and compute the prefix), and names in the victim's place,
    which it cannot enter. It says how many of each it bound, then waits for its stdin
    to close."""
    import socket

    become(uid, gid)
    held, bound = [], {"abstract": 0, "place": 0}
    for i in range(int(count)):
        for kind, name in (("abstract", f"\0tms-job-{victim}-{job_hash_hex}-{40000 + i}-{i:016x}"),
                           ("place", os.path.join(place_dir, f"j-{job_hash_hex}-{40000 + i}-{i:016x}"))):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                s.bind(name)
                s.listen(1)
            except OSError:
                s.close()
                continue
            held.append(s)
            bound[kind] += 1
    print(bound["abstract"], bound["place"], flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    peers = {"flooder": flooder, "presser": presser, "taker": taker, "hoarder": hoarder, "squatter": squatter}
    peers[sys.argv[1]](*sys.argv[2:])
