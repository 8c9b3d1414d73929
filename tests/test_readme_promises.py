"""What README tells a new user holds: every member it lists exists on the module as
on the singleton, its calls are shown as they are used, the command line answers in
one line, a misspelt variable is named, and the Makefile's commands do what they say."""
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, check_ok, child_env, libcuda_present
from host_scenarios import api, disk_backup, import_env

README = (REPO / "README.md").read_text(encoding="utf-8")


def readme_members():
    """The names in the first column of README's table of the singleton's members."""
    table = README.split("| member of `torch_memory_saver.torch_memory_saver` |", 1)[1].split("\n\n", 1)[0]
    names = []
    for line in table.splitlines()[2:]:
        cell = line.replace("\\|", "/").split("|")[1]
        names += re.findall(r"`([a-z_]+)(?=[(` =])", cell)
    return sorted(set(names))


def test_readme_member_table_is_read():
    members = readme_members()
    assert {"region", "pause", "resume", "is_paused", "paused_tags", "disable", "cuda_graph", "hook_mode",
            "preload_method", "get_cpu_backup", "set_disk_backup_dir", "disk_backup_dir", "malloc", "free",
            "memory_report", "host_budget", "stats"} <= set(members), members


def test_every_member_readme_lists_is_on_the_module_and_acts_on_the_singleton(run_scenario):
    out = check_ok(run_scenario("api", "module_level_calls", ",".join(readme_members())))
    assert out == "done\n"


def readme_calls():
    """(name, [(parameter, default text or None)]) of each call README's member table shows."""
    table = README.split("| member of `torch_memory_saver.torch_memory_saver` |", 1)[1].split("\n\n", 1)[0]
    calls = []
    for line in table.splitlines()[2:]:
        for name, params in re.findall(r"`([a-z_]+)\((.*?)\)`", line.split("|")[1]):
            shown = [p.strip() for p in params.split(",") if p.strip()]
            calls.append((name, [(p.split("=", 1)[0], p.split("=", 1)[1] if "=" in p else None) for p in shown]))
    return calls


def test_readme_shows_each_call_with_its_parameter_names_and_defaults():
    import ast
    import inspect

    from torch_memory_saver import TorchMemorySaver

    calls = readme_calls()
    assert {"region", "get_cpu_backup", "memory_report", "share", "malloc"} <= {n for n, _ in calls}, calls
    for name, shown in calls:
        real = [p for p in inspect.signature(getattr(TorchMemorySaver, name)).parameters.values() if p.name != "self"]
        # A bare `*` where the keyword-only parameters start, as Python writes it.
        star = next((i for i, p in enumerate(real) if p.kind is p.KEYWORD_ONLY), None)
        assert [i for i, (p, _) in enumerate(shown) if p == "*"] == ([] if star is None else [star]), (name, shown)
        shown = [(p, d) for p, d in shown if p != "*"]
        assert [p for p, _ in shown] == [p.name for p in real], (name, shown, [p.name for p in real])
        for (param, default), p in zip(shown, real):
            if default is not None:
                assert ast.literal_eval(default) == p.default, (name, param, default, p.default)


def test_module_level_names_readme_promises_exist():
    import torch_memory_saver

    said = README.split("Module level:", 1)[1].split("\n\n", 1)[0]
    said = re.sub(r"\([^()]{2,}\)", "", said)                        # what each is, in parentheses
    names = re.findall(r"`(?:with )?([A-Za-z_][A-Za-z_0-9]*)(?:\(\):?)?`", said)
    assert {"configure_subprocess", "Error", "Report"} <= set(names), names
    for name in names:
        assert hasattr(torch_memory_saver, name), f"README promises torch_memory_saver.{name}"


def test_readme_shows_configure_subprocess_as_the_context_manager_it_is():
    import torch_memory_saver

    with torch_memory_saver.configure_subprocess():
        assert "_tms_preload" in os.environ["LD_PRELOAD"]
    shown = re.findall(r"(.{0,5})`?configure_subprocess\(\)", README)
    assert shown and all(before.endswith("with ") for before in shown), shown


