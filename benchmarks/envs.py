"""Where the measured memory lives: GPU tensors (GpuEnv) or, for --dry-run on a machine without a GPU, allocations of
the library's host backend (HostEnv).

Both offer the same small interface, so the measurement loops of every suite are the same code in a real run and in
a dry run:

  alloc(tag, sizes, backup, backend, disk) -> block   allocations made inside region(tag)
  alloc_granules(tag, n) -> block               n allocations of one granule (2 MiB)
  dispose(block, tag, pause)                    drop a block and give its memory back
  fill_random(block, seed) / snapshot / verify  contents checks
  free_bytes()                                  free device memory (None on the host backend)
  tag_allocs(tag) / tag_stats(tag)              what the library holds for the tag
"""
import ctypes
import hashlib
import os
import random

from .common import GiB, MiB

# Keep a second copy of the data on the GPU for an exact comparison only if this
# much memory would still be free afterwards; otherwise compare checksums.
COPY_HEADROOM = 4 * GiB


def _tms(mode):
    from torch_memory_saver import torch_memory_saver as tms

    if mode in ("torch", "preload"):
        tms.hook_mode = mode
    return tms


class _Env:
    def tag_allocs(self, tag):
        return [a for a in self.tms.allocations() if a["tag"] == tag]

    def tag_stats(self, tag):
        """The tag's row of tms.stats(), summed over devices."""
        total = {}
        for per_tag in self.tms.stats().values():
            for field, value in per_tag.get(tag, {}).items():
                total[field] = total.get(field, 0) + value
        return total

    @staticmethod
    def region_kw(tag, backup, backend, disk, skip=None, restore=None):
        kw = {"tag": tag} if skip is None else {"tag": tag, "skip_unchanged": skip}
        if restore is not None:
            kw["restore"] = restore
        if backup:
            kw.update(enable_cpu_backup=True, cpu_backup_backend=backend)
        if disk:
            kw.update(enable_disk_backup=True)
        return kw


