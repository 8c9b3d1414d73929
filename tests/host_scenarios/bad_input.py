# Tests the native module too: its pause/resume, set_region, malloc/free and get_cpu_backup arguments.
"""Bad input gets a clear exception, never a crash or a wrong action
(tests/test_bad_input.py, and tests/test_security.py for input from outside): tags that
are str but not usable, get_cpu_backup of CPU tensors over host-backend memory, integers
out of range, the "LD_PRELOAD missing" message, a tag through the C ABI that is not
UTF-8, cudaMalloc(NULL), more tags than the table holds, a disk directory with a NUL."""
import ctypes
import os
import sys

import torch_memory_saver
from _prelude import MiB, core, expect, fill, raw_region, read, row, run_cases, start, tms


def nul_in_tag():
    """A tag with an embedded NUL is rejected, not cut at the NUL (pause("kv\\0junk") paused "kv")."""
    native = core()
    with raw_region("kv"):
        p = tms.malloc(MiB)
    expect(ValueError, tms.region("kv\0junk").__enter__, match="null")     # as region() does today
    for op in (tms.pause, tms.resume, native.pause, native.resume):
        try:
            op("kv\0junk")
        except ValueError:
            pass
        else:
            raise AssertionError(f"{op.__qualname__}('kv\\0junk') did not raise")
        assert row(p)["state"] == "active", f"{op.__qualname__}('kv\\0junk') acted on tag 'kv'"
    print("done")


def unusual_tags():
    """Unencodable tags raise and change nothing; non-ASCII and very long ones work."""
    native = core()
    # Lone surrogates cannot be encoded: UnicodeEncodeError (a ValueError), nothing changes.
    for enter in (lambda: tms.region("\ud800").__enter__(), lambda: tms.pause("\ud800"),
                  lambda: tms.resume("bad\udfff"), lambda: native.set_region(True, "\ud800", False, "mmap")):
        expect(ValueError, enter)
    assert native.get_region() == (False, "default", False, "mmap", False, None, None)
    # Any other str is a tag, and errors name it.
    tag = "kv-缓存-ключ"
    with tms.region(tag, enable_cpu_backup=True):
        p = tms.malloc(MiB + 1)
    assert row(p)["tag"] == tag
    d = fill(p, MiB + 1)
    tms.pause(tag)
    expect(torch_memory_saver.Error, tms.pause, tag, match=f"pause of tag '{tag}': already paused")
    tms.resume(tag)
    assert read(p, MiB + 1) == d
    # A very long tag: the message is cut to its buffer, still an exception.
    long_tag = "L" * 100_000
    with tms.region(long_tag):
        q = tms.malloc(1)
    tms.pause(long_tag)
    e = expect(torch_memory_saver.Error, tms.pause, long_tag, match="torch_memory_saver: pause of tag 'LLLL")
    assert len(str(e)) < 1000, len(str(e))
    tms.resume(long_tag)
    assert row(q)["tag"] == long_tag
    print("done")


