"""The GPU tests spread over the machine's GPUs, TMS_TEST_PER_GPU pytest-xdist workers
per GPU (1 unless set; `make test-gpu` sets PER_GPU).

TMS_TEST_GPUS names the GPUs to spread over ("0,1", as CUDA_VISIBLE_DEVICES names them;
`make test-gpu` sets it to every GPU the driver sees: `python tests/gpus.py` prints
them). With it, worker gwN runs on GPU N modulo the list's length: CUDA_VISIBLE_DEVICES
is set when the worker starts, before anything imports torch, and every child inherits
it. A scenario process uses a few GiB and spends most of its time starting Python and
CUDA, so several share a GPU well; the scenarios count what the library did, never the
device's free memory. The few that read it (marked `whole_gpu`: a worker sharing its
GPU skips them, saying so) and the tests marked `two_gpus` (every worker skips them)
run in a run without workers, the second step of `make test-gpu`, which sees every GPU
of the list. The compatibility tests share the package installed once per worker
(`installed`), so they go to one worker together.

Without TMS_TEST_GPUS nothing changes: every GPU test runs on one worker, one after the
other (xdist group "gpu"), the others beside them. tests/conftest.py calls configure()
and arrange() from its hooks; `-p gpus` does the same for a run of other tests
(tests/test_gpu_workers.py checks the assignment that way, with GPUs that do not exist).
"""
import os
import subprocess
import sys

GPUS_VAR = "TMS_TEST_GPUS"
PER_GPU_VAR = "TMS_TEST_PER_GPU"
INSTALLED = ("test_compat_scenario", "test_compat_slime", "test_compat_areal", "test_compat_megatron",
             "test_c_program_on_the_gpu_through_the_abi")


def parse(value):
    """The GPU ids a TMS_TEST_GPUS value names, in order; [] for none."""
    ids = [part.strip() for part in (value or "").split(",")]
    if ids == [""]:
        return []
    if "" in ids or len(set(ids)) != len(ids):
        raise ValueError(f"{GPUS_VAR}={value!r}: name each GPU once, separated by commas (e.g. 0,1)")
    return ids


def per_gpu(value):
    """Workers per GPU a TMS_TEST_PER_GPU value asks for: 1 unless set, else a whole number from 1 to 16."""
    if value is None or value.strip() == "":
        return 1
    if not value.strip().isdigit() or not 1 <= int(value) <= 16:
        raise ValueError(f"{PER_GPU_VAR}={value!r}: workers per GPU, a whole number from 1 to 16")
    return int(value)


def worker_gpu(gpus, worker_id, workers, per=1):
    """The GPU worker `worker_id` ("gw3") of `workers` runs on: its place in gpus, modulo
    their number. More than `per` workers on a GPU: a ValueError says so."""
    if workers > len(gpus) * per:
        raise ValueError(f"{workers} pytest-xdist workers for {len(gpus)} GPUs ({GPUS_VAR}={','.join(gpus)}) and "
                         f"{per} per GPU ({PER_GPU_VAR}): run at most -n {len(gpus) * per}")
    index = int(worker_id[2:]) if worker_id.startswith("gw") and worker_id[2:].isdigit() else -1
    if not 0 <= index < workers:
        raise ValueError(f"worker {worker_id!r} has no GPU of {GPUS_VAR}={','.join(gpus)}")
    return gpus[index % len(gpus)]


def visible():
    """The GPUs the driver sees, as CUDA_VISIBLE_DEVICES names them ([] without a driver).
    Asked of a fresh interpreter: this process never initialises CUDA."""
    code = ("import ctypes\n"
            "try:\n"
            "    cuda = ctypes.CDLL('libcuda.so.1')\n"
            "except OSError:\n"
            "    print(0)\n"
            "else:\n"
            "    n = ctypes.c_int(0)\n"
            "    ok = cuda.cuInit(0) == 0 and cuda.cuDeviceGetCount(ctypes.byref(n)) == 0\n"
            "    print(n.value if ok else 0)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    count = int(proc.stdout.strip() or 0) if proc.returncode == 0 else 0
    named = parse(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    return named[:count] if "CUDA_VISIBLE_DEVICES" in os.environ else [str(i) for i in range(count)]


def configure(config):
    """Registers the marker and, under TMS_TEST_GPUS, gives this process its GPUs."""
    config.addinivalue_line("markers", "two_gpus: needs two GPUs at once (runs where it sees every GPU)")
    config.addinivalue_line("markers", "whole_gpu: reads the device's free memory (runs where no other test shares "
                                       "its GPU)")
    gpus = parse(os.environ.get(GPUS_VAR, ""))
    per = per_gpu(os.environ.get(PER_GPU_VAR))
    config._tms_gpus = gpus
    config._tms_gpu_worker = None
    config._tms_per_gpu = per
    if not gpus:
        return
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        gpu = worker_gpu(gpus, workerinput["workerid"], int(workerinput.get("workercount", 1)), per)
        config._tms_gpu_worker = gpu
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    else:
        workers = getattr(config.option, "numprocesses", None)
        if isinstance(workers, int) and workers > len(gpus) * per:
            import pytest

            raise pytest.UsageError(f"-n {workers} pytest-xdist workers for {len(gpus)} GPUs ({GPUS_VAR}="
                                    f"{','.join(gpus)}) and {per} per GPU ({PER_GPU_VAR}): run at most "
                                    f"-n {len(gpus) * per}")
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)


def arrange(config, items):
    """Groups and skips of the GPU tests for this run (see the module's docstring)."""
    import pytest

    worker_gpu_id = getattr(config, "_tms_gpu_worker", None)
    spread = bool(getattr(config, "_tms_gpus", None))
    for item in items:
        if not _is_gpu_test(item):
            continue
        if not spread:
            item.add_marker(pytest.mark.xdist_group("gpu"))
            continue
        if item.originalname in INSTALLED:
            item.add_marker(pytest.mark.xdist_group("installed"))
        if worker_gpu_id is not None and item.get_closest_marker("two_gpus"):
            item.add_marker(pytest.mark.skip(
                reason=f"needs every GPU of {GPUS_VAR}; this worker has GPU {worker_gpu_id} alone (`make test-gpu` "
                       f"runs the two-GPU tests after the others, without workers)"))
        elif worker_gpu_id is not None and config._tms_per_gpu > 1 and item.get_closest_marker("whole_gpu"):
            item.add_marker(pytest.mark.skip(
                reason=f"reads GPU {worker_gpu_id}'s free memory, which the other workers on it move (`make "
                       f"test-gpu` runs it after the others, without workers)"))


def _is_gpu_test(item):
    return item.nodeid.startswith("tests/test_gpu.py") or "/test_gpu.py::" in item.nodeid or \
        item.get_closest_marker("gpu") is not None


# As a plugin (`-p gpus`) for a run outside this directory.
def pytest_configure(config):
    configure(config)


def pytest_collection_modifyitems(config, items):
    arrange(config, items)


if __name__ == "__main__":
    print(",".join(visible()))
