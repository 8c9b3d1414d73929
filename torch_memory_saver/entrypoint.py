"""The process singleton: regions, pause/resume, backups, hook-mode glue."""
import contextlib
import logging
import os
import threading
from typing import Optional

from . import _library, _observe, _preload

logger = logging.getLogger("torch_memory_saver")

_TAG_DEFAULT = "default"
_BACKUP_BACKENDS = ("pinned", "mmap")


def _check_tag(tag, *, allow_none=False, what="tag"):
    if tag is None and allow_none:
        return
    if not isinstance(tag, str):
        raise TypeError(f"torch_memory_saver: {what} must be a str{' or None' if allow_none else ''}, "
                        f"not {type(tag).__name__}")
    if not tag:
        raise ValueError(f"torch_memory_saver: {what} must be a non-empty string")
    if "\0" in tag:
        raise ValueError(f"torch_memory_saver: {what} {tag!r} contains a null character")


def _torch_is_rocm() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(getattr(torch.version, "hip", None))


def _torch_gpu_platform():
    """'hip' or 'cuda' if torch sees a GPU of that platform, else None."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    return "hip" if getattr(torch.version, "hip", None) else "cuda"


class TorchMemorySaver:
    """Process-wide entry point (use the `torch_memory_saver` instance)."""

    def __init__(self):
        self._hook_mode = "preload"
        self._impl: Optional[_Impl] = None
        self._init_lock = threading.Lock()
        self._pending_margin = 0
        self._pending_retain = None

    # ---- configuration -------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return True

    @property
    def hook_mode(self) -> str:
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, value: str):
        if value not in _library.HOOK_MODES:
            raise ValueError(f"torch_memory_saver: hook_mode must be 'preload' or 'torch', got {value!r}")
        if self._impl is not None and value != self._hook_mode:
            raise RuntimeError(
                f"torch_memory_saver: hook_mode is already {self._hook_mode!r} (in use since the first "
                f"region/pause/resume); set hook_mode before first use")
        self._hook_mode = value

    @property
    def progress(self) -> bool:
        """Log progress lines (INFO, logger "torch_memory_saver") for backed-up
        pauses/resumes that take more than a second. Off by default; TMS_PROGRESS=1."""
        return _observe.progress_enabled

    @progress.setter
    def progress(self, value: bool):
        if not isinstance(value, bool):
            raise TypeError(f"torch_memory_saver: progress must be a bool, not {type(value).__name__}")
        _observe.progress_enabled = value

    @property
    def memory_margin_bytes(self) -> int:
        return self._impl.core.get_memory_margin_bytes() if self._impl else self._pending_margin

    @memory_margin_bytes.setter
    def memory_margin_bytes(self, value: int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"torch_memory_saver: memory_margin_bytes must be an int, not {type(value).__name__}")
        if value < 0:
            raise ValueError(f"torch_memory_saver: memory_margin_bytes must be >= 0, got {value}")
        if value >= 1 << 64:
            raise ValueError(f"torch_memory_saver: memory_margin_bytes must be < 2**64, got {value}")
        if self._impl:
            self._impl.core.set_memory_margin_bytes(value)
        else:
            self._pending_margin = value

    @property
    def retain_cpu_backup(self) -> bool:
        if self._impl:
            return self._impl.core.get_retain_cpu_backup()
        if self._pending_retain is not None:
            return self._pending_retain
        return _library.load(self._hook_mode).defaults()["retain_cpu_backup"]

    @retain_cpu_backup.setter
    def retain_cpu_backup(self, value: bool):
        if not isinstance(value, bool):
            raise TypeError(f"torch_memory_saver: retain_cpu_backup must be a bool, not {type(value).__name__}")
        if self._impl:
            self._impl.core.set_retain_cpu_backup(value)
        else:
            self._pending_retain = value

    # ---- regions -------------------------------------------------------------

    @contextlib.contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
               cpu_backup_backend: Optional[str] = None):
        """Allocations made by this thread inside are pauseable under `tag`."""
        _check_tag(tag)
        kind = self._backup_backend(enable_cpu_backup, cpu_backup_backend)
        impl = self._ensure_impl()
        with impl.region(tag, bool(enable_cpu_backup), kind):
            yield

    @contextlib.contextmanager
    def disable(self):
        """Allocations inside are ordinary, even within a region."""
        impl = self._ensure_impl()
        with impl.disable():
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global",
                   tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False):
        """Like `torch.cuda.graph`, with the graph's memory pauseable under `tag`."""
        _check_tag(tag)
        kind = self._backup_backend(enable_cpu_backup, None)
        impl = self._ensure_impl()
        with impl.cuda_graph(cuda_graph, pool, stream, capture_error_mode, tag, bool(enable_cpu_backup), kind):
            yield

    # ---- pause / resume ------------------------------------------------------

    def pause(self, tag: Optional[str] = None):
        """Release the memory of `tag` (all tags if None); backed-up tags copy to host first."""
        _check_tag(tag, allow_none=True)
        _observe.logged(self._ensure_impl().core, "pause", tag)

    def resume(self, tag: Optional[str] = None):
        """Map `tag`'s memory back at the same addresses; backed-up contents are restored."""
        _check_tag(tag, allow_none=True)
        _observe.logged(self._ensure_impl().core, "resume", tag)

    def get_cpu_backup(self, x, zero_copy: bool = False):
        """Host copy of tensor `x` while its allocation is paused with backup (or
        retained), else None. zero_copy=True aliases the backup instead of copying."""
        import torch

        if not isinstance(x, torch.Tensor):
            raise TypeError(f"torch_memory_saver: get_cpu_backup expects a torch.Tensor, not {type(x).__name__}")
        core = self._ensure_impl().core
        if x.numel() == 0:
            return torch.empty(x.shape, dtype=x.dtype)
        item = x.element_size()
        span = (sum((n - 1) * s for n, s in zip(x.shape, x.stride())) + 1) * item
        view = core.get_cpu_backup(x.data_ptr(), span)
        if view is None:
            return None
        host = torch.frombuffer(view, dtype=torch.uint8).view(x.dtype).as_strided(x.shape, x.stride())
        return host if zero_copy else host.clone(memory_format=torch.contiguous_format)

    def stats(self):
        """{device: {tag: {field: value}}}: allocations, bytes requested/reserved/
        mapped/paused, host backup bytes by kind, pause/resume counts, time and
        bytes copied. Reads counters only (no driver call): cheap every step."""
        return _observe.stats(self._ensure_impl().core)

    def memory_summary(self) -> str:
        """A readable table of stats(), like torch.cuda.memory_summary()."""
        return _observe.memory_summary(self._ensure_impl().core)

    @staticmethod
    def configure_subprocess():
        return _preload.configure_subprocess()

    # ---- internals -----------------------------------------------------------

    def _backup_backend(self, enable_cpu_backup, cpu_backup_backend):
        if not isinstance(enable_cpu_backup, bool):
            raise TypeError(f"torch_memory_saver: enable_cpu_backup must be a bool, "
                            f"not {type(enable_cpu_backup).__name__}")
        if cpu_backup_backend is None:
            return _library.load(self._hook_mode).defaults()["init_cpu_backup_backend"]
        if cpu_backup_backend not in _BACKUP_BACKENDS:
            raise ValueError(f"torch_memory_saver: cpu_backup_backend must be 'pinned' or 'mmap', "
                             f"got {cpu_backup_backend!r}")
        if not enable_cpu_backup:
            raise ValueError(f"torch_memory_saver: cpu_backup_backend={cpu_backup_backend!r} needs "
                             f"enable_cpu_backup=True")
        return cpu_backup_backend

    def _ensure_impl(self) -> "_Impl":
        if self._impl is None:
            with self._init_lock:
                if self._impl is None:
                    impl = _Impl(self._hook_mode)
                    impl.core.set_memory_margin_bytes(self._pending_margin)
                    if self._pending_retain is not None:
                        impl.core.set_retain_cpu_backup(self._pending_retain)
                    self._impl = impl
        return self._impl

    @property
    def _core(self):
        """The native module in use (for tests and the host backend)."""
        return self._ensure_impl().core