class GpuEnv(_Env):
    kind = "cuda"

    def __init__(self, mode, use_tms=True):
        import torch

        self.torch = torch
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device visible to PyTorch (torch.cuda.is_available() is False)")
        torch.cuda.init()
        self.device = torch.device("cuda", torch.cuda.current_device())
        torch.empty(1, device=self.device)  # create the context now, not inside a timing
        self.tms = _tms(mode) if use_tms else None
        self.mode = mode

    def info(self):
        torch = self.torch
        props = torch.cuda.get_device_properties(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return {"device_name": torch.cuda.get_device_name(self.device), "device_total_bytes": int(total),
                "device_free_bytes_at_start": int(free),
                "capability": list(torch.cuda.get_device_capability(self.device)),
                "multiprocessors": getattr(props, "multi_processor_count", None), "torch_version": torch.__version__,
                "torch_cuda_version": torch.version.cuda, "backend": "cuda"}

    def sync(self):
        self.torch.cuda.synchronize()

    def free_bytes(self):
        self.torch.cuda.synchronize()
        return int(self.torch.cuda.mem_get_info(self.device)[0])

    def alloc(self, tag, sizes, backup=False, backend=None, disk=False, skip=None, restore=None):
        torch = self.torch
        try:
            with self.tms.region(**self.region_kw(tag, backup, backend, disk, skip, restore)):
                block = [torch.empty(int(s), dtype=torch.uint8, device=self.device) for s in sizes]
        except BaseException:
            if not backup and not disk:
                self.dispose([], tag)  # give back what was allocated before the failure
            raise
        self.sync()
        return block

    def alloc_granules(self, tag, n):
        # PyTorch's caching allocator packs requests of <= 1 MiB into 2 MiB
        # segments (its "small" pool), two 1 MiB tensors per segment: 2n tensors
        # of 1 MiB are n allocations of exactly 2 MiB in the library. (A 2 MiB
        # tensor would come from a 20 MiB segment.)
        return self.alloc(tag, [MiB] * (2 * n))

    def dispose(self, block, tag, pause=True):
        """Drops the tensors. Their segments stay cached in the tag's MemPool
        (empty_cache does not release a live pool), so pausing the tag is what
        gives the device memory back; the tag is not used again."""
        block.clear()
        if pause and self.tms is not None:
            try:
                self.tms.pause(tag)
            except RuntimeError:
                pass  # already paused

    def addresses(self, block):
        return [t.data_ptr() for t in block]

    def poke(self, block, offsets):
        """Adds one to the byte at each offset into the block's tensors laid end to end."""
        for off in offsets:
            block[off // block[0].numel()][off % block[0].numel()] += 1
        self.sync()

    def memset(self, block, value):
        """Every byte of the block set to value by the device, as a plain fill does."""
        for t in block:
            t.fill_(value)
        self.sync()

    def holds_only(self, block, value):
        return all(bool((t == value).all()) for t in block)

    def touch(self, block, value):
        """Writes the first and last bytes of the block: the memory is usable."""
        n = min(4096, block[0].numel())
        block[0][:n].fill_(value & 0xFF)
        block[-1][-n:].fill_(value & 0xFF)
        self.sync()

    def fill_random(self, block, seed):
        torch = self.torch
        g = torch.Generator(device=self.device)
        g.manual_seed(int(seed))
        for t in block:
            if t.numel() % 8 == 0:
                t.view(torch.int64).random_(generator=g)
            else:
                t.random_(0, 256, generator=g)
        self.sync()

    def can_keep_copy(self, nbytes):
        return self.free_bytes() > nbytes + COPY_HEADROOM

    def _checksum(self, t):
        torch = self.torch
        if t.numel() % 8 == 0:
            w64 = t.view(torch.int64)
            w32 = t.view(torch.int32)
            # Integer sums (wrapping) are exact and order independent.
            return (int(w32.sum(dtype=torch.int64)), int(w64.sum()))
        return (int(t.sum(dtype=torch.int64)), 0)

    def snapshot(self, block, keep_copy):
        if keep_copy:
            return {"kind": "gpu-copy", "refs": [t.clone() for t in block]}
        return {"kind": "checksum", "sums": [self._checksum(t) for t in block]}

    def resnapshot(self, block, snap):
        if snap["kind"] == "gpu-copy":
            for r, t in zip(snap["refs"], block):
                r.copy_(t)
            self.sync()
            return snap
        return self.snapshot(block, False)

    def verify(self, block, snap):
        torch = self.torch
        self.sync()
        if snap["kind"] == "gpu-copy":
            return all(bool(torch.equal(t, r)) for t, r in zip(block, snap["refs"]))
        return [self._checksum(t) for t in block] == snap["sums"]

    def drop_snapshot(self, snap):
        snap.clear()
        self.torch.cuda.empty_cache()


class HostEnv(_Env):
    """The library's host backend (TMS_BACKEND=host): VMM emulated with memfds.
    Used by --dry-run to run every loop without a GPU."""

    kind = "host"

    def __init__(self, mode, use_tms=True):
        os.environ["TMS_BACKEND"] = "host"  # read when the library first loads its backend
        self.mode = mode
        self.tms = _tms(mode) if use_tms else None

    def info(self):
        return {"device_name": "host backend (dry run)", "backend": "host", "torch_version": None,
                "torch_cuda_version": None}

    def sync(self):
        pass

    def free_bytes(self):
        return None  # freed memory is read from RSS instead

    def alloc(self, tag, sizes, backup=False, backend=None, disk=False, skip=None, restore=None):
        with self.tms.region(**self.region_kw(tag, backup, backend, disk, skip, restore)):
            block = [(self.tms.malloc(int(s)), int(s)) for s in sizes]
        for p, n in block:
            ctypes.memset(p, 0, n)  # resident, as device memory is once created
        return block

    def alloc_granules(self, tag, n):
        return self.alloc(tag, [2 * MiB] * n)

    def dispose(self, block, tag, pause=True):
        for p, _ in block:
            self.tms.free(p)
        block.clear()

    def addresses(self, block):
        return [p for p, _ in block]

    def poke(self, block, offsets):
        for off in offsets:
            p, n = block[off // block[0][1]]
            b = ctypes.c_ubyte.from_address(p + off % n)
            b.value = (b.value + 1) & 0xFF

    def touch(self, block, value):
        for p, n in block:
            ctypes.memset(p, value & 0xFF, n)

    def memset(self, block, value):
        self.touch(block, value)

    def holds_only(self, block, value):
        return all(ctypes.string_at(p, n) == bytes([value]) * n for p, n in block)

    def fill_random(self, block, seed):
        rnd = random.Random(seed)
        for p, n in block:
            pattern = rnd.randbytes(min(n, 4096))
            for off in range(0, n, len(pattern)):
                k = min(len(pattern), n - off)
                ctypes.memmove(p + off, pattern, k)

    def can_keep_copy(self, nbytes):
        return True

    def snapshot(self, block, keep_copy):
        if keep_copy:
            return {"kind": "host-copy", "refs": [ctypes.string_at(p, n) for p, n in block]}
        return {"kind": "checksum", "sums": [hashlib.blake2b(ctypes.string_at(p, n)).hexdigest() for p, n in block]}

    def resnapshot(self, block, snap):
        return self.snapshot(block, snap["kind"] != "checksum")

    def verify(self, block, snap):
        if snap["kind"] == "checksum":
            return [hashlib.blake2b(ctypes.string_at(p, n)).hexdigest() for p, n in block] == snap["sums"]
        return all(ctypes.string_at(p, n) == r for (p, n), r in zip(block, snap["refs"]))

    def drop_snapshot(self, snap):
        snap.clear()


def make_env(mode, dry_run, use_tms=True):
    return (HostEnv if dry_run else GpuEnv)(mode, use_tms=use_tms)
