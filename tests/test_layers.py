"""The C sources keep docs/design.md's layers: every `#include "…"` in src/ and every call
from one file into a function another file defines goes down the layers (or sideways
within one), and no two files call each other, directly or round a circle. The
environment is read only by platform/ (the settings table), the faces hold no branch on
the hook variant (hooks/variant.h answers for it), and no file declares another file's
function by hand (the compiler checks a call only against the header that declares it).
Reads files only: no build, no import of the package. The checks run on synthetic trees
too, so a planted upward include, circle, getenv, variant branch or prototype is shown
to fail."""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SRC = REPO / "src"

# The layers, top to bottom, and what a file of each may include and call:
# its own layer and the ones listed. docs/design.md states the same table.
LAYERS = ("face", "hooks", "share", "core", "backup", "platform")
MAY_USE = {
    "face": {"face", "share", "core"},
    "hooks": {"hooks", "share", "core"},
    "share": {"share", "core", "platform"},
    "core": {"core", "backup", "platform"},
    "backup": {"backup", "platform"},
    "platform": {"platform"},
}
# Leaves of platform/ that every layer may include (and call): status codes and the
# error record, the log line, the fork module every subsystem with a lock registers
# with, the CUDA ABI the hooks interpose, the glibc symbol versions the build includes
# into every file, the settings table (every setting, parsed once) and the host budget's
# record (filled by the ledger, shown by the faces).
SHARED = {"platform/error.h", "platform/log.h", "platform/fork.h", "platform/cuda_abi.h", "platform/glibc_compat.h",
          "platform/config.h", "platform/host_budget.h"}
# Single edges beyond the table, each with its reason.
EXCEPTIONS = {
    ("face/module.c", "hooks/variant.h"):
        "the variant seam: the allocator hooks' methods are offered where the variant has them",
    ("face/module_process.c", "hooks/variant.h"):
        "the variant seam: is this library the process's cudaMalloc, the relocation hooks",
    ("face/module_share.c", "hooks/variant.h"):
        "the variant seam: install_ipc_hooks, as the variant routes the CUDA IPC calls",
}
# Headers that several files implement, one per build (a call into any of them is a
# use of the header): the hook variant seam, answered by each variant's hook file.
SEAMS = {"hooks/variant.h": {"hooks/hook_preload.c", "hooks/hook_torch.c"}}

INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def layer_of(rel):
    """The layer of a path relative to src/ ("core/alloc.c" -> "core"), or None."""
    top = rel.split("/", 1)[0]
    return top if top in LAYERS else None


def sources(root):
    """Every .c and .h under root, relative to it, with its text."""
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8", errors="replace")
            for p in sorted([*root.rglob("*.c"), *root.rglob("*.h")])}


def allowed(user, used):
    """May the file `user` include the header `used` (or call the file `used` defines)?
    Both relative to src/."""
    if used in SHARED or (user, used) in EXCEPTIONS:
        return True
    a, b = layer_of(user), layer_of(used)
    return a is not None and b is not None and b in MAY_USE[a]


def includes(files):
    """(file, header) for every quoted include that names a file of the tree."""
    out = []
    for rel, text in files.items():
        for target in INCLUDE.findall(text):
            if target in files:
                out.append((rel, target))
            elif (Path(rel).parent / target).as_posix() in files:  # relative to the includer
                out.append((rel, (Path(rel).parent / target).as_posix()))
    return out


def upward_includes(files):
    """What a file may not see: a header it includes, or one a header it includes pulls
    in (a contract header hands its user only what its user may include itself)."""
    direct = {}
    for a, b in includes(files):
        direct.setdefault(a, []).append(b)
    found = []
    for a in sorted(direct):
        seen, todo = {}, [(b, b) for b in direct[a]]
        while todo:
            header, via = todo.pop()
            if header in seen:
                continue
            seen[header] = via
            todo += [(nxt, via) for nxt in direct.get(header, ())]
        for header, via in sorted(seen.items()):
            if not allowed(a, header):
                found.append(f"{a} includes {header}" + ("" if via == header else f" (through {via})"))
    return found