def test_disk_backup_dir_is_made_with_its_missing_parents_as_readme_says(run_scenario, tmp_path):
    check_ok(run_scenario("api", "disk_dir_with_missing_parents", tmp_path))
    assert "created with missing parents, mode 0700" in README


def test_memory_report_names_what_is_wrong_with_devices(run_scenario):
    assert check_ok(run_scenario("api", "memory_report_arguments")) == "done\n"


# ---- the command line -------------------------------------------------------------------


def _cli(*args, env=None, backend=None):
    return subprocess.run([sys.executable, "-m", "torch_memory_saver", *args], cwd="/", capture_output=True,
                          text=True, timeout=120, env=child_env(env, backend=backend))


@pytest.mark.skipif(libcuda_present(), reason="a CUDA driver is here: memory-report has a GPU to report")
def test_memory_report_without_a_gpu_is_one_line():
    proc = _cli("memory-report")
    assert proc.returncode == 1 and proc.stdout == "", proc
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and "CUDA driver not found" in lines[0] and "TMS_BACKEND=host" in lines[0], proc.stderr
    assert lines[0].startswith("python -m torch_memory_saver memory-report: "), lines


@pytest.mark.parametrize("command", ["info", "preload-path", "memory-report", "demo"])
def test_a_malformed_variable_is_one_line_for_every_command(command):
    proc = _cli(command, env={"TMS_BACKUP_THREADS": "lots"}, backend="host")
    assert proc.returncode == 1 and proc.stdout == "", proc
    assert proc.stderr == "torch_memory_saver: TMS_BACKUP_THREADS='lots' is not a number from 1 to 32\n", proc.stderr


def test_a_program_importing_the_package_still_gets_the_value_error(run_py):
    proc = run_py("import torch_memory_saver", prelude=False, env={"TMS_BACKUP_THREADS": "lots"})
    assert proc.returncode == 1 and "ValueError: torch_memory_saver: TMS_BACKUP_THREADS='lots'" in proc.stderr


def test_every_error_of_a_bad_argument_starts_with_the_librarys_name(in_child):
    # Each call's mistake is in its arguments; what is checked in Python and what in C
    # alike say who is speaking. get_cpu_backup's zero_copy is a bool, as README shows.
    calls = ["tms.free(-1)", "tms.free(1 << 70)", "tms.free('x')", "tms.pause(3)", "tms.resume(['w', 3])",
             "tms.pause('w', measure_free=1)", "tms.is_paused(3)", "tms.malloc('x')",
             "setattr(tms, 'progres', True)", "setattr(tms, 'progress', 'yes')",
             "setattr(torch_memory_saver, 'progres', True)", "tms.get_cpu_backup(t, zero_copy='yes')",
             "tms.get_cpu_backup(t, zero_copy=1)", "tms.region(3).__enter__()", "tms.set_disk_backup_dir(3)"]
    said = dict(in_child(api.bad_argument_errors, calls))
    out = "\n".join(f"{c} -> {e}" for c, e in said.items())
    assert list(said) == calls, out
    assert {c: e for c, e in said.items() if not e.split(" ", 1)[-1].startswith("torch_memory_saver: ")} == {}, out
    assert said["tms.get_cpu_backup(t, zero_copy='yes')"] == \
        "TypeError torch_memory_saver: get_cpu_backup(zero_copy=...) must be a bool, not str", out
    assert "there is no setting 'progres'; did you mean 'progress'?" in said["setattr(tms, 'progres', True)"], out


def test_a_misspelt_variable_is_named_with_the_one_it_is_close_to(run_py):
    proc = run_py("import torch_memory_saver", prelude=False, env={"TMS_BACKUP_THREAD": "4", "TMS_OTHER_TOOL": "1"})
    assert proc.returncode == 0, proc.stderr
    assert ("RuntimeWarning: torch_memory_saver: TMS_BACKUP_THREAD is not a variable of this library and is "
            "ignored; did you mean TMS_BACKUP_THREADS?") in proc.stderr, proc.stderr
    assert "TMS_OTHER_TOOL" not in proc.stderr                       # another program's: not ours to judge
    proc = run_py("import torch_memory_saver", prelude=False, env={"TMS_OTHER_TOOL": "1", "TMS_LOG": "debug"})
    assert proc.returncode == 0 and "TMS_OTHER_TOOL is not a variable of this library; ignored" in proc.stderr


