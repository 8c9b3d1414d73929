"""On the host backend: stats() arithmetic, memory_summary(), pause/resume
log lines, progress lines and the command line."""
import os
import subprocess
import sys

import pytest

from conftest import REPO, child_env
from host_scenarios import observe


def test_stats_follow_every_state_change(in_child):
    in_child(observe.stats_follow_every_state_change)


def test_memory_summary_lists_every_tag(in_child):
    out = in_child.output(observe.memory_summary)
    lines = out.splitlines()
    assert lines[0] == "torch_memory_saver memory summary"
    assert lines[1].split()[:3] == ["device", "tag", "allocs"]
    rows = {line.split()[1]: line for line in lines[3:-1]}
    assert set(rows) == {"kv_cache", "weights"}
    assert lines[-1] == "host backups: 5.00 MiB by this process, no budget (5 % of host memory kept available)"
    assert "4.00 MiB" in rows["kv_cache"] and rows["kv_cache"].rstrip().endswith("0        0")
    # weights: reserved 6 MiB, mapped 0, paused 6 MiB, backup (mmap) 5 MiB, (disk) 0, 1 pause
    assert rows["weights"].split()[3:] == ["6.00", "MiB", "0", "B", "6.00", "MiB", "0", "B", "5.00", "MiB", "0", "B",
                                           "1", "0"]


def test_pause_and_resume_log_a_summary_at_info_and_allocations_at_debug(in_child):
    out = in_child.output(observe.log_lines)
    lines = [l for l in out.splitlines() if "torch_memory_saver" in l]
    assert len(lines) == 4, out
    assert lines[0].startswith("INFO torch_memory_saver pause tag=w: released 8.00 MiB, 8.00 MiB copied in ")
    assert lines[0].endswith("GB/s")
    assert lines[1].startswith("DEBUG torch_memory_saver   0x") and "tag=w device=0 paused backup=mmap" in lines[1]
    assert lines[2].startswith("INFO torch_memory_saver resume tag=w: mapped 8.00 MiB, 8.00 MiB copied in ")
    assert "active backup=none" in lines[3]


def test_progress_lines_for_a_long_backed_up_pause(in_child, tmp_path):
    # A copy slowed down: one worker, tiny blocks; and held at the gate until a progress line is out.
    out = in_child.output(observe.progress_lines, timeout=120, env={
        "TMS_BACKUP_THREADS": "1", "TMS_BACKUP_BLOCK_BYTES": "64KiB", "TMS_HOST_COPY_GATE": tmp_path / "gate"})
    progress = [l for l in out.splitlines() if "% (" in l]
    assert progress, out
    assert all(l.startswith(("pause tag=w: ", "resume tag=w: ")) and "of 256.00 MiB copied" in l for l in progress)


@pytest.mark.parametrize("op, progress", [("pause", "on"), ("resume", "on"), ("pause", "off")])
def test_ctrl_c_lets_the_call_finish_logs_its_summary_then_raises(in_child, tmp_path, op, progress):
    # With progress lines the call runs in a thread: Ctrl-C must not abandon it there
    # either, and is acknowledged on stderr while the call runs.
    child = in_child.run(observe.interrupt_mid_call, op, progress, timeout=120,
                         env={"TMS_HOST_COPY_GATE": tmp_path / "gate"})
    child.result(stderr_empty=False)
    done, what = ("paused", "released") if op == "pause" else ("active", "mapped")
    assert child.stdout.splitlines() == [f"KeyboardInterrupt [('w', '{done}')]",
                                         f"logged: {op} tag=w: {what} 64.00 MiB, 64.00 MiB",
                                         "same bytes: True"], child.describe()
    ack = f"torch_memory_saver: Ctrl-C noted: the {op} of tag=w finishes first, then KeyboardInterrupt is raised\n"
    assert child.stderr == (ack if progress == "on" else ""), child.describe()


