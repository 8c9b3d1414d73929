"""Release the GPU memory behind chosen tensors and give it back later at the
same virtual addresses, optionally keeping the contents on the host."""
import sys
import types

from . import _library
from ._errors import DiskBackupDirError, Error, OutOfMemoryError
from ._preload import configure_subprocess
from ._report import DeviceReport, Report
from .entrypoint import TorchMemorySaver


def _started_as_command():
    """True while this package is imported to run its command line (`python -m
    torch_memory_saver`, the torch-memory-saver script): there a malformed
    variable is one line on stderr, not a traceback."""
    argv = getattr(sys, "orig_argv", [])
    as_module = any(argv[i] == "-m" and argv[i + 1] == __name__ for i in range(len(argv) - 1))
    script = bool(sys.argv) and sys.argv[0].rsplit("/", 1)[-1] == "torch-memory-saver"
    return as_module or script


try:
    _library.check_environment()  # a malformed TMS_* variable is a ValueError here, not at first use
except ValueError as e:
    if _started_as_command():
        raise SystemExit(f"{e}") from None
    raise
_library.warn_unknown_variables()

__version__ = "0.1.0"

torch_memory_saver = TorchMemorySaver()


class _Module(types.ModuleType):
    """The module answers for the singleton: its functions are the singleton's
    bound methods, its settings and read-only properties forward to it (a plain
    module attribute would be set and silently ignored)."""


def _forward(name, member):
    if isinstance(member, property):
        setter = None if member.fset is None else (lambda self, value, n=name: setattr(torch_memory_saver, n, value))
        setattr(_Module, name, property(lambda self, n=name: getattr(torch_memory_saver, n), setter,
                                        doc=member.__doc__))
    elif callable(member) and name not in globals():
        globals()[name] = getattr(torch_memory_saver, name)


for _name, _member in vars(TorchMemorySaver).items():
    if not _name.startswith("_"):
        _forward(_name, _member)
sys.modules[__name__].__class__ = _Module
del _name, _member

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess", "Error", "OutOfMemoryError",
           "DiskBackupDirError", "Report", "DeviceReport", "__version__",
           *sorted(n for n in vars(TorchMemorySaver) if not n.startswith("_") and n != "configure_subprocess")]
