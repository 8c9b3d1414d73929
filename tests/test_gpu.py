"""GPU tests: each scenario of tests/gpu_scenarios/ runs in a fresh
Python process, in each hook mode it applies to, and must exit 0 after printing
"OK". Skipped as a whole where PyTorch sees no CUDA GPU.

Run on a GPU machine with `make test-gpu`: one pytest-xdist worker per GPU, each on
its GPU alone, then the tests marked two_gpus with every GPU visible (tests/gpus.py);
on one GPU in two parts of about equal time, `make test-gpu PART=1` and `PART=2`.
`python -m pytest -q tests/test_gpu.py` runs them all one after the other.

A preload-mode child is started inside `configure_subprocess()`, so it has the
preload library on LD_PRELOAD; a torch-mode child has it removed from
LD_PRELOAD. TMS_* variables and PYTORCH_CUDA_ALLOC_CONF of this process are not
passed on: each scenario sets what it needs. The exceptions are the settings
that select how the core works rather than what a scenario tests, so the whole
suite can run again under them: TMS_CHUNK_BYTES (e.g. 64MiB: the chunked core
of ROCm) and TMS_BACKUP_THREADS.
"""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from torch_memory_saver import _library, configure_subprocess
from conftest import installed_env

REPO_ROOT = Path(__file__).resolve().parent.parent
SCENARIOS = REPO_ROOT / "tests" / "gpu_scenarios"
HOOK_MODES = ("preload", "torch")
TIMEOUT_S = 300


def _probe_gpu():
    """(device count, reason to skip, probe error), the last two None unless they
    apply. Asked of a fresh interpreter, so this process never initialises CUDA."""
    code = ("import json\n"
            "try:\n"
            "    import torch\n"
            "except ImportError as e:\n"
            "    print(json.dumps({'torch': None, 'error': str(e)}))\n"
            "else:\n"
            "    ok = torch.cuda.is_available()\n"
            "    print(json.dumps({'torch': torch.__version__, 'cuda': ok,\n"
            "                      'devices': torch.cuda.device_count() if ok else 0}))\n")
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180,
                              env=_base_env())
    except subprocess.TimeoutExpired:
        return 0, None, "probing torch.cuda.is_available() timed out after 180 s"
    try:
        info = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return 0, None, (f"probing torch.cuda.is_available() failed (rc={proc.returncode}):\n"
                         f"{proc.stdout}\n{proc.stderr}")
    if info["torch"] is None:
        return 0, f"PyTorch is not importable ({info['error']})", None
    if not info["cuda"]:
        return 0, f"no CUDA GPU: torch.cuda.is_available() is False (torch {info['torch']})", None
    return info["devices"], None, None


_PASSED_ON = ("TMS_CHUNK_BYTES", "TMS_BACKUP_THREADS")


def _base_env(extra=None):
    """This process's environment without TMS_* and PYTORCH_CUDA_ALLOC_CONF, with
    the repository root first on PYTHONPATH, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if (not k.startswith("TMS_") or k in _PASSED_ON) and k != "PYTORCH_CUDA_ALLOC_CONF"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def _without_preload_library(value):
    """LD_PRELOAD with this package's preload library taken out."""
    ours = _library.path("preload")

    def is_ours(entry):
        try:
            return os.path.samefile(entry, ours)
        except OSError:
            return False

    return " ".join(e for e in value.replace(":", " ").split() if not is_ours(e))


DEVICE_COUNT, SKIP_REASON, PROBE_ERROR = _probe_gpu()

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(SKIP_REASON is not None, reason=SKIP_REASON or ""),
]


# Preload mode twice: with the library on LD_PRELOAD, and without it, where the
# hooks are installed by patching relocation tables.
RELOCATION = "preload-relocation"
GPU_MODES = ("preload", RELOCATION, "torch")


def _relocation_env(hook_mode, child_env):
    """The scenario's own hook mode and, for RELOCATION, the method begin() must see."""
    if hook_mode == RELOCATION:
        child_env["TMS_TEST_PRELOAD_METHOD"] = "relocation"
        return "preload"
    return hook_mode


