"""The host backup budget: several processes on one ledger (tests/host_scenarios/budget.py).

Each process is started, pauses, reports where its backups went and what the
ledger holds, and waits; the test then resumes (or kills) them in turn."""
import json
import signal
import subprocess
import sys
import uuid

import pytest

from conftest import HOST_SCENARIOS, REPO, MiB, child_env


class Holder:
    """One process of the budget scenario, paused and waiting."""

    def __init__(self, env, count=2, mib=16):
        self.proc = subprocess.Popen([sys.executable, str(HOST_SCENARIOS / "budget.py"), "hold", str(count), str(mib)],
                                     cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        self.state = json.loads(line)

    def finish(self, command="resume"):
        out, err = self.proc.communicate(command + "\n", timeout=60)
        assert self.proc.returncode == 0, err
        assert err == "", err
        return out

    def resume_and_stay(self):
        self.proc.stdin.write("resume\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "done\n", self.proc.stderr.read()

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.communicate(timeout=60)


def _env(tmp_path, **extra):
    env = {"TMS_HOST_BACKUP_LIMIT_NAME": f"test-{uuid.uuid4().hex[:12]}", "TMPDIR": tmp_path}
    env.update(extra)
    return child_env(env)


def test_four_processes_share_the_budget_and_spill_the_rest_to_disk(tmp_path):
    env = _env(tmp_path, TMS_HOST_BACKUP_LIMIT="80MiB", TMS_SPILL_TO_DISK="1")
    holders = [Holder(env) for _ in range(4)]       # 32 MiB of backups each
    got = [(h.state["error"], h.state["cpu"], h.state["disk"]) for h in holders]
    # 80 MiB: the first two in RAM, the third 16 MiB in RAM and 16 on disk, the last on disk.
    assert got == [(None, 2, 0), (None, 2, 0), (None, 1, 1), (None, 0, 2)], got
    assert [h.state["budget"]["mine"] for h in holders] == [32 * MiB, 32 * MiB, 16 * MiB, 0]
    last = holders[-1].state["budget"]
    assert (last["limit"], last["reserved"], last["free"]) == (80 * MiB, 80 * MiB, 0), last
    for h in holders:
        assert all(s == "paused" for s in h.state["states"])
        assert h.finish() == "done\n"                 # every byte back, from RAM and from disk


def test_without_spill_a_pause_past_the_budget_raises_and_changes_nothing(tmp_path):
    env = _env(tmp_path, TMS_HOST_BACKUP_LIMIT="48MiB")
    first = Holder(env)
    second = Holder(env)
    assert first.state["error"] is None
    err = second.state["error"]
    assert err.startswith("OutOfMemoryError: ") and "host backup budget 'test-" in err, err
    assert f"needs {32 * MiB} bytes" in err and f"{16 * MiB} (0.02 GiB) are free" in err, err
    assert second.state["states"] == ["active", "active"] and second.state["budget"]["mine"] == 0
    assert second.finish() == "done\n"                # the bytes never moved
    assert first.finish() == "done\n"


def test_a_killed_process_gives_its_reservation_back(tmp_path):
    env = _env(tmp_path, TMS_HOST_BACKUP_LIMIT="48MiB")
    killed = Holder(env)
    assert killed.state["budget"]["reserved"] == 32 * MiB
    killed.kill()                                     # SIGKILL: no exit handler runs
    after = Holder(env)
    assert after.state["error"] is None and after.state["budget"]["reserved"] == 32 * MiB, after.state
    assert after.finish() == "done\n"


def test_a_resume_gives_the_reservation_back_while_the_process_lives(tmp_path):
    env = _env(tmp_path, TMS_HOST_BACKUP_LIMIT="48MiB")
    first = Holder(env)
    first.resume_and_stay()                           # alive, its backups released
    second = Holder(env)                              # needs 32 MiB: fits only if the first's record says 0
    assert second.state["error"] is None and second.state["budget"]["reserved"] == 32 * MiB, second.state
    assert second.finish() == "done\n"
    assert first.finish("") == ""


def _meminfo(tmp_path, total_gib, available_gib):
    path = tmp_path / "meminfo"
    path.write_text(f"MemTotal: {total_gib << 20} kB\nMemFree: 1 kB\nMemAvailable: {int(available_gib * (1 << 20))} kB\n")
    return path


@pytest.mark.parametrize("safety,spill,expect", [("1", "0", "raises"), ("0", "0", "ram"), ("1", "1", "disk")])
def test_without_a_limit_the_host_keeps_five_percent_available(tmp_path, safety, spill, expect):
    # 100 GiB of host memory, 5.04 GiB available: 40 MiB above the 5 % kept.
    env = _env(tmp_path, TMS_HOST_MEMINFO=_meminfo(tmp_path, 100, 5.04), TMS_HOST_MEMORY_SAFETY=safety,
               TMS_SPILL_TO_DISK=spill)
    h = Holder(env)                                   # needs 32 MiB: fits
    assert h.state["error"] is None and h.state["cpu"] == 2
    big = Holder(env, count=2, mib=32)                # needs 64 MiB: does not
    s = big.state
    if expect == "raises":
        assert s["error"].startswith("OutOfMemoryError: torch_memory_saver: host memory: this pause needs") and "5 %" in s["error"], s
        assert "TMS_HOST_MEMORY_SAFETY=0" in s["error"] and s["states"] == ["active", "active"]
    elif expect == "ram":
        assert s["error"] is None and s["cpu"] == 2, s
    else:
        assert s["error"] is None and (s["cpu"], s["disk"]) == (1, 1), s
    assert big.finish() == "done\n" and h.finish() == "done\n"


def test_a_budget_as_a_share_of_the_host(tmp_path):
    env = _env(tmp_path, TMS_HOST_MEMINFO=_meminfo(tmp_path, 64, 32), TMS_HOST_BACKUP_LIMIT="25%")
    h = Holder(env)
    b = h.state["budget"]
    assert (b["limit"], b["mine"], b["mem_total"], b["mem_available"]) == (16 << 30, 32 * MiB, 64 << 30, 32 << 30), b
    assert b["name"].startswith("test-") and b["safety"] is True and b["spill_to_disk"] is False
    assert h.finish() == "done\n"
