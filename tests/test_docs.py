"""The documents stay usable: README.md short and for users, every relative link in it
and in docs/*.md leading somewhere, README linking only to what the sdist ships, and
docs/performance.md answering where the code points to it. Reads files only: no
build, no GPU, no import of the package."""
import fnmatch
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 300

# [text](target) and ![alt](target); the target ends at whitespace or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~)")


def _prose(path):
    """The file's text outside fenced code blocks (links in code are not links)."""
    out, in_code = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if FENCE.match(line.strip()):
            in_code = not in_code
            continue
        if not in_code:
            out.append(line)
    return "\n".join(out)


def _links(path):
    """Relative links of a Markdown file: (target path or "", anchor or "")."""
    found = []
    for target in LINK.findall(_prose(path)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        found.append((file_part, anchor))
    return found


def _slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to '-'."""
    text = re.sub(r"`|\*\*|\*|_(?=\w)|(?<=\w)_", "", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text, flags=re.UNICODE)
    return text.replace(" ", "-")


def _anchors(path):
    slugs, seen = set(), {}
    for line in _prose(path).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = _slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        slugs.add(slug if n == 0 else f"{slug}-{n}")
    return slugs


def _documents():
    return [README, *sorted(DOCS.glob("*.md"))]


def test_readme_is_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; at most {MAX_README_LINES} (move detail to docs/)"


def test_design_and_performance_exist_and_readme_links_both():
    for name in ("design.md", "performance.md"):
        assert (DOCS / name).is_file(), f"docs/{name} is missing"
    targets = {t for t, _ in _links(README)}
    assert {"docs/design.md", "docs/performance.md"} <= targets, sorted(targets)


@pytest.mark.parametrize("doc", _documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(doc):
    broken = []
    for target, anchor in _links(doc):
        dest = (doc.parent / target).resolve() if target else doc
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}#{anchor}: no such heading in {dest.relative_to(REPO)}")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


# ---- what the sdist ships ------------------------------------------------------------

def _manifest_rules():
    rules = []
    for line in (REPO / "MANIFEST.in").read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words:
            rules.append((words[0], words[1:]))
    return rules


def _repo_files():
    skip = {".git", "build", "dist", "__pycache__"}
    return [p.relative_to(REPO).as_posix() for p in REPO.rglob("*")
            if p.is_file() and not skip.intersection(p.relative_to(REPO).parts)]


def sdist_files():
    """What `python -m build --sdist` puts in, roughly: setuptools' defaults (the
    project files, the README, the license, the package's modules and stubs), then
    MANIFEST.in's commands in order."""
    files = _repo_files()
    shipped = {f for f in files if f in ("README.md", "LICENSE", "pyproject.toml", "setup.py", "MANIFEST.in")
               or re.fullmatch(r"torch_memory_saver/[^/]+\.(py|pyi)|torch_memory_saver/py\.typed", f)}

    def under(d):
        d = d.strip("/") + "/"
        return [f for f in files if f.startswith(d)]

    for cmd, args in _manifest_rules():
        if cmd in ("include", "exclude"):
            hit = [f for f in files if any(fnmatch.fnmatchcase(f, a) for a in args)]
        elif cmd in ("recursive-include", "recursive-exclude"):
            hit = [f for f in under(args[0]) if any(fnmatch.fnmatchcase(f.rsplit("/", 1)[-1], a) for a in args[1:])]
        elif cmd in ("global-include", "global-exclude"):
            hit = [f for f in files if any(fnmatch.fnmatchcase(f.rsplit("/", 1)[-1], a) for a in args)]
        elif cmd in ("graft", "prune"):
            hit = [f for a in args for f in under(a)]
        else:
            continue
        if cmd in ("include", "recursive-include", "global-include", "graft"):
            shipped.update(hit)
        else:
            shipped.difference_update(hit)
    return shipped


def test_readme_links_only_to_what_the_sdist_ships():
    shipped = sdist_files()
    outside = sorted({t for t, _ in _links(README) if t and (README.parent / t).resolve().is_file()
                      and (README.parent / t).resolve().relative_to(REPO).as_posix() not in shipped})
    assert not outside, f"README.md links to files the sdist leaves out: {outside} (see MANIFEST.in)"


def test_sdist_model_matches_manifest():
    """The rough model above agrees with MANIFEST.in on what it must: sources in,
    tests and benchmarks out but README's plot."""
    shipped = sdist_files()
    assert "src/build.txt" in shipped and "include/torch_memory_saver.h" in shipped
    assert "src/core/pause.c" in shipped and "README.md" in shipped
    plots = {t for t, _ in _links(README) if t.endswith(".png")}
    assert len(plots) == 1 and plots <= shipped, plots
    assert not any(f.startswith(("tests/", "benchmarks/")) for f in shipped - plots)


# ---- no history in the README --------------------------------------------------------

HISTORY = [
    (re.compile(r"\bissues?\s*#?\d+", re.I), "an issue number"),
    (re.compile(r"(?<![\w/&])#\d+\b"), "an issue reference"),
    (re.compile(r"(?<![0-9A-Za-z_x])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![0-9A-Za-z_])"),
     "a commit hash"),
    (re.compile(r"\b(until|before|since|after) commit\b", re.I), "a commit in history"),
    (re.compile(r"\bused to (be|run|take|have|go)\b", re.I), "history"),
]


def test_readme_holds_no_history():
    text = README.read_text(encoding="utf-8")
    found = [f"{what}: {m.group(0)!r}" for rx, what in HISTORY for m in rx.finditer(text)]
    assert not found, "README.md is for users; history lives in git: " + "; ".join(found)


def test_history_patterns_catch_what_they_should():
    samples = ["fixed in issue 12", "see #42", "at commit 5e4d491 it", "until commit abc", "it used to take 3 s"]
    for s in samples:
        assert any(rx.search(s) for rx, _ in HISTORY), s
    for s in ["manylinux_2_28", "abi3", "kv=0x7f0ee8000000", "#hook-modes", "2026-11-25", "deadbeef cafe"]:
        assert not any(rx.search(s) for rx, _ in HISTORY), s


# ---- the code's pointers into performance.md -----------------------------------------

def test_every_source_that_cites_performance_md_has_its_section():
    text = (DOCS / "performance.md").read_text(encoding="utf-8")
    citing = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "src").rglob("*.[ch]")
                    if "docs/performance.md" in p.read_text(encoding="utf-8", errors="replace"))
    assert citing, "no source cites docs/performance.md: is this test still needed?"
    missing = [f for f in citing if f not in text]
    assert not missing, f"docs/performance.md has no section naming {missing}, which cite it"