# ---- calls ------------------------------------------------------------------------------

COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
LITERAL = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'')
# A function definition: at the start of a line, a head without parentheses or
# braces, the name, its parameters, then the body's brace.
DEFINITION = re.compile(r"^(?P<head>[A-Za-z_][^;{}()#=\n]*?)\b(?P<name>[A-Za-z_]\w*)\s*\([^;{}]*?\)\s*\{", re.M)
IDENTIFIER = re.compile(r"\b[A-Za-z_]\w*\b")
TAG = re.compile(r"\b(?:struct|union|enum)\s+[A-Za-z_]\w*")  # a type's tag names no function, whatever it shares a name with


def code_of(text):
    """The text without comments and string or character literals."""
    return LITERAL.sub('""', COMMENT.sub(" ", text))


def definitions(code):
    """(global names, static names) of the functions a file defines."""
    global_names, static_names = set(), set()
    for m in DEFINITION.finditer(code):
        (static_names if re.search(r"\bstatic\b", m.group("head")) else global_names).add(m.group("name"))
    return global_names, static_names


MACRO = re.compile(r"^[ \t]*#[ \t]*define[ \t]+(\w+)((?:.*\\\n)*.*)$", re.M)


def macro_bodies(files, rel, code):
    """The bodies of the macros code uses that rel's headers define (directly or
    through other headers, and macros those bodies use): a call in a macro is made
    by the file that uses it."""
    direct = {}
    for a, b in includes(files):
        direct.setdefault(a, set()).add(b)
    seen, todo = set(), list(direct.get(rel, ()))
    while todo:
        header = todo.pop()
        if header not in seen:
            seen.add(header)
            todo += direct.get(header, ())
    macros = {m.group(1): m.group(2) for h in sorted(seen) for m in MACRO.finditer(code_of(files[h]))}
    used, todo = set(), set(IDENTIFIER.findall(code)) & set(macros)
    while todo:
        name = todo.pop()
        used.add(name)
        todo |= (set(IDENTIFIER.findall(macros[name])) & set(macros)) - used
    return "\n".join(macros[name] for name in sorted(used))


def call_graph(files):
    """{file: {file it calls or takes the address of a function of}} over the .c files."""
    code = {rel: code_of(text) for rel, text in files.items() if rel.endswith(".c")}
    code = {rel: text + "\n" + macro_bodies(files, rel, text) for rel, text in code.items()}
    defined, local = {}, {}
    for rel, text in code.items():
        global_names, static_names = definitions(text)
        local[rel] = global_names | static_names
        for name in global_names:
            defined.setdefault(name, set()).add(rel)
    graph = {rel: set() for rel in code}
    for rel, text in code.items():
        for name in set(IDENTIFIER.findall(TAG.sub(" ", text))) - local[rel]:
            graph[rel] |= defined.get(name, set()) - {rel}
    return graph


def headers_of(c_file):
    """The headers a .c file implements: its own, and any seam it answers."""
    return [c_file[:-2] + ".h", *(h for h, impls in SEAMS.items() if c_file in impls)]


def upward_calls(files):
    graph = call_graph(files)
    return [f"{a} uses {b}" for a in sorted(graph) for b in sorted(graph[a])
            if not allowed(a, b) and not any(allowed(a, h) for h in headers_of(b))]


def circles(graph):
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def include_graph(files):
    graph = {rel: set() for rel in files}
    for a, b in includes(files):
        graph[a].add(b)
    return graph


# ---- the environment, the variant, prototypes -------------------------------------------------

GETENV = re.compile(r"\b(?:secure_)?getenv\s*\(")


