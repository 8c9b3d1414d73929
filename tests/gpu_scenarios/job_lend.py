"""Lending within a job on one GPU: two member processes (this file again, role `member`,
driven over stdin/stdout) and one outside the job. Once B's backed-up weights are paused, A
keeps all it pauses (its weights, its KV cache) for the job; B's resume maps A's memory (its report names A),
restored byte-exact; the outsider's resume gets none of it; B's weights, on A's memory, are
shared with A again; A's own resume maps its kept weights and other memory for its KV cache; every byte checked in both; B's
pause gives A's memory back, the bound releases it; once all have exited the device's free
memory is back where it started. With
`off`, the same steps without a job: nothing kept, nothing borrowed, a pause frees its
memory at once, as without lending.

    python tests/gpu_scenarios/job_lend.py <preload|torch> [on|off]
"""
import gc
import hashlib
import os
import pickle
import struct
import subprocess
import sys
import tempfile
import time
import uuid

import torch

from _common import GiB, MiB, begin, check, mib, say

KV = GiB                  # A's discarded tag: one allocation, kept whole for B
WEIGHTS = GiB             # B's backed-up tag: as large, so A's handles serve it (a handle maps whole)
SETTLE_S = 30


def send(pipe, obj):
    data = pickle.dumps(obj)
    pipe.write(struct.pack("<I", len(data)) + data)
    pipe.flush()


def take(pipe):
    head = pipe.read(4)
    check(len(head) == 4, "a member hung up")
    return pickle.loads(pipe.read(struct.unpack("<I", head)[0]))


