"""The C build and C tests: configures CMakeLists.txt in a temporary directory, builds it,
runs ctest, and once more under AddressSanitizer + UndefinedBehaviorSanitizer."""
import os
import shlex
import subprocess
import sys

import pytest

import cbuild

JOBS = "2"


def _env():
    """The tests set what they need: outer TMS_* settings or a preload would change them."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TMS_")}
    env.pop("LD_PRELOAD", None)
    return env


def _run(cmd, cwd=None, env=None, timeout=300):
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env or _env(), capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"{shlex.join(map(str, cmd))} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def _ctest(build_dir, env=None, exclude=None):
    out = _run(["ctest", "--output-on-failure", "-j", JOBS, "--timeout", "120", *(["-E", exclude] if exclude else [])],
               cwd=build_dir, env=env)
    assert "100% tests passed" in out, out
    return out


@pytest.fixture(scope="session")
def cmake_build():
    return cbuild.cmake_build()  # the plain build valgrind and the fuzz driver run too


def test_ctest(cmake_build):
    # The fuzz driver's timed runs add time, not paths: test_fuzz.py runs the same
    # driver from fixed seeds, and the sanitizer ctest below runs these too.
    out = _ctest(cmake_build, exclude="^fuzz_core|^cumem_walk_short$")
    for name in ("core_host", "ledger", "os", "cumem_host", "cumem_walk_1", "cumem_walk_3", "core_host_chunk_4MiB", "core_host_chunk_5MiB", "core_host_faults",
                 "core_host_faults_chunked",
                 # the hip backend against tests/c/hip_stub.c
                 "core_hip_stub", "core_hip_stub_rocm7", "core_hip_stub_no_register", "core_hip_stub_chunk_4MiB",
                 "core_hip_stub_chunk_5MiB", "hip_stub_rocm6", "hip_stub_rocm7",
                 # relocation passes racing dlclose on another thread
                 "reloc_race",
                 # the CUDA ABI mirror (src/platform/cuda_abi.h) against the real cuda.h: our machines
                 # have the headers, so a configure that drops it is a failure, not a skip
                 "cuda_abi"):
        assert f" {name} " in out, out


def test_variants_import(cmake_build):
    """Both variants come out under setup.py's file names (the stable ABI's) and load as CPython modules."""
    for variant in ("preload", "torch"):
        path = cmake_build / f"_tms_{variant}.abi3.so"
        assert path.is_file(), sorted(p.name for p in cmake_build.iterdir())
        code = (
            "import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('_tms_{variant}', sys.argv[1])\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            "m.use_backend('host'); print(m.VARIANT, m.backend())\n"
        )
        assert _run([sys.executable, "-c", code, path]).split() == [variant, "host"]


def _lsan_works(tmp):
    """LeakSanitizer needs ptrace-like access that some containers deny; probe it."""
    probe = tmp / "probe.c"
    probe.write_text("#include <stdlib.h>\nint main(void) { free(malloc(1)); return 0; }\n")
    build = subprocess.run([*cbuild.compiler(), "-fsanitize=address,undefined", str(probe), "-o", str(tmp / "probe")],
                           capture_output=True, text=True)
    if build.returncode != 0:
        pytest.skip(f"the C compiler cannot build with -fsanitize=address,undefined: {build.stderr.strip()[:300]}")
    run = subprocess.run([str(tmp / "probe")], env={**_env(), "ASAN_OPTIONS": "detect_leaks=1"},
                         capture_output=True, text=True)
    return run.returncode == 0


def test_ctest_address_undefined_sanitizers(tmp_path_factory):
    if not cbuild.compiler():
        pytest.skip("no C compiler (cc, or $CC)")
    leaks = _lsan_works(tmp_path_factory.mktemp("cmake-asan"))
    build_dir = cbuild.cmake_build("address,undefined", python_modules=False)
    env = {
        **_env(),
        "ASAN_OPTIONS": f"detect_leaks={int(leaks)}:abort_on_error=0:strict_string_checks=1",
        "UBSAN_OPTIONS": "print_stacktrace=1:halt_on_error=1",
    }
    # The same test_core_host in more configurations adds time, not code: the chunked
    # paths run in the faults and fuzz entries, one HIP-stub run stays, and one short
    # walk of the segments (the plain ctest above runs them all).
    _ctest(build_dir, env=env, exclude="^(core_host_chunk_.*|core_hip_stub_chunk_.*|core_hip_stub_no_register|"
                                       "core_hip_stub_rocm7|cumem_walk_1|cumem_walk_3)$")
