"""The `switch` suite: a trainer and a rollout trading one GPU as colocated RL stacks (slime, verl) run it: `python -m
benchmarks switch [--upstream DIR] [--gib G] [--kv-fraction F] [--cycles N] [--part all|switch|wait] [--deadline S]
[--out DIR] [--dry-run]`.

*switch*: the trainer's bf16 weights, fp32 gradients and Adam moments of a Llama-shaped model (G GiB) in one backed-up
tag; the rollout's weights and a KV cache (F of the free memory), not backed up. A cycle: (1) the rollout resumes its
weights; (2) it receives the trainer's (ours: share()/open_shared(); upstream: CUDA IPC), copies and closes them; (3)
the trainer pauses; (4) the rollout resumes its KV cache; (5) it pauses both; (6) the trainer resumes. Each phase is
timed in its process, beside its floor from the same run (pinned copies, a device copy, the driver's own create + map or
unmap + release on an idle device); cycles where (4) and (6) follow the other's pause at once alternate with cycles
after 2 s idle, and each of the first kind is followed by a *no gap* one: the rollout resumes and pauses while the
trainer is active (so in a job too its memory goes back to the driver), the trainer pauses, and (4) follows at once, no
training step between; --also "TMS_JOB=..." runs the same in a job beside it. *wait*: create + map of N GiB right after
another process freed M, against after 2 s idle, nearly full or empty, the driver alone and through this library;
lending handles between processes; whether an imported handle exports again. Every wait is bounded, the JSON is
rewritten after each step, --deadline skips what would not fit.
--dry-run: the host backend, tiny sizes. Report: switch_<device>.{md,json,png}.
"""
import collections
import contextlib
import ctypes as C
import mmap
import os
import pickle
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from multiprocessing.reduction import ForkingPickler

from . import limits, report
from .common import (GiB, MiB, REPO, Deadline, child_env, fmt_bytes, import_library, log, median, parser, pyplot,
                     save_png, worker_cmd, write_json_atomic)
from .envs import make_env
from .speed import LLAMA

TITLE = "The engine switch: a trainer and a rollout trading one GPU"
PHASES = {"weights_resume": ("1 rollout resumes its weights", "driver create + map, idle device"),
          "refresh": ("2 weight refresh: share, open, copy, close", "device copy of the weights"),
          "trainer_pause": ("3 trainer pauses (backed up)", "pinned copy to host"),
          "kv_resume": ("4 rollout resumes its KV cache", "driver create + map, idle device"),
          "rollout_pause": ("5 rollout pauses weights and KV cache", "driver unmap + release"),
          "trainer_resume": ("6 trainer resumes (restored)", "pinned copy to device")}
NOGAP = "4 KV resume right after the rollout's own pause and the trainer's, no gap"
IDLE_S = 2.0    # the idle gap the targets name
SETTLE_S = 2.0  # before the other process frees: what earlier rows freed is clean by then
FD_BATCH = 250  # descriptors per message (the kernel takes at most 253)
LENDING = ("kept_bytes", "returned_bytes", "reused_bytes", "borrowed_bytes")  # a pause or resume report in a job


def _state(target, cfg):
    """The trainer's tensors (bytes each) for about target bytes: bf16 weights, fp32
    gradients and Adam's two moments (14 bytes a parameter) of as many of cfg's layers
    as fit, the embedding only where it is under a third of the total."""
    h, i, kv = cfg["hidden"], cfg["intermediate"], cfg["kv_heads"] * cfg["head_dim"]
    layer = [h * h, h * kv, h * kv, h * h, h * i, h * i, i * h, h, h]  # q k v o gate up down, two norms
    embed = [cfg["vocab"] * h] if cfg["vocab"] * h * 14 * 3 < target else []
    layers = max(1, round((target / 14 - sum(embed) - h) / sum(layer)))
    params = embed + layer * layers + [h]
    return {"weights": [2 * p for p in params], "rest": [4 * p for p in params] * 3, "layers": layers}


def _sizes(args):
    if args.dry_run:
        cfg = dict(LLAMA, hidden=128, intermediate=256, vocab=512, kv_heads=2, head_dim=32)
        return {"trainer": _state(4 * MiB, cfg), "probe": 8 * MiB, "kv_dry": 8 * MiB, "wait": [2 * MiB, 8 * MiB],
                "plan": ["warm", "after", "nogap", "idle"], "idle_s": 0.05, "settle_s": 0.05}
    return {"trainer": _state(args.gib * GiB, LLAMA), "probe": 4 * GiB, "kv_dry": None,
            "wait": [n * GiB for n in (1, 8, 32, 64)], "idle_s": IDLE_S, "settle_s": SETTLE_S,
            "plan": ["warm"] + [k for c in range(args.cycles) for k in (["idle"] if c % 2 else ["after", "nogap"])]}


# ---- the CUDA driver's VMM calls through ctypes, no library and no PyTorch between ----

P, U64, SZ = C.POINTER, C.c_ulonglong, C.c_size_t
POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