def test_link_checker_catches_a_broken_link(tmp_path):
    doc = tmp_path / "x.md"
    (tmp_path / "there.md").write_text("# A heading\n")
    doc.write_text("[ok](there.md) [ok](there.md#a-heading) [bad](missing.md) [bad](there.md#nope)\n"
                   "```\n[in code](ignored.md)\n```\n[web](https://example.com/x.md)\n")
    links = _links(doc)
    assert ("ignored.md", "") not in links and len(links) == 4
    broken = [(t, a) for t, a in links
              if not (tmp_path / t).exists() or (a and a not in _anchors(tmp_path / t))]
    assert broken == [("missing.md", ""), ("there.md", "nope")]


# ---- what the docs list is what there is -----------------------------------------------

NUMBERS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven", 8: "eight", 9: "nine", 10: "ten"}


def _benchmark_suites():
    """The suites `python -m benchmarks --help` lists (it imports no torch)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "benchmarks", "--help"], cwd=REPO, capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return re.findall(r"^  (\w+)\s", out.split("suites:", 1)[1], re.M)


def _section(path, heading):
    """The text of `path` from the heading `heading` to the next heading of its level or above."""
    text = path.read_text(encoding="utf-8")
    m = re.search(rf"^(#+) {re.escape(heading)}\s*$", text, re.M)
    assert m, f"{path.name} has no heading {heading!r}"
    end = re.search(rf"^#{{1,{len(m.group(1))}}} ", text[m.end():], re.M)
    return text[m.end():m.end() + end.start()] if end else text[m.end():]


def test_the_docs_list_every_benchmark_suite():
    suites = _benchmark_suites()
    assert len(suites) >= 5 and "run" in suites and "speed" in suites, suites
    for path, heading in ((DOCS / "design.md", "Benchmarks"), (DOCS / "performance.md", "Running the benchmarks")):
        text = _section(path, heading)
        missing = [s for s in suites if f"`{s}`" not in text]
        assert not missing, f"{path.name}, section {heading!r}, does not name the suites {missing}"
        for word in re.findall(r"\b(\w+) suites\b", text):
            if word in NUMBERS.values():
                assert word == NUMBERS.get(len(suites)), f"{path.name} says {word} suites; there are {len(suites)}"


def test_the_usage_line_of_the_benchmarks_lists_every_suite():
    suites = _benchmark_suites()
    text = _section(DOCS / "performance.md", "Running the benchmarks")
    line = next(l for l in text.splitlines() if l.startswith("python -m benchmarks <suite> [options]"))
    listed = [w.strip() for w in line.split("#", 1)[1].split("|")]
    assert listed == suites, (listed, suites)


def test_performance_md_names_a_constant_where_it_is_defined():
    """A TMS_ name that no code reads from the environment is a constant: its line says
    which file defines it, so no one takes it for a variable to set."""
    sources = [p for p in (REPO / "src").rglob("*.[ch]")]
    code = "".join(p.read_text(encoding="utf-8", errors="replace")
                   for p in [*sources, *(REPO / "benchmarks").glob("*.py"), *(REPO / "torch_memory_saver").glob("*.py")])
    variables = set(re.findall(r'"(TMS_[A-Z0-9_]+)"', code))
    wrong = []
    for n, line in enumerate((DOCS / "performance.md").read_text(encoding="utf-8").splitlines(), 1):
        for name in re.findall(r"`(TMS_[A-Z0-9_]+)`", line):
            if name in variables:
                continue
            defined = [p.relative_to(REPO / "src").as_posix() for p in sources
                       if re.search(rf"#define {name}\b", p.read_text(encoding="utf-8", errors="replace"))]
            if not defined or not any(d in line for d in defined):
                wrong.append(f"performance.md:{n}: {name} (defined in {defined or 'nothing'})")
    assert not wrong, "constants not named with their file (or names that are nothing):\n" + "\n".join(wrong)


def test_performance_md_marks_every_report_that_is_not_in_the_results():
    text = (DOCS / "performance.md").read_text(encoding="utf-8")
    assert "A report name marked †" in text and "git show" in text
    results = {p.name for p in (REPO / "benchmarks" / "results").iterdir()}
    gone = [f"{n}: {name}" for n, line in enumerate(text.splitlines(), 1)
            for name in re.findall(r"`([\w.-]+\.(?:md|json|png))`", line)
            if re.match(r"\d{8}-\d{6}_", name) and name not in results and "†" not in line]
    assert not gone, "reports named that exist only in history, unmarked: " + "; ".join(gone)


def test_design_source_map_names_every_source_file():
    block = next(b for b in re.findall(r"```\n(.*?)```", (DOCS / "design.md").read_text(encoding="utf-8"), re.S)
                 if "include/torch_memory_saver.h" in b)
    named = set(re.findall(r"[\w.]+\.(?:c|h|py)\b", block))
    sources = [*(REPO / "src").rglob("*.[ch]"), *(REPO / "torch_memory_saver").glob("*.py")]
    missing = sorted(p.relative_to(REPO).as_posix() for p in sources if p.name not in named)
    assert not missing, f"docs/design.md's source map leaves out {missing}"


# ---- the code and the tests point at what exists, and hold no history -------------------

CODE_DIRS = ("src", "include", "torch_memory_saver", "tests", "benchmarks")
CODE_SUFFIXES = {".c", ".h", ".py", ".pyi"}


def _code_files():
    skip = {"__pycache__", "results"}
    return sorted(p for d in CODE_DIRS for p in (REPO / d).rglob("*")
                  if p.suffix in CODE_SUFFIXES and p.is_file() and not skip.intersection(p.parts))


def test_tests_and_code_hold_no_history():
    """Tests are named for behaviour and say why in comments; issue numbers and
    bug histories live in git. (This file's own samples are exempt.)"""
    found = []
    for path in _code_files():
        if path.name == "test_docs.py":
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for rx, what in HISTORY[:2] + [(re.compile(r"\bwas a bug\b|\bfixed in [0-9a-f]{7}", re.I), "a bug's history")]:
                if rx.search(line):
                    found.append(f"{path.relative_to(REPO)}:{n}: {what}: {line.strip()[:80]}")
    assert not found, "history in code or tests:\n" + "\n".join(found)


# A path in a comment or docstring: from the repository root, or src/-relative (core/pause.c).
PATH = re.compile(r"(?<![\w./-])((?:src|include|torch_memory_saver|tests|benchmarks|docs)/[\w./-]*\w\.(?:c|h|py|pyi|md|txt)"
                  r"|(?:face|hooks|core|backup|platform)/\w+\.[ch])\b")


def test_every_source_path_named_in_the_code_exists():
    missing = []
    for path in _code_files():
        if path.name == "test_layers.py":
            continue  # its own made-up trees, planted to show the layer check bites
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            for name in PATH.findall(line):
                if "*" in name or "<" in name:
                    continue
                candidates = [REPO / name, REPO / "src" / name]
                if not any(c.exists() for c in candidates):
                    missing.append(f"{path.relative_to(REPO)}:{n}: {name}")
    assert not missing, "paths named in the code that do not exist:\n" + "\n".join(missing)


def test_the_path_checker_sees_paths_in_comments():
    line = "/* as core/pause.c does; see src/backup/ledger.c and tests/test_docs.py */"
    assert PATH.findall(line) == ["core/pause.c", "src/backup/ledger.c", "tests/test_docs.py"]


# A C file named bare in a comment (pause.c): some file of the repository has that name.
BARE_C = re.compile(r"(?<![\w./-])(\w+\.c)\b")


def test_every_c_file_named_bare_in_the_code_exists():
    names = {p.name for d in ("src", "tests", "benchmarks") for p in (REPO / d).rglob("*.c")}
    missing = []
    for path in _code_files():
        if path.suffix not in (".c", ".h"):
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            missing += [f"{path.relative_to(REPO)}:{n}: {name}" for name in BARE_C.findall(line) if name not in names]
    assert not missing, "C files named in comments that do not exist:\n" + "\n".join(missing)


def test_design_maps_every_source_file_to_tests_that_exist():
    text = _section(DOCS / "design.md", "Where each source file is tested")
    named = set(re.findall(r"`(?:[\w/]+/)?([\w.]+\.(?:c|h|py))`", text))
    sources = [*(REPO / "src").rglob("*.[ch]"), *(REPO / "torch_memory_saver").glob("*.py")]
    missing = sorted(p.relative_to(REPO).as_posix() for p in sources if p.name not in named)
    assert not missing, f"docs/design.md maps no tests to {missing}"
    tests = {p.name for p in (REPO / "tests").rglob("*") if p.is_file()}
    sources_names = {p.name for p in sources}
    unknown = sorted(n for n in named if n not in tests and n not in sources_names)
    assert not unknown, f"docs/design.md's test map names files that do not exist: {unknown}"
