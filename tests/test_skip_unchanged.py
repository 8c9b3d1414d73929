"""skip_unchanged: a pause fingerprints each 2 MiB chunk of a kept backup's allocation and
copies only the chunks that changed since the backup was written; anything that could
change the bytes behind the library (a forked child, a zero-copy view, a failed
fingerprint) makes the next pause copy everything. Host backend
(tests/host_scenarios/skip_unchanged.py): the fingerprints are the CPU's computation of
the GPU kernel's function."""
import hashlib
import importlib.util
import re
import shutil

import pytest

from conftest import REPO
from host_scenarios import skip_unchanged
from host_scenarios.skip_unchanged import CHUNK


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


def test_the_fingerprint_is_the_documented_function(in_child):
    np = pytest.importorskip("numpy")
    rng = np.random.default_rng(5)
    nh = rng.integers(0, 2 ** 32, size=(4, 256), dtype=np.uint32)
    points = rng.integers(1, (1 << 61) - 2, size=4, dtype=np.uint64)
    data = rng.integers(0, 256, size=2 * CHUNK, dtype=np.uint8).tobytes()
    first, flipped = in_child(skip_unchanged.fingerprints, data, nh.tobytes() + points.tobytes())
    want = _reference(data, CHUNK, nh, points)
    assert first == [tuple(int(x) for x in t) for t in want]
    assert flipped[0] != first[0] and flipped[1] == first[1]  # the last byte of chunk 0 counts


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


def test_a_pause_copies_only_the_chunks_that_changed(in_child):
    in_child(skip_unchanged.copies_only_changed_chunks)


def test_scattered_changes_copy_each_changed_chunk_alone(in_child):
    in_child(skip_unchanged.scattered_changes)


def test_random_writes_over_hundreds_of_cycles_restore_every_byte(in_child):
    copied, unchanged = in_child(skip_unchanged.random_writes, 200, timeout=120)
    assert unchanged > copied, (copied, unchanged)   # most chunks did not change


def test_a_forked_child_copies_everything(in_child):
    out = in_child(skip_unchanged.forked_child)
    assert out == [str(4 * CHUNK), "0", "0", str(4 * CHUNK)], out


def test_a_zero_copy_view_makes_every_later_pause_copy_everything(in_child):
    in_child(skip_unchanged.zero_copy_view)


def test_a_failed_fingerprint_copies_everything_and_says_why(in_child):
    in_child(skip_unchanged.failed_fingerprint, env={"TMS_FAULT": "fingerprint:4"})


def test_the_setting_and_its_variable_and_a_region_that_says_otherwise(in_child):
    in_child(skip_unchanged.the_setting, env={"TMS_SKIP_UNCHANGED": "1"})