def run_scenario(name, hook_mode, *args, env=None):
    """Runs tests/gpu_scenarios/<name>.py in a fresh process; returns the CompletedProcess.
    hook_mode RELOCATION: preload mode started without LD_PRELOAD."""
    if PROBE_ERROR:
        pytest.fail(PROBE_ERROR)
    for mode in HOOK_MODES:
        try:
            _library.path(mode)
        except ImportError as e:
            pytest.fail(f"{e} (run `make build` first)")
    if hook_mode == "preload":
        with configure_subprocess():
            child_env = _base_env(env)
    else:
        child_env = _base_env(env)
        child_env["LD_PRELOAD"] = _without_preload_library(child_env.get("LD_PRELOAD", ""))
        if not child_env["LD_PRELOAD"]:
            del child_env["LD_PRELOAD"]
    cmd = [sys.executable, str(SCENARIOS / f"{name}.py"), _relocation_env(hook_mode, child_env), *args]
    try:
        return subprocess.run(cmd, cwd=REPO_ROOT, env=child_env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{name} {hook_mode} {' '.join(args)} did not finish in {TIMEOUT_S} s\n"
                    f"--- stdout ---\n{e.stdout}\n--- stderr ---\n{e.stderr}")


def _report(proc):
    return (f"command: {' '.join(map(str, proc.args))}\nexit status: {proc.returncode}\n"
            f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}")


def check_passed(proc, empty_stderr=False):
    report = _report(proc)
    assert proc.returncode == 0, report
    for marker in ("Traceback", "Segmentation", "core dumped"):
        assert marker not in proc.stderr, f"{marker!r} in stderr\n{report}"
    lines = proc.stdout.strip().splitlines()
    assert lines and lines[-1] == "OK", f"the scenario did not finish (no final OK)\n{report}"
    if empty_stderr:
        assert proc.stderr.strip() == "", f"stderr not empty\n{report}"


@pytest.mark.parametrize("case", ["engine", "transformer", "disable", "cdll"])
@pytest.mark.parametrize("hook_mode,where", [("preload", "region"), ("torch", "region"), ("preload", "init")])
def test_live_only(case, hook_mode, where):
    env = {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"} if where == "init" else None
    check_passed(run_scenario("live_only", hook_mode, case, where, env=env))


@pytest.mark.parametrize("hook_mode", ["torch", "preload"])
def test_budget_two_processes_as_a_group(hook_mode):
    check_passed(run_scenario("budget_group", hook_mode))


@pytest.mark.parametrize("hook_mode", GPU_MODES)
@pytest.mark.parametrize("scenario", [
    "pause_frees",
    "cpu_backup",
    "retain",
    "get_cpu_backup",
    "tags_independent",
    "disable_in_region",
    "cuda_graph",
    pytest.param("memory_margin_oom", marks=pytest.mark.whole_gpu),
    "pause_during_kernel",
    "free_while_paused",
    "soak",
    "stress_threads",
    "stats_match",
    "nothing_waits",
    "skip_unchanged",
    "integrity",
])
def test_scenario(scenario, hook_mode):
    check_passed(run_scenario(scenario, hook_mode))


@pytest.mark.parametrize("hook_mode", GPU_MODES)
def test_disk_backup(hook_mode, tmp_path):
    d = tmp_path / "disk"
    proc = run_scenario("disk_backup", hook_mode, env={"TMS_TEST_DISK_DIR": str(d)})
    check_passed(proc)
    assert os.listdir(d) == [], f"left in {d} at exit: {os.listdir(d)}\n{_report(proc)}"


@pytest.mark.parametrize("hook_mode", GPU_MODES)
def test_nested_regions_init_enable(hook_mode):
    # The "default"-tag part (allocations outside regions) runs in preload mode only.
    check_passed(run_scenario("nested_init_enable", hook_mode, env={"TMS_INIT_ENABLE": "1"}))


# PyTorch's expandable segments: the scenario of its own, and scenarios
# of the suite whose memory then comes from expandable segments (in preload mode:
# adopted from PyTorch's own cuMem* calls; TMS_INIT_ENABLE covers the default pool).
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}


@pytest.mark.parametrize("hook_mode", GPU_MODES)
@pytest.mark.parametrize("scenario", ["expandable", "cpu_backup", "free_while_paused", "stress_threads"])
def test_expandable_segments(scenario, hook_mode):
    check_passed(run_scenario(scenario, hook_mode, env=EXPANDABLE))