class _Impl:
    def __init__(self, hook_mode: str):
        self.hook_mode = hook_mode
        self.core = _library.load(hook_mode)
        self._pools = {}
        self._pools_lock = threading.Lock()
        self._allocator = None
        self._on_gpu = None
        self._warm = False
        if not os.environ.get("TMS_BACKEND") and self.core.loaded_backend() is None and _torch_is_rocm():
            self.core.use_backend("hip")  # one build serves both: the platform is chosen here
        if "expandable_segments:true" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").replace(" ", "").lower():
            raise RuntimeError("torch_memory_saver: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True is not "
                               "supported (PyTorch then maps memory itself instead of calling cudaMalloc)")

    def on_gpu(self) -> bool:
        """True on a GPU backend (cuda, hip) with a torch that sees the GPU: regions then use
        torch MemPools. False on the host backend (regions only set the thread's settings)."""
        if self._on_gpu is None:
            backend = self.core.backend()  # raises with the reason if no driver
            # Regions use torch pools only where torch drives the same GPUs as the
            # backend (a HIP backend under a CUDA torch is a test stub, not a GPU).
            gpu = backend != "host" and backend == _torch_gpu_platform()  # host: no torch import
            if gpu and self.hook_mode == "preload":
                _preload.check_interposed(self.core)
            self._on_gpu = gpu
        return self._on_gpu

    # Pools keep region allocations in segments of their own, so PyTorch's
    # cache never hands region memory to code outside the region or back.
    def _pool(self, tag, backup, kind, device):
        import torch

        key = (tag, backup, kind, device)
        with self._pools_lock:
            pool = self._pools.get(key)
            if pool is None:
                # PyTorch registers a pool with the device current at creation.
                with torch.cuda.device(device):
                    if tag is None:  # disable(): ordinary memory, kept apart from regions
                        pool = torch.cuda.MemPool()
                    elif self.hook_mode == "torch":
                        if self._allocator is None:
                            self._allocator = torch.cuda.memory.CUDAPluggableAllocator(
                                self.core.library_path(), "tms_torch_malloc", "tms_torch_free")
                        pool = torch.cuda.MemPool(self._allocator.allocator())
                    else:
                        pool = torch.cuda.MemPool()
                self._pools[key] = pool
        return pool

    @contextlib.contextmanager
    def _thread_region(self, active, tag, backup, kind):
        previous = self.core.get_region()
        self.core.set_region(active, tag, backup, kind)
        try:
            yield
        finally:
            self.core.set_region(*previous)

    @contextlib.contextmanager
    def _pools_on_all_devices(self, make_pool):
        import torch

        with contextlib.ExitStack() as stack:
            for device in range(torch.cuda.device_count()):
                stack.enter_context(torch.cuda.use_mem_pool(make_pool(device), device=device))
            yield

    @contextlib.contextmanager
    def region(self, tag, backup, kind):
        if backup and not self._warm:
            self.core.warm_backups()  # pins the staging once, not in the first pause
            self._warm = True
        if not self.on_gpu():
            with self._thread_region(True, tag, backup, kind):
                yield
            return
        with self._pools_on_all_devices(lambda device: self._pool(tag, backup, kind, device)):
            with self._thread_region(True, tag, backup, kind):
                yield

    @contextlib.contextmanager
    def disable(self):
        _, tag, backup, kind = self.core.get_region()
        if not self.on_gpu():
            with self._thread_region(False, tag, backup, kind):
                yield
            return
        # A default-allocator pool per device, kept for the process: dropping
        # a pool while a region's pool is in use trips PyTorch's assertions.
        with self._pools_on_all_devices(lambda device: self._pool(None, False, None, device)):
            with self._thread_region(False, tag, backup, kind):
                yield

    @contextlib.contextmanager
    def cuda_graph(self, graph, pool, stream, capture_error_mode, tag, backup, kind):
        import torch

        if not self.on_gpu():
            raise RuntimeError("torch_memory_saver: cuda_graph needs a GPU backend (cuda or hip) and a torch that sees the GPU")
        if pool is None and self.hook_mode == "torch":
            pool = self._pool(tag, backup, kind, torch.cuda.current_device()).id
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=capture_error_mode):
            with self._thread_region(True, tag, backup, kind):
                yield
