"""Fuzzing the core: tests/c/fuzz_core.c drives random sequences of
alloc/free/pause/resume/region/retain/margin on the host backend and checks,
after every step, that backed-up bytes survive, states and status codes are the
documented ones, the statistics gauges equal sums over the table, and the
emulated device's free bytes equal its capacity minus the mapped bytes.

The plain build (the CMake build's, which ctest and valgrind run too) always runs:
random inputs from a fixed seed, a bounded number of them. The libFuzzer build (clang) runs for a bounded time
where clang's libFuzzer is installed, and is skipped, saying so, where not.
ctest runs the plain driver too (CMakeLists.txt: fuzz_core, fuzz_core_chunked,
fuzz_core_faults), under ASan+UBSan in test_c_suite.py.
"""
import os
import random
import shutil
import subprocess

import pytest

import cbuild

# Each of these must happen in a run of RUNS inputs: the model's expectations
# were checked on every path that matters, not only on the easy ones.
RUNS = 25
MUST_HAPPEN = [
    "alloc_ok", "alloc_oom", "alloc_margin_oom", "alloc_bad_device", "alloc_zero", "frees", "free_paused",
    "bad_free", "pause_ok", "pause_all", "pause_state", "pause_noop", "resume_ok", "resume_partial_oom",
    "resume_state", "resume_noop", "restored_bytes", "retained_copies", "backup_reads", "backup_range_errors",
]


@pytest.fixture(scope="module")
def fuzz_core():
    return cbuild.cmake_build() / "fuzz_core"   # the plain CMake build's, as ctest and valgrind run it


@pytest.mark.parametrize("chunk", [None, "5MiB"])
def test_random_sequences_keep_every_invariant(fuzz_core, tmp_path, chunk):
    env = cbuild.tool_env(TMS_FUZZ_ARTIFACT_DIR=tmp_path, **({"TMS_CHUNK_BYTES": chunk} if chunk else {}))
    proc = cbuild.run([fuzz_core, "--runs", RUNS, "--seed", 11], timeout=180, env=env)
    assert proc.returncode == 0, cbuild.detail(proc)
    assert f"{RUNS} passed, 0 failed" in proc.stdout, cbuild.detail(proc)
    ev = cbuild.events(proc.stdout)
    missing = [name for name in MUST_HAPPEN if not ev.get(name)]
    assert not missing, f"paths never reached in {RUNS} inputs: {missing}\n{proc.stdout}"
    if chunk:
        assert ev["alloc_multi_chunk"] > 0, proc.stdout
    assert ev["faults_seen"] == 0, proc.stdout
    assert not list(tmp_path.iterdir()), "a failing input was written"


# TMS_FAULT: the n-th call of each op fails once. Several plans, so faults land
# in allocation, pause (staging, pinning, copy, unmap), resume (create, map,
# restore copy) and free at different points of the sequences.
FAULT_PLANS = [
    "create:7,map:9,unmap:5,copy_to_host:4,copy_to_device:6,host_alloc:3",
    "create:23,map:31,unmap:17,copy_to_host:19,copy_to_device:11,host_alloc:6",
    "create:61,map:45,unmap:40,copy_to_host:52,copy_to_device:29,host_alloc:1",
]


def test_injected_faults_lose_nothing(fuzz_core, tmp_path):
    seen = 0
    for i, plan in enumerate(FAULT_PLANS):
        env = cbuild.tool_env(TMS_FAULT=plan, TMS_CHUNK_BYTES="4MiB" if i % 2 else "",
                              TMS_FUZZ_ARTIFACT_DIR=tmp_path)
        proc = cbuild.run([fuzz_core, "--runs", 12, "--seed", 20 + i], timeout=120, env=env)
        assert proc.returncode == 0, f"TMS_FAULT={plan}\n{cbuild.detail(proc)}"
        assert "TMS_FAULT set" in proc.stdout
        seen += cbuild.events(proc.stdout)["faults_seen"]
    # Each fired fault fails one call; all 18 fire within 12 inputs here (a
    # little slack: which calls come first varies with the address layout).
    assert seen >= 15, seen