def cpu_backup_of_views():
    """get_cpu_backup of slices, strided, stride-0 and offset views, empty, past the end, foreign."""
    import torch

    start()
    n = 3 * MiB + 10
    with tms.region("g", enable_cpu_backup=True):
        p = tms.malloc(n)
    with tms.region("plain"):
        q = tms.malloc(MiB)

    def over(ptr, nbytes, dtype=torch.uint8):        # a CPU tensor over allocation memory
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=dtype)

    w = over(p, n)
    w.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    f = over(p + 4, 768 * 1024 * 4, torch.int32)     # a 4-byte view at an offset (ints: random bits, no NaN)
    views = {
        "whole": w,
        "slice": w[12345:2 * MiB + 7],
        "tail": w[n - 5:],
        "int32 2-D transposed": f.view(768, 1024).t(),
        "int32 strided": f.view(768, 1024)[1::3, 5::7],
        "stride 0": f[100:101].expand(64),
        "int16 odd offset": over(p + 2 * MiB + 1, 1000 * 2, torch.int16)[3:],
    }
    expected = {k: v.clone() for k, v in views.items()}
    past_end = over(p + n - 4, 8)                      # within the rounding slack, past the size
    outside = torch.zeros(1024)
    assert tms.get_cpu_backup(w) is None               # active, not retained
    tms.pause("g")
    tms.pause("plain")
    assert tms.get_cpu_backup(over(q, 16)) is None     # paused without backup (q not touched: just a pointer)
    for k, v in views.items():
        got = tms.get_cpu_backup(v)
        assert got.device.type == "cpu" and got.shape == v.shape and got.dtype == v.dtype, k
        assert got.is_contiguous() and torch.equal(got, expected[k]), k
        alias = tms.get_cpu_backup(v, zero_copy=True)
        assert alias.stride() == v.stride() and torch.equal(alias, expected[k]), k
    e = tms.get_cpu_backup(w[10:10])
    assert e.numel() == 0 and e.device.type == "cpu"
    expect(ValueError, tms.get_cpu_backup, past_end, match="runs past allocation")
    assert tms.get_cpu_backup(outside) is None          # not ours: no backup (as upstream)
    expect(TypeError, tms.get_cpu_backup, w.numpy())
    tms.resume("g")
    assert torch.equal(w, expected["whole"])
    print("done")


def native_integers_out_of_range():
    """Sizes, addresses and backends out of range raise in the native module; nothing changes."""
    native = core()
    with raw_region("big"):
        e = expect(native.OutOfMemoryError, native.malloc, 2**63 - 1, match="address reserve of")
        assert "'big'" in str(e) and isinstance(e, MemoryError), e
        expect(ValueError, native.malloc, 2**64, match="nbytes 18446744073709551616 is larger than any device")
        expect(TypeError, native.malloc, "1")
        expect(TypeError, native.malloc, 1.0)
        p = tms.malloc(MiB)
    expect(ValueError, native.free, 0, match="not an allocation")
    expect(ValueError, native.free, -1, match="not a 64-bit address")     # no wrap-around to 2**64 - 1
    expect(ValueError, native.free, p - 2**64, match="not a 64-bit address")
    expect(ValueError, native.free, 2**64, match="not a 64-bit address")
    expect(TypeError, native.free, "x")
    expect(ValueError, native.free, p + 1, match="not an allocation")     # inside, not the start
    expect(TypeError, native.get_cpu_backup, "x", 1)
    expect(TypeError, native.set_region, True, 1, False, "mmap")
    expect(ValueError, native.use_backend, "tpu", match="unknown backend 'tpu'")
    expect(native.Error, native.use_backend, "cuda", match="backend 'host' is already in use")
    assert [r["ptr"] for r in tms.allocations()] == [p] and row(p)["state"] == "active"
    tms.memory_margin_bytes = 5
    try:                                               # after first use: straight to the core
        tms.memory_margin_bytes = 2**64
    except (OverflowError, ValueError):
        pass
    else:
        raise AssertionError("memory_margin_bytes = 2**64 accepted")
    assert tms.memory_margin_bytes == 5 and native.get_memory_margin_bytes() == 5
    print("done")


def backup_pointer_beyond_64_bits():
    """get_cpu_backup(p + 2**64) raises; it once returned p's backup (no overflow check)."""
    native = core()
    with raw_region("w", True, "mmap"):
        p = tms.malloc(MiB)
    fill(p, MiB)
    tms.pause("w")
    try:
        got = native.get_cpu_backup(p + 2**64, MiB)
    except (OverflowError, ValueError):
        print("done")
    else:
        raise AssertionError(f"get_cpu_backup(p + 2**64) returned {type(got).__name__}: p's backup")


def margin_beyond_size_t_before_first_use():
    """memory_margin_bytes = 2**64 before first use raises at the assignment, naming it."""
    try:
        tms.memory_margin_bytes = 2**64
    except (OverflowError, ValueError) as e:
        assert "memory_margin_bytes" in str(e), e
    else:
        raise AssertionError("memory_margin_bytes = 2**64 accepted before first use")
    tms.pause()                                        # first use works
    assert core().get_memory_margin_bytes() == 0
    print("done")