def environment_readers(files):
    """Files outside platform/ that read the environment (platform/config.c reads it for all)."""
    return sorted(rel for rel, text in files.items() if layer_of(rel) != "platform" and GETENV.search(code_of(text)))


CONDITIONAL = re.compile(r"^[ \t]*#[ \t]*(if|ifdef|ifndef|elif)\b(.*)$", re.M)
VARIANT_NAME = re.compile(r"VARIANT|PRELOAD|TORCH|TMS_IS_", re.I)


def variant_branches(files):
    """Conditional directives of face/ on the hook variant. The one guard that the build
    named a variant at all (#ifndef TMS_VARIANT, then #error) branches on nothing."""
    found = []
    for rel, text in files.items():
        if layer_of(rel) != "face":
            continue
        code = COMMENT.sub(" ", text)
        for m in CONDITIONAL.finditer(code):
            directive, rest = m.group(1), m.group(2).strip()
            guard = directive == "ifndef" and rest == "TMS_VARIANT" and re.match(r"\s*#\s*error\b", code[m.end():])
            if VARIANT_NAME.search(rest) and not guard:
                found.append(f"{rel}: #{directive} {rest}")
    return sorted(found)


# A declaration of a function at file scope: a head without parentheses or braces, the
# name and its parameters, attributes, then the semicolon.
DECLARATION = re.compile(r"^(?P<head>[A-Za-z_][^;{}()#=\n]*?)\b(?P<name>[A-Za-z_]\w*)\s*\([^;{}]*?\)"
                         r"(?:\s*__attribute__\s*\(\(.*?\)\))?\s*;", re.M | re.S)


def handwritten_prototypes(files):
    """Functions a .c file declares itself that another file defines: a header must
    declare them, so the compiler checks the call and the definition against one text."""
    code = {rel: code_of(text) for rel, text in files.items() if rel.endswith(".c")}
    defined = {}
    for rel, text in code.items():
        for name in definitions(text)[0]:
            defined.setdefault(name, set()).add(rel)
    found = []
    for rel, text in code.items():
        for m in DECLARATION.finditer(text):
            head = m.group("head")
            if re.search(r"\b(static|typedef|return)\b", head):
                continue
            for other in sorted(defined.get(m.group("name"), set()) - {rel}):
                found.append(f"{rel} declares {m.group('name')} of {other}")
    return sorted(found)


# ---- the tree ---------------------------------------------------------------------------

def test_every_source_is_in_a_layer():
    stray = [rel for rel in sources(SRC) if layer_of(rel) is None]
    assert not stray, f"files of src/ outside the layers' folders {LAYERS}: {stray}"


def test_no_include_runs_up_the_layers():
    found = upward_includes(sources(SRC))
    assert not found, "includes that break docs/design.md's layers:\n" + "\n".join(found)


def test_no_call_runs_up_the_layers():
    found = upward_calls(sources(SRC))
    assert not found, "calls that break docs/design.md's layers:\n" + "\n".join(found)


def test_no_files_call_each_other_in_a_circle():
    found = circles(call_graph(sources(SRC)))
    assert not found, "source files that call each other in a circle: " + "; ".join(" <-> ".join(c) for c in found)


def test_no_headers_include_each_other_in_a_circle():
    found = circles(include_graph(sources(SRC)))
    assert not found, "headers that include each other in a circle: " + "; ".join(" <-> ".join(c) for c in found)


# The operating system's file, user, socket and process primitives: above platform/ a file asks platform/os.h
# (one statx helper, one path-trust walk, one reader of the user database). stat, fstat
# and lstat are GLIBC_2.33 symbols besides, beyond the wheel's glibc floor.
OS_CALLS = ("statx", "stat", "fstat", "lstat", "fstatat", "statfs", "fstatfs", "getpwuid", "getpwuid_r",
            "getpwnam", "getpwnam_r", "realpath", "secure_getenv",
            # sockets, descriptor limits and raw system calls (peer credentials, pidfds, one budget)
            "socket", "accept", "accept4", "getsockopt", "setsockopt", "getrlimit", "setrlimit", "prlimit", "syscall")