def test_replays_input_files_and_directories(fuzz_core, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rnd = random.Random(5)
    for i in range(3):
        (corpus / f"input-{i}").write_bytes(bytes(rnd.randrange(256) for _ in range(300)))
    # alloc (op 0) of a class-3 size (one granule) on device 0, pause of every
    # tag (op 5, selector 12), resume of every tag (op 8, selector 12), free.
    one = tmp_path / "one"
    one.write_bytes(bytes([0, 0, 3, 0, 0, 5, 12, 8, 12, 3, 0]))
    proc = cbuild.run([fuzz_core, one, corpus], timeout=60)
    assert proc.returncode == 0, cbuild.detail(proc)
    ev = cbuild.events(proc.stdout)
    assert ev["inputs"] == 4 and "4 passed, 0 failed" in proc.stdout, proc.stdout
    proc = cbuild.run([fuzz_core, one], timeout=60)
    ev = cbuild.events(proc.stdout)
    assert (ev["alloc_ok"], ev["pause_ok"], ev["pause_all"], ev["resume_ok"], ev["frees"]) == (1, 1, 1, 1, 1), \
        proc.stdout
    assert ev["restored_bytes"] == 2 << 20, proc.stdout   # the default region backs up (mmap)
    proc = cbuild.run([fuzz_core, tmp_path / "missing"], timeout=60)
    assert proc.returncode != 0 and "missing" in proc.stderr


# ---- libFuzzer (coverage-guided; clang) -----------------------------------------


def _libfuzzer_cc(tmp_path):
    """clang if it can build and run a libFuzzer target here, else skip saying why."""
    clang = os.environ.get("TMS_FUZZ_CC") or shutil.which("clang")
    if not clang:
        pytest.skip("clang not installed: the libFuzzer build of tests/c/fuzz_core.c needs it "
                    "(apt-get install clang; the plain driver ran above)")
    probe = tmp_path / "probe.c"
    probe.write_text("#include <stddef.h>\n#include <stdint.h>\n"
                     "int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }\n")
    build = subprocess.run([clang, "-fsanitize=fuzzer,address,undefined", str(probe), "-o", str(tmp_path / "probe")],
                           capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"{clang} cannot link libFuzzer (-fsanitize=fuzzer; Debian: libclang-rt-dev): "
                    f"{build.stderr.strip()[:300]}")
    run = subprocess.run([str(tmp_path / "probe"), "-runs=1"], capture_output=True, text=True, timeout=60)
    if run.returncode != 0:
        pytest.skip(f"a libFuzzer probe does not run here: {run.stderr.strip()[-300:]}")
    return [clang]


def _lsan_usable(tmp_path, cc):
    probe = tmp_path / "leak.c"
    probe.write_text("#include <stdlib.h>\nint main(void) { free(malloc(1)); return 0; }\n")
    subprocess.run([*cc, "-fsanitize=address", str(probe), "-o", str(tmp_path / "leak")], check=True)
    return subprocess.run([str(tmp_path / "leak")], env=cbuild.tool_env(ASAN_OPTIONS="detect_leaks=1"),
                          capture_output=True).returncode == 0


def test_libfuzzer_bounded_run(tmp_path):
    cc = _libfuzzer_cc(tmp_path)
    binary = cbuild.build("fuzz_core", cc=cc, defines=["TMS_FUZZ_LIBFUZZER"],
                          flags=["-O1", "-fsanitize=fuzzer,address,undefined", "-fno-sanitize-recover=all",
                                 "-fno-omit-frame-pointer"])
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    rnd = random.Random(3)   # seed inputs as long as the plain driver's, so every op runs from the start
    for i in range(8):
        (corpus / f"seed-{i}").write_bytes(bytes(rnd.randrange(256) for _ in range(rnd.randrange(64, 512))))
    env = cbuild.tool_env(
        ASAN_OPTIONS=f"detect_leaks={int(_lsan_usable(tmp_path, cc))}:abort_on_error=0",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1")
    proc = cbuild.run([binary, "-max_total_time=6", "-seed=1", "-max_len=512", "-timeout=30", "-rss_limit_mb=3072",
                       f"-artifact_prefix={tmp_path}/", corpus], timeout=120, env=env)
    assert proc.returncode == 0, cbuild.detail(proc)
    assert "Done " in proc.stderr and "runs in" in proc.stderr, proc.stderr[-2000:]
