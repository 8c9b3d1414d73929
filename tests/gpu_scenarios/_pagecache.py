"""How much of a file sits in the page cache: shared by the disk backup scenario and
tests/test_disk_backup.py (which copies this function's source into its children)."""
import ctypes
import os


def cached_bytes(path):
    """Bytes of the file in the page cache (mincore over a mapping that reads nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    n = os.path.getsize(path)
    fd = os.open(path, os.O_RDONLY)
    addr = libc.mmap(None, n, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
    os.close(fd)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
    vec = ctypes.create_string_buffer((n + 4095) // 4096)
    failed = libc.mincore(addr, n, vec) != 0
    libc.munmap(addr, n)
    if failed:
        raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
    return sum(b & 1 for b in vec.raw) * 4096
