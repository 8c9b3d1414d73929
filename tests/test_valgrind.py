"""The C tests and the plain fuzz driver under valgrind memcheck (memory
safety): any invalid access, use of uninitialised memory or leak fails the test.

tests/c/valgrind.supp suppresses one thing only: the thread-local storage of the
copy workers, which live for the process (src/backup/transfer.c) and so are still
running at exit. Skipped where valgrind is not installed.
"""
import shutil

import pytest

import cbuild

SUPP = cbuild.C_TESTS / "valgrind.supp"
VALGRIND = ["valgrind", "-q", "--error-exitcode=99", "--leak-check=full", "--errors-for-leak-kinds=definite,possible",
            f"--suppressions={SUPP}"]

# test_core_host's scenarios but `threads` (ThreadSanitizer's, test_concurrency.py):
# valgrind runs threads one at a time, so there it is slow and proves little.
CORE_SCENARIOS = ["config", "driver", "basics", "backup_pinned", "backup_mmap", "discard", "state_errors",
                  "free_paused", "retain", "margin_and_oom", "sizes", "tags", "devices"]

CASES = {
    # id: (program of the plain CMake build, argv, environment)
    "core_host": ("test_core_host", CORE_SCENARIOS, {}),
    # The fault plans CMakeLists.txt runs: error paths are where leaks hide.
    "core_host_faults": ("test_core_host", [],
                         {"TMS_FAULT": "map:2,host_alloc:1,create:12,unmap:8,copy_to_host:11,copy_to_device:13"}),
    "core_host_faults_chunked": ("test_core_host", [], {"TMS_CHUNK_BYTES": "2MiB",
                                                        "TMS_FAULT": "create:3,map:5,unmap:3"}),
    "ledger": ("test_ledger", [], {}),
    "fuzz_chunked": ("fuzz_core", ["--runs", "4", "--seed", "1"], {"TMS_CHUNK_BYTES": "4MiB"}),
    "fuzz_faults": ("fuzz_core", ["--runs", "4", "--seed", "3"],
                    {"TMS_FAULT": "create:7,map:9,unmap:5,copy_to_host:4,copy_to_device:6,host_alloc:3"}),
}


@pytest.fixture(scope="module")
def valgrind():
    if not shutil.which("valgrind"):
        pytest.skip("valgrind not installed (Debian: apt-get install valgrind)")
    return VALGRIND


@pytest.mark.parametrize("case", list(CASES))
def test_clean_under_valgrind(valgrind, case):
    program, argv, env = CASES[case]
    binary = cbuild.cmake_build() / program   # the build ctest runs: nothing compiled again
    proc = cbuild.run([*valgrind, binary, *argv], timeout=300, env=cbuild.tool_env(**env))
    assert proc.returncode == 0, cbuild.detail(proc)
    assert " 0 failed" in proc.stdout, cbuild.detail(proc)
    assert "==" not in proc.stderr, cbuild.detail(proc)   # -q: valgrind prints only what it found
