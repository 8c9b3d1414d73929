"""A function of a test, run in a fresh Python process: both halves of the protocol.

The backend, the TMS_* environment, the fault counters and the allocation table are
per process, so a test hands a module-level function (of its own module, or of a
scenario module in tests/host_scenarios/) to the `in_child` fixture (tests/conftest.py),
which runs `python tests/child.py REQUEST RESULT` with the environment it asks for. The
child imports the function's module by name, calls it with the pickled arguments and
pickles back what it returned, or the exception it raised with its traceback (and the
locals of the frame that raised); the parent returns the value or raises the exception,
the child's traceback chained to it. A function that kills its process (a signal, an
exit) leaves no result: the parent reports the exit status and both streams.

The child half imports nothing but the standard library, so a child costs a Python
start-up and its function's imports; a function in a test module also imports pytest
and conftest there (a few hundred milliseconds more), one in a scenario module does not.
"""
import os
import pickle
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
# Where a child finds the function's module: the test modules (tests/, as pytest's
# default import mode names them), the scenario modules (host_scenarios.<name>) and
# the one prelude they import (_prelude), and the package (the repository root).
CHILD_PATH = (str(TESTS), str(TESTS / "host_scenarios"), str(REPO))


# ---- the child --------------------------------------------------------------------------

def _locals_of_the_raising_frame(tb):
    """`name = repr` lines of the innermost frame of a traceback (reprs cut short: a
    frame may hold megabytes of bytes)."""
    import reprlib

    short = reprlib.Repr()
    short.maxstring = short.maxother = 160
    short.maxlong = 60
    while tb.tb_next is not None:
        tb = tb.tb_next
    frame = tb.tb_frame
    lines = [f"locals of {frame.f_code.co_name}() at line {tb.tb_lineno}:"]
    for name, value in frame.f_locals.items():
        try:
            text = short.repr(value)
        except Exception as e:  # a repr that fails says so rather than hiding the failure
            text = f"<repr failed: {type(e).__name__}>"
        lines.append(f"    {name} = {text}")
    return "\n".join(lines)


def _main(request_path, result_path):
    for entry in reversed(CHILD_PATH):
        if entry not in sys.path:
            sys.path.insert(1, entry)
    with open(request_path, "rb") as f:
        module_name, qualname, args = pickle.load(f)
    import importlib

    try:
        fn = importlib.import_module(module_name)
        for part in qualname.split("."):
            fn = getattr(fn, part)
        outcome = ("returned", fn(*args))
    except SystemExit:
        raise  # the function chose its exit status: no result, as for a signal
    except BaseException as e:
        import traceback

        tb = e.__traceback__.tb_next or e.__traceback__  # from the function on: this file's frame says nothing
        text = "".join(traceback.format_exception(type(e), e, tb)) + _locals_of_the_raising_frame(tb)
        if not str(e) and isinstance(e, AssertionError):
            # A bare assert (no rewriting here, unlike pytest's): the line that failed is its message.
            last = traceback.extract_tb(tb)[-1]
            e.args = (f"{os.path.basename(last.filename)}:{last.lineno}: {last.line}",)
        try:
            pickle.loads(pickle.dumps(e))
            raised = e
        except Exception:  # an exception that does not survive pickling arrives as its type's name and text
            raised = None
        outcome = ("raised", raised, f"{type(e).__module__}.{type(e).__qualname__}: {e}", text)
        sys.stderr.write(text + "\n")
        _write(result_path, outcome)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # the state is broken: no atexit handler or finaliser runs on it
    _write(result_path, outcome)


def _write(path, outcome):
    try:
        data = pickle.dumps(outcome)
    except Exception as e:
        data = pickle.dumps(("raised", None, f"the child's result cannot be pickled: {e!r}", repr(outcome)[:2000]))
    with open(path, "wb") as f:
        f.write(data)


# ---- the parent -------------------------------------------------------------------------

class ChildTraceback(Exception):
    """The child's own traceback, chained as the cause of the exception re-raised here."""


class ChildFailed(AssertionError):
    """The child ended without a result (a signal, an exit, a timeout), or wrote to
    stderr where the test expected nothing."""


class Outcome:
    """What a child did: returncode (negative: the signal), stdout, stderr, and
    either value (what the function returned), or error (the exception it raised,
    with traceback: the child's text), or neither when it ended without a result."""

    def __init__(self, returncode, stdout, stderr, result, command):
        self.returncode, self.stdout, self.stderr, self.command = returncode, stdout, stderr, command
        self.value = self.error = self.traceback = None
        self.returned = False
        if result is not None and result[0] == "returned":
            self.returned, self.value = True, result[1]
        elif result is not None:
            _, raised, summary, self.traceback = result
            self.error = raised if raised is not None else ChildFailed(summary)

    def describe(self):
        return (f"{self.command}\nexit status: {self.returncode}\n--- stdout ---\n{self.stdout}"
                f"--- stderr ---\n{self.stderr}")

    def result(self, stderr_empty=True):
        """The value the function returned; raises what it raised (its traceback chained),
        or ChildFailed if it returned nothing or (stderr_empty) wrote to stderr."""
        __tracebackhide__ = True
        if self.error is not None:
            raise self.error.with_traceback(None) from ChildTraceback(
                f"in the child ({self.command}):\n{self.traceback}\n--- stdout ---\n{self.stdout}")
        if not self.returned or self.returncode != 0:
            raise ChildFailed(f"the child ended without a result\n{self.describe()}")
        if stderr_empty and self.stderr:
            raise ChildFailed(f"the child wrote to stderr\n{self.describe()}")
        return self.value


def run(fn, args, env, cwd, timeout, workdir, python=None):
    """Runs fn(*args) in `python tests/child.py` with environment env; returns its Outcome.
    workdir: a directory of the test's own for the request and result files."""
    import subprocess

    module_name, qualname = fn.__module__, fn.__qualname__
    if "<locals>" in qualname or module_name == "__main__":
        raise TypeError(f"in_child runs module-level functions (by import): {module_name}.{qualname} is not one")
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    fd, request = _tempfile(workdir, "request")
    with os.fdopen(fd, "wb") as f:
        pickle.dump((module_name, qualname, tuple(args)), f)
    fd, result = _tempfile(workdir, "result")
    os.close(fd)
    command = [python or sys.executable, str(TESTS / "child.py"), request, result]
    label = f"{module_name}.{qualname}{tuple(args)!r}"
    try:
        proc = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise ChildFailed(f"{label} did not finish in {timeout} s\n--- stdout ---\n{_text(e.stdout)}"
                          f"--- stderr ---\n{_text(e.stderr)}") from None
    try:
        with open(result, "rb") as f:
            data = f.read()
        outcome = pickle.loads(data) if data else None
    finally:
        os.unlink(request)
        os.unlink(result)
    return Outcome(proc.returncode, proc.stdout, proc.stderr, outcome, label)


def _tempfile(workdir, kind):
    import tempfile

    fd, path = tempfile.mkstemp(prefix=f"child-{kind}-", dir=workdir)
    return fd, path


def _text(data):
    if data is None:
        return ""
    return data.decode(errors="replace") if isinstance(data, bytes) else data


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
