"""disable()'s pools: ordinary memory, given back to the driver when the block ends."""
import contextlib
import ctypes
import threading


class ScratchPools:
    """Default-allocator MemPools, one per device for each disable() block.

    Giving their memory back, and only theirs, is the delicate part. Dropping
    a MemPool runs PyTorch's emptyCache(pool), which asserts, and so aborts the
    process, while any thread routes allocations to a pool (a region, a graph
    capture). Instead, when the block ends, the pool's own reference is
    released (a pool nobody uses is "freeable") and torch.cuda.empty_cache()
    frees the cached segments of freeable pools, which it also does while
    captures are underway. While a thread routes allocations to a pool it
    leaves the default pools' cache alone, so this thread routes to an empty
    guard pool on each device meanwhile: the default cache (which holds paused
    allocations in preload mode) and the cache of every pool in use stay.

    Having been released once, a MemPool object must never be destroyed (its
    destructor would release the pool again), so every object made here lives
    for the process. One whose pool PyTorch has forgotten (no segment left) is
    used again by the next block; one whose pool still holds segments (a
    tensor allocated inside the block is alive) is set aside.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._idle = {}      # device -> [MemPool] PyTorch has forgotten: reusable
        self._kept = []      # every MemPool made here, for the process's life
        self._guards = {}    # device -> MemPool never allocated from (see give_back)

    def take(self, device):
        """(pool, fresh) for one block on device; fresh: its object holds a reference."""
        import torch

        with self._lock:
            idle = self._idle.get(device)
            if idle:
                return idle.pop(), False
        with torch.cuda.device(device):  # PyTorch registers a pool with the current device
            pool = torch.cuda.MemPool()
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pool))  # never destroyed, not even at exit
        with self._lock:
            self._kept.append(pool)
        return pool, True

    def give_back(self, taken):
        """Ends a block: [(device, pool, fresh)] taken for it, their use ended."""
        import torch

        for device, pool, fresh in taken:
            if fresh:
                torch._C._cuda_releasePool(device, pool.id)
        with contextlib.ExitStack() as stack:
            for device, _, _ in taken:
                stack.enter_context(torch.cuda.use_mem_pool(self._guard(device), device=device))
            torch.cuda.empty_cache()
        for device, pool, _ in taken:
            if _forgotten(pool):
                with self._lock:
                    self._idle.setdefault(device, []).append(pool)


    def _guard(self, device):
        import torch

        with self._lock:
            guard = self._guards.get(device)
        if guard is None:
            with torch.cuda.device(device):
                guard = torch.cuda.MemPool()
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(guard))  # as the scratch pools: never destroyed
            with self._lock:
                guard = self._guards.setdefault(device, guard)
        return guard


def _forgotten(pool):
    """True if PyTorch dropped the pool (no segment left after empty_cache), so
    the next use_mem_pool creates it anew; False when unsure."""
    import torch

    try:
        snapshot = torch.cuda.memory_snapshot(pool.id)
    except (TypeError, RuntimeError):
        return False
    segments = snapshot.get("segments", []) if isinstance(snapshot, dict) else snapshot
    return not any(tuple(s.get("segment_pool_id", ())) == tuple(pool.id) for s in segments)