class _Loc(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class _Prop(C.Structure):  # CUmemAllocationProp
    _fields_ = [("type", C.c_int), ("handle_types", C.c_int), ("loc", _Loc), ("win32", C.c_void_p),
                ("compression", C.c_ubyte), ("rdma", C.c_ubyte), ("usage", C.c_ushort), ("reserved", C.c_ubyte * 4)]


class _Access(C.Structure):  # CUmemAccessDesc
    _fields_ = [("loc", _Loc), ("flags", C.c_int)]


_SIGNATURES = {
    "cuInit": [C.c_uint], "cuDeviceGet": [P(C.c_int), C.c_int], "cuDevicePrimaryCtxRetain": [P(C.c_void_p), C.c_int],
    "cuCtxSetCurrent": [C.c_void_p], "cuCtxSynchronize": [], "cuMemGetInfo_v2": [P(SZ), P(SZ)],
    "cuGetErrorName": [C.c_int, P(C.c_char_p)], "cuMemGetAllocationGranularity": [P(SZ), P(_Prop), C.c_int],
    "cuMemAddressReserve": [P(U64), SZ, SZ, U64, U64], "cuMemAddressFree": [U64, SZ],
    "cuMemCreate": [P(U64), SZ, P(_Prop), U64], "cuMemRelease": [U64], "cuMemMap": [U64, SZ, SZ, U64, U64],
    "cuMemUnmap": [U64, SZ], "cuMemSetAccess": [U64, SZ, P(_Access), SZ], "cuMemsetD8_v2": [U64, C.c_ubyte, SZ],
    "cuMemExportToShareableHandle": [P(C.c_int), U64, C.c_int, U64],
    "cuMemImportFromShareableHandle": [P(U64), C.c_void_p, C.c_int]}


class Driver:
    """The primary context of one device made current on the calling thread (the one
    PyTorch uses, where the process has it). Every call is checked."""

    def __init__(self, device=0):
        self.cu, self.device = C.CDLL("libcuda.so.1"), device
        for fn, args in _SIGNATURES.items():
            getattr(self.cu, fn).argtypes = args
        dev, ctx, gran = C.c_int(), C.c_void_p(), SZ()
        self.call("cuInit", 0)
        self.call("cuDeviceGet", C.byref(dev), device)
        self.call("cuDevicePrimaryCtxRetain", C.byref(ctx), dev)
        self.call("cuCtxSetCurrent", ctx)
        self.call("cuMemGetAllocationGranularity", C.byref(gran), C.byref(self.prop(False)), 0)
        self.granularity = gran.value

    def name(self, rc):
        s = C.c_char_p()
        return s.value.decode() if self.cu.cuGetErrorName(rc, C.byref(s)) == 0 and s.value else f"CUresult {rc}"

    def call(self, fn, *args):
        rc = getattr(self.cu, fn)(*args)
        if rc:
            raise RuntimeError(f"{fn}: {self.name(rc)} ({rc})")

    def prop(self, exportable):
        # CU_MEM_ALLOCATION_TYPE_PINNED, on CU_MEM_LOCATION_TYPE_DEVICE
        return _Prop(type=1, handle_types=POSIX_FD if exportable else 0, loc=_Loc(1, self.device))

    def mem_info(self):
        free, total = SZ(), SZ()
        self.call("cuMemGetInfo_v2", C.byref(free), C.byref(total))
        return free.value, total.value

    def sync(self):
        self.call("cuCtxSynchronize")

    def create(self, size, exportable=False):
        h = U64()
        self.call("cuMemCreate", C.byref(h), size, C.byref(self.prop(exportable)), 0)
        return h.value

    def export_fd(self, handle):
        """(descriptor, 0), or (None, the driver's error code)."""
        fd = C.c_int(-1)
        rc = self.cu.cuMemExportToShareableHandle(C.byref(fd), handle, POSIX_FD, 0)
        return (fd.value, 0) if rc == 0 else (None, rc)

    def import_fd(self, fd):
        h = U64()
        self.call("cuMemImportFromShareableHandle", C.byref(h), C.c_void_p(fd), POSIX_FD)
        return h.value


class Block:
    """size bytes at one reserved range, backed by handles of chunk bytes each (one handle by default); the range stays
    reserved until close(), as the library keeps an allocation's. What a failed make() left behind, drop() releases."""

    def __init__(self, drv, size, chunk=None, exportable=False):
        g = drv.granularity
        self.drv, self.chunk, self.exportable, self.handles, self.mapped = drv, -(-(chunk or size) // g) * g, \
            exportable, [], 0
        self.size = -(-size // self.chunk) * self.chunk
        va = U64()
        drv.call("cuMemAddressReserve", C.byref(va), self.size, 0, 0, 0)
        self.va = va.value

    def make(self):
        """Creates the handles still missing, then maps them: (create seconds, map seconds)."""
        t0 = time.perf_counter()
        while len(self.handles) < self.size // self.chunk:
            self.handles.append(self.drv.create(self.chunk, self.exportable))
        t1 = time.perf_counter()
        access = _Access(_Loc(1, self.drv.device), 3)  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE on the device
        for h in self.handles:
            va = self.va + self.mapped * self.chunk
            self.drv.call("cuMemMap", va, self.chunk, 0, h, 0)
            self.mapped += 1
            self.drv.call("cuMemSetAccess", va, self.chunk, C.byref(access), 1)
        return t1 - t0, time.perf_counter() - t1

    def fill(self, value=0x5A):
        self.drv.call("cuMemsetD8_v2", self.va, value, self.size)
        self.drv.sync()

    def drop(self):
        while self.handles:
            if self.mapped == len(self.handles):
                self.mapped -= 1
                self.drv.call("cuMemUnmap", self.va + self.mapped * self.chunk, self.chunk)
            self.drv.call("cuMemRelease", self.handles.pop())

    def close(self):
        self.drop()
        self.drv.call("cuMemAddressFree", self.va, self.size)


# ---- the workers' side ---------------------------------------------------------------

class Engine:
    """A trainer, a rollout or a probe: the library (this one, or upstream's), timed calls."""

    def __init__(self, mode, dry_run, peer=None):
        self.env, self.dry = make_env(mode, dry_run), dry_run
        self.tms, self.blocks = self.env.tms, {}
        self.ours = hasattr(self.tms, "share")

    @property
    def torch(self):  # not imported where no one needs it (a dry run's probe)
        import torch

        return torch

    def timed(self, fn):
        self.env.sync()
        t0 = time.monotonic()  # CLOCK_MONOTONIC: comparable between the processes of one host
        got = fn()
        self.env.sync()
        t1 = time.monotonic()
        devs = got.as_dict().get("devices", {}).values() if hasattr(got, "as_dict") else ()
        lent = {k: sum(d.get(k, 0) for d in devs) for k in LENDING if any(k in d for d in devs)}  # a job's
        return dict(lent, s=t1 - t0, t0=t0, t1=t1)

    def alloc(self, tag, sizes, backup=False):
        """(the env's block, tensors over it): on the host backend, CPU tensors over malloc()'s memory."""
        block = self.env.alloc(tag, sizes, backup=backup)
        return block, block if not self.dry else [
            self.torch.frombuffer((C.c_char * n).from_address(p), dtype=self.torch.uint8) for p, n in block]

    def info(self):
        return dict(self.env.info(), retain_cpu_backup=getattr(self.tms, "retain_cpu_backup", None))

    def pause(self, tag=None):
        return self.timed(lambda: self.tms.pause(tag))

    def resume(self, tag=None):
        return self.timed(lambda: self.tms.resume(tag))

    def probe_setup(self, sizes):
        """The probe: a discarded tag of each size, paused."""
        for n in sizes:
            self.blocks[n] = self.env.alloc(f"probe{n}", [n])
            self.tms.pause(f"probe{n}")
        return {"info": self.info()}

    def create(self, n, chunk=None):
        """The probe: a resume of n bytes (the memory the driver creates and maps), then its pause."""
        r = self.resume(f"probe{n}")
        self.env.touch(self.blocks[n], 1)
        self.tms.pause(f"probe{n}")
        return r


class Trainer(Engine):
    def setup(self, shapes, probe_bytes):
        """The floors while the device is idle (pinned copies both ways as the limits
        section measures them; a device copy of the weights' bytes), then the state."""
        self.nw, wbytes = len(shapes["weights"]), sum(shapes["weights"])
        lim = limits.run(self.env, {"bytes": probe_bytes, "reps": 3}, Deadline(0))  # pinned rows only
        a = self.torch.ones(wbytes, dtype=self.torch.uint8, device=None if self.dry else self.env.device)
        b = self.torch.empty_like(a)
        d2d = median([self.timed(lambda: b.copy_(a))["s"] for _ in range(4)][1:])
        a = b = None  # given back before the state is allocated
        if not self.dry:
            self.torch.cuda.empty_cache()
        sizes = shapes["weights"] + shapes["rest"]
        self.block, self.tensors = self.alloc("train", sizes, backup=True)
        self.env.fill_random(self.block, 1)
        return {"link_d2h_gbps": lim["pinned_d2h_gbps"], "link_h2d_gbps": lim["pinned_h2d_gbps"],
                "d2d_gbps": wbytes / d2d / 1e9, "weights_bytes": wbytes, "bytes": sum(sizes), "tensors": len(sizes),
                "info": self.info()}

    def train(self, seed):
        """A training step's stand-in, not timed: new weights; checksums of the whole
        state (checked after the resume) and of the weights (for the rollout's check)."""
        self.env.fill_random(self.block[:self.nw], seed)
        self.snap = self.env.snapshot(self.block, False)
        if not self.dry:
            self.torch.cuda.empty_cache()  # the checksums' scratch
        return self.snap["sums"][:self.nw]

    def share(self):
        t0, weights = time.monotonic(), self.tensors[:self.nw]
        if self.ours:
            payload, how = pickle.dumps([self.tms.share(t) for t in weights]), "share() / open_shared()"
        else:
            import torch.multiprocessing  # noqa: F401 (PyTorch's reductions of CUDA tensors)
            try:
                payload, how = bytes(ForkingPickler.dumps(weights)), "CUDA IPC (torch.multiprocessing)"
            except Exception as e:  # what its users do where region memory cannot be sent
                self.copies = [t.clone() for t in weights]  # outside any region: cudaMalloc'd memory
                payload = bytes(ForkingPickler.dumps(self.copies))
                how = f"CUDA IPC of copies outside the region (of the region's tensors: {type(e).__name__}: {e})"
        self.env.sync()
        return {"payload": payload, "how": how[:600], "s": time.monotonic() - t0, "t0": t0}

    def unshare(self):
        """Drops what share() made (copies, PyTorch's IPC bookkeeping)."""
        def drop():
            self.copies = None
            if not self.ours:
                self.torch.cuda.ipc_collect()
                self.torch.cuda.empty_cache()
        return self.timed(drop)

    def pause(self, tag=None):
        return super().pause("train")

    def resume(self, tag=None):
        out = super().resume("train")
        out["exact"] = bool(self.env.verify(self.block, self.snap)) if hasattr(self, "snap") else None
        return out


class Rollout(Engine):
    def setup(self, weights):
        self.weights = weights
        self.block, self.tensors = self.alloc("weights", weights)
        return {"info": self.info()}

    def size_kv(self, fraction, count, dry_bytes):
        """As serving engines size it: a fraction of the memory free now, in `count` tensors."""
        free = self.env.free_bytes()
        each = max(2 * MiB, int(fraction * free if free is not None else dry_bytes) // count // (2 * MiB) * 2 * MiB)
        self.kv = [each] * count
        self.kv_block = self.alloc("kv", self.kv)[0]
        return {"free_bytes": free, "kv_bytes": each * count, "kv_tensors": count}

    def refresh(self, payload):
        out = self.timed(lambda: self._copy_in(payload))
        out["sums"] = self.env.snapshot(self.block, False)["sums"]
        out["check_s"] = time.monotonic() - out["t1"]
        return out

    def _copy_in(self, payload):
        # Every reference to what was opened dies with this frame: the last one closes it.
        src = pickle.loads(payload)
        src = [self.tms.open_shared(s) for s in src] if self.ours else src
        for dst, s in zip(self.tensors, src):
            dst.copy_(s)
        self.env.sync()

    def floor(self, reps, idle_s):
        """The driver alone on the idle device, in this process: create + map of the rollout's allocations (weights,
        then KV cache), then unmap + release of all. The weights' allocations as PyTorch's cache makes them, near
        enough: one per tensor of 1 MiB or more, the smaller ones packed together."""
        if self.dry:
            return {"skipped": "the host backend has no CUDA driver"}
        drv = Driver(self.torch.cuda.current_device())
        small = sum(s for s in self.weights if s < MiB)
        weights = [s for s in self.weights if s >= MiB] + ([small] if small else [])
        groups, rows = [[Block(drv, s) for s in weights], [Block(drv, s) for s in self.kv]], []
        try:
            for _ in range(reps):
                time.sleep(idle_s)
                t = [time.perf_counter()]
                for group in groups:
                    for b in group:
                        b.make()
                    drv.sync()
                    t.append(time.perf_counter())
                for b in groups[0] + groups[1]:
                    b.drop()
                drv.sync()
                t.append(time.perf_counter())
                rows.append({"weights_resume": t[1] - t[0], "kv_resume": t[2] - t[1], "rollout_pause": t[3] - t[2]})
        finally:  # nothing of the floor's stays on the device, whatever failed
            for b in groups[0] + groups[1]:
                b.close()
        return dict({k: median([r[k] for r in rows]) for k in rows[0]}, reps=rows, allocations=[len(g) for g in groups])


class Other:
    """The driver alone (ctypes) in two roles: the other engine, which takes and frees memory (host memory in a dry run)
    and lends its handles, and the measuring process, which creates right after a free and imports what is lent."""

    def __init__(self, mode, dry_run, peer=None):
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # descriptors in flight count against it
        want = 65536 if hard == resource.RLIM_INFINITY else min(65536, hard)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        self.drv, self.blocks = None if dry_run else Driver(), {}
        self.peer = socket.socket(fileno=peer) if peer is not None else None
        if self.peer:
            self.peer.settimeout(60)

    def info(self):
        return dict(zip(("free", "total"), self.drv.mem_info() if self.drv else (None, None)))

    def take(self, name, size, chunk=None, exportable=False):
        if not self.drv:
            self.blocks[name] = mmap.mmap(-1, size)
            self.blocks[name].write(b"\x5a" * size)
            return {}
        b = Block(self.drv, size, chunk, exportable)
        try:
            b.make()
            b.fill()
        except BaseException:
            b.close()
            raise
        self.blocks[name] = b
        return {}

    def free(self, name):
        self.blocks.pop(name).close()
        if self.drv:
            self.drv.sync()
        return {"t1": time.monotonic()}

    def create(self, n, chunk=None):
        b = Block(self.drv, n, chunk)
        try:
            t0 = time.monotonic()
            c, m = b.make()
            out = {"t0": t0, "s": time.monotonic() - t0, "create_s": c, "map_s": m, "handles": len(b.handles)}
            b.fill()
        finally:
            b.close()
        return out

    def lend(self, name):
        """Exports the handles and sends the descriptors as they come, then drops its own
        references; the importer hears when it stops short."""
        b, t0 = self.blocks.pop(name), time.monotonic()
        try:
            for i in range(0, len(b.handles), FD_BATCH):
                fds = [self.drv.export_fd(h) for h in b.handles[i:i + FD_BATCH]]
                try:
                    bad = [rc for fd, rc in fds if fd is None]
                    if bad:
                        raise RuntimeError(f"cuMemExportToShareableHandle: {self.drv.name(bad[0])}")
                    socket.send_fds(self.peer, [b"F"], [fd for fd, _ in fds])
                finally:
                    for fd, _ in fds:
                        if fd is not None:
                            os.close(fd)
        except BaseException:
            self.peer.send(b"E")
            b.close()
            raise
        t1 = time.monotonic()
        b.close()
        self.drv.sync()
        return {"t0": t0, "sent_s": t1 - t0, "dropped_s": time.monotonic() - t1}

    def receive(self, size, chunk):
        """Imports the descriptors as they come, then maps them; drop_lent() gives back
        what it holds, whatever happened."""
        self.lent = lent = Block(self.drv, size, chunk)
        while len(lent.handles) < size // chunk:
            msg, fds, _, _ = socket.recv_fds(self.peer, 16, FD_BATCH + 3)
            try:
                if not fds:
                    raise RuntimeError(f"the sender stopped after {len(lent.handles)} of {size // chunk} handles "
                                       f"({msg!r})")
                for fd in fds:
                    lent.handles.append(self.drv.import_fd(fd))
            finally:
                for fd in fds:
                    os.close(fd)
        t1 = time.monotonic()
        _, map_s = lent.make()
        out = {"imported_t1": t1, "map_s": map_s, "t2": time.monotonic()}
        lent.fill()
        return out

    def reexport(self):
        """Exports an imported handle again and sends it on (nothing where the driver refuses)."""
        fd, rc = self.drv.export_fd(self.lent.handles[0])
        socket.send_fds(self.peer, [b"R"], [] if fd is None else [fd])
        if fd is not None:
            os.close(fd)
        return {"exported": fd is not None, "error": self.drv.name(rc) if rc else None, "rc": rc}

    def drop_lent(self):
        if getattr(self, "lent", None):
            self.lent.close()
            self.lent = None
        return {}


ROLES = {"trainer": Trainer, "rollout": Rollout, "probe": Engine, "other": Other}


def worker(role, fd, library=None, mode="preload", dry_run=False, peer=None, save=None):
    """Answers the runner's requests ((name, kwargs) -> ("ok", value) or ("error", why))
    until it says quit or goes away."""
    if library:
        import_library(library)
    conn, obj, served = Connection(fd), ROLES[role](mode, dry_run, peer), 0
    while conn.poll(900):
        try:
            name, kw = conn.recv()
        except EOFError:
            break
        if name == "quit":
            break
        try:
            reply = ("ok", getattr(obj, name)(**kw))
        except Exception as e:
            reply = ("error", f"{type(e).__name__}: {e}"[:2000])
        conn.send(reply)
        served += 1
    return {"role": role, "served": served}


# ---- the runner's side ---------------------------------------------------------------

class Failed(RuntimeError):
    """The worker answered with an error: that step failed, the worker lives on."""


class Broken(RuntimeError):
    """The worker died or did not answer in time: the part stops."""


class Proc:
    """A worker process and the runner's end of its socket; every wait is bounded."""

    def __init__(self, label, role, library, args, tmp, until, peer=None, env=None):
        ours, theirs = socket.socketpair()
        self.label, self.conn, self.until = label, Connection(ours.detach()), until
        self.tail = collections.deque(maxlen=8)
        fds = (theirs.fileno(),) + ((peer.fileno(),) if peer else ())
        cmd = worker_cmd("switch", os.path.join(tmp, f"{label.replace(' ', '-')}.json"),
                         {"role": role, "fd": fds[0], "library": library, "mode": args.mode, "dry_run": args.dry_run,
                          "peer": fds[1] if peer else None},
                         library=library if library and args.mode == "preload" and not args.dry_run else None)
        self.proc = subprocess.Popen(cmd, cwd=REPO, env={**child_env(args.dry_run, clean=True), **(env or {})},
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace", pass_fds=fds)
        theirs.close()  # the child holds its copy: its exit reads as end of file here
        self.pump = threading.Thread(target=self._echo, daemon=True)
        self.pump.start()

    def _echo(self):
        for line in self.proc.stdout:
            self.tail.append(line.rstrip())
            print(f"  [{self.label}] {line.rstrip()}", flush=True)

    def send(self, request, **kw):
        try:
            self.conn.send((request, kw))
        except OSError as e:
            raise Broken(f"{self.label}: cannot send {request}: {e}")

    def wait(self, timeout, what):
        limit = max(10.0, min(timeout, self.until - time.time() + 30))
        end = time.monotonic() + limit
        while time.monotonic() < end:
            if self.conn.poll(0.2):
                try:
                    status, value = self.conn.recv()
                except (EOFError, OSError):
                    break
                if status != "ok":
                    raise Failed(f"{what}: {value}")
                return value
            if self.proc.poll() is not None:
                break
        try:
            self.proc.wait(5)  # end of file comes a moment before the exit status
        except subprocess.TimeoutExpired:
            raise Broken(f"{self.label}: no answer to {what} in {limit:.0f} s")
        self.pump.join(5)
        raise Broken(f"{self.label} ended (exit {self.proc.returncode}) during {what}: "
                     + " / ".join(self.tail)[-1500:])

    def call(self, request, timeout=120, **kw):
        self.send(request, **kw)
        return self.wait(timeout, request)

    def quit(self):
        with contextlib.suppress(OSError):
            self.conn.send(("quit", {}))

    def close(self):
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.pump.join(5)
        self.conn.close()


class Team(list):
    """The workers of one part, each stopped (killed if need be) when the part ends."""

    def __init__(self, args, until):
        super().__init__()
        self.args, self.until, self.tmp = args, until, tempfile.TemporaryDirectory(prefix="tms-switch-")

    def start(self, label, role, library=None, peer=None, env=None):
        self.append(Proc(label, role, library, self.args, self.tmp.name, self.until, peer, env))
        if peer:
            peer.close()  # the worker has it
        return self[-1]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self:
            p.quit()
        for p in self:
            p.close()
        self.tmp.cleanup()


def _ms(x):
    return "-" if x is None else f"{x * 1e3:.1f}"


def _lending(part):
    """What a job lent in the last cycles right after and with no gap, phase by phase (nothing without a job)."""
    last = {r["kind"]: r["phases"] for r in part.get("cycles", []) if r["kind"] in ("after", "nogap")}
    said = [f"{kind} {name} {k.split('_')[0]} {v[k] / GiB:.2f} GiB" for kind, phases in last.items()
            for name, v in phases.items() for k in LENDING if v.get(k)]
    return "; last cycles: " + ", ".join(said) if said else ""


def cycle(tr, ro, c, kind, idle_s):
    ph = {}
    out = {"cycle": c, "kind": kind, "phases": ph}

    def step(name, proc, request, **kw):
        try:
            ph[name] = proc.call(request, **kw)
        except Failed as e:
            ph[name] = {"error": str(e)}
        return ph[name]

    if kind == "nogap":  # a job's pause keeps nothing while no member has paused memory
        ro.call("resume")
        step("rollout_pause", ro, "pause")  # the trainer active: in a job too, the rollout's memory goes to the driver
        step("trainer_pause", tr, "pause")
        step("kv_resume", ro, "resume", tag="kv")
        ro.call("pause", tag="kv")
        out["trainer_exact"] = tr.call("resume").get("exact")
        return out
    sums = tr.call("train", seed=c + 2)
    step("weights_resume", ro, "resume", tag="weights")
    try:
        sh = tr.call("share")
        try:
            cp = ro.call("refresh", payload=sh.pop("payload"))
        finally:
            dr = tr.call("unshare")
        ph["refresh"] = {"s": sh["s"] + cp["s"] + dr["s"], "t0": sh["t0"], "t1": dr["t1"], "share_s": sh["s"],
                         "copy_s": cp["s"], "drop_s": dr["s"], "how": sh["how"]}
        out["refresh_exact"], check_s = cp["sums"] == sums, cp["check_s"]
    except Failed as e:
        ph["refresh"] = {"error": str(e)}
    step("trainer_pause", tr, "pause")
    time.sleep(idle_s if kind == "idle" else 0)
    step("kv_resume", ro, "resume", tag="kv")
    step("rollout_pause", ro, "pause")
    time.sleep(idle_s if kind == "idle" else 0)
    out["trainer_exact"] = step("trainer_resume", tr, "resume").get("exact")
    if not any("error" in p for p in ph.values()):  # less the rollout's check of what it received
        out["switch_s"] = ph["trainer_resume"]["t1"] - ph["weights_resume"]["t0"] - check_s
    return out


def run_switch(label, library, args, sizes, until, save, env=None):
    part, shapes = {"library": label, "cycles": [], "errors": [], "env": env}, sizes["trainer"]
    with Team(args, until) as team:
        tr, ro = (team.start(f"{label} {r}", r, library, env=env) for r in ("trainer", "rollout"))
        try:
            t = part["trainer"] = tr.call("setup", 600, shapes=shapes, probe_bytes=sizes["probe"])
            part["rollout"] = ro.call("setup", 300, weights=shapes["weights"])
            part["first_pause"] = tr.call("pause", 300)
            part["kv"] = ro.call("size_kv", 300, fraction=args.kv_fraction, count=2 * shapes["layers"],
                                 dry_bytes=sizes["kv_dry"])
            ro.call("pause")
            d = part["driver_floor"] = ro.call("floor", 300, reps=3, idle_s=sizes["idle_s"])
            part["first_resume"] = tr.call("resume", 300)
            f = part["floors"] = {"trainer_pause": t["bytes"] / t["link_d2h_gbps"] / 1e9,
                                  "trainer_resume": t["bytes"] / t["link_h2d_gbps"] / 1e9,
                                  "refresh": t["weights_bytes"] / t["d2d_gbps"] / 1e9,
                                  **{k: d.get(k) for k in ("weights_resume", "kv_resume", "rollout_pause")}}
            log(f"{label}: trainer {fmt_bytes(t['bytes'])} in {t['tensors']} tensors, KV cache "
                f"{fmt_bytes(part['kv']['kv_bytes'])}; floors (ms) " + ", ".join(f"{k} {_ms(v)}" for k, v in f.items()))
            save()
            spent = []
            for c, kind in enumerate(sizes["plan"]):
                if time.time() + max(spent, default=30.0) + (2 * sizes["idle_s"] if kind == "idle" else 0) + 5 > until:
                    part["stopped"] = f"deadline: {len(sizes['plan']) - c} of {len(sizes['plan'])} cycles not run"
                    break
                t0 = time.time()
                part["cycles"].append(cycle(tr, ro, c, kind, sizes["idle_s"]))
                spent.append(time.time() - t0)
                log(f"{label} cycle {c} ({kind}): " + " | ".join(
                    f"{k} {'error' if 'error' in v else _ms(v['s'])}" for k, v in part["cycles"][-1]["phases"].items())
                    + f" | switch {_ms(part['cycles'][-1].get('switch_s'))} ms")
                save()
        except (Failed, Broken) as e:
            part["errors"].append(str(e))
            log(f"{label}: stopped: {e}")
    part["errors"] += [f"cycle {r['cycle']} {k}: {v['error']}" for r in part["cycles"]
                       for k, v in r["phases"].items() if "error" in v]
    return part


def run_wait(args, sizes, until, save, out):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with Team(args, until) as team:
        other = team.start("other", "other", peer=a)
        drv = None if args.dry_run else team.start("driver", "other", peer=b)
        probe = team.start("library", "probe", REPO)
        b.close()
        try:
            free = out["free_at_start"] = other.call("info")["free"]
            big = sizes["wait"][-1] if free is None else min(64 * GiB, (free - 8 * GiB) // 2 // GiB * GiB)
            ns = sorted({min(n, big) for n in sizes["wait"]})
            probe.call("probe_setup", 300, sizes=ns)
            rows = [("row", (who, n, n, full, None)) for full in (True, False) for n in ns
                    for who in ("driver", "library")]
            extras = [(GiB, big, True, None), (GiB, big, False, None), (8 * GiB, GiB, True, None),
                      (8 * GiB, 8 * GiB, True, 64 * MiB)]
            plan = rows[:len(rows) // 2] + [("lend", c) for c in (2 * MiB, 64 * MiB, GiB)] + \
                rows[len(rows) // 2:] + [("row", ("driver", *e)) for e in extras]
            if drv is None:
                out["skipped"].append("driver-alone rows, lending, a nearly full device: the host backend has no "
                                      "CUDA driver")
                plan = [(w, i) for w, i in plan if w == "row" and i[0] == "library" and not i[3]]
            for what, item in plan:
                for when in ("after", "idle") if what == "row" else ("",):
                    if time.time() + sizes["settle_s"] + sizes["idle_s"] + 10 > until:
                        out["skipped"].append(f"{what} {item} {when}: deadline")
                        continue
                    try:
                        if what == "lend":
                            out["lend"].append(_lend(other, drv, item, sizes, out))
                        else:
                            out["rows"].append(_wait_row(other, drv if item[0] == "driver" else probe, item, when,
                                                         sizes))
                    except Failed as e:
                        out["errors"].append(f"{what} {item} {when}: {e}")
                    save()
        except (Failed, Broken) as e:
            out["errors"].append(str(e))
            log(f"wait: stopped: {e}")


def _wait_row(other, meas, item, when, sizes):
    who, n, m, full, chunk = item
    ballast = (other.call("info")["free"] - max(n, m) - 2 * GiB) // (2 * MiB) * (2 * MiB) if full else 0
    if ballast > 0:
        other.call("take", name="ballast", size=ballast)
    try:
        other.call("take", name="other", size=m)
        time.sleep(sizes["settle_s"])
        freed = other.call("free", name="other")["t1"]
        time.sleep(sizes["idle_s"] if when == "idle" else 0)
        r = meas.call("create", n=n, chunk=chunk)
    finally:
        if ballast > 0:
            other.call("free", name="ballast")
    log(f"wait: {who} {fmt_bytes(n)}{f' in {fmt_bytes(chunk)} handles' if chunk else ''} after {fmt_bytes(m)} "
        f"freed, {'full' if full else 'empty'}, {when}: {_ms(r['s'])} ms")
    return dict(r, who=who, n=n, m=m, full=full, chunk=chunk, when=when, ballast=ballast, since_free_s=r["t0"] - freed)


def _lend(other, drv, chunk, sizes, out):
    """8 GiB lent in handles of chunk bytes; the first time, also whether the importer
    can export one again (the other process then imports and maps it: one more hop)."""
    n = 8 * GiB
    other.call("take", name="lend", size=n, chunk=chunk, exportable=True)
    time.sleep(sizes["settle_s"])
    drv.send("receive", size=n, chunk=chunk)
    try:
        try:
            h = other.call("lend", name="lend")
        finally:
            r = drv.wait(120, "receive")  # answered either way: the lender says when it stops
        if "reexport" not in out:
            other.send("receive", size=chunk, chunk=chunk)
            rx = out["reexport"] = {"exported": None, "error": None}
            try:
                rx.update(drv.call("reexport"))
            finally:
                try:
                    other.wait(90, "receive")
                    rx["mapped"] = True
                except Failed as e:
                    rx["mapped"] = str(e) if rx["exported"] else False
                other.call("drop_lent")
    finally:
        drv.call("drop_lent")
    row = {"chunk": chunk, "handles": n // chunk, "bytes": n, "export_send_s": h["sent_s"],
           "imported_s": r["imported_t1"] - h["t0"], "map_s": r["map_s"], "total_s": r["t2"] - h["t0"]}
    log(f"wait: lending 8 GiB in {fmt_bytes(chunk)} handles: {_ms(row['total_s'])} ms to mapped")
    return row


# ---- the report ----------------------------------------------------------------------

def _phase(part, name, kind="after"):
    return median([r["phases"][name]["s"] for r in part.get("cycles", [])
                   if r["kind"] == kind and "s" in r["phases"].get(name, {})])


def _switch(part):
    return median([r.get("switch_s") for r in part.get("cycles", []) if r["kind"] == "after"])


def _floor_sum(part):
    f = part.get("floors") or {}
    return sum(f.values()) if f and None not in f.values() else None


def _div(a, b):
    return a / b if a is not None and b else None


def _x(v):
    return "-" if v is None else f"{v:.2f}×"


def switch_table(parts, idle_s):
    labels, floors = list(parts), parts[next(iter(parts))].get("floors") or {}
    head = ["phase", "floor", "floor ms"] + [f"{k} ms{w}" for k in labels for w in ("", f", {idle_s:g} s idle")] + \
        [f"{labels[0]} ÷ floor"] + (["ours ÷ upstream"] if "upstream" in parts else [])
    rows = []
    for name, (label, what) in list(PHASES.items()) + [("switch", ("whole switch, (1) to (6)", "sum of the floors")),
                                                       ("nogap", (NOGAP, PHASES["kv_resume"][1]))]:
        floor = _floor_sum(parts[labels[0]]) if name == "switch" else floors.get(name.replace("nogap", "kv_resume"))
        vals = [(_switch(parts[k]), None) if name == "switch" else (_phase(parts[k], "kv_resume", "nogap"), None)
                if name == "nogap" else (_phase(parts[k], name), _phase(parts[k], name, "idle")) for k in labels]
        rows.append([label, what, _ms(floor)] + [_ms(v) for pair in vals for v in pair] + [_x(_div(vals[0][0], floor))]
                    + ([_x(_div(vals[0][0], vals[labels.index("upstream")][0]))] if "upstream" in parts else []))
    return report.table(head, rows, "ll" + "r" * (len(head) - 2))


def ratios(doc):
    """The targets: name -> (value, wanted)."""
    out, parts = {}, doc["switch"]
    for k, p in parts.items():
        for name, what, by in (("kv_resume", "KV resume", "trainer's"),
                               ("trainer_resume", "trainer resume", "rollout's")):
            out[f"{k}: {what} right after the {by} pause ÷ after 2 s idle"] = (
                _div(_phase(p, name), _phase(p, name, "idle")), "≤ 1.2")
        out[f"{k}: whole switch ÷ sum of its floors"] = (_div(_switch(p), _floor_sum(p)), "≤ 1.2")
    for k in (k for k in parts if "," in k):  # --also: in a job, never slower than without
        out[f"{k}: {NOGAP} ÷ ours'"] = (_div(_phase(parts[k], "kv_resume", "nogap"),
                                            _phase(parts["ours"], "kv_resume", "nogap")), "≤ 1")
    for k in (k for k in parts if "upstream" in parts and k != "upstream"):
        out[f"whole switch, {k} ÷ upstream"] = (_div(_switch(parts[k]), _switch(parts["upstream"])), "< 1")
    return {k: v for k, v in out.items() if v[0] is not None}


def wait_tables(w, idle_s):
    pairs = {}
    for r in w["rows"]:
        pairs.setdefault((r["who"], r["n"], r["m"], r["full"], r["chunk"]), {})[r["when"]] = r["s"]
    out = [report.table(["create + map", "N", "freed just before", "device", "right after ms",
                         f"after {idle_s:g} s idle ms", "after ÷ idle"],
                        [[("driver alone" if who == "driver" else "library resume")
                          + (f", {fmt_bytes(c)} handles" if c else ""), fmt_bytes(n), fmt_bytes(m),
                          "nearly full" if full else "nearly empty", _ms(p.get("after")), _ms(p.get("idle")),
                          _x(_div(p.get("after"), p.get("idle")))] for (who, n, m, full, c), p in pairs.items()],
                        "lrrlrrr")]
    if w["lend"]:
        out += ["", report.table(["handle size", "handles", "export + send ms", "all imported ms", "map ms",
                                  "lend to mapped ms"],
                                 [[fmt_bytes(r["chunk"]), r["handles"], _ms(r["export_send_s"]), _ms(r["imported_s"]),
                                   _ms(r["map_s"]), _ms(r["total_s"])] for r in w["lend"]])]
    rx = w.get("reexport")
    if rx:
        out += ["", f"An imported handle exported again by the importer: **{'yes' if rx['exported'] else 'no'}** "
                f"({rx['error'] or 'CUDA_SUCCESS'}); imported and mapped by a third process: {rx.get('mapped')}."]
    return "\n".join(out)


def _exact(doc):
    return all(r.get(k) is not False for p in doc["switch"].values() for r in p.get("cycles", [])
               for k in ("refresh_exact", "trainer_exact"))


def body(doc, sizes, args, images):
    lines, parts, w, idle = [], doc["switch"], doc.get("wait"), sizes["idle_s"]
    if parts:
        first = parts[next(iter(parts))]
        t, kv, f = first.get("trainer") or {}, first.get("kv") or {}, first.get("driver_floor") or {}
        lines += ["## The switch", "", (
            f"Trainer: {fmt_bytes(t.get('bytes'))} in {t.get('tensors')} tensors ({sizes['trainer']['layers']} "
            "Llama layers), backed up with each library's default kind (this library `mmap`, upstream `pinned`), "
            f"retain_cpu_backup {(t.get('info') or {}).get('retain_cpu_backup')}. Rollout: the weights "
            f"({fmt_bytes(t.get('weights_bytes'))}) and a KV cache of {fmt_bytes(kv.get('kv_bytes'))} "
            f"({args.kv_fraction:g} of the memory free), not backed up. Cycles: {', '.join(sizes['plan'])}; "
            f"medians. Floors: pinned link {t.get('link_d2h_gbps') or 0:.1f} GB/s to host, "
            f"{t.get('link_h2d_gbps') or 0:.1f} to device; device copy {t.get('d2d_gbps') or 0:.0f} GB/s; driver "
            f"create + map: {f.get('skipped') or 'median of 3 runs, each after %g s idle' % idle}. "
            f"Contents exact in every cycle: {_exact(doc)}."), "", switch_table(parts, idle), ""]
        for k, p in parts.items():
            how = next((r["phases"]["refresh"]["how"] for r in p["cycles"][::-1]
                        if "how" in r["phases"].get("refresh", {})), None)
            lines.append(f"- {k}: refresh by {how}; {p.get('stopped') or '%d cycles' % len(p['cycles'])}" + _lending(p))
        lines += ["", report.table(["target", "value", "wanted"],
                                   [[k, f"{v:.2f}", want] for k, (v, want) in doc["ratios"].items()], "lrl"), ""]
    if w:
        lines += ["## What a create waits for right after another process freed", "",
                  f"Create + map of N (one handle unless said), right after another process freed M that it held "
                  f"filled (what was freed before had {sizes['settle_s']:g} s to settle), against the same after "
                  f"{idle:g} s idle; *nearly full*: that process also holds a ballast leaving 2 GiB beside the "
                  "larger of N and M. Lending: it exports the handles of 8 GiB, sends the descriptors over a Unix "
                  "socket and drops its own references; this process imports and maps them.", "",
                  wait_tables(w, idle), ""] + (["Skipped: " + "; ".join(w["skipped"]), ""] if w["skipped"] else [])
    errors = [f"{k}: {e}" for k, p in parts.items() for e in p["errors"]] + (w or {}).get("errors", [])
    lines += ["Errors: " + "; ".join(errors), ""] if errors else []
    return "\n".join(lines + ([f"![switch]({images['switch']})"] if images.get("switch") else []))


def plot(doc, out, stem):
    """Left: the phases right after the other process, stacked, beside their floors.
    Right: create + map of N after N freed, against N."""
    plt = pyplot()
    if plt is None:
        return {}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.2))
    parts = doc["switch"]
    bars = [("floor", parts[next(iter(parts))].get("floors") or {})] if parts else []
    for y, (label, vals) in enumerate(bars + [(k, {n: _phase(p, n) for n in PHASES}) for k, p in parts.items()]):
        left = 0.0
        for j, name in enumerate(PHASES):
            ax1.barh(y, (vals.get(name) or 0) * 1e3, left=left, color=f"C{j}", label=None if y else PHASES[name][0])
            left += (vals.get(name) or 0) * 1e3
    ax1.set_yticks(range(len(bars) + len(parts)), [b[0] for b in bars] + list(parts))
    ax1.set_xlabel("ms (medians of the cycles right after the other process)")
    ax1.legend(fontsize=7)
    rows = [r for r in (doc.get("wait") or {}).get("rows", []) if r["n"] == r["m"] and not r["chunk"]]
    for who, full, when in sorted({(r["who"], r["full"], r["when"]) for r in rows}):
        pts = sorted((r["n"] / GiB, r["s"] * 1e3) for r in rows
                     if (r["who"], r["full"], r["when"]) == (who, full, when))
        ax2.plot(*zip(*pts), ("C3" if full else "C0") + ("-" if who == "driver" else "--"),
                 marker="o" if when == "after" else "x", label=f"{who}, {'full' if full else 'empty'}, {when}")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("N GiB created after N GiB freed")
    ax2.set_ylabel("create + map ms")
    ax2.legend(fontsize=7)
    fig.suptitle(f"{doc['meta'].get('device_name', '')}: the engine switch, and the wait after a free", fontsize=10)
    save_png(plt, fig, os.path.join(out, f"{stem}.png"))
    return {"switch": f"{stem}.png"}


def main(argv=None):
    ap = parser("switch", __doc__)
    ap.add_argument("--upstream", metavar="DIR", help="also run the torch_memory_saver found in DIR")
    ap.add_argument("--gib", type=float, default=12.0, help="the trainer's backed-up state (default 12)")
    ap.add_argument("--kv-fraction", type=float, default=0.9, help="the KV cache's share of the free memory")
    ap.add_argument("--cycles", type=int, default=5, help="cycles after the warm-up (default 5)")
    ap.add_argument("--mode", choices=("preload", "torch"), default="preload", help="hook mode (default preload)")
    ap.add_argument("--part", choices=("all", "switch", "wait"), default="all")
    ap.add_argument("--deadline", type=float, default=390.0, help="seconds the run may take (default 390)")
    ap.add_argument("--also", metavar="VAR=VALUE ...", help="also run this library with these variables (TMS_JOB=...)")
    args = ap.parse_args(argv := sys.argv[1:] if argv is None else argv)
    meta, sizes, start = report.collect_meta("switch", argv, args.dry_run), _sizes(args), time.time()
    out, stem = report.out_dir(args.out, args.dry_run), report.name(meta)
    doc = {"meta": meta, "switch": {}, "settings": {k: getattr(args, k) for k in ("gib", "kv_fraction", "cycles", "mode", "deadline")},
           "wait": None if args.part == "switch" else {"rows": [], "lend": [], "skipped": [], "errors": []}}
    save = lambda: write_json_atomic(os.path.join(out, f"{stem}.json"), doc, strip=REPO + os.sep)  # noqa: E731
    # Each part gets its weight's share of the time left; what one leaves goes to the next.
    also = dict(kv.split("=", 1) for kv in (args.also or "").split())
    parts = [("ours", REPO, 1.0)] + ([(f"ours, {args.also}", REPO, 1.0)] if also else []) if args.part != "wait" else []
    if args.upstream and parts and not args.dry_run:  # the upstream library has no host backend
        parts.append(("upstream", os.path.abspath(args.upstream), 1.3))
    parts += [("wait", None, 1.5)] if args.part != "switch" else []
    for i, (label, library, weight) in enumerate(parts):
        left = start + args.deadline - time.time()
        until = time.time() + left * weight / sum(p[2] for p in parts[i:])
        log(f"{label}: {until - time.time():.0f} s of the {left:.0f} s left")
        if label == "wait":
            run_wait(args, sizes, until, save, doc["wait"])
        else:
            doc["switch"][label] = run_switch(label, library, args, sizes, until, save, also if "," in label else None)
        save()
    doc["ratios"] = ratios(doc)
    info = (doc["switch"].get("ours", {}).get("trainer") or {}).get("info") or {}
    meta.setdefault("device_name", info.get("device_name"))
    report.publish(args, doc, TITLE, lambda images: body(doc, sizes, args, images), plots=lambda o, s: plot(doc, o, s),
                   extra_rows=[["torch", info.get("torch_version") or "-"]])
    log(f"{time.time() - start:.0f} s")
    failed = [e for p in doc["switch"].values() for e in p["errors"]] + (doc["wait"] or {}).get("errors", [])
    return 1 if failed or not _exact(doc) else 0


if __name__ == "__main__":
    sys.exit(main())
