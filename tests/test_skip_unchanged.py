"""skip_unchanged: a pause fingerprints each 2 MiB chunk of a kept backup's allocation and
copies only the chunks that changed since the backup was written; anything that could
change the bytes behind the library (a forked child, a zero-copy view, a failed
fingerprint) makes the next pause copy everything. Host backend: the fingerprints are
the CPU's computation of the GPU kernel's function."""
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess

import pytest

from conftest import REPO

MiB = 1 << 20
CHUNK = 2 * MiB


def _reference(data, chunk, nh, points):
    """The fingerprint as platform/fingerprint.h describes it, written anew in numpy."""
    np = pytest.importorskip("numpy")
    p61 = (1 << 61) - 1
    out = []
    for c in range(0, len(data), chunk):
        u = np.frombuffer(data[c:c + chunk], dtype=np.uint32).reshape(-1, 64, 256, 4)  # (group, step, thread, word)
        lanes = []
        for j in range(4):
            k = nh[j].reshape(64, 4)
            a = (u + k[None, :, None, :]).astype(np.uint64)  # the 32-bit sum wraps before the product
            block = (a[..., 0] * a[..., 1] + a[..., 2] * a[..., 3]).sum(axis=1, dtype=np.uint64)  # (group, thread)
            h, x = 0, int(points[j])
            for v in block.reshape(-1):
                h = (h * x + (int(v) >> 32)) % p61
                h = (h * x + (int(v) & 0xFFFFFFFF)) % p61
            lanes.append(h)
        out.append(tuple(lanes))
    return out


def test_the_fingerprint_is_the_documented_function(run_py, ok):
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(5)
    nh = rng.integers(0, 2 ** 32, size=(4, 256), dtype=np.uint32)
    points = rng.integers(1, (1 << 61) - 2, size=4, dtype=np.uint64)
    data = rng.integers(0, 256, size=2 * CHUNK, dtype=np.uint8).tobytes()
    key = nh.tobytes() + points.tobytes()
    (REPO / "build").mkdir(exist_ok=True)
    path = REPO / "build" / f"fp-{os.getpid()}.bin"
    path.write_bytes(key + data)
    try:
        out = ok(run_py(f"""
            blob = open({str(path)!r}, "rb").read()
            key, data = blob[:{len(key)}], blob[{len(key)}:]
            print(core.fingerprint_bytes(data, {CHUNK}, key))
            flipped = bytearray(data); flipped[{CHUNK} - 1] ^= 0x80
            print(core.fingerprint_bytes(bytes(flipped), {CHUNK}, key))
        """))
    finally:
        path.unlink()
    first, second = out.splitlines()
    want = _reference(data, CHUNK, nh, points)
    assert eval(first) == [tuple(int(x) for x in t) for t in want]
    flipped = eval(second)
    assert flipped[0] != eval(first)[0] and flipped[1] == eval(first)[1]  # the last byte of chunk 0 counts


