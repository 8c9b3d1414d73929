# Developer commands. `make test` is the test command README and .ci/run use.
PYTHON ?= python3
BUILD_DIR ?= build/cmake

.PHONY: build reinstall test test-gpu demo bench sanitize clean

# Both variants compiled in place (torch_memory_saver/_tms_*.so) for tests.
build:
	$(PYTHON) build_backend/tms_build.py

# Installs the package into the current environment (offline; no build deps).
reinstall:
	$(PYTHON) -m pip uninstall -y torch_memory_saver >/dev/null 2>&1 || true
	$(PYTHON) -m pip install --no-build-isolation .

test: build
	$(PYTHON) -m pytest -q tests

demo: build
	$(PYTHON) -m torch_memory_saver demo

bench: build
	$(PYTHON) -m benchmarks.run

# C tests under AddressSanitizer + UndefinedBehaviorSanitizer.
sanitize:
	cmake -S . -B $(BUILD_DIR)-asan -DTMS_SANITIZE=address,undefined >/dev/null
	cmake --build $(BUILD_DIR)-asan -j2
	cd $(BUILD_DIR)-asan && ctest --output-on-failure

clean:
	rm -rf build dist *.egg-info torch_memory_saver/_tms_*.so
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