def os_calls_above_platform(files):
    call = re.compile(r"\b(" + "|".join(OS_CALLS) + r")\s*\(")
    return [f"{rel} calls {name}" for rel, text in sorted(files.items()) if layer_of(rel) not in (None, "platform")
            for name in sorted(set(call.findall(code_of(text))))]


def test_os_primitives_are_called_in_platform_only():
    found = os_calls_above_platform(sources(SRC))
    assert not found, "OS primitives called outside platform/ (use platform/os.h):\n" + "\n".join(found)


def test_a_planted_os_call_fails(tmp_path):
    files = _tree(tmp_path, {
        "backup/ledger.c": "int f(struct statx *st) { return statx(0, \"\", 0, 0, st); } /* realpath() */\n",
        "platform/os_file.c": "int g(struct statx *st) { return statx(0, \"\", 0, 0, st); }\n",
        "core/a.c": "struct statx st; int stat_count(void) { return 0; }\n",
    })
    assert os_calls_above_platform(files) == ["backup/ledger.c calls statx"]


def test_only_the_platform_reads_the_environment():
    found = environment_readers(sources(SRC))
    assert not found, ("files outside src/platform/ that call getenv (add a row to platform/config.h's table and read "
                       "tms_defaults() instead): " + ", ".join(found))


def test_the_faces_do_not_branch_on_the_hook_variant():
    found = variant_branches(sources(SRC))
    assert not found, "conditionals on the hook variant in src/face/ (ask hooks/variant.h):\n" + "\n".join(found)


def test_no_file_declares_another_files_function_by_hand():
    found = handwritten_prototypes(sources(SRC))
    assert not found, "prototypes written in a .c file (include the header that declares them):\n" + "\n".join(found)


def test_the_call_graph_sees_the_calls_it_should():
    """The parse finds what it must in the real tree (a parse that found nothing would pass)."""
    graph = call_graph(sources(SRC))
    assert "core/table.c" in graph["core/claim.c"] or "core/table.c" in graph["core/alloc.c"]
    assert "platform/driver.c" in graph["core/pause.c"]
    assert "backup/transfer_batch.c" in graph["backup/save.c"] and "backup/transfer.c" in graph["backup/transfer_batch.c"]
    assert "backup/save.c" in graph["core/pause.c"] and "backup/restore.c" in graph["core/resume.c"]
    assert "hooks/reloc.c" in graph["hooks/shim.c"]       # a call inside a header's macro counts for its user
    assert "core/alloc.c" in graph["hooks/hook.c"]
    assert {"platform/os_host.c", "platform/os_dir.c", "platform/os_file.c"} <= graph["backup/ledger.c"]
    assert {"platform/os_dir.c", "platform/os_file.c"} <= graph["backup/files_dir.c"]
    assert {"hooks/hook_preload.c", "hooks/hook_torch.c"} <= graph["face/module_share.c"]  # the variant seam
    assert "platform/config.c" in graph["backup/ledger.c"]  # the settings table, read by every layer


def test_the_core_reaches_backups_through_one_entry_each_way():
    """The core saves with tms_backup_save and restores with tms_backup_restore: it calls
    no copy worker (tms_transfer_*) and sees no backup's record (struct tms_backup is
    complete only in backup/kind.h, which no core file includes)."""
    internals = ("backup/kind.h", "backup/transfer.h", "backup/save.h", "backup/host.h", "backup/files.h",
                 "backup/files_dir.h")
    for rel, text in sources(SRC).items():
        if not rel.startswith("core/"):
            continue
        code = code_of(text)
        assert not re.search(r"\btms_transfer_\w+\s*\(", code), f"{rel} calls the copy workers directly"
        for header in INCLUDE.findall(text):
            assert header not in internals, f"{rel} includes {header}, a backup layer's internal header"
    calls = call_graph(sources(SRC))
    backup_users = {f for f in calls if f.startswith("core/") and any(g.startswith("backup/") for g in calls[f])}
    assert "core/pause.c" in backup_users and "core/resume.c" in backup_users


