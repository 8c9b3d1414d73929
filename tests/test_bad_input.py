"""Bad input (issue 5) that test_api.py and test_host_backend.py leave out: every
case gets a clear exception, never a crash, an exit or a wrong action.

Already covered there: unknown hook_mode and changing it after first use;
cpu_backup_backend without backup or unknown; non-str and empty tags (region,
pause, resume, cuda_graph, native); pause/resume of an unknown tag (a no-op);
double pause/resume (RuntimeError naming the tag, both variants); negative and
non-int memory_margin_bytes; malformed TMS_INIT_*/TMS_RETAIN_*/TMS_CHUNK_BYTES/
TMS_BACKEND/TMS_FAULT/TMS_HOST_* values; native get_cpu_backup ranges.

Here: tags that are str but not usable (embedded NUL, unencodable, non-ASCII,
very long); get_cpu_backup of CPU tensors over host-backend memory (not in a
region, slices, non-contiguous and stride-0 views, past the end, empty);
malformed TMS_BACKUP_THREADS / TMS_BACKUP_BLOCK_BYTES and more TMS_FAULT /
TMS_HOST_* forms; integers out of range for the native API and for
memory_margin_bytes; the preload-mode "LD_PRELOAD missing" message (the check
the GPU path runs, called directly: without a GPU it is never reached).
"""
import pytest

from conftest import check_ok

# ---- tags -----------------------------------------------------------------------


def test_tag_with_embedded_nul_is_rejected_not_truncated(run_py):
    # Was a bug (fixed in 79500e7): pause/resume cut the tag at the NUL, so
    # pause("kv\0junk") paused tag "kv".
    out = check_ok(run_py("""
        with raw_region("kv"):
            p = core.malloc(MiB)
        expect(ValueError, tms.region("kv\\0junk").__enter__, match="null")     # as region() does today
        for op in (tms.pause, tms.resume, core.pause, core.resume):
            try:
                op("kv\\0junk")
            except ValueError:
                pass
            else:
                raise AssertionError(f"{op.__qualname__}('kv\\\\0junk') did not raise")
            assert row(p)["state"] == "active", f"{op.__qualname__}('kv\\\\0junk') acted on tag 'kv'"
        print("done")
    """))
    assert out == "done\n"


def test_unencodable_non_ascii_and_long_tags(run_py):
    out = check_ok(run_py("""
        # Lone surrogates cannot be encoded: UnicodeEncodeError (a ValueError), nothing changes.
        for enter in (lambda: tms.region("\\ud800").__enter__(), lambda: tms.pause("\\ud800"),
                      lambda: tms.resume("bad\\udfff"), lambda: core.set_region(True, "\\ud800", False, "mmap")):
            expect(ValueError, enter)
        assert core.get_region() == (False, "default", False, "mmap", False)
        # Any other str is a tag, and errors name it.
        tag = "kv-缓存-ключ"
        with tms.region(tag, enable_cpu_backup=True):
            p = core.malloc(MiB + 1)
        assert row(p)["tag"] == tag
        d = fill(p, MiB + 1)
        tms.pause(tag)
        expect(core.Error, tms.pause, tag, match=f"pause of tag '{tag}': already paused")
        tms.resume(tag)
        assert read(p, MiB + 1) == d
        # A very long tag: the message is cut to its buffer, still an exception.
        long_tag = "L" * 100_000
        with tms.region(long_tag):
            q = core.malloc(1)
        tms.pause(long_tag)
        e = expect(core.Error, tms.pause, long_tag, match="torch_memory_saver: pause of tag 'LLLL")
        assert len(str(e)) < 1000, len(str(e))
        tms.resume(long_tag)
        assert row(q)["tag"] == long_tag
        print("done")
    """))
    assert out == "done\n"


# ---- get_cpu_backup of tensors (CPU tensors over host-backend allocations) ------------


def test_get_cpu_backup_of_slices_views_and_foreign_tensors(run_py):
    pytest.importorskip("torch")
    out = check_ok(run_py("""
        import torch
        n = 3 * MiB + 10
        with tms.region("g", enable_cpu_backup=True):
            p = core.malloc(n)
        with tms.region("plain"):
            q = core.malloc(MiB)
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
    """))
    assert out == "done\n"


# ---- environment ----------------------------------------------------------------

# (variable, value, what the message must hold besides the variable's name)
_MALFORMED = [
    ("TMS_BACKUP_THREADS", "0", "'0'"),
    ("TMS_BACKUP_THREADS", "33", "'33'"),
    ("TMS_BACKUP_THREADS", "two", "'two'"),
    ("TMS_BACKUP_THREADS", "4x", "'4x'"),
    ("TMS_BACKUP_BLOCK_BYTES", "1000", "'1000'"),          # below 64 KiB
    ("TMS_BACKUP_BLOCK_BYTES", "1GiB", "'1GiB'"),          # above 256 MiB
    ("TMS_BACKUP_BLOCK_BYTES", "65537", "'65537'"),        # not whole pages
    ("TMS_BACKUP_BLOCK_BYTES", "8 MiB", "'8 MiB'"),
    ("TMS_INIT_ENABLE", " 1", "' 1'"),
    ("TMS_HOST_DEVICE_BYTES", "0", "'0'"),
    ("TMS_HOST_DEVICES", "0", "'0'"),
    ("TMS_HOST_DEVICES", "8MiB", "not a device count"),    # a count, not a size
    ("TMS_HOST_DEVICES", "2.0", "'2.0'"),
    ("TMS_HOST_NUMA_NODE", "-1", "not a NUMA node"),
    ("TMS_HOST_NUMA_NODE", "1024", "'1024'"),
    ("TMS_HOST_NUMA_NODE", "node0", "'node0'"),
    ("TMS_FAULT", "create", "'create'"),
    ("TMS_FAULT", "create:2x", "'create:2x'"),
    ("TMS_FAULT", "create:-1", "'create:-1'"),
    ("TMS_FAULT", "map:1,unmap", "'map:1,unmap'"),
    ("TMS_FAULT", "create:1," * 40, "too long"),
]


