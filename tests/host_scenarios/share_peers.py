"""The other side of tests/host_scenarios/share.py's attacks, in processes that load
neither torch nor torch_memory_saver (they start in a fraction of a second): a flood of
connections to a sender's socket, and a receiver that skips the library."""
import os
import struct
import sys
import time


def become(uid, gid):
    os.setgroups([])
    os.setresgid(int(gid), int(gid), int(gid))
    os.setresuid(int(uid), int(uid), int(uid))


def flooder(name, mode, amount, *user):
    """The attacker of share.py's floods: `idle` opens `amount` connections and holds
    them without asking (it says "held" once that many connects returned, then waits for
    its stdin to close); `churn` connects and hangs up as fast as it can for `amount`
    seconds and says how many connects returned and in how many seconds. As another
    user if given one."""
    import resource
    import socket

    if user:
        become(*user)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    held, connected = [], 0
    print("flooding", flush=True)
    start = time.monotonic()
    deadline = start + (float(amount) if mode == "churn" else 60)
    while time.monotonic() < deadline and (mode == "churn" or connected < int(amount)):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        s.setblocking(False)
        try:
            s.connect("\0" + name)
            connected += 1
        except BlockingIOError:  # the backlog is full: only the sender's accepts free a place
            s.close()
            if mode == "idle":
                time.sleep(0.001)
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


def taker(handle_hex, then):
    """A receiver of this user that skips the library: it asks with the handle's token, keeps
    the descriptor it gets, maps it and hangs up without saying it let go. Then it stays
    (`stay`: reads the bytes on request) or exits (`exit`)."""
    import mmap
    import socket

    h = bytes.fromhex(handle_hex)
    pid, sid, va, size = struct.unpack_from("<IxxxxQQQ", h, 8)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect(f"\0tms-share-{pid}-{sid:016x}")
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


if __name__ == "__main__":
    {"flooder": flooder, "taker": taker}[sys.argv[1]](*sys.argv[2:])
