"""The package says it is typed (py.typed): mypy sees a user's script as the library
runs it. The module-level functions and settings exist, pause() and resume() return
a Report, each setting has the type the settings table gives it, and a misspelt
setting or a positional measure_free is an error in the script, as it is at run time."""
import os
import re
import subprocess
import sys
import textwrap

import pytest

from conftest import REPO

pytest.importorskip("mypy", reason="mypy is not installed here (make deps installs it where pip can)")

# The settings table's types as mypy spells them (it has spelt them more than one way).
SPELLINGS = {"bool": {"bool", "builtins.bool"}, "int": {"int", "builtins.int"},
             "str": {"str | None", "builtins.str | None", "Union[builtins.str, None]", "Optional[builtins.str]"}}
REPORT = {"torch_memory_saver._report.Report"}


def _mypy(tmp_path, lines):
    """{line number: what mypy said of it} for a script of these lines, with the package
    found in this tree (mypy does not follow an editable install's import hook); the
    package's own code and torch are not judged, only the script's use of them."""
    (tmp_path / "user.py").write_text("\n".join(lines) + "\n")
    (tmp_path / "mypy.ini").write_text(f"[mypy]\nfollow_imports = silent\ncache_dir = {tmp_path / 'cache'}\n"
                                       "[mypy-torch.*]\nfollow_imports = skip\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MYPY")}
    proc = subprocess.run([sys.executable, "-m", "mypy", "--config-file", "mypy.ini", "--no-error-summary", "user.py"],
                          cwd=tmp_path, env=dict(env, MYPYPATH=str(REPO)), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode in (0, 1) and not proc.stderr, proc
    said = {}
    for line in proc.stdout.splitlines():
        m = re.fullmatch(r"user\.py:(\d+): (.*)", line)
        assert m, proc.stdout
        said.setdefault(int(m.group(1)), []).append(m.group(2))
    return said


@pytest.fixture
def members():
    """(the singleton's public members, {setting: its type in the table})."""
    from torch_memory_saver import TorchMemorySaver
    from torch_memory_saver._settings import ROWS

    return sorted(n for n in vars(TorchMemorySaver) if not n.startswith("_")), {n: r["type"] for n, r in ROWS.items()}


def test_mypy_sees_the_module_the_singleton_and_their_settings(tmp_path, members):
    names, settings = members
    script = ["import torch_memory_saver",
              "from torch_memory_saver import Report, torch_memory_saver as tms",
              "with tms.region('w', enable_cpu_backup=True):",
              "    p: int = tms.malloc(1 << 20)",
              "report: Report = torch_memory_saver.pause(['w'], measure_free=True)",
              "with torch_memory_saver.configure_subprocess():",
              "    pass"]
    good = len(script)                                  # lines 1..good: no error
    revealed = {}                                       # line -> what its type must be
    for n in names:                                     # every member of the singleton, on the module
        script.append(f"reveal_type(torch_memory_saver.{n})")
        revealed[len(script)] = None
    for where in ("tms", "torch_memory_saver"):         # every setting, on both, with its table type
        for n, kind in settings.items():
            script.append(f"reveal_type({where}.{n})")
            revealed[len(script)] = SPELLINGS[kind]
    for call in ("tms.pause('w')", "torch_memory_saver.resume()"):
        script.append(f"reveal_type({call})")
        revealed[len(script)] = REPORT
    # Set last: mypy narrows a setting's type to the value set, for the lines after.
    script += ["tms.progress = True", "torch_memory_saver.retain_cpu_backup = False", "tms.job = None"]
    set_ok = range(len(script) - 2, len(script) + 1)
    bad = {"tms.progres = True": '"TorchMemorySaver" has no attribute "progres"',
           "torch_memory_saver.progres = True": 'Module has no attribute "progres"',
           "tms.pause('w', True)": "Too many positional arguments",
           "tms.progress = 'yes'": 'Incompatible types in assignment (expression has type "str", variable has type "bool")'}
    script += list(bad)
    said = _mypy(tmp_path, script)
    assert [n for n in [*range(1, good + 1), *set_ok] if n in said] == [], said
    for n, kinds in revealed.items():
        [note] = said[n]
        kind = note.split('Revealed type is "', 1)[1][:-1]
        assert kind != "Any" and (kinds is None or kind in kinds), (script[n - 1], note, kinds)
    for n, (line, error) in enumerate(bad.items(), len(script) - len(bad) + 1):
        errors = [e for e in said.get(n, []) if e.startswith("error: ")]
        assert len(errors) == 1 and error in errors[0], (line, said.get(n))
