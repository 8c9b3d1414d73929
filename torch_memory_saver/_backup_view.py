"""Host backups as memoryviews. The native modules use the stable C API of 3.10,
which has no buffer protocol; a ctypes array over the backup's bytes exports them
instead and holds the native keeper, so the bytes live as long as any view of them
(slices and tensors made with torch.frombuffer included)."""
import ctypes


def view(address: int, nbytes: int, keeper, writable: bool = True) -> memoryview:
    array = (ctypes.c_ubyte * nbytes).from_address(address)
    array._tms_keeper = keeper
    out = memoryview(array).cast("B")  # ctypes says "<B": plain bytes index and compare as bytes
    # A view the caller only copies out of cannot change what the backup's fingerprints describe.
    return out if writable else out.toreadonly()
