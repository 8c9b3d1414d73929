"""The settings table (src/platform/config.h) is the one place a setting is made: the
environment's parser, the known variables, the core's run-time accessors, the native
get/set methods and the singleton's properties all come from its rows, every value is
checked once, in C, the same before the core is loaded as after, and a new row is all a
new setting takes (a copy of the tree with two rows planted is built and used)."""
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

import torch_memory_saver
from torch_memory_saver import TorchMemorySaver
from torch_memory_saver import _tms_env

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text(encoding="utf-8")
ROWS = _tms_env.settings()
RUN = [row for row in ROWS if row["run"]]


def _env(**extra):
    """This environment less its TMS_* settings and preloads, on the host backend."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TMS_", "LD_PRELOAD"))}
    env.update({"PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1", "TMS_BACKEND": "host", **extra})
    return env


def _python(code, env, cwd=REPO):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and not proc.stderr, f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


def test_the_table_describes_every_row():
    names = [row["name"] for row in ROWS]
    assert len(names) == len(set(names)) and {"memory_margin_bytes", "retain_cpu_backup", "chunk_bytes"} <= set(names)
    for row in ROWS:
        assert row["type"] in ("bool", "int", "str") and row["doc"] and row["accepts"], row
        assert row["group"] in ("run", "env", "host", "outside") and row["run"] is (row["group"] == "run"), row
    # Run-time settings are switches and numbers, and texts a layer above keeps (the job).
    assert [row["type"] for row in RUN] and all(row["type"] in ("bool", "int", "str") for row in RUN)
    assert [row["name"] for row in RUN if row["type"] == "str"] == ["job"]


def test_the_known_variables_are_the_tables():
    own = [row["env"] for row in ROWS if row["env"] and row["group"] != "outside"]
    names = _tms_env.names()
    assert names[:len(own)] == own and set(names[len(own):]) == {"TMS_DEMO_REEXEC", "TMS_WERROR", "TMS_EXTRA_CFLAGS"}
    assert all(_tms_env.is_known(n) for n in names + ["TMS_BENCH_X", "TMS_TEST_X", "TMS_FUZZ_X"])
    assert not _tms_env.is_known("TMPDIR") and not _tms_env.is_known("TMS_BACKUP_THREAD")


def test_every_setting_is_documented_in_readme():
    # The variables tests and benchmarks use say so in their doc; every other one is the user's.
    env_table = README.split("## Environment", 1)[1].split("\n\n", 2)[1]
    missing = [row["env"] for row in ROWS if row["env"] and row["group"] != "outside"
               and not row["doc"].startswith("tests") and f"`{row['env']}" not in env_table]
    assert not missing, f"README's Environment table does not name {missing}"
    members = README.split("| member of `torch_memory_saver.torch_memory_saver` |", 1)[1].split("\n\n", 1)[0]
    missing = [row["name"] for row in RUN if f"`{row['name']} = " not in members]
    assert not missing, f"README's table of members does not show {missing}"


def test_every_run_time_setting_is_a_property_with_the_tables_doc():
    for row in RUN:
        member = vars(TorchMemorySaver)[row["name"]]
        assert isinstance(member, property) and member.fset and member.__doc__ == row["doc"], row["name"]
        assert isinstance(vars(type(torch_memory_saver))[row["name"]], property), row["name"]
    assert torch_memory_saver.entrypoint.setting_names() == sorted([*(row["name"] for row in RUN), "hook_mode"])


def test_the_python_layer_names_no_setting():
    # What it knows of settings it reads from the table: no row's name is written in it.
    text = (REPO / "torch_memory_saver" / "_settings.py").read_text()
    assert not [row["name"] for row in RUN if row["name"] in text]


def test_a_value_is_checked_once_in_c_the_same_before_and_after_first_use():
    out = _python("""
        import torch_memory_saver
        from torch_memory_saver import _tms_env
        tms = torch_memory_saver.torch_memory_saver

        def said(fn, value):
            try:
                fn(value)
            except Exception as e:
                return type(e).__name__, str(e)
            raise AssertionError(f"{value!r} accepted")

        cases = {}
        for row in _tms_env.settings():
            if row["run"]:
                bad = ([1, "yes", None, 0.0] if row["type"] == "bool" else [3, b"x", True, "no spaces", ".dot", "x" * 65]
                       if row["type"] == "str" else [-1, -(1 << 70), 1 << 64, 1.5, True, "1"])
                cases[row["name"]] = [(v, said(lambda v: _tms_env.check_setting(row["name"], v), v)) for v in bad]
        for name, seen in cases.items():
            before = getattr(tms, name)
            for value, want in seen:
                assert said(lambda v: setattr(tms, name, v), value) == want, (name, value)   # before first use
            assert getattr(tms, name) == before, name
        core = tms._core                                                                   # first use
        for name, seen in cases.items():
            before = getattr(core, "get_" + name)()
            for value, want in seen:
                assert said(lambda v: setattr(tms, name, v), value) == want, (name, value)
                assert said(getattr(core, "set_" + name), value) == want, (name, value)
            assert getattr(core, "get_" + name)() == getattr(tms, name) == before, name
        print(sorted(cases))
        print(cases["memory_margin_bytes"][0][1], cases["retain_cpu_backup"][0][1])
        """, _env())
    names, first = out.splitlines()
    assert names == repr(sorted(row["name"] for row in RUN))
    assert first == ("('ValueError', 'torch_memory_saver: memory_margin_bytes must be >= 0, got -1') "
                     "('TypeError', 'torch_memory_saver: retain_cpu_backup must be a bool, not int')")


# ---- a new setting is one row -----------------------------------------------------------

# Two rows of the kinds the next settings will be: a switch that changes at run time, and a
# name the environment gives.
PLANTED = [
    '    X(planted_switch, boolean, "TMS_PLANTED_SWITCH", 0, (), NULL, '
    'RUN(tms_core_set_planted_switch, tms_core_planted_switch), "Planted: pauses skip what did not change.") \\',
    '    X(planted_name, name, "TMS_PLANTED_NAME", "", (64), "a name of 1 to 64 letters, digits, \'_\', \'-\' or \'.\'", ENV, '
    '"planted: the job") \\',
]


def _build_description(src):
    desc = {}
    for line in (src / "build.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, value = line.split(None, 1)
            desc.setdefault(key, []).append(value.strip())
    return desc


def _build_package(tree):
    """Builds _tms_env and _tms_preload of tree/src into tree/torch_memory_saver, as setup.py
    does (build.txt's sources and flags), unoptimised for speed."""
    src, out = tree / "src", tree / "torch_memory_saver"
    desc = _build_description(src)
    flags = [*desc["cflags"][0].split(), "-include", str(src / desc["first"][0]), "-fPIC", "-O0", "-Werror",
             f"-I{src}", f"-I{tree / 'include'}", f"-I{sysconfig.get_paths()['include']}",
             "-DPy_LIMITED_API=0x030A0000"]
    modules = {
        "_tms_env": (desc["env"], []),
        "_tms_preload": (desc["core"] + desc["hooks"] + [v.split()[1] for v in desc["variant"] if v.startswith("preload ")]
                         + desc["face"], ["-DTMS_VARIANT=preload"]),
    }
    jobs = [(name, f, extra) for name, (files, extra) in modules.items() for f in files]
    objects = {name: [] for name in modules}

    def compile_one(job):
        name, f, extra = job
        obj = tree / "obj" / name / (f.replace("/", "_") + ".o")
        obj.parent.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["cc", *flags, *extra, "-c", str(src / f), "-o", str(obj)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, f"{f}: {proc.stderr}"
        return name, obj

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        for name, obj in pool.map(compile_one, jobs):
            objects[name].append(str(obj))
    ldflags = desc["ldflags"][0].split()
    for name, objs in objects.items():
        proc = subprocess.run(["cc", "-shared", *objs, "-o", str(out / f"{name}.abi3.so"), *ldflags],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr


@pytest.mark.slow
def test_a_new_setting_is_one_row_of_the_table(tmp_path):
    if not shutil.which("cc"):
        pytest.skip("no C compiler")
    tree = tmp_path / "tree"
    shutil.copytree(REPO / "src", tree / "src")
    shutil.copytree(REPO / "include", tree / "include")
    shutil.copytree(REPO / "torch_memory_saver", tree / "torch_memory_saver",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "include"))
    config = tree / "src" / "platform" / "config.h"
    text = config.read_text()
    table = re.search(r"#define TMS_SETTINGS\(X\)[ \t]*\\\n", text)
    assert table, "config.h has no TMS_SETTINGS(X)"
    text = text[:table.end()] + "".join(row + "\n" for row in PLANTED) + text[table.end():]
    config.write_text(text)
    _build_package(tree)

    env = _env(PYTHONPATH=str(tree), TMS_PLANTED_SWITCH="yes", TMS_PLANTED_NAME="rl-step_1")
    out = _python("""
        import warnings
        warnings.simplefilter("error")                       # a planted variable is no unknown one
        import torch_memory_saver
        from torch_memory_saver import _tms_env
        tms = torch_memory_saver.torch_memory_saver
        rows = {row["name"]: row for row in _tms_env.settings()}
        assert rows["planted_name"]["env"] == "TMS_PLANTED_NAME" and not rows["planted_name"]["run"] and rows["planted_switch"]["run"]
        assert {"TMS_PLANTED_SWITCH", "TMS_PLANTED_NAME"} <= set(_tms_env.names())
        assert tms.planted_switch is True                    # the environment's, before first use
        assert type(tms).planted_switch.__doc__ == "Planted: pauses skip what did not change."
        tms.planted_switch = False                           # waits for the core
        try:
            tms.planted_switch = 1
        except TypeError as e:
            print(e)
        core = tms._core
        assert core.get_planted_switch() is False            # reached the core's accessor
        tms.planted_switch = True
        assert core.get_planted_switch() is True and torch_memory_saver.planted_switch is True
        print(core.__file__.endswith("tree/torch_memory_saver/_tms_preload.abi3.so"))
        """, env, cwd=tree)
    assert out == "torch_memory_saver: planted_switch must be a bool, not int\nTrue\n", out
    for var, value, said in [("TMS_PLANTED_NAME", "../etc", "TMS_PLANTED_NAME='../etc' is not a name of 1 to 64"),
                             ("TMS_PLANTED_SWITCH", "maybe", "TMS_PLANTED_SWITCH='maybe' is not a boolean")]:
        proc = subprocess.run([sys.executable, "-c", "import torch_memory_saver"], cwd=tree, env=_env(
            PYTHONPATH=str(tree), **{var: value}), capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1 and f"ValueError: torch_memory_saver: {said}" in proc.stderr, proc.stderr


def test_python_reads_the_librarys_variables_only_through_the_table():
    # One reader of TMS_* (the C table, _tms_env.env_choice for a choice asked before the core
    # loads): a variable read by hand in Python would escape its checks and its documentation.
    # The command line's own variables (TMS_ENV_ELSEWHERE) are the exception.
    package = Path(__file__).resolve().parent.parent / "torch_memory_saver"
    read = re.compile(r"""(?:environ\.get\(|environ\[|getenv\()\s*["'](TMS_[A-Z_]+)["']\s*[),\]]""")
    elsewhere = {"TMS_DEMO_REEXEC"}
    found = [f"{p.name}: {name}" for p in sorted(package.glob("*.py")) for m in read.finditer(p.read_text())
             for name in [m.group(1)] if name not in elsewhere and not re.search(
                 rf"environ\[[\"']{name}[\"']\]\s*=", p.read_text()[m.start():m.end() + 4])]
    assert not found, found