@pytest.mark.parametrize("var,value,fragment", _MALFORMED,
                         ids=[f"{v}={x[:12]!r}" for v, x, _ in _MALFORMED])
def test_more_malformed_env_values_raise_at_import_naming_variable_and_value(run_py, var, value, fragment):
    out = check_ok(run_py(f"""
        for attempt in range(2):                           # not cached as success
            try:
                import torch_memory_saver
            except ValueError as e:
                assert {var!r} in str(e) and {fragment!r} in str(e), str(e)
            else:
                raise AssertionError("import succeeded")
        print("done")
    """, prelude=False, env={var: value}))
    assert out == "done\n"


# ---- integers out of range ------------------------------------------------------


def test_native_integer_arguments_out_of_range(run_py):
    out = check_ok(run_py("""
        with raw_region("big"):
            e = expect(core.OutOfMemoryError, core.malloc, 2**63 - 1, match="address reserve of")
            assert "'big'" in str(e) and isinstance(e, MemoryError), e
            expect(ValueError, core.malloc, 2**64, match="nbytes 18446744073709551616 is larger than any device")
            expect(TypeError, core.malloc, "1")
            expect(TypeError, core.malloc, 1.0)
            p = core.malloc(MiB)
        expect(ValueError, core.free, 0, match="not an allocation")
        expect(ValueError, core.free, -1, match="not a 64-bit address")     # no wrap-around to 2**64 - 1
        expect(ValueError, core.free, p - 2**64, match="not a 64-bit address")
        expect(ValueError, core.free, 2**64, match="not a 64-bit address")
        expect(TypeError, core.free, "x")
        expect(ValueError, core.free, p + 1, match="not an allocation")     # inside, not the start
        expect(TypeError, core.get_cpu_backup, "x", 1)
        expect(TypeError, core.set_region, True, 1, False, "mmap")
        expect(ValueError, core.use_backend, "tpu", match="unknown backend 'tpu'")
        expect(core.Error, core.use_backend, "cuda", match="backend 'host' is already in use")
        assert [r["ptr"] for r in core.allocations()] == [p] and row(p)["state"] == "active"
        tms.memory_margin_bytes = 5
        try:                                               # after first use: straight to the core
            tms.memory_margin_bytes = 2**64
        except (OverflowError, ValueError):
            pass
        else:
            raise AssertionError("memory_margin_bytes = 2**64 accepted")
        assert tms.memory_margin_bytes == 5 and core.get_memory_margin_bytes() == 5
        print("done")
    """))
    assert out == "done\n"


def test_get_cpu_backup_pointer_beyond_64_bits_raises(run_py):
    # Was a bug (fixed in 79500e7): the pointer was parsed without an overflow
    # check, so p + 2**64 returned p's backup.
    out = check_ok(run_py("""
        with raw_region("w", True, "mmap"):
            p = core.malloc(MiB)
        fill(p, MiB)
        tms.pause("w")
        try:
            got = core.get_cpu_backup(p + 2**64, MiB)
        except (OverflowError, ValueError):
            print("done")
        else:
            raise AssertionError(f"get_cpu_backup(p + 2**64) returned {type(got).__name__}: p's backup")
    """))
    assert out == "done\n"


def test_margin_beyond_size_t_before_first_use_raises_at_assignment(run_py):
    # Was a bug (fixed in 79500e7): accepted before first use, then every call
    # raised OverflowError (not naming the setting) and the core never started.
    out = check_ok(run_py("""
        try:
            tms.memory_margin_bytes = 2**64
        except (OverflowError, ValueError) as e:
            assert "memory_margin_bytes" in str(e), e
        else:
            raise AssertionError("memory_margin_bytes = 2**64 accepted before first use")
        tms.pause()                                        # first use works
        assert tms._core.get_memory_margin_bytes() == 0
        print("done")
    """, load_core=False))
    assert out == "done\n"


# ---- preload mode without LD_PRELOAD -------------------------------------------------


def test_missing_ld_preload_message_says_how_to_fix(run_py, built_libs):
    # The check regions run in preload mode on a GPU backend (entrypoint.py
    # _Impl.on_gpu); here it is called directly: with the library on LD_PRELOAD,
    # without it (relocation hooks), and without it with TMS_RELOC_HOOKS=0.
    code = """
        from torch_memory_saver import _preload
        if os.environ.get("TMS_RELOC_HOOKS") == "0":
            e = expect(RuntimeError, _preload.ensure_hooked, core)
            msg = str(e)
            for part in ("hook_mode='preload' needs", core.library_path(), "in LD_PRELOAD",
                         "python -m torch_memory_saver run --", "configure_subprocess()", "TMS_RELOC_HOOKS=0",
                         "hook_mode = 'torch'"):
                assert part in msg, (part, msg)
            print("raised")
        else:
            print(_preload.ensure_hooked(core))
    """
    assert check_ok(run_py(code, env={"TMS_RELOC_HOOKS": "0"})) == "raised\n"
    assert check_ok(run_py(code)) == "relocation\n"
    assert check_ok(run_py(code, env={"LD_PRELOAD": built_libs["preload"]})) == "ld_preload\n"
