"""The host backup budget: several processes on one ledger (tests/host_scenarios/budget.py).

Each process is started, pauses, reports where its backups went and what the
ledger holds, and waits; the test then resumes (or kills) them in turn."""
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from conftest import HOST_SCENARIOS, REPO, MiB, child_env


class Holder:
    """One process of the budget scenario, paused and waiting. prefix runs it under
    another command (unshare); as_user = (uid, gid) runs it as that user; wait=False
    returns before its pause has ended (read_state then waits)."""

    def __init__(self, env, count=2, mib=16, prefix=(), as_user=None, wait=True):
        case = ["hold_as", *map(str, as_user)] if as_user else ["hold"]
        self.proc = subprocess.Popen([*prefix, sys.executable, str(HOST_SCENARIOS / "budget.py"), *case, str(count),
                                      str(mib)], cwd=REPO, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        if wait:
            self.read_state()

    def read_state(self):
        line = self.proc.stdout.readline()
        assert line, self.proc.stderr.read()
        self.state = json.loads(line)
        return self.state

    def finish(self, command="resume", stderr=""):
        """Ends it (resume or stay); its stderr must be `stderr`, or hold it if a list."""
        out, err = self.proc.communicate(command + "\n", timeout=60)
        assert self.proc.returncode == 0, err
        if isinstance(stderr, list):
            assert all(s in err for s in stderr), err
        else:
            assert err == stderr, err
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


# ---- trust: what another user, a container, a zombie or an environment value can do ----


def _shared_names(uid):
    """The ledger's last places, names under /dev/shm (or /tmp) anyone may make first."""
    base = Path("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    return [base / f"tms-ledger-{uid}"] + [base / f"tms-ledger-{uid}-{k}" for k in range(1, 8)]


def _home_ledger_dir(home):
    """The ledger's place in the user's home."""
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return Path(home) / ".cache" / "torch_memory_saver" / f"ledger-{boot}"


def _remove(path):
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path, ignore_errors=True)


def _as(uid, gid, *cmd):
    subprocess.run(cmd, user=uid, group=gid, extra_groups=[], check=True, timeout=30, capture_output=True)


def _squat(attacker, path, shape="their_directory", target="/"):
    """What another user leaves at one of the victim's names before the victim comes."""
    if shape == "their_directory":
        _as(attacker, attacker, "mkdir", "-m", "700", str(path))
    elif shape == "a_0777_directory":
        _as(attacker, attacker, "mkdir", "-m", "777", str(path))
    elif shape == "a_symlink":
        _as(attacker, attacker, "ln", "-s", str(target), str(path))
    else:
        _as(attacker, attacker, "touch", str(path))


@pytest.fixture
def victim_env(tmp_path):
    """make_env(uid, gid, **extra): a victim's environment, with a TMPDIR of its own (for
    disk backups) and no runtime directory; its names under /dev/shm are removed after."""
    made = []

    def make_env(uid, gid, **extra):
        tmp = Path(tempfile.mkdtemp(prefix="tms-victim-"))
        os.chown(tmp, uid, gid)
        made.append((tmp, uid))
        return child_env({"TMS_HOST_BACKUP_LIMIT_NAME": f"test-{uuid.uuid4().hex[:12]}", "TMPDIR": tmp,
                          "XDG_RUNTIME_DIR": None, **extra})

    yield make_env
    for tmp, uid in made:
        shutil.rmtree(tmp, ignore_errors=True)
        for name in _shared_names(uid):
            _remove(name)


@pytest.fixture
def squatted(other_uids):
    """(victim uid, attacker uid), and every name the attacker made removed after."""
    victim, attacker = other_uids
    yield victim, attacker
    for name in _shared_names(victim) + _shared_names(attacker):
        _remove(name)


@pytest.mark.parametrize("shape", ["their_directory", "a_0777_directory", "a_symlink", "a_file"])
def test_another_user_cannot_switch_the_budget_off(squatted, victim_env, shape):
    # A victim with no home (a uid the user database does not know, as in many containers)
    # and no runtime directory: the attacker makes its first name under /dev/shm before it.
    # Its pauses go on, with a warning, on a ledger under the next name, made by the victim.
    victim, attacker = squatted
    taken, second = _shared_names(victim)[:2]
    _squat(attacker, taken, shape, target=tempfile.gettempdir())
    env = victim_env(victim, victim, TMS_HOST_BACKUP_LIMIT="48MiB")
    h = Holder(env, as_user=(victim, victim))
    assert h.state["error"] is None and h.state["cpu"] == 2, h.state
    assert h.state["budget"]["reserved"] == 32 * MiB, h.state
    ledger = second / f"{env['TMS_HOST_BACKUP_LIMIT_NAME']}.ledger"
    assert h.state["budget"]["ledger"] == str(ledger), h.state
    assert ledger.is_file() and ledger.stat().st_uid == victim and (second.stat().st_mode & 0o777) == 0o700
    # A second process of the victim finds the same ledger: the budget is shared.
    other = Holder(env, as_user=(victim, victim))
    assert other.state["error"] is not None and "host backup budget" in other.state["error"], other.state
    assert other.finish(stderr=[f"the host backup ledger skips {taken}: "]) == "done\n"
    assert h.finish(stderr=[f"the host backup ledger skips {taken}: "]) == "done\n"


def test_with_every_place_taken_each_process_keeps_its_own_budget(squatted, victim_env):
    # Every name under /dev/shm taken as well: no pause fails; each process counts its own
    # backups against the budget, and says so once.
    victim, attacker = squatted
    for name in _shared_names(victim):
        _squat(attacker, name)
    env = victim_env(victim, victim, TMS_HOST_BACKUP_LIMIT="48MiB")
    first, second = Holder(env, as_user=(victim, victim)), Holder(env, as_user=(victim, victim))
    for h in (first, second):
        assert h.state["error"] is None and h.state["cpu"] == 2, h.state
        assert h.state["budget"]["ledger"] is None and h.state["budget"]["reserved"] == 32 * MiB, h.state
    for h in (first, second):
        out, err = h.proc.communicate("resume\n\n", timeout=60)
        assert h.proc.returncode == 0 and out == "done\n", err
        assert err.count("no private place for the host backup ledger") == 1, err
        assert "count this process's backups alone" in err, err
        assert err.count("the host backup ledger skips") == 1, err  # the first name stands for the rest


def test_the_users_runtime_directory_comes_first(tmp_path):
    run = tmp_path / "run"
    run.mkdir(mode=0o700)
    env = _env(tmp_path, TMS_HOST_BACKUP_LIMIT="48MiB", XDG_RUNTIME_DIR=run)
    first, second = Holder(env), Holder(env)
    ledger = run / "torch_memory_saver" / f"{env['TMS_HOST_BACKUP_LIMIT_NAME']}.ledger"
    assert first.state["error"] is None and first.state["budget"]["ledger"] == str(ledger), first.state
    assert second.state["error"] is not None and "host backup budget" in second.state["error"], second.state
    assert second.finish() == "done\n" and first.finish() == "done\n"


def test_a_runtime_directory_others_can_use_is_skipped(squatted, victim_env, tmp_path):
    victim, attacker = squatted
    run = Path(tempfile.mkdtemp(prefix="tms-run-"))
    os.chown(run, victim, victim)
    os.chmod(run, 0o777)
    try:
        env = victim_env(victim, victim, TMS_HOST_BACKUP_LIMIT="48MiB", XDG_RUNTIME_DIR=run)
        h = Holder(env, as_user=(victim, victim))
        assert h.state["error"] is None, h.state
        assert h.state["budget"]["ledger"].startswith(str(_shared_names(victim)[0]) + "/"), h.state
        assert h.finish(stderr=[f"the host backup ledger skips {run}: it is not this user's alone"]) == "done\n"
    finally:
        shutil.rmtree(run, ignore_errors=True)


def test_processes_of_one_user_find_one_ledger_whatever_their_environment(two_users, victim_env):
    # The names under /dev/shm taken, two processes of the victim with different
    # environments share the budget (the home's place comes from the user database).
    victim, attacker = two_users
    for name in _shared_names(victim.pw_uid):
        _squat(attacker.pw_uid, name)
    env = victim_env(victim.pw_uid, victim.pw_gid, TMS_HOST_BACKUP_LIMIT="48MiB")
    first = Holder({**env, "XDG_RUNTIME_DIR": f"/run/user/{victim.pw_uid}", "HOME": "/nonexistent"},
                   as_user=(victim.pw_uid, victim.pw_gid))
    second_env = {k: v for k, v in env.items() if k not in ("XDG_RUNTIME_DIR", "HOME")}
    second = Holder(second_env, as_user=(victim.pw_uid, victim.pw_gid))
    assert first.state["error"] is None, first.state
    ledger = _home_ledger_dir(victim.pw_dir) / f"{env['TMS_HOST_BACKUP_LIMIT_NAME']}.ledger"
    assert first.state["budget"]["ledger"] == str(ledger), first.state
    assert ledger.is_file() and ledger.stat().st_uid == victim.pw_uid
    assert second.state["error"] is not None and "host backup budget" in second.state["error"], second.state
    assert second.finish() == "done\n"
    assert first.finish() == "done\n"


def _unshare_pid():
    cmd = ["unshare", "--pid", "--fork", "--mount-proc"]
    if not shutil.which("unshare"):
        pytest.skip("no unshare")
    probe = subprocess.run([*cmd, "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"a PID namespace is not permitted here: {probe.stderr.strip()}")
    return cmd


def test_a_process_in_another_pid_namespace_shares_the_budget(tmp_path):
    # As a container with --ipc=host: its own PID namespace and /proc, the host's /dev/shm.
    unshare = _unshare_pid()
    env = _env(tmp_path, TMS_HOST_BACKUP_LIMIT="48MiB")
    for first_prefix, second_prefix in ((unshare, ()), ((), unshare)):
        first = Holder(env, prefix=first_prefix)
        second = Holder(env, prefix=second_prefix)
        assert first.state["error"] is None, first.state
        assert second.state["error"] is not None and "host backup budget" in second.state["error"], second.state
        assert second.state["budget"]["reserved"] == 32 * MiB, second.state
        assert second.finish() == "done\n" and first.finish() == "done\n"


def test_a_killed_process_not_yet_reaped_gives_its_reservation_back(tmp_path):
    env = _env(tmp_path, TMS_HOST_BACKUP_LIMIT="48MiB")
    killed = Holder(env)
    killed.proc.send_signal(signal.SIGKILL)
    os.waitid(os.P_PID, killed.proc.pid, os.WEXITED | os.WNOWAIT)   # dead, and a zombie: its /proc entry stays
    assert Path(f"/proc/{killed.proc.pid}/stat").read_text().split(") ")[1].startswith("Z")
    after = Holder(env)
    assert after.state["error"] is None and after.state["budget"]["reserved"] == 32 * MiB, after.state
    assert after.finish() == "done\n"
    killed.proc.communicate(timeout=60)


def _meminfo_text(tmp_path, text):
    path = tmp_path / "meminfo"
    path.write_text(text)
    return path


@pytest.mark.parametrize("hook,value", [("TMS_HOST_MEMINFO", "/dev/zero"), ("TMS_HOST_MEMINFO", "/dev/urandom"),
                                        ("TMS_HOST_MEMINFO", "fifo"), ("TMS_HOST_COPY_GATE", "fifo")])
def test_a_test_hook_cannot_hold_a_pause(tmp_path, hook, value):
    if value == "fifo":
        value = tmp_path / "fifo"
        os.mkfifo(value)                                   # nobody ever writes to it
    env = _env(tmp_path, **{hook: value})
    proc = subprocess.run([sys.executable, str(HOST_SCENARIOS / "budget.py"), "hold", "2", "16"], cwd=REPO, env=env,
                          input="resume\n\n", capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    state, done = proc.stdout.splitlines()
    assert json.loads(state)["error"] is None and done == "done", proc.stdout


def test_meminfo_numbers_out_of_range_read_as_unknown(tmp_path):
    # A negative figure, one past 2^64 and one past 4 PiB: unknown, not wrapped.
    path = _meminfo_text(tmp_path, "MemTotal: -5 kB\nMemAvailable: 18446744073709551617 kB\n")
    h = Holder(_env(tmp_path, TMS_HOST_MEMINFO=path))
    b = h.state["budget"]
    assert h.state["error"] is None and (b["mem_total"], b["mem_available"]) == (0, 0), h.state
    assert h.finish() == "done\n"
    path.write_text("MemTotal: 4503599627370496 kB\nMemAvailable: 1 kB\n")
    h = Holder(_env(tmp_path, TMS_HOST_MEMINFO=path, TMS_HOST_BACKUP_LIMIT="25%"))
    err = h.state["error"]                             # a share of an unknown size: the pause says so
    assert err is not None and "no MemTotal could be read from" in err and h.state["budget"]["mem_total"] == 0, h.state
    assert h.state["states"] == ["active", "active"]
    assert h.finish() == "done\n"


def _at_gate(proc, gate):
    """Waits until proc holds the gate open (its pause has reserved and waits at its
    first copy); False if its pause ended first."""
    fds = Path(f"/proc/{proc.pid}/fd")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for fd in list(fds.iterdir()) if fds.exists() else []:
            try:
                if os.readlink(fd) == str(gate):
                    return True
            except OSError:
                pass
        if proc.poll() is not None or select.select([proc.stdout], [], [], 0.01)[0]:
            return False
    return False


def test_without_a_limit_pauses_in_flight_count_against_the_five_percent(tmp_path):
    # 100 GiB of host memory, 5.04 GiB available: 40 MiB above the 5 % kept. One process's pause of
    # 32 MiB waits at its first copy; another's of 32 MiB would take the host under 5 %.
    meminfo = _meminfo_text(tmp_path, f"MemTotal: {100 << 20} kB\nMemAvailable: {int(5.04 * (1 << 20))} kB\n")
    gate = tmp_path / "gate"
    gate.write_bytes(b"")
    env = _env(tmp_path, TMS_HOST_MEMINFO=meminfo)
    copying = Holder({**env, "TMS_HOST_COPY_GATE": str(gate)}, wait=False)
    assert _at_gate(copying.proc, gate)
    other = Holder(env)
    err = other.state["error"]
    assert err is not None and "5 %" in err and "pauses still copying have reserved" in err, other.state
    assert other.state["states"] == ["active", "active"]
    gate.write_bytes(b"x")
    assert copying.read_state()["error"] is None
    again = Holder(env)                                # copied: MemAvailable counts it now, the ledger no more
    assert again.state["error"] is None, again.state
    for h in (other, again, copying):
        assert h.finish() == "done\n"


def test_a_run_leaves_no_ledger_file_behind(tmp_path):
    env = _env(tmp_path, TMS_HOST_BACKUP_LIMIT="80MiB")
    ledger = Path(env["XDG_RUNTIME_DIR"]) / "torch_memory_saver" / f"{env['TMS_HOST_BACKUP_LIMIT_NAME']}.ledger"
    killed, stays, resumes = Holder(env), Holder(env), Holder(env)
    assert ledger.is_file()
    killed.kill()                                      # its record stays behind, dead
    assert stays.finish("stay") == ""                  # exits paused
    assert resumes.finish("resume") == "done\n"        # the last one out
    assert not ledger.exists(), sorted(p.name for p in ledger.parent.iterdir())
    env = _env(tmp_path)                               # no limit: the 5 % safety's ledger
    h = Holder(env)
    assert h.finish() == "done\n"
    assert not (ledger.parent / f"{env['TMS_HOST_BACKUP_LIMIT_NAME']}.ledger").exists()