def test_every_variable_readme_documents_is_known(in_child):
    # Less a C constant's prefix and the example of a misspelling.
    documented = sorted(set(re.findall(r"`(TMS_[A-Z0-9_]+)", README)) - {"TMS_STATUS_", "TMS_BACKUP_THREAD"})
    assert in_child(import_env.unknown_variables, documented) == ([], [])


# ---- the Makefile -----------------------------------------------------------------------


def test_make_clean_removes_every_build_output(tmp_path):
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    outputs = ["build/temp/x.o", "dist/x.whl", "torch_memory_saver/_tms_preload.abi3.so",
               "torch_memory_saver_hook_mode_preload.abi3.so", "torch_memory_saver/include/torch_memory_saver.h",
               "torch_memory_saver.egg-info/PKG-INFO", "torch_memory_saver/__pycache__/x.pyc"]
    kept = ["torch_memory_saver/__init__.py", "src/core/pause.c", "include/torch_memory_saver.h"]
    for f in outputs + kept:
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("x")
    subprocess.run(["make", "-s", "clean"], cwd=tmp_path, check=True, capture_output=True, timeout=60)
    assert [f for f in outputs if (tmp_path / f).exists()] == []
    assert [f for f in kept if not (tmp_path / f).exists()] == []


def test_make_check_keeps_nothing_in_pips_cache(tmp_path):
    """make check's tests build wheels from an sdist, which pip would keep in its cache
    (outside the tree) for good: every step make check runs tells pip to use none."""
    # A stand-in interpreter: records each call's arguments and environment and does nothing.
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\nimport json, os, sys\n"
                    f"open({str(calls)!r}, 'a').write(json.dumps([sys.argv[1:], dict(os.environ)]) + '\\n')\n")
    fake.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "MAKE", "MFLAGS"))}
    proc = subprocess.run(["make", "-s", "check", f"PYTHON={fake}"], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    import json

    runs = [json.loads(line) for line in calls.read_text().splitlines()]
    pytest_envs = [e for argv, e in runs if argv[:2] == ["-m", "pytest"]]
    assert len(pytest_envs) == 2, [argv for argv, _ in runs]          # make test, make test-packaging
    # What a test's `pip wheel` of an sdist leaves in the cache under that environment.
    project = tmp_path / "tiny"
    (project / "tiny").mkdir(parents=True)
    (project / "tiny" / "__init__.py").write_text("")
    (project / "setup.py").write_text("from setuptools import setup\nsetup(name='tiny', version='1.0', packages=['tiny'])\n")
    subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "sdist")], cwd=project, check=True,
                   capture_output=True, timeout=120)
    pip_envs = [{k: v for k, v in e.items() if k.startswith("PIP_")} for e in pytest_envs]
    assert pip_envs[0] == pip_envs[1], pip_envs
    cache = tmp_path / "cache"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "--no-index",
                           "-w", str(tmp_path / "w"), *(tmp_path / "sdist").iterdir()],
                          env={**env, "PIP_CACHE_DIR": str(cache), **pip_envs[0]}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert [w.name for w in (tmp_path / "w").iterdir()] == ["tiny-1.0-py3-none-any.whl"]
    assert not cache.exists() or sorted(str(p.relative_to(cache)) for p in cache.rglob("*") if p.is_file()) == []


