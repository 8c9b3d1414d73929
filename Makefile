# Developer commands. `make check` is the test command README and .ci/run use: `make test`
# (the suite) and `make test-packaging` (wheels, the sdist, installs), each within its
# time on two cores; `make test-gpu` runs the GPU suite on a GPU machine.
PYTHON ?= python3
BUILD_DIR ?= build/cmake

.PHONY: build ptx deps reinstall test test-packaging check test-gpu soak demo bench bench-multi-gpu bench-alloc-count bench-speed bench-switch bench-dry-run sanitize sanitize-thread sanitize-python fuzz clean

# The extensions compiled in place (torch_memory_saver/_tms_*.abi3.so, the upstream-named
# shims at the root) for tests; warnings are errors here and in CI, never in a user's install.
build:
	TMS_WERROR=1 $(PYTHON) setup.py -q build_ext --inplace

# The fingerprint kernel's PTX embedded in the library (src/platform/fingerprint_ptx.h),
# rebuilt from src/platform/fingerprint.cu; needs nvcc, which the build itself does not.
ptx:
	$(PYTHON) src/platform/gen_ptx.py

# An editable install of this tree into the current environment (offline, with the
# environment's setuptools), from any state: nothing installed, a regular install or
# an editable one of another tree. pip builds before it removes what was installed, so
# a failed build leaves the old install in place. Once this tree is installed
# editable, the in-place build is what the install runs and only changed sources
# are compiled again.
reinstall: build
	@$(PYTHON) -I -c "$$EDITABLE_HERE" "$(CURDIR)" 2>/dev/null || { \
	  $(PYTHON) -c "import setuptools.command.bdist_wheel" 2>/dev/null || $(PYTHON) -c "import wheel" 2>/dev/null \
	    || $(PYTHON) -m pip install -q wheel; \
	  TMS_WERROR=1 $(PYTHON) -m pip install -q --no-build-isolation -e .; }

define EDITABLE_HERE
import importlib.metadata as m, json, sys
url = json.loads(m.distribution("torch_memory_saver").read_text("direct_url.json") or "{}")
sys.exit(0 if url.get("dir_info", {}).get("editable") and url.get("url") == "file://" + sys.argv[1] else 1)
endef
export EDITABLE_HERE

# Each only if missing: `pip install torch==2.13.0` takes the CPU wheel from
# disk on CI machines; GPU machines already have their torch, which must not be
# replaced. numpy: the torch wheel does not pull it in, and without it torch warns
# on every import. auditwheel checks the wheel's manylinux tag; where it cannot be
# had (no network, as on the lent GPU machines) that one test skips.
# pytest-xdist runs the suite on two workers; without it (no network) the suite
# runs on one. mypy checks a user's script against the package's types; without it
# that test skips.
deps:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	@$(PYTHON) -c "import numpy" 2>/dev/null || $(PYTHON) -m pip install -q numpy
	@$(PYTHON) -c "import pytest" 2>/dev/null || $(PYTHON) -m pip install -q pytest
	@$(PYTHON) -c "import xdist" 2>/dev/null || $(PYTHON) -m pip install -q pytest-xdist 2>/dev/null || true
	@$(PYTHON) -c "import auditwheel" 2>/dev/null || $(PYTHON) -m pip install -q auditwheel 2>/dev/null || true
	@$(PYTHON) -c "import mypy" 2>/dev/null || $(PYTHON) -m pip install -q mypy 2>/dev/null || true

PYTEST_WORKERS ?= 2
XDIST = $$($(PYTHON) -c "import xdist; print('-n $(PYTEST_WORKERS) --dist loadgroup')" 2>/dev/null)
test: deps build
	$(PYTHON) -m pytest -q $(XDIST) -m "not packaging" $(PYTEST_ARGS) tests

# The build and packaging tests (marked `packaging` in tests/conftest.py).
test-packaging: deps build
	$(PYTHON) -m pytest -q $(XDIST) -m packaging $(PYTEST_ARGS) tests