class Member:
    def __init__(self, name, hook_mode, job):
        env = dict(os.environ, TMS_JOB_HOLD_MS="3000", TMS_JOB_WAIT_MS="2000")
        env.pop("TMS_JOB", None)
        if job:
            env["TMS_JOB"] = job
        self.name = name
        self.proc = subprocess.Popen([sys.executable, __file__, hook_mode, "member"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env)
        self.pid = self.proc.pid

    def ask(self, *request):
        send(self.proc.stdin, request)
        kind, answer = take(self.proc.stdout)
        check(kind == "ok", f"{self.name}: {answer}")
        return answer

    def pause(self, tag):
        return self.ask("pause", tag)

    def resume(self, tag):
        return self.ask("resume", tag)

    def finish(self):
        self.proc.stdin.close()
        check(self.proc.wait(timeout=120) == 0, f"{self.name} exited with {self.proc.returncode}")


def digest(t):
    return hashlib.sha256(t.numpy().tobytes()).hexdigest()


def member(hook_mode):
    # The pipe to the scenario is stdout's descriptor; whatever prints goes to stderr.
    proto_in, proto_out = sys.stdin.buffer, os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    tms = begin("job_lend member", hook_mode)
    torch.cuda.init()
    tensors, expected = {}, {}
    while True:
        head = proto_in.read(4)
        if len(head) < 4:
            return
        op, *args = pickle.loads(proto_in.read(struct.unpack("<I", head)[0]))
        try:
            if op == "ready":
                answer = "ready"
            elif op == "alloc":
                tag, n, backup = args
                with tms.region(tag, enable_cpu_backup=backup):
                    tensors[tag] = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
                expected[tag] = tensors[tag].cpu()
                answer = None
            elif op == "exact":
                torch.cuda.synchronize()
                answer = bool(torch.equal(tensors[args[0]].cpu(), expected[args[0]]))
            elif op in ("pause", "resume"):
                torch.cuda.synchronize()
                answer = getattr(tms, op)(args[0]).as_dict()
            elif op == "memory":
                answer = tms.memory_report()[torch.cuda.current_device()]
            elif op == "share":
                answer = (tms.share(tensors[args[0]]), digest(expected[args[0]]))
            elif op == "open":
                shared, want = args
                tensors["opened"] = tms.open_shared(shared)
                torch.cuda.synchronize()
                answer = digest(tensors["opened"].cpu()) == want
            elif op == "close":
                del tensors["opened"]
                gc.collect()
                torch.cuda.synchronize()
                answer = None
            else:
                raise ValueError(op)
            reply = ("ok", answer)
        except Exception as e:
            reply = ("error", f"{type(e).__name__}: {e}")
        send(proto_out, reply)


def device_free():
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def until(what, fn):
    end = time.monotonic() + SETTLE_S
    while not (got := fn()):
        check(time.monotonic() < end, f"{what}: not within {SETTLE_S} s")
        time.sleep(0.02)
    return got


def dev(report):
    (d,) = report["devices"].values()
    return d


def main(hook_mode, mode="on"):
    # The members' sockets go into the runtime directory: one of this run's own, so that
    # what is left there at the end is theirs.
    os.environ["XDG_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="tms-job-lend-")
    begin(f"job_lend ({mode})", hook_mode)
    on = mode == "on"
    job = f"gpu-{uuid.uuid4().hex[:12]}" if on else None
    free0 = device_free()  # this process's context included, before and after alike
    a, b = Member("A", hook_mode, job), Member("B", hook_mode, job)
    outsider = Member("outsider", hook_mode, None)
    for m in (a, b, outsider):  # started together: each imports torch and makes its context at once
        m.ask("ready")
    a.ask("alloc", "w", 64 * MiB, True)
    a.ask("alloc", "kv", KV, False)
    b.ask("alloc", "w", WEIGHTS, True)
    outsider.ask("alloc", "x", 256 * MiB, False)

    check(dev(b.pause("w"))["kept_bytes"] == 0, "B kept memory though nobody had paused")
    # B has paused: A keeps all it releases from now on.
    check(dev(a.ask("pause", "w"))["kept_bytes"] == (64 * MiB if on else 0), "A did not keep its weights")
    outsider.ask("pause", "x")
    before = device_free()
    r = dev(a.ask("pause", "kv"))
    freed = device_free() - before
    say(f"A's KV pause: kept {mib(r['kept_bytes'])}, device free memory +{mib(freed)}")
    if on:
        check(r["kept_bytes"] == KV, f"A kept {r['kept_bytes']} bytes for B, expected its KV cache's {KV}")
        check(freed < KV, f"A's kept memory was freed: free memory +{mib(freed)}")
        check(a.ask("memory")["job_kept"] == KV + 64 * MiB, "A's memory report does not show the kept memory")
    else:
        check(r["kept_bytes"] == 0 and r["released_bytes"] == KV, f"without a job A's pause released {r}")

    d = dev(outsider.ask("resume", "x"))
    check(d["borrowed_bytes"] == 0 and d["fallback"] is None, f"the outsider got lent memory: {d}")
    if on:
        check(a.ask("memory")["job_kept"] == KV + 64 * MiB, "the outsider's resume took A's kept memory")
    say("outsider: its resume got nothing of the job's")

    d = dev(b.resume("w"))
    say(f"B's resume: borrowed {mib(d['borrowed_bytes'])} from {d['lenders']}, fallback {d['fallback']}")
    check(b.ask("exact", "w"), "B's weights differ after the resume")
    if on:
        check(d["borrowed_bytes"] == WEIGHTS and d["lenders"] == {a.pid: WEIGHTS} and d["fallback"] is None,
              f"B's resume did not map A's memory: {d}")
        check(a.ask("memory")["job_lent"] == KV and b.ask("memory")["job_borrowed"] == WEIGHTS,
              "the memory reports do not show the lend")
    else:
        check(d["borrowed_bytes"] == 0 and d["fallback"] is None and d["reused_bytes"] == 0, f"without a job: {d}")

    if on:  # memory a job lent is shared again: the driver does not export an imported handle, its descriptor goes on
        check(a.ask("open", *b.ask("share", "w")), "A opened B's shared weights and read other bytes")
        a.ask("close")
        say("B's weights, on A's memory, shared with A and read exact")

    d = dev(a.ask("resume", None))
    check(a.ask("exact", "w"), "A's weights differ after its resume")
    # Its kept weights come back unless the bound released them meanwhile; what it lent to B never does.
    check(d["reused_bytes"] in ((0, 64 * MiB) if on else (0,)) and d["borrowed_bytes"] == 0,
          f"A mapped memory it had lent, or B's: {d}")
    say(f"A's resume: reused {mib(d['reused_bytes'])} of its own, the rest from the driver, fallback {d['fallback']}")

    r = dev(b.pause("w"))
    check(r["returned_bytes"] == (WEIGHTS if on else 0), f"B's pause gave back {r['returned_bytes']} bytes")
    if on:
        until("A has its memory back", lambda: a.ask("memory")["job_lent"] == 0)
        until("the bound releases A's kept memory", lambda: a.ask("memory")["job_kept"] == 0)
    b.resume("w")
    check(b.ask("exact", "w"), "B's weights differ after its second resume")
    say(f"B paused and resumed again: gave back {mib(r['returned_bytes'])}")

    for m in (a, b, outsider):
        m.finish()
    place = os.path.join(os.environ["XDG_RUNTIME_DIR"], "torch_memory_saver")
    left = [n for n in (os.listdir(place) if os.path.isdir(place) else []) if any(f"-{m.pid}-" in n for m in (a, b))]
    check(not left, f"the members' sockets outlived them in {place}: {left}")
    free1 = until("the device's memory back", lambda: (f := device_free()) >= free0 and f)
    say(f"after every member exited: device free memory {mib(free1)} (at the start {mib(free0)})")
    say("OK")


if __name__ == "__main__":
    if sys.argv[2:3] == ["member"]:
        member(sys.argv[1])
    else:
        main(sys.argv[1], *sys.argv[2:3])
