"""Which device bytes hold nothing anyone will read: the free blocks of PyTorch's caching allocator.

A backed-up pause copies only the rest (the core intersects these ranges with
its allocations, so memory PyTorch did not hand out is copied whole). Blocks
freed but still pending on a stream count as live.
"""
import sys
from array import array


def _snapshot(torch):
    """The caching allocator's segments, or None where it cannot say."""
    backend = getattr(torch._C, "_cuda_getAllocatorBackend", None)
    if backend is not None and backend() != "native":
        return None  # cudaMallocAsync keeps no blocks of its own
    try:
        return torch.cuda.memory_snapshot()
    except Exception:  # the whole allocation is copied instead: never worse than without the hint
        return None


def free_spans():
    """bytes of native uint64 (start, length) pairs, sorted and merged: the
    blocks PyTorch's allocator holds free, on every device; None if torch's
    CUDA is not in use or its allocator cannot say."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    segments = _snapshot(torch)
    if segments is None:
        return None
    spans = []
    for seg in segments:
        at = seg["address"]
        for block in seg["blocks"]:
            size = block["size"]
            if block["state"] == "inactive":
                start = block.get("address", at)
                if spans and spans[-1][0] + spans[-1][1] == start:
                    spans[-1][1] += size
                else:
                    spans.append([start, size])
            at += size
    spans.sort()
    flat = array("Q")
    for start, size in spans:
        flat.append(start)
        flat.append(size)
    return flat.tobytes()