def test_the_core_knows_the_job_only_as_its_provider():
    """The job is one unit of share/ that the core reaches through struct tms_provider's two
    entries (give after an unmap, provide before a map): at most two files of core/ name
    the job or its lending and borrowing (the report's fields are one), and no core file
    holds a descriptor, a socket or a lender's pid (an extent's provenance is opaque to it)."""
    files = sources(SRC)
    naming = sorted(rel for rel, text in files.items()
                    if rel.startswith("core/") and re.search(r"job|lend|borrow", text, re.I))
    assert len(naming) <= 2, f"core files that name the job: {naming}"
    for rel, text in files.items():
        if rel.startswith("core/"):
            code = code_of(text)
            assert not re.search(r"\b(?:via|lender|shared_on)\b", code), f"{rel} holds a lent piece's socket facts"
    extent = re.search(r"struct tms_extent \{(.*?)\};", files["core/core_share.h"], re.S).group(1)
    assert not re.search(r"\bfd\b", code_of(extent)), "an extent carries a descriptor"
    provider = re.search(r"struct tms_provider \{(.*?)\};", files["core/core_share.h"], re.S).group(1)
    assert re.findall(r"\(\*(\w+)\)", code_of(provider)) == ["give", "provide"]



def test_design_md_states_the_same_table():
    text = (REPO / "docs" / "design.md").read_text(encoding="utf-8")
    for layer, uses in MAY_USE.items():
        row = re.search(rf"^\|\s*{layer}\s*\|([^|\n]*)\|", text, re.M)
        assert row, f"docs/design.md has no row for the layer {layer!r} in its table of layers"
        named = set(re.findall(r"\b(" + "|".join(LAYERS) + r")\b", row.group(1)))
        assert named == uses - {layer}, f"docs/design.md's row {layer!r} names {sorted(named)}, the test {sorted(uses - {layer})}"
    for header in SHARED:
        assert header.split("/")[1] in text, f"docs/design.md does not name the shared header {header}"
    for user, used in EXCEPTIONS:
        assert user.split("/")[1] in text and used.split("/")[1] in text, f"docs/design.md does not state {user} -> {used}"
    for header, impls in SEAMS.items():
        assert header in text and all(i.split("/")[1] in text for i in impls), f"docs/design.md does not state {header}"


# ---- the checks catch what they should ------------------------------------------------------

def _tree(tmp_path, files):
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return sources(tmp_path)


def test_a_planted_upward_include_fails(tmp_path):
    files = _tree(tmp_path, {
        "core/core.h": "#include \"platform/error.h\"\n",
        "platform/error.h": "int tms_fail(void);\n",
        "platform/driver.c": "#include \"core/core.h\"\n",                 # platform -> core: up
        "face/abi.c": "#include \"backup/backup.h\"\n#include \"core/core.h\"\n",  # face -> backup: skips core
        "backup/backup.h": "#include \"platform/error.h\"\n",
        "hooks/hook.c": "#include \"core/core.h\"\n#include \"platform/log.h\"\n",  # allowed: a shared leaf
        "platform/log.h": "",
        "core/hands.h": "#include \"backup/backup.h\"\n",                   # core -> backup: allowed ...
        "hooks/cumem.c": "#include \"core/hands.h\"\n",                      # ... but not handed to the hooks
    })
    assert sorted(upward_includes(files)) == ["face/abi.c includes backup/backup.h",
                                              "hooks/cumem.c includes backup/backup.h (through core/hands.h)",
                                              "platform/driver.c includes core/core.h"]