check: test test-packaging

# pip keeps each wheel it builds from an sdist (the packaging tests build some) and each
# download in its cache, outside the tree, for good: make check leaves nothing there.
deps test test-packaging check: export PIP_NO_CACHE_DIR = 1

# The GPU suite (tests/test_gpu.py) on every GPU the driver sees (or GPUS=0,1), in one
# call: PER_GPU pytest-xdist workers per GPU (a scenario is mostly Python and CUDA
# starting, so a few share a GPU well), then, without workers, the tests that need every
# GPU or a GPU alone (tests/gpus.py). PART=1 and PART=2 split it in two halves where a
# call is short. pytest's status 5 (no test selected) is no failure here.
GPUS ?= $(shell $(PYTHON) tests/gpus.py)
PER_GPU ?= 6
GPU_PART_1 = test_scenario or test_exit_states or test_compat or test_c_program
GPU_K_1 = -k "$(GPU_PART_1)"
GPU_K_2 = -k "not ($(GPU_PART_1))"
comma := ,
test-gpu: deps build
	@test -n "$(GPUS)" || { echo "make test-gpu: the CUDA driver sees no GPU"; exit 1; }
	@rc=0; export TMS_TEST_GPUS=$(GPUS) TMS_TEST_PER_GPU=$(PER_GPU); \
	$(PYTHON) -m pytest -q $$($(PYTHON) -c "import xdist; print('-n', $(words $(subst $(comma), ,$(GPUS))) * $(PER_GPU), \
	    '--dist loadgroup')" 2>/dev/null) -m "not two_gpus and not whole_gpu" $(GPU_K_$(PART)) $(PYTEST_ARGS) \
	    tests/test_gpu.py || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; \
	$(PYTHON) -m pytest -q -m "two_gpus or whole_gpu" $(GPU_K_$(PART)) $(PYTEST_ARGS) tests/test_gpu.py \
	    || { r=$$?; [ $$r -eq 5 ] || rc=$$r; }; exit $$rc

# What make test's walks, fuzzing and races do, for minutes rather than seconds, under
# AddressSanitizer + UndefinedBehaviorSanitizer: the expandable-segments walk
# (SOAK_STEPS steps over 20 seeds, then 2,000 race rounds), the core fuzzer and
# relocation passes racing dlclose.
SOAK_STEPS ?= 200000
SOAK_SECONDS ?= 300
soak:
	cmake -S . -B $(BUILD_DIR)-soak -DTMS_SANITIZE=address,undefined -DTMS_PYTHON_MODULES=OFF >/dev/null
	cmake --build $(BUILD_DIR)-soak -j2 --target test_cumem_host fuzz_core test_reloc_race
	$(BUILD_DIR)-soak/test_cumem_host --steps $(SOAK_STEPS) --walks 20 --seed 100 --race-rounds 2000
	TMS_CHUNK_BYTES=4MiB $(BUILD_DIR)-soak/fuzz_core --seconds $(SOAK_SECONDS) --seed 100
	$(BUILD_DIR)-soak/fuzz_core --seconds $(SOAK_SECONDS) --seed 101
	$(BUILD_DIR)-soak/test_reloc_race --seconds $(SOAK_SECONDS) $(BUILD_DIR)-soak/libreloc_user.so

# Installs the package, then runs the demo from outside the source tree so the
# installed copy is the one imported.
demo:
	$(PYTHON) -m pip install -q .
	cd /tmp && $(PYTHON) -m torch_memory_saver demo

# One tool, `python -m benchmarks <suite>`: `make bench` runs the one-GPU suite
# (run); SUITE picks another and BENCH_ARGS adds its options. The other bench-*
# targets are short names for the suites. Reports go to benchmarks/results.
SUITE ?= run
BENCH_ARGS ?=
bench: build
	$(PYTHON) -m benchmarks $(SUITE) $(BENCH_ARGS)

