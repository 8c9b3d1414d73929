"""Pauseable memory that other processes can map: explicit handles (share /
open_shared), and PyTorch's own CUDA tensor sharing (torch.multiprocessing)
through the runtime's IPC calls, which the native hooks serve for our memory."""
import dataclasses
import weakref
from typing import Any, Optional, Tuple

from . import _library

MAGIC = b"TMSSHR01"
_HANDLE_BYTES = 64


@dataclasses.dataclass(frozen=True)
class SharedTensor:
    """What share() returns: small and picklable. Another process of the same user
    opens it with open_shared(); the sender's memory stays where it is."""

    handle: bytes          # 64 bytes naming the allocation, its process and a random token
    offset: int            # bytes from the allocation's start to the tensor's first element
    dtype: object          # a torch.dtype
    shape: Tuple[int, ...]
    stride: Tuple[int, ...]
    device: Optional[int]  # the sender's device index (None: the host backend's memory)


def span_bytes(tensor) -> int:
    """Bytes from the first to one past the last element a strided view reaches."""
    if tensor.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride())) + 1) * tensor.element_size()


def share(core, tensor) -> SharedTensor:
    if not _library.is_tensor(tensor):
        raise TypeError(f"torch_memory_saver: share expects a torch.Tensor, not {type(tensor).__name__}")
    ptr = tensor.data_ptr()
    handle, base, size = core.share(ptr)
    if ptr - base + span_bytes(tensor) > size:
        raise ValueError(f"torch_memory_saver: share: the tensor at {ptr:#x} ({span_bytes(tensor)} bytes) runs past "
                         f"its allocation {base:#x} ({size} bytes)")
    device = tensor.device.index if tensor.device.type != "cpu" else None
    return SharedTensor(handle, ptr - base, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), device)


class _Mapping:
    """Another process's allocation mapped here; closed when the last tensor on it goes."""

    def __init__(self, core, ptr: int, size: int):
        self.ptr, self.size = ptr, size
        self._closer = weakref.finalize(self, core.close_shared, ptr)

    @property
    def __cuda_array_interface__(self):
        return {"shape": (self.size,), "typestr": "|u1", "data": (self.ptr, False), "version": 3, "strides": None,
                "stream": None}


def _host_bytes(mapping):
    """A CPU tensor over the mapping (the host backend's "device" memory is host memory)."""
    import ctypes

    import torch

    class _Buffer(ctypes.c_char * mapping.size):
        pass

    buf = _Buffer.from_address(mapping.ptr)
    buf.mapping = mapping  # the buffer keeps the mapping open; torch.frombuffer keeps the buffer
    return torch.frombuffer(buf, dtype=torch.uint8)


def open_shared(core, shared: SharedTensor, device: Optional[int], on_gpu: bool):
    if not isinstance(shared, SharedTensor):
        raise TypeError(f"torch_memory_saver: open_shared expects what share() returned, not "
                        f"{type(shared).__name__}")
    torch = _library.torch_module("open_shared")
    if device is not None and (not isinstance(device, int) or isinstance(device, bool) or device < 0):
        raise ValueError(f"torch_memory_saver: open_shared: device must be a device index, not {device!r}")
    if on_gpu and device is None:
        device = torch.cuda.current_device()
    ptr, size = core.open_shared(shared.handle, -1 if device is None else device)
    mapping = _Mapping(core, ptr, size)
    if on_gpu:
        raw = torch.as_tensor(mapping, device=torch.device("cuda", device))
    else:
        raw = _host_bytes(mapping)
    item = torch.empty((), dtype=shared.dtype).element_size()
    if shared.offset % item:
        raise ValueError(f"torch_memory_saver: open_shared: offset {shared.offset} is not a multiple of "
                         f"{shared.dtype}'s {item} bytes")
    return raw.view(shared.dtype).as_strided(shared.shape, shared.stride, shared.offset // item)


# ---- torch.multiprocessing ---------------------------------------------------------

def _receive_handle(data: bytes) -> bytes:
    """Unpickled in the receiving process: its runtime IPC calls must reach this
    library before PyTorch opens the handle, so they are hooked here first."""
    from . import torch_memory_saver as tms

    tms._ensure_initialized().core.install_ipc_hooks()
    return data


class _HandleBytes(bytes):
    """A storage handle naming our memory: pickled so that the receiver imports this
    package (and a receiver without it fails naming it) before opening it."""

    def __reduce__(self):
        return (_receive_handle, (bytes(self),))


def is_our_handle(data) -> bool:
    """PyTorch's handle string: 2 bytes (version, type 'c') then the runtime's 64, or the 64 alone."""
    if not isinstance(data, bytes):
        return False
    return data[2:10] == MAGIC if len(data) == _HANDLE_BYTES + 2 else data[:8] == MAGIC


# The native module whose IPC hooks are being installed beside the caller
# (install_ipc_hooks_later), until a share has waited for them.
_ipc_installing: Any = None


def install_ipc_hooks_later(core):
    """Starts the walk that installs the IPC hooks on a thread of its own; the
    first share through PyTorch's reductions waits for it."""
    global _ipc_installing
    core.install_ipc_hooks_later()
    _ipc_installing = core


def _wait_for_ipc_hooks():
    global _ipc_installing
    core = _ipc_installing
    if core is None:
        return
    try:
        core.install_ipc_hooks()
    except NotImplementedError:
        pass  # TMS_RELOC_HOOKS=0: PyTorch's own IPC call answers, as without the library
    _ipc_installing = None


def mark_storage_sharing():
    """Wraps UntypedStorage._share_cuda_ (what torch.multiprocessing's reductions
    call) so handles of our memory travel as _HandleBytes. Once per process."""
    import torch

    cls = torch.UntypedStorage
    original = getattr(cls, "_share_cuda_", None)
    if original is None or getattr(original, "_tms_marks_handles", False):
        return

    def _share_cuda_(self, *args, **kwargs):
        _wait_for_ipc_hooks()
        out = original(self, *args, **kwargs)
        if len(out) > 1 and is_our_handle(out[1]):
            out = (out[0], _HandleBytes(out[1]), *out[2:])
        return out

    _share_cuda_._tms_marks_handles = True
    _share_cuda_.__doc__ = original.__doc__
    cls._share_cuda_ = _share_cuda_
