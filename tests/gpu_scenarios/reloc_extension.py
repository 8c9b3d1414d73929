"""Relocation hooks: a CUDA library (TMS_TEST_EXTENSION, tests/c/cuda_ext.c)
loaded after the hooks were installed without LD_PRELOAD. Its cudaMalloc inside a
region is the library's: recorded under the tag, released by pause (every byte), its
bytes restored by resume with backup at the same address, freed by its cudaFree.
Outside a region its allocations are CUDA's own and free normally."""
import ctypes
import os
import sys

from _common import (MiB, begin, check, check_released, check_taken, free_bytes, mapped_bytes, owner, say)


def main(hook_mode):
    tms = begin("reloc_extension", hook_mode)  # the hooks are installed here
    free_bytes()
    ext = ctypes.CDLL(os.environ["TMS_TEST_EXTENSION"])  # loaded afterwards, through the patched dlopen
    ext.ext_alloc.restype = ctypes.c_void_p
    ext.ext_alloc.argtypes = [ctypes.c_size_t]
    ext.ext_free.argtypes = [ctypes.c_void_p]
    ext.ext_copy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    patched = tms._core.relocation_report()[0].splitlines()
    check(os.environ["TMS_TEST_EXTENSION"] in patched, f"the extension was not patched: {patched}")

    plain = ext.ext_alloc(8 * MiB)
    check(plain and owner(plain) is None, "an allocation outside a region was taken by the library")
    check(ext.ext_free(plain) == 0, "cudaFree of CUDA's own allocation failed")

    n = 96 * MiB + 12345
    base = mapped_bytes()
    with tms.region(tag="ext", enable_cpu_backup=True):
        ptr = ext.ext_alloc(n)
    row = owner(ptr)
    check(row is not None and row["tag"] == "ext", f"the extension's allocation in a region is not the library's: {row}")
    check(mapped_bytes() - base == row["reserved"] >= n,
          f"the extension's allocation of {n} bytes: the library maps {mapped_bytes() - base} more bytes, "
          f"its row reserves {row['reserved']}")
    data = os.urandom(n)
    check(ext.ext_copy(ptr, data, n, 1) == 0, "cudaMemcpy to the allocation failed")
    check_released(tms.pause("ext"), row["reserved"], "pause('ext')")
    check_taken(tms.resume("ext"), row["reserved"], "resume('ext')")
    back = ctypes.create_string_buffer(n)
    check(ext.ext_copy(back, ptr, n, 0) == 0, "cudaMemcpy from the allocation failed")
    check(back.raw == data, "the extension's bytes differ after pause/resume")
    check(ext.ext_free(ptr) == 0 and owner(ptr) is None, "the extension's cudaFree did not free the allocation")
    say("the extension's cudaMalloc in a region was served, paused, restored and freed by the library")
    print("OK")


if __name__ == "__main__":
    main(sys.argv[1])