def test_the_embedded_ptx_is_built_from_the_kernel_source():
    source = (REPO / "src" / "platform" / "fingerprint.cu").read_text()
    header = (REPO / "src" / "platform" / "fingerprint_ptx.h").read_text()
    digest = re.search(r'#define TMS_FINGERPRINT_CU_SHA256 "([0-9a-f]{64})"', header).group(1)
    assert digest == hashlib.sha256(source.encode()).hexdigest(), \
        "platform/fingerprint.cu changed since fingerprint_ptx.h was built: run `make ptx`"
    assert ".visible .entry tms_fingerprint(" in header and '".version 7.0\\n"' in header
    nvcc = shutil.which("nvcc")
    if not nvcc:
        pytest.skip("no nvcc here: the header's digest matches its source, the PTX is not rebuilt")
    spec = importlib.util.spec_from_file_location("gen_ptx", REPO / "src" / "platform" / "gen_ptx.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    version = gen.nvcc_version(nvcc)
    recorded = re.search(r'#define TMS_FINGERPRINT_NVCC "([\d.]+)"', header).group(1)
    if version != recorded:
        pytest.skip(f"nvcc {version} here, the header was built with {recorded}: its PTX may differ in form")
    assert gen.header(gen.build_ptx(nvcc=nvcc), source, version) == header, "fingerprint_ptx.h is stale: run `make ptx`"


def test_a_pause_copies_only_the_chunks_that_changed(run_py, ok):
    ok(run_py(f"""
        CHUNK = {CHUNK}
        tms.retain_cpu_backup = False          # skip_unchanged keeps the backup by itself
        with tms.region("w", enable_cpu_backup=True, skip_unchanged=True):
            p = core.malloc(8 * CHUNK)
        data = bytearray(fill(p, 8 * CHUNK))
        r = tms.pause("w")
        assert (r.copied_bytes, r.unchanged_bytes) == (8 * CHUNK, 0), r   # the first save records
        assert r.why_not_skipped is None and r.fingerprint_seconds > 0, r
        tms.resume("w")
        assert read(p, 8 * CHUNK) == bytes(data)
        assert row(p)["has_cpu_backup"], "skip_unchanged keeps the backup while active"
        assert tms.memory_report()[0]["host_retained"] == 8 * CHUNK, tms.memory_report()
        r = tms.pause("w")
        assert (r.copied_bytes, r.unchanged_bytes, r.skipped_bytes) == (0, 8 * CHUNK, 0), r
        tms.resume("w")
        assert read(p, 8 * CHUNK) == bytes(data)
        for chunk, at in ((0, 0), (3, CHUNK // 2 + 1), (7, CHUNK - 1)):   # first, middle, last byte of a chunk
            off = chunk * CHUNK + at
            data[off] ^= 0x5A
            ctypes.memmove(p + off, bytes([data[off]]), 1)
            r = tms.pause("w")
            assert (r.copied_bytes, r.unchanged_bytes) == (CHUNK, 7 * CHUNK), (chunk, r)
            tms.resume("w")
            assert read(p, 8 * CHUNK) == bytes(data), chunk
        core.free(p)
    """))


def test_scattered_changes_copy_each_changed_chunk_alone(run_py, ok):
    # Every other chunk changed: one copy per chunk, many more than the allocation's one range.
    ok(run_py(f"""
        CHUNK = {CHUNK}
        n = 64
        with tms.region("s", enable_cpu_backup=True, skip_unchanged=True):
            p = core.malloc(n * CHUNK)
        data = bytearray(fill(p, n * CHUNK))
        tms.pause("s"); tms.resume("s")
        for cycle in range(3):
            for c in range(cycle % 2, n, 2):
                off = c * CHUNK + 7 * c
                data[off] ^= 0xA5
                ctypes.memmove(p + off, bytes([data[off]]), 1)
            r = tms.pause("s")
            assert (r.copied_bytes, r.unchanged_bytes) == (n // 2 * CHUNK, n // 2 * CHUNK), (cycle, r)
            tms.resume("s")
            assert read(p, n * CHUNK) == bytes(data), cycle
        core.free(p)
        print("done")
    """))


def test_random_writes_over_hundreds_of_cycles_restore_every_byte(run_py, ok):
    ok(run_py(f"""
        import struct
        CHUNK = {CHUNK}
        rng = random.Random(11)
        sizes = [CHUNK, 3 * CHUNK - 4096, 4 * CHUNK]
        with tms.region("f", enable_cpu_backup=True, skip_unchanged=True):
            ptrs = [core.malloc(n) for n in sizes]
        want = [bytearray(fill(p, n)) for p, n in zip(ptrs, sizes)]
        copied = unchanged = 0
        for cycle in range(200):
            for _ in range(rng.randrange(4)):
                i = rng.randrange(len(ptrs))
                off = rng.randrange(sizes[i])
                n = min(rng.randrange(1, 300), sizes[i] - off)
                new = os.urandom(n)
                ctypes.memmove(ptrs[i] + off, new, n)
                want[i][off:off + n] = new
            # Sometimes a whole chunk is free in the caller's cache: skipped, back undefined.
            free = []
            if rng.random() < 0.3:
                i = rng.randrange(len(ptrs))
                c = rng.randrange(sizes[i] // CHUNK)
                free.append((i, c * CHUNK))
            spans = b"".join(struct.pack("=QQ", ptrs[i] + off, CHUNK) for i, off in free)
            r = core.pause("f", spans or None)
            dev = r["devices"][0]
            assert dev["copied_bytes"] + dev["unchanged_bytes"] + dev["skipped_bytes"] == sum(sizes), (cycle, dev)
            copied += dev["copied_bytes"]
            unchanged += dev["unchanged_bytes"]
            core.resume("f")
            for i, off in free:   # what comes back there is whatever the new memory holds
                want[i][off:off + CHUNK] = read(ptrs[i] + off, CHUNK)
            for i, p in enumerate(ptrs):
                assert read(p, sizes[i]) == bytes(want[i]), (cycle, i)
        assert unchanged > copied, (copied, unchanged)   # most chunks did not change
        print("done")
    """, timeout=120))


def test_a_forked_child_copies_everything(run_py, ok):
    out = ok(run_py(f"""
        CHUNK = {CHUNK}
        with tms.region("w", enable_cpu_backup=True, skip_unchanged=True):
            p = core.malloc(4 * CHUNK)
        data = fill(p, 4 * CHUNK)
        tms.pause("w"); tms.resume("w")
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            rep = tms.pause("w")   # the parent's fingerprints are another process's
            os.write(w, f"{{rep.copied_bytes}} {{rep.unchanged_bytes}}".encode())
            os._exit(0)
        os.close(w)
        child = os.read(r, 100).decode()
        os.waitpid(pid, 0)
        rep = tms.pause("w")
        tms.resume("w")
        assert read(p, 4 * CHUNK) == data
        print(child, rep.copied_bytes, rep.unchanged_bytes)
    """))
    assert out.split() == [str(4 * CHUNK), "0", "0", str(4 * CHUNK)], out


def test_a_zero_copy_view_makes_every_later_pause_copy_everything(run_py, ok):
    ok(run_py(f"""
        CHUNK = {CHUNK}
        with tms.region("w", enable_cpu_backup=True, skip_unchanged=True):
            p = core.malloc(4 * CHUNK)
        data = fill(p, 4 * CHUNK)
        tms.pause("w")
        core.get_cpu_backup(p, 4 * CHUNK, False, True)   # copied out at once (the package's way): still trusted
        tms.resume("w")
        assert tms.pause("w").unchanged_bytes == 4 * CHUNK
        view = core.get_cpu_backup(p, 4 * CHUNK)   # may be written: never trusted again
        view[5] ^= 1                               # the host copy no longer holds what was fingerprinted
        del view
        tms.resume("w")
        assert read(p, 4 * CHUNK)[6:] == data[6:]
        for _ in range(2):
            r = tms.pause("w")
            assert (r.copied_bytes, r.unchanged_bytes) == (4 * CHUNK, 0), r
            tms.resume("w")
        assert read(p, 4 * CHUNK)[6:] == data[6:]
    """))


def test_a_failed_fingerprint_copies_everything_and_says_why(run_py, ok):
    ok(run_py(f"""
        CHUNK = {CHUNK}
        with tms.region("w", enable_cpu_backup=True, skip_unchanged=True):
            p = core.malloc(2 * CHUNK)
        data = fill(p, 2 * CHUNK)
        tms.pause("w"); tms.resume("w")                      # fingerprints 1, 2 (after the copy), 3 (the check)
        r = tms.pause("w")                                   # fingerprint 4 fails
        assert (r.copied_bytes, r.unchanged_bytes) == (2 * CHUNK, 0), r
        assert "fingerprinting 2 chunks on device 0 failed" in r.why_not_skipped, r.why_not_skipped
        tms.resume("w")
        r = tms.pause("w")                                   # what was recorded was forgotten
        assert (r.copied_bytes, r.unchanged_bytes, r.why_not_skipped) == (2 * CHUNK, 0, None), r
        tms.resume("w")
        assert tms.pause("w").unchanged_bytes == 2 * CHUNK
        tms.resume("w")
        assert read(p, 2 * CHUNK) == data
    """, env={"TMS_FAULT": "fingerprint:4"}))


def test_the_setting_and_its_variable_and_a_region_that_says_otherwise(run_py, ok):
    ok(run_py(f"""
        CHUNK = {CHUNK}
        assert tms.skip_unchanged is True                   # TMS_SKIP_UNCHANGED=1
        with tms.region("a", enable_cpu_backup=True):
            a = core.malloc(CHUNK)
        with tms.region("b", enable_cpu_backup=True, skip_unchanged=False):
            b = core.malloc(CHUNK)
        fill(a, CHUNK); fill(b, CHUNK)
        for _ in range(2):
            r = tms.pause(); tms.resume()
        assert (r.copied_bytes, r.unchanged_bytes) == (CHUNK, CHUNK), r
        tms.skip_unchanged = False
        r = tms.pause(); tms.resume()
        assert (r.copied_bytes, r.unchanged_bytes) == (2 * CHUNK, 0), r
        for bad, exc in (("yes", TypeError),):
            try:
                with tms.region("c", enable_cpu_backup=True, skip_unchanged=bad):
                    pass
            except exc:
                pass
            else:
                raise AssertionError(bad)
        try:
            with tms.region("c", skip_unchanged=True):
                pass
        except ValueError as e:
            assert "enable_cpu_backup=True" in str(e), e
        else:
            raise AssertionError("skip_unchanged without a CPU backup")
    """, env={"TMS_SKIP_UNCHANGED": "1"}))