def ensure_hooked():
    """The check preload-mode regions run on a GPU: raises (TMS_RELOC_HOOKS=0) naming
    every way to fix it, else prints how the hooks came ("ld_preload", "relocation")."""
    from torch_memory_saver import _preload

    native = core()
    if os.environ.get("TMS_RELOC_HOOKS") == "0":
        e = expect(RuntimeError, _preload.ensure_hooked, native)
        msg = str(e)
        for part in ("hook_mode='preload' needs", native.library_path(), "in LD_PRELOAD",
                     "python -m torch_memory_saver run --", "configure_subprocess()", "TMS_RELOC_HOOKS=0",
                     "hook_mode = 'torch'"):
            assert part in msg, (part, msg)
        print("raised")
    else:
        print(_preload.ensure_hooked(native))


def disk_backup_dir_with_nul():
    """A disk backup directory with an embedded NUL is refused, its name shown escaped."""
    e = expect(torch_memory_saver.DiskBackupDirError, tms.set_disk_backup_dir, "/tmp/a\0b")
    assert str(e).startswith("torch_memory_saver: the disk backup directory '/tmp/a\\x00b'"), str(e)


def tag_not_utf8():
    """The C ABI refuses a tag that is not UTF-8 where it enters (TMS_STATUS_ARG), keeps
    the current tag, and every reader still works afterwards."""
    start()                                                                 # the C ABI is the running core's
    cdll = tms._impl._binary_wrapper.cdll
    with tms.region("ok"):
        core().malloc(MiB)
    assert cdll.tms_set_current_tag(b"\xff\xfe") == 6                       # TMS_STATUS_ARG
    assert b"not valid UTF-8" in cdll.tms_get_last_error()
    assert cdll.tms_get_current_tag() == b"default"                         # unchanged
    assert cdll.tms_set_current_tag(b"caf\xc3\xa9") == 0 and cdll.tms_get_current_tag() == "café".encode()
    for reader in (tms.stats, tms.allocations, tms.memory_summary, tms.paused_tags):
        reader()                                                            # every reader still works
    tms.pause("ok")
    tms.resume("ok")
    assert tms.stats()[0]["ok"]["pauses"] == 1


def cudamalloc_of_null():
    """The preload variant's cudaMalloc(NULL, n) in a region is cudaErrorInvalidValue,
    keeps nothing and says NULL."""
    tms.hook_mode = "preload"
    hook = ctypes.CDLL(core().library_path())                               # the preload variant's cudaMalloc
    with tms.region("r"):
        assert hook.cudaMalloc(None, ctypes.c_size_t(MiB)) == 1              # cudaErrorInvalidValue
    assert tms.allocations() == []
    assert "NULL" in core().last_hook_error()


def many_distinct_tags():
    """More distinct tags than the table holds at once (65,536), each with an allocation
    freed again; one tag keeps its allocation throughout."""
    native = core()
    with tms.region("kept"):
        native.malloc(MiB)
    for i in range(70000):
        native.set_region(True, f"t{i}", False, "mmap")
        if i % 5000 == 0:
            native.free(native.malloc(4096))
    native.set_region(False, "default", False, "mmap")
    assert [r["tag"] for r in tms.allocations()] == ["kept"]
    tms.pause("kept")
    tms.resume("kept")


def python_arguments():
    """Python arguments out of range are ValueErrors naming the argument."""
    with tms.region("r"):
        e = expect(ValueError, tms.malloc, 2 ** 70, match="torch_memory_saver: malloc: nbytes")
        assert str(2 ** 70) in str(e)
        expect(ValueError, tms.malloc, -5, match="torch_memory_saver: malloc: nbytes must be >= 0, got -5")
        expect(ValueError, lambda: tms.malloc(MiB, device=-7), match="device must be >= 0")
        expect(ValueError, core().malloc, MiB, -7, match="device must be >= 0")
        expect(ValueError, core().malloc, MiB, 99, match="device 99 does not exist")
    assert tms.allocations() == []


if __name__ == "__main__":
    run_cases(globals(), sys.argv)
