"""examples/ runs as README says: the RL loop on the host backend, and README's excerpt of
it pauses and resumes in the example's order."""
import re
import subprocess
import sys

from conftest import REPO, child_env

EXAMPLE = REPO / "examples" / "rl_loop.py"


def _calls(text):
    """The pauses, resumes and empty_cache() calls of a piece of code, in order."""
    return re.findall(r"tms\.(?:pause|resume)\([^)]*\)|torch\.cuda\.empty_cache\(\)", text)


def test_the_rl_loop_runs_on_the_host_backend():
    proc = subprocess.run([sys.executable, str(EXAMPLE)], cwd=REPO, env=child_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc
    lines = proc.stdout.splitlines()
    step = ["  resume rollout_weights: 16.00 MiB mapped, contents undefined",
            "  refresh: 16.00 MiB copied from the trainer",
            "  pause trainer: 48.00 MiB released, 48.00 MiB copied to the host",
            "  empty_cache: the host backend has no PyTorch cache to empty",
            "  resume kv_cache: 64.00 MiB mapped, contents undefined",
            "  pause kv_cache, rollout_weights: 80.00 MiB released, 0.00 MiB copied",
            "  resume trainer: 48.00 MiB mapped, 48.00 MiB restored, same bytes: True",
            "  train: one optimizer step"]
    assert lines == [
        "setup: trainer 48.00 MiB (model and optimizer, CPU backup), rollout weights 16.00 MiB, KV cache 64.00 MiB",
        "step 1", *step, "step 2", *step, "paused now: ['kv_cache', 'rollout_weights']"], proc.stdout


def test_readmes_excerpt_pauses_and_resumes_as_the_example_does():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "[examples/rl_loop.py](examples/rl_loop.py)" in readme
    block = readme.split("[examples/rl_loop.py](examples/rl_loop.py)", 1)[1].split("```python\n", 1)[1].split("```")[0]
    code = EXAMPLE.read_text()
    setup, loop = code.split("for step in range", 1)
    # The setup's pause, then one step: the excerpt's calls are the example's, in its order.
    assert _calls(block) == _calls(setup)[-1:] + _calls(loop), (_calls(block), _calls(code))
    assert "torch.cuda.empty_cache()" in _calls(block)
