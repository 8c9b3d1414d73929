"""GPU scenarios of tests/test_gpu.py.

Each module is one scenario, run in a fresh process by the test:

    python tests/gpu_scenarios/<name>.py <hook_mode> [args...]

with the repository root on PYTHONPATH and, for hook_mode "preload", the
preload library on LD_PRELOAD (torch_memory_saver.configure_subprocess()).
A scenario prints what it checks, raises AssertionError on the first failed
check, and prints "OK" as its last line when everything held.
"""