def _tree_copy(dest):
    """The tracked files of this tree (what a fresh clone has), copied to dest."""
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    for name in files.decode().split("\0"):
        if name and (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def _objects(tree):
    """{object file: mtime} of a tree's build."""
    return {p: p.stat().st_mtime_ns for p in (tree / "build").rglob("*.o")}


@pytest.mark.slow
def test_make_builds_what_changed_and_reinstalls_from_any_state(tmp_path):
    """make build compiles again only what changed (once per variant), and make
    reinstall, from nothing installed, a regular install or an editable one, and over
    a truncated in-tree extension, leaves this tree installed editable and the package
    importable from anywhere."""
    tree = _tree_copy(tmp_path / "tree")

    def build():
        """The sources of the objects make build wrote (src/-relative, once per variant)."""
        before = _objects(tree) if (tree / "build").exists() else {}
        proc = subprocess.run(["make", "build"], cwd=tree, capture_output=True, text=True, timeout=600,
                              env=dict(os.environ, PYTHON=sys.executable))
        assert proc.returncode == 0, proc.stderr[-3000:]
        return sorted("src/" + p.with_suffix(".c").as_posix().split("/src/", 1)[1]
                      for p, t in _objects(tree).items() if before.get(p) != t and "/src/" in p.as_posix())

    assert len(build()) > 40
    assert build() == []
    os.utime(tree / "src" / "core" / "tags.c")
    assert build() == ["src/core/tags.c", "src/core/tags.c"]          # once per variant, and nothing else
    os.utime(tree / "src" / "core" / "span_index.h")                # a header: its includers, once per variant
    assert build() == ["src/core/span_index.c", "src/core/span_index.c", "src/core/table.c", "src/core/table.c"]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}

    def installed():
        code = ("import importlib.metadata as m, json, torch_memory_saver as t; d = m.distribution('torch_memory_saver');"
                "print(t.__file__, json.loads(d.read_text('direct_url.json') or '{}').get('dir_info', {}))")
        proc = subprocess.run([python, "-c", code], cwd="/", capture_output=True, text=True, timeout=120, env=env)
        return proc.stdout.strip() if proc.returncode == 0 else f"not importable: {proc.stderr[-500:]}"

    def reinstall():
        proc = subprocess.run(["make", "-s", "reinstall", f"PYTHON={python}"], cwd=tree, capture_output=True,
                              text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert installed() == f"{tree}/torch_memory_saver/__init__.py {{'editable': True}}"

    reinstall()                                                      # from nothing
    reinstall()                                                      # from itself
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps", str(tree)], check=True,
                   env=env, capture_output=True, timeout=600)
    assert installed().endswith("{}") and "site-packages" in installed()  # a regular install
    # ... and an in-tree extension cut short, which the build would keep as newer than its sources.
    os.truncate(tree / "torch_memory_saver" / "_tms_preload.abi3.so", 4096)
    reinstall()
    code = "from torch_memory_saver import torch_memory_saver as t; print(t._core.VARIANT)"
    proc = subprocess.run([python, "-c", code], cwd="/", capture_output=True, text=True, timeout=120,
                          env=dict(env, TMS_BACKEND="host"))
    assert proc.stdout == "preload\n", proc.stderr[-2000:]


def test_a_wheel_build_without_the_wheel_package_says_to_install_it():
    # As in a fresh venv of Python 3.11 (setuptools 65, no wheel), where setuptools' own
    # message is "invalid command 'bdist_wheel'": here neither has bdist_wheel.
    code = """if True:
        import runpy, sys
        class NoWheel:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "wheel" or name == "setuptools.command.bdist_wheel":
                    raise ImportError(f"no {name} here")
        sys.meta_path.insert(0, NoWheel())
        sys.argv = ["setup.py", "-q", "bdist_wheel"]
        runpy.run_path("setup.py", run_name="__main__")
    """
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc
    assert "needs the 'wheel' package" in proc.stderr and "`pip install wheel`" in proc.stderr, proc.stderr


