"""The singleton's implementation: the core of its hook mode, the MemPools that keep
region memory apart in PyTorch's cache, disable()'s scratch pools, CUDA graphs."""
import contextlib
import importlib
import os
import sys
import threading
from typing import Any, Dict, Optional

from . import _abi, _library, _preload, _scratch, _share


def _torch_platform():
    """'hip' or 'cuda': the platform the importable torch was built for, else None.
    torch is imported only where the environment leaves the core nothing else to
    go by (importing it takes seconds)."""
    torch = sys.modules.get("torch")
    env = importlib.import_module("torch_memory_saver._tms_env")
    if torch is None and not (env.env_choice("backend") or env.env_choice("platform")):
        try:
            import torch
        except ImportError:
            return None
    return None if torch is None else "hip" if getattr(torch.version, "hip", None) else "cuda"


def _torch_gpu_platform():
    """'hip' or 'cuda' if torch sees a GPU of that platform, else None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return "hip" if getattr(torch.version, "hip", None) else "cuda"


def backup_across_pages(core, ptr: int, nbytes: int):
    """(spans pages, copy): whether [ptr, ptr+nbytes) is made of consecutive
    adopted allocations (expandable-segment pages), and if so its bytes copied
    from their backups as a uint8 tensor, or None if one of them has none now."""
    import torch

    pieces, at, end = [], ptr, ptr + nbytes
    while at < end:
        row = core.allocation_at(at)
        if row is None or not row["adopted"]:
            return False, None
        n = min(end, row["ptr"] + row["size"]) - at
        view = core.get_cpu_backup(at, n, False, True)  # copied out at once: the backup stays trusted
        if view is None:
            return True, None
        pieces.append(torch.frombuffer(view, dtype=torch.uint8).clone())
        at += n
    return True, torch.cat(pieces)


class _Impl:
    def __init__(self, hook_mode: str):
        self.hook_mode = hook_mode
        self.core = _library.load(hook_mode)
        # Upstream's private path to the C ABI, `_impl._binary_wrapper.cdll`:
        # the very library the module was loaded from (one core state).
        self._binary_wrapper = _abi.BinaryWrapper(self.core.library_path())
        self._pools: Dict[tuple, Any] = {}
        self._pools_lock = threading.Lock()
        self._scratch = _scratch.ScratchPools()
        self._disabled = threading.local()  # depth of this thread's disable() blocks
        self._allocator = None
        self._on_gpu: Optional[bool] = None
        self.preload_method: Optional[str] = None  # set by on_gpu(): "ld_preload" or "relocation"
        # One build serves CUDA and ROCm: the core picks the backend, told what
        # torch was built for (TMS_BACKEND and TMS_PLATFORM say first).
        self.core.set_platform_hint(_torch_platform())
        if sys.modules.get("torch") is not None:  # a process that shares before its first region marks its handles too
            _share.mark_storage_sharing()

    @property
    def _hook_mode(self) -> str:  # upstream's attribute name
        return self.hook_mode

    def on_gpu(self) -> bool:
        """True on a GPU backend (cuda, hip) with a torch that sees the GPU: regions then use
        torch MemPools. False on the host backend (regions only set the thread's settings)."""
        if self._on_gpu is None:
            backend = self.core.backend()  # raises with the reason if no driver
            # Regions use torch pools only where torch drives the same GPUs as the
            # backend (a HIP backend under a CUDA torch is a test stub, not a GPU).
            gpu = backend != "host" and backend == _torch_gpu_platform()  # host: no torch import
            if gpu and self.hook_mode == "preload":
                self.preload_method = _preload.ensure_hooked(self.core)
            if gpu:
                self._route_ipc()
            self._on_gpu = gpu
        return self._on_gpu

    def _route_ipc(self):
        """PyTorch's CUDA tensor sharing reaches our memory through the runtime's IPC
        calls: hooked here (torch mode, beside the caller: a share waits for it;
        preload mode's hooks include them), and its handles marked so receivers
        load this package first."""
        if self.hook_mode == "torch":
            _share.install_ipc_hooks_later(self.core)
            _share.mark_storage_sharing()
            return
        try:
            self.core.install_ipc_hooks()
        except NotImplementedError:
            return  # TMS_RELOC_HOOKS=0: region tensors cannot go through torch.multiprocessing
        _share.mark_storage_sharing()

    # Pools keep region allocations in segments of their own, so PyTorch's
    # cache never hands region memory to code outside the region or back.
    def _pool(self, tag, backup, kind, device, disk=False, skip=None, restore=None):
        import torch

        key = (tag, backup, kind, disk, skip, restore, device)
        with self._pools_lock:
            pool = self._pools.get(key)
            if pool is None:
                # PyTorch registers a pool with the device current at creation.
                with torch.cuda.device(device):
                    if self.hook_mode == "torch":
                        if self._allocator is None:
                            self._allocator = torch.cuda.memory.CUDAPluggableAllocator(
                                self.core.library_path(), "tms_torch_malloc", "tms_torch_free")
                        pool = torch.cuda.MemPool(self._allocator.allocator())
                    else:
                        pool = torch.cuda.MemPool()
                self._pools[key] = pool
        return pool

    @contextlib.contextmanager
    def _thread_region(self, active, tag, backup, kind, disk=False, skip=None, restore=None):
        previous = self.core.get_region()
        self.core.set_region(active, tag, backup, kind, disk, skip, restore)
        try:
            yield
        finally:
            self.core.set_region(*previous)

    def devices_in_use(self):
        """The devices a region or disable() block routes to its pools: the current
        one and every other this process already uses (an active context). A pool
        on any other device would make PyTorch create a context there, about half
        a GiB of a GPU the process never uses."""
        import torch

        current = torch.cuda.current_device()
        return [d for d in range(torch.cuda.device_count()) if d == current or self.core.device_active(d)]

    @contextlib.contextmanager
    def _pools_on(self, devices, make_pool):
        import torch

        with contextlib.ExitStack() as stack:
            for device in devices:
                stack.enter_context(torch.cuda.use_mem_pool(make_pool(device), device=device))
            yield

    @contextlib.contextmanager
    def region(self, tag, backup, kind, disk=False, skip=None, restore=None):
        if not self.on_gpu():
            with self._thread_region(True, tag, backup, kind, disk, skip, restore):
                yield
            return
        pool = lambda device: self._pool(tag, backup, kind, device, disk, skip, restore)  # noqa: E731
        with self._pools_on(self.devices_in_use(), pool):
            with self._thread_region(True, tag, backup, kind, disk, skip, restore):
                yield

    def disabled_here(self) -> bool:
        """True inside a disable() block of this thread."""
        return getattr(self._disabled, "depth", 0) > 0

    @contextlib.contextmanager
    def disable(self):
        self._disabled.depth = getattr(self._disabled, "depth", 0) + 1
        try:
            with self._disable():
                yield
        finally:
            self._disabled.depth -= 1

    @contextlib.contextmanager
    def _disable(self):
        _, tag, backup, kind, disk, skip, restore = self.core.get_region()
        if not self.on_gpu():
            with self._thread_region(False, tag, backup, kind, disk, skip, restore):
                yield
            return
        # Ordinary memory in pools of its own, apart from region segments, given
        # back to the driver when the block ends (_scratch.py says how).
        taken = [(device, *self._scratch.take(device)) for device in self.devices_in_use()]
        pools = {device: pool for device, pool, _ in taken}
        try:
            with self._pools_on(pools, pools.__getitem__):
                with self._thread_region(False, tag, backup, kind, disk, skip, restore):
                    yield
        finally:
            self._scratch.give_back(taken)

    @contextlib.contextmanager
    def cuda_graph(self, graph, pool, stream, capture_error_mode, tag, backup, kind):
        torch = _library.torch_module("cuda_graph")
        if not self.on_gpu():
            raise RuntimeError("torch_memory_saver: cuda_graph needs a GPU backend (cuda or hip) and a torch that sees the GPU")
        if pool is None and self.hook_mode == "torch":
            pool = self._pool(tag, backup, kind, torch.cuda.current_device()).id
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            with self._thread_region(True, tag, backup, kind):
                yield