def test_a_planted_upward_call_and_circle_fail(tmp_path):
    files = _tree(tmp_path, {
        "core/a.c": "static int helper(void) { return 1; }\n"
                    "int core_a(void)\n{\n    return core_b() + helper(); /* core_c() in a comment */\n}\n",
        "core/b.c": "int core_b(void) { return core_c(); }\n",
        "core/c.c": "int core_c(void)\n{\n    return core_a() + plat();\n}\n",
        "platform/p.c": "int plat(void) { return core_b(); }\n",   # platform -> core: up
        "backup/s.c": "static int helper(void) { return 0; }\nint other(void) { return helper(); }\n",
    })
    graph = call_graph(files)
    assert graph["core/a.c"] == {"core/b.c"}
    assert graph["backup/s.c"] == set()  # a static helper of the same name elsewhere is no edge
    assert upward_calls(files) == ["platform/p.c uses core/b.c"]
    assert circles(graph) == [["core/a.c", "core/b.c", "core/c.c", "platform/p.c"]]


def test_definitions_span_lines_and_skip_statics():
    code = code_of("static int a(void)\n{\n}\nint b(int x,\n      int y)\n{\n}\n"
                   "__attribute__((destructor)) static void c(void) {}\nTMS_EXPORT int d(void) { return 0; }\n"
                   "#define e(x) f(x)\nint g(void);\n")
    assert definitions(code) == ({"b", "d"}, {"a"})


def test_a_planted_getenv_variant_branch_and_prototype_fail(tmp_path):
    files = _tree(tmp_path, {
        "platform/config.c": "const char *read(void) { return getenv(\"TMS_X\"); }\n",   # allowed: the platform
        "backup/ledger.c": "const char *dir(void)\n{\n    return secure_getenv(\"XDG\");\n}\n",
        "hooks/reloc.c": "/* getenv(\"X\") in a comment */\nconst char *p = \"getenv(\";\n",  # neither counts
        "face/module.h": "#ifndef TMS_VARIANT\n#error \"needs a variant\"\n#endif\n",  # the guard: allowed
        "face/module_share.c": "#if TMS_VARIANT_IS_PRELOAD\nint a;\n#endif\n#ifdef TMS_PRELOAD_ONLY\n#endif\n"
                               "int tms_torch_install_ipc_hooks(struct tms_err *err);\n"
                               "static int helper(void);\nextern int own(void) __attribute__((alias(\"x\")));\n",
        "hooks/hook_torch.c": "int tms_torch_install_ipc_hooks(struct tms_err *err)\n{\n    return 0;\n}\n"
                              "static int helper(void) { return 0; }\n",
    })
    assert environment_readers(files) == ["backup/ledger.c"]
    assert variant_branches(files) == ["face/module_share.c: #if TMS_VARIANT_IS_PRELOAD",
                                       "face/module_share.c: #ifdef TMS_PRELOAD_ONLY"]
    assert handwritten_prototypes(files) == [
        "face/module_share.c declares tms_torch_install_ipc_hooks of hooks/hook_torch.c"]


def test_a_call_into_a_seam_is_a_use_of_its_header(tmp_path):
    files = _tree(tmp_path, {
        "hooks/variant.h": "int tms_variant_x(void);\n",
        "hooks/hook_preload.c": "#include \"hooks/variant.h\"\nint tms_variant_x(void) { return 1; }\n",
        "hooks/hook_torch.c": "#include \"hooks/variant.h\"\nint tms_variant_x(void) { return 0; }\n",
        "face/module.c": "#include \"hooks/variant.h\"\nint f(void) { return tms_variant_x(); }\n",
        "face/abi.c": "int g(void) { return tms_variant_x(); }\n",   # not one of the exceptions
    })
    assert upward_includes(files) == []
    assert upward_calls(files) == ["face/abi.c uses hooks/hook_preload.c", "face/abi.c uses hooks/hook_torch.c"]