def progress_without_logging(interrupt):
    """A 64 MiB backed-up pause with progress on and logging never configured; returns
    whether it raised KeyboardInterrupt, the tag's state and whether the bytes came
    back. Its first copy waits at the gate (TMS_HOST_COPY_GATE) until the first
    progress line is on stderr, or with interrupt, until the Ctrl-C that line sends
    is acknowledged there: the pause cannot end before."""
    import faulthandler
    import logging
    import signal
    import threading

    import torch_memory_saver._observe as observe
    from _prelude import MiB, fill, read, start, states, tms

    faulthandler.dump_traceback_later(30, exit=True)   # no line on stderr: the pause waits, and fails here
    gate = os.open(os.environ["TMS_HOST_COPY_GATE"], os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    main, real, seen = threading.main_thread().ident, sys.stderr, []

    class Watch:  # stderr as written, acting on the library's lines
        def write(self, text):
            real.write(text)
            if "% (" in text and not seen:
                seen.append(text)
                if interrupt:
                    signal.pthread_kill(main, signal.SIGINT)
                else:
                    os.write(gate, b"x")
            if "Ctrl-C noted" in text:
                os.write(gate, b"x")
            return len(text)

        def flush(self):
            real.flush()

    start()
    assert not logging.getLogger("torch_memory_saver").hasHandlers()
    sys.stderr = Watch()
    observe.PROGRESS_AFTER_S = observe.PROGRESS_EVERY_S = 0.05
    tms.progress = True
    with tms.region("w", enable_cpu_backup=True):
        p = tms.malloc(64 * MiB)
    d = fill(p, 64 * MiB)
    try:
        tms.pause("w")
        raised = False
    except KeyboardInterrupt:
        raised = True
    sys.stderr = real
    paused = states()
    tms.progress = False
    tms.resume("w")
    faulthandler.cancel_dump_traceback_later()
    return raised, paused, read(p, 64 * MiB) == d


@pytest.mark.parametrize("interrupt", [False, True])
def test_progress_shows_on_stderr_without_logging_and_acknowledges_ctrl_c_at_once(in_child, tmp_path, interrupt):
    child = in_child.run(progress_without_logging, interrupt, timeout=120, env={
        "TMS_BACKUP_THREADS": "1", "TMS_BACKUP_BLOCK_BYTES": "64KiB", "TMS_HOST_COPY_GATE": tmp_path / "gate"})
    assert child.result(stderr_empty=False) == (interrupt, [("w", "paused")], True), child.describe()
    lines = child.stderr.splitlines()
    ack = "torch_memory_saver: Ctrl-C noted: the pause of tag=w finishes first, then KeyboardInterrupt is raised"
    progress = [i for i, line in enumerate(lines) if "% (" in line]
    assert progress and all(lines[i].startswith("torch_memory_saver: pause tag=w: ")
                            and lines[i].endswith(" s)") and "of 64.00 MiB copied" in lines[i] for i in progress), lines
    assert lines[-1].startswith("torch_memory_saver: pause tag=w: released 64.00 MiB, 64.00 MiB copied in "), lines
    assert [i for i, line in enumerate(lines) if line == ack] == ([progress[0] + 1] if interrupt else []), lines
    assert len(lines) == len(progress) + 1 + interrupt, lines


def test_progress_needs_a_bool(in_child):
    in_child(observe.progress_needs_a_bool)


def test_cli_info_preload_path_and_run():
    env = child_env()
    info = subprocess.run([sys.executable, "-m", "torch_memory_saver", "info"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert info.returncode == 0, info.stderr
    assert info.stdout.startswith("torch_memory_saver 0.1.0\n")
    assert "backend           host" in info.stdout and "preload active    False" in info.stdout
    path = subprocess.run([sys.executable, "-m", "torch_memory_saver", "preload-path"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert path.returncode == 0 and path.stdout.strip().endswith(".so") and "_tms_preload" in path.stdout
    run = subprocess.run([sys.executable, "-m", "torch_memory_saver", "run", "--", sys.executable, "-m",
                          "torch_memory_saver", "info"], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "preload active    True" in run.stdout
    missing = subprocess.run([sys.executable, "-m", "torch_memory_saver", "run", "--", "/no/such/program"],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert missing.returncode == 127 and "cannot run '/no/such/program'" in missing.stderr


def _cli(*args, **kw):
    return subprocess.run([sys.executable, "-m", "torch_memory_saver", *args], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=60, **kw)


def test_cli_version_help_and_missing_command():
    version = _cli("--version")
    assert version.returncode == 0 and version.stdout == "torch_memory_saver 0.1.0\n"
    helptext = _cli("--help").stdout
    assert "release the GPU memory" in helptext and "--version" in helptext and "run -- CMD" in helptext
    demo_help = _cli("demo", "--help").stdout
    assert "Default: preload" in " ".join(demo_help.split())
    missing = _cli("run", "--", "no_such_program_here")
    assert missing.returncode == 127
    assert missing.stderr == "torch_memory_saver run: cannot run 'no_such_program_here': No such file or directory\n"


def test_cli_info_into_a_closed_pipe_is_quiet():
    # The reader is gone before the first line is written: no BrokenPipeError traceback.
    r, w = os.pipe()
    os.close(r)
    try:
        proc = subprocess.run([sys.executable, "-m", "torch_memory_saver", "info"], cwd=REPO, env=child_env(),
                              stdout=w, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(w)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_cli_memory_report():
    proc = _cli("memory-report")
    assert proc.returncode == 0, proc.stderr
    head, row = proc.stdout.splitlines()
    assert head.split()[:4] == ["device", "total", "used", "ours_active"] and row.split()[:3] == ["0", "16.000", "GiB"]


def test_demo_on_the_host_backend_times_every_step():
    proc = _cli("demo")
    assert proc.returncode == 0, proc.stderr
    rows = [l for l in proc.stdout.splitlines() if l.startswith("| allocate")]
    assert len(rows) == 1 and float(rows[0].rsplit("|", 2)[1]) > 0, proc.stdout
    assert rows[0].startswith("| allocate+touch 256 MiB kv_cache + 256 MiB weights "), rows  # as --help and README say
    assert "weights restored exactly: True" in proc.stdout


def test_report_type_declarations_name_every_byte_field():
    """The TYPE_CHECKING declarations of DeviceReport and Report, written by hand for
    type checkers, list exactly the byte fields the core declares, in its order."""
    import ast

    from torch_memory_saver import _report

    tree = ast.parse(open(_report.__file__).read())
    declared = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef) and n.name in ("DeviceReport", "Report")):
        block = next(n for n in cls.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING")
        declared[cls.name] = [s.target.id for s in block.body if isinstance(s, ast.AnnAssign)]
    want = [name for name, _doc in _report.BYTE_FIELDS]
    assert declared == {"DeviceReport": want, "Report": want}, (declared, want)


def test_a_resume_reports_what_it_mapped_and_both_levels_carry_every_field(in_child):
    in_child(observe.report_fields_on_both_levels)