# Every GPU of the host pausing at once, one process per GPU; GIB=24 by default.
GIB ?= 24
bench-multi-gpu: build
	$(PYTHON) -m benchmarks multi_gpu --gib $(GIB) $(BENCH_ARGS)

bench-alloc-count: build
	$(PYTHON) -m benchmarks alloc_count $(BENCH_ARGS)

bench-speed: build
	$(PYTHON) -m benchmarks speed $(BENCH_ARGS)

bench-switch: build
	$(PYTHON) -m benchmarks switch $(BENCH_ARGS)

# Every suite's dry run on the host backend (no GPU; reports in build/bench-dry-run).
bench-dry-run: build
	for s in run multi_gpu alloc_count speed switch; do \
	    TMS_BACKEND=host $(PYTHON) -m benchmarks $$s --dry-run || exit 1; done

# C tests under AddressSanitizer + UndefinedBehaviorSanitizer.
sanitize:
	cmake -S . -B $(BUILD_DIR)-asan -DTMS_SANITIZE=address,undefined >/dev/null
	cmake --build $(BUILD_DIR)-asan -j2
	cd $(BUILD_DIR)-asan && ctest --output-on-failure

# The host-backend Python suites against an ASan+UBSan build of the extension
# (ASan catches the deliberate touch of paused memory, so those two tests are
# left out), then the normal build again.
SAN_FLAGS = -fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=all
sanitize-python:
	TMS_WERROR=1 TMS_EXTRA_CFLAGS="$(SAN_FLAGS)" $(PYTHON) setup.py -q build_ext --inplace --force
	ASAN_OPTIONS=verify_asan_link_order=0:detect_leaks=0 $(PYTHON) -m pytest -q -p no:cacheprovider \
	    tests/test_host_backend.py tests/test_observe.py tests/test_teardown.py tests/test_disk_backup.py \
	    -k "not touching_paused_memory_faults"; rc=$$?; TMS_WERROR=1 $(PYTHON) setup.py -q build_ext --inplace --force; exit $$rc

# The threads scenario, the expandable-segments race, the fuzz driver and relocation
# passes racing dlclose (RELOC_RACE_SECONDS) under ThreadSanitizer, which is told
# not to judge the dynamic loader's own memory (tests/c/tsan.supp says why).
RELOC_RACE_SECONDS ?= 10
sanitize-thread:
	cmake -S . -B $(BUILD_DIR)-tsan -DTMS_SANITIZE=thread >/dev/null
	cmake --build $(BUILD_DIR)-tsan -j2 --target test_core_host test_cumem_host fuzz_core test_reloc_race
	$(BUILD_DIR)-tsan/test_core_host threads && $(BUILD_DIR)-tsan/fuzz_core --runs 5
	$(BUILD_DIR)-tsan/test_cumem_host --steps 400 --race-rounds 100
	TSAN_OPTIONS="halt_on_error=1:suppressions=$(CURDIR)/tests/c/tsan.supp" \
	    $(BUILD_DIR)-tsan/test_reloc_race --seconds $(RELOC_RACE_SECONDS) $(BUILD_DIR)-tsan/libreloc_user.so

# Coverage-guided fuzzing of the core (tests/c/fuzz_core.c) with clang's libFuzzer
# (Debian: clang, libclang-rt-14-dev); CI runs the same harness as a plain driver.
FUZZ_SECONDS ?= 600
fuzz:
	cmake -S . -B $(BUILD_DIR)-fuzz -DCMAKE_C_COMPILER=clang -DTMS_LIBFUZZER=ON >/dev/null
	cmake --build $(BUILD_DIR)-fuzz -j2 --target fuzz_core_libfuzzer
	mkdir -p build/fuzz-corpus
	$(BUILD_DIR)-fuzz/fuzz_core_libfuzzer -max_total_time=$(FUZZ_SECONDS) -max_len=512 -timeout=30 build/fuzz-corpus

clean:
	rm -rf build dist *.egg-info torch_memory_saver/_tms_*.so torch_memory_saver_hook_mode_*.abi3.so \
	    torch_memory_saver/include
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