def test_a_test_run_leaves_nothing_in_the_temporary_directory(tmp_path):
    # A run of two tests that write temporary files (tmp_path, a child's script),
    # on two workers as `make test` runs them, with a temporary directory of its own.
    temp = tmp_path / "temp"
    temp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TMS_"))}
    env["TMPDIR"] = str(temp)
    nodes = ["tests/test_api.py::test_without_ld_preload_the_hook_is_not_active",
             "tests/test_docs.py::test_link_checker_catches_a_broken_link"]
    workers = ["-n", "2"] if importlib.util.find_spec("xdist") else []
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *workers, *nodes],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 passed" in proc.stdout, proc.stdout
    assert sorted(os.listdir(temp)) == [], sorted(os.listdir(temp))


# ---- what README says of the demo, the command line and the files ------------------------


def test_readme_and_the_demo_name_what_the_demo_moves():
    from torch_memory_saver import _demo

    said = _demo.what_it_does()
    assert said == "pauses and resumes 5 GiB in two tags on a GPU (512 MiB on the host backend, where there is none)"
    assert said.split(" (")[0] in " ".join(README.split()) and "512 MiB on the host backend" in " ".join(README.split())
    assert said in " ".join(_cli("--help", backend="host").stdout.split())
    # The host demo's table names these sizes: tests/test_observe.py runs it.


@pytest.mark.skipif(libcuda_present(), reason="a CUDA driver is here: the demo may find a GPU")
def test_the_demo_asked_for_a_gpu_backend_without_a_gpu_stops_and_says_why():
    proc = _cli("demo", env={"TMS_BACKEND": "cuda"})
    assert proc.returncode == 1 and proc.stdout == "", proc
    assert proc.stderr.startswith("torch_memory_saver demo: TMS_BACKEND=cuda asks for a GPU, but PyTorch sees none"), \
        proc.stderr
    assert "to run the demo on the host backend" in proc.stderr


def test_readme_names_the_console_command_and_the_group_errors_failures():
    from torch_memory_saver.distributed import GroupError

    scripts = (REPO / "pyproject.toml").read_text().split("[project.scripts]", 1)[1].split("\n[", 1)[0]
    assert 'torch-memory-saver = "torch_memory_saver.__main__:main"' in scripts and "`torch-memory-saver`" in README
    assert "`GroupError.failures`" in README and GroupError("x", failures={1: "Error: no"}).failures == {1: "Error: no"}


def test_every_file_of_a_disk_backup_is_one_readme_names(in_child, tmp_path):
    bullet = README.split("**Files**:", 1)[1].split("\n- ", 1)[0].split("\n\n", 1)[0]
    patterns = re.findall(r"`(tms-<pid>-[^`]+)`", bullet)
    assert len(patterns) == 2, bullet
    names = [re.escape(p).replace(re.escape("<pid>"), r"\d+").replace(re.escape("<token>"), "[0-9a-f]{16}")
             .replace(re.escape("<random>"), "[0-9a-f]{16}") for p in patterns]
    files = in_child(disk_backup.files_while_paused, str(tmp_path / "d"), "preload")
    assert {next((i for i, rx in enumerate(names) if re.fullmatch(rx, f)), None) for f in files} == {0, 1}, (files, names)


def test_readme_shows_tensors_on_the_host_backend_backed_up_and_shared(run_py):
    pytest.importorskip("torch")
    block = README.split("## Without a GPU: the host backend", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    assert "tms.get_cpu_backup(t)" in block and "tms.share(t)" in block and "tms.open_shared(s)" in block, block
    out = check_ok(run_py(block + textwrap.dedent("""
        import pickle, subprocess, sys
        tms.pause("weights")
        assert tms.get_cpu_backup(t)[-1] == 7
        tms.resume("weights")
        other = ("import os, pickle, sys; os.environ['TMS_BACKEND'] = 'host'; "
                 "from torch_memory_saver import torch_memory_saver as tms; "
                 "x = tms.open_shared(pickle.loads(sys.stdin.buffer.read())); print(int(x[5])); x[5] = 9")
        print(subprocess.run([sys.executable, "-c", other], input=pickle.dumps(s), capture_output=True,
                             check=True).stdout.decode().strip(), int(t[5]))
        """), prelude=False))
    assert out == "7 9\n", out