@pytest.mark.parametrize("hook_mode", GPU_MODES)
def test_expandable_segments_init_enable(hook_mode):
    check_passed(run_scenario("nested_init_enable", hook_mode, env={**EXPANDABLE, "TMS_INIT_ENABLE": "1"}))


@pytest.mark.parametrize("hook_mode", ["preload", RELOCATION])
def test_expandable_segments_default_pool_shrinks(hook_mode):
    # slime's and AReaL's start: every allocation pauseable, PyTorch's own segment shrinking under it.
    check_passed(run_scenario("expandable_default_pool", hook_mode,
                              env={**EXPANDABLE, "TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}))


@pytest.mark.two_gpus
@pytest.mark.parametrize("hook_mode", HOOK_MODES)
def test_multi_gpu(hook_mode):
    if DEVICE_COUNT < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {DEVICE_COUNT}")
    check_passed(run_scenario("multi_gpu", hook_mode))


# One process per GPU with every GPU visible, as tensor-parallel ranks run: nothing on
# a GPU the process does not use, and a group over NCCL that pauses, fails to
# resume on one rank, stays paused everywhere and resumes on a retry.
@pytest.mark.two_gpus
@pytest.mark.parametrize("hook_mode", GPU_MODES)
@pytest.mark.parametrize("scenario", ["one_device_of_two", "nccl_group"])
def test_one_process_per_gpu(scenario, hook_mode):
    if DEVICE_COUNT < 2:
        pytest.skip(f"needs 2 GPUs, this machine has {DEVICE_COUNT}")
    check_passed(run_scenario(scenario, hook_mode))


# A region tensor shared with a spawned child: through torch.multiprocessing's
# reductions (the runtime's IPC calls on our memory) and share()/open_shared();
# a pause while the child holds it is refused, after its close it frees. With two GPUs
# the child opens it on the other one too.
@pytest.mark.two_gpus
@pytest.mark.parametrize("hook_mode", GPU_MODES)
def test_share_ipc(hook_mode):
    check_passed(run_scenario("share_ipc", hook_mode))


# Lending within a job: two processes on one GPU and one outside the job; B's resume maps
# A's memory, every byte exact, and the device's free memory is back once all have exited.
# "off": the same steps without a job.
# Lending is the core's, the same under every hook: on in one hook mode, off (the same
# steps without a job) in the other.
@pytest.mark.whole_gpu  # checks that the device's free memory comes back
@pytest.mark.parametrize("mode,hook_mode", [("on", "torch"), ("off", "preload")])
def test_job_lends_between_two_processes(mode, hook_mode):
    check_passed(run_scenario("job_lend", hook_mode, mode))


@pytest.mark.parametrize("hook_mode", HOOK_MODES)
@pytest.mark.parametrize("case", ["active", "paused", "paused_backup", "backup_first_use"])
def test_exit_states(case, hook_mode):
    check_passed(run_scenario("exit_states", hook_mode, case), empty_stderr=True)


# ---- drop-in compatibility: the installed package, framework call shapes ----
#
# Each scenario runs in a fresh process against the package as `pip install .`
# lays it out (the `installed` fixture), started the way the framework starts
# its workers: slime and AReaL put an upstream-named library on LD_PRELOAD
# themselves, SGLang uses configure_subprocess(), Megatron runs in torch mode.

def run_installed_scenario(name, hook_mode, site, tmp_path, preload=None, env=None):
    """Runs tests/gpu_scenarios/<name>.py from tmp_path with the installed package in
    site; preload: the file (relative to site) to put on LD_PRELOAD, else what the
    hook mode's usual start gives."""
    if PROBE_ERROR:
        pytest.fail(PROBE_ERROR)
    child_env = installed_env(site, env)
    for k in ("TMS_BACKEND", "TMS_BACKUP_THREADS"):
        child_env.pop(k, None)
    child_env.update({k: os.environ[k] for k in _PASSED_ON if k in os.environ})
    child_env["COMPAT_SITE"] = str(site)
    child_env["PYTHONUNBUFFERED"] = "1"
    child_env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if preload is not None:
        child_env["LD_PRELOAD"] = str(site / preload)
    elif hook_mode == "preload":
        child_env["LD_PRELOAD"] = str(next(site.glob("torch_memory_saver/_tms_preload*.so")))
    else:
        child_env.pop("LD_PRELOAD", None)
    cmd = [sys.executable, str(SCENARIOS / f"{name}.py"), _relocation_env(hook_mode, child_env)]
    try:
        return subprocess.run(cmd, cwd=tmp_path, env=child_env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{name} {hook_mode} did not finish in {TIMEOUT_S} s\n--- stdout ---\n{e.stdout}\n"
                    f"--- stderr ---\n{e.stderr}")


@pytest.mark.parametrize("hook_mode", GPU_MODES)
@pytest.mark.parametrize("scenario", ["compat_sglang", "compat_verl", "compat_disable"])
def test_compat_scenario(scenario, hook_mode, installed, tmp_path):
    check_passed(run_installed_scenario(scenario, hook_mode, installed, tmp_path))


def test_compat_slime(installed, tmp_path):
    check_passed(run_installed_scenario(
        "compat_slime", "preload", installed, tmp_path, preload="torch_memory_saver_hook_mode_preload_cu13.abi3.so",
        env={"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}))


def test_compat_areal(installed, tmp_path):
    check_passed(run_installed_scenario(
        "compat_areal", "preload", installed, tmp_path, preload="torch_memory_saver_hook_mode_preload.abi3.so",
        env={"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}))


def test_compat_megatron_torch_mode(installed, tmp_path):
    check_passed(run_installed_scenario("compat_megatron", "torch", installed, tmp_path))


def _cuda_toolkit():
    """(include dir, lib dir) of a CUDA toolkit with the runtime's headers and shared library."""
    roots = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(str(Path(nvcc).resolve().parent.parent))
    for root in filter(None, roots):
        root = Path(root)
        for lib in (root / "lib64", root / "lib", root / "targets" / "x86_64-linux" / "lib"):
            if (root / "include" / "cuda_runtime_api.h").exists() and list(lib.glob("libcudart.so*")):
                return root / "include", lib
    return None


def _build_with_cudart(source, out, *flags, libs=()):
    """Builds tests/c/<source> against the CUDA toolkit's runtime (skips without one); returns out.
    libs come last on the command line (after what needs them: --as-needed linkers)."""
    toolkit = _cuda_toolkit()
    if toolkit is None:
        pytest.skip("no CUDA toolkit (cuda_runtime_api.h and libcudart.so) found")
    include, lib = toolkit
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    build = subprocess.run([cc, *flags, f"-I{include}", str(REPO_ROOT / "tests" / "c" / source), "-o", str(out),
                            f"-L{lib}", "-lcudart", f"-Wl,-rpath,{lib}", *libs], capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    return out


def test_c_program_on_the_gpu_through_the_abi(installed, tmp_path):
    # A C program: cudaMalloc (served by the preloaded library under TMS_INIT_ENABLE=1),
    # tms_pause(NULL) / tms_resume(NULL) on a size that is not a multiple of the
    # granularity, its bytes checked through cudaMemcpy (tests/c/abi_client.c).
    exe = _build_with_cudart("abi_client.c", tmp_path / "abi_client", "-std=c11", "-D_GNU_SOURCE",
                             "-DABI_CLIENT_CUDA", "-Wall", "-Wextra", f"-I{REPO_ROOT / 'include'}", libs=["-ldl"])
    env = installed_env(installed, {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"})
    env.pop("TMS_BACKEND", None)
    for name in ("torch_memory_saver_hook_mode_preload_cu13.abi3.so", "torch_memory_saver_hook_mode_preload.abi3.so"):
        env["LD_PRELOAD"] = str(installed / name)
        proc = subprocess.run([str(exe)], env=env, capture_output=True, text=True, timeout=120)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, "OK cuda\n", ""), _report(proc)


def test_extension_loaded_after_import_is_hooked_by_relocation(tmp_path):
    # A CUDA library built here (cudaMalloc/cudaFree through libcudart, as a CUDA
    # extension calls them), loaded after the hooks were installed without LD_PRELOAD:
    # its allocation in a region is the library's, pauses and resumes with its bytes.
    ext = _build_with_cudart("cuda_ext.c", tmp_path / "libtms_test_ext.so", "-shared", "-fPIC", "-O2",
                             "-Wl,-z,relro,-z,now")
    check_passed(run_scenario("reloc_extension", RELOCATION, env={"TMS_TEST_EXTENSION": str(ext)}))
