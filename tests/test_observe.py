"""Issue 7 on the host backend: stats() arithmetic, memory_summary(), pause/resume
log lines, progress lines and the command line."""
import subprocess
import sys

from conftest import REPO, check_ok, child_env


def test_stats_follow_every_state_change(run_py):
    out = check_ok(run_py("""
        import torch_memory_saver
        G = 2 * MiB                                           # host backend granularity
        with tms.region("kv"):
            kv = core.malloc(3 * MiB)                         # reserves 4 MiB
        with tms.region("w", enable_cpu_backup=True, cpu_backup_backend="mmap"):
            w = core.malloc(5 * MiB + 1)                      # reserves 6 MiB
        with tms.region("p", enable_cpu_backup=True, cpu_backup_backend="pinned"):
            p1 = core.malloc(1, 1)                            # device 1, reserves 2 MiB
        s = torch_memory_saver.stats()
        assert s[0]["kv"]["allocations"] == 1 and s[0]["kv"]["bytes_requested"] == 3 * MiB, s
        assert s[0]["kv"]["bytes_reserved"] == 2 * G and s[0]["kv"]["bytes_mapped"] == 2 * G, s
        assert s[0]["w"]["bytes_reserved"] == 3 * G and s[1]["p"]["bytes_reserved"] == G, s
        assert s[0]["w"]["bytes_paused"] == 0 and s[0]["w"]["pauses"] == 0, s
        fill(w, 5 * MiB + 1)

        tms.pause()
        s = torch_memory_saver.stats()
        assert s[0]["kv"]["bytes_mapped"] == 0 and s[0]["kv"]["bytes_paused"] == 2 * G, s
        assert s[0]["kv"]["bytes_backup_mmap"] == 0 and s[0]["kv"]["bytes_to_host"] == 0, s
        assert s[0]["w"]["bytes_backup_mmap"] == 5 * MiB + 1 and s[0]["w"]["bytes_to_host"] == 5 * MiB + 1, s
        assert s[1]["p"]["bytes_backup_pinned"] == 1 and s[1]["p"]["bytes_backup_mmap"] == 0, s
        for dev, tag in ((0, "kv"), (0, "w"), (1, "p")):
            assert s[dev][tag]["pauses"] == 1 and s[dev][tag]["pause_ns"] > 0, (tag, s)
        # the emulated device's free bytes agree with the gauges
        for dev in (0, 1):
            free, total = core.mem_get_info(dev)
            assert total - free == sum(r["bytes_mapped"] for r in s[dev].values()) == 0, (dev, free, total, s)

        tms.resume("w")
        s = torch_memory_saver.stats()
        free, total = core.mem_get_info(0)
        assert total - free == s[0]["w"]["bytes_mapped"] == 3 * G, (free, total, s)
        assert s[0]["w"]["bytes_mapped"] == 3 * G and s[0]["w"]["bytes_backup_mmap"] == 0, s
        assert s[0]["w"]["resumes"] == 1 and s[0]["w"]["bytes_to_device"] == 5 * MiB + 1, s
        assert s[0]["kv"]["resumes"] == 0, s                 # other tags untouched
        core.free(kv)
        s = torch_memory_saver.stats()
        assert s[0]["kv"]["allocations"] == 0 and s[0]["kv"]["bytes_reserved"] == 0, s
        assert s[0]["kv"]["bytes_paused"] == 0 and s[0]["kv"]["pauses"] == 1, s   # counters stay
        print("done")
    """))
    assert out == "done\n"


def test_memory_summary_lists_every_tag(run_py):
    out = check_ok(run_py("""
        import torch_memory_saver
        assert "no allocations yet" in torch_memory_saver.memory_summary()
        with tms.region("kv_cache"):
            core.malloc(3 * MiB)
        with tms.region("weights", enable_cpu_backup=True):
            core.malloc(5 * MiB)
        tms.pause("weights")
        print(torch_memory_saver.memory_summary())
    """))
    lines = out.splitlines()
    assert lines[0] == "torch_memory_saver memory summary"
    assert lines[1].split()[:3] == ["device", "tag", "allocs"]
    rows = {line.split()[1]: line for line in lines[3:]}
    assert set(rows) == {"kv_cache", "weights"}
    assert "4.00 MiB" in rows["kv_cache"] and rows["kv_cache"].rstrip().endswith("0        0")
    # weights: reserved 6 MiB, mapped 0, paused 6 MiB, backup (mmap) 5 MiB, (disk) 0, 1 pause
    assert rows["weights"].split()[3:] == ["6.00", "MiB", "0", "B", "6.00", "MiB", "0", "B", "5.00", "MiB", "0", "B",
                                           "1", "0"]


def test_pause_and_resume_log_a_summary_at_info_and_allocations_at_debug(run_py):
    proc = run_py("""
        import logging
        logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(levelname)s %(name)s %(message)s")
        with tms.region("w", enable_cpu_backup=True):
            p = core.malloc(8 * MiB)
        tms.pause("w")
        tms.resume("w")
        logging.getLogger("torch_memory_saver").setLevel(logging.WARNING)
        tms.pause("w")                                   # silent
    """)
    out = check_ok(proc)
    lines = [l for l in out.splitlines() if "torch_memory_saver" in l]
    assert len(lines) == 4, out
    assert lines[0].startswith("INFO torch_memory_saver pause tag=w: released 8.00 MiB, 8.00 MiB copied in ")
    assert lines[0].endswith("GB/s")
    assert lines[1].startswith("DEBUG torch_memory_saver   0x") and "tag=w device=0 paused backup=mmap" in lines[1]
    assert lines[2].startswith("INFO torch_memory_saver resume tag=w: mapped 8.00 MiB, 8.00 MiB copied in ")
    assert "active backup=none" in lines[3]


def test_progress_lines_for_a_long_backed_up_pause(run_py):
    # A copy slowed down to take > 1 s: one worker, tiny blocks.
    out = check_ok(run_py("""
        import logging
        import torch_memory_saver._observe as observe
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        assert tms.progress is False                      # off by default
        tms.progress = True
        observe.PROGRESS_AFTER_S = 0.05
        observe.PROGRESS_EVERY_S = 0.05
        with tms.region("w", enable_cpu_backup=True):
            p = core.malloc(256 * MiB)
        d = fill(p, 256 * MiB)
        tms.pause("w")
        tms.resume("w")
        assert read(p, 256 * MiB) == d
    """, env={"TMS_BACKUP_THREADS": "1", "TMS_BACKUP_BLOCK_BYTES": "64KiB"}, timeout=120))
    progress = [l for l in out.splitlines() if "% (" in l]
    assert progress, out
    assert all(l.startswith(("pause tag=w: ", "resume tag=w: ")) and "of 256.00 MiB copied" in l for l in progress)


def test_progress_needs_a_bool(run_py):
    check_ok(run_py("""
        try:
            tms.progress = "yes"
        except TypeError as e:
            assert "progress must be a bool" in str(e)
        else:
            raise AssertionError("no TypeError")
    """))


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
