"""Release the GPU memory behind chosen tensors and give it back later at the
same virtual addresses, optionally keeping the contents on the host."""
import difflib as _difflib
import sys as _sys
import types as _types
from typing import TYPE_CHECKING as _TYPE_CHECKING, Optional as _Optional

from . import _library


def _started_as_command():
    """True while this package is imported to run its command line (`python -m
    torch_memory_saver`, the torch-memory-saver script): there a malformed
    variable is one line on stderr, not a traceback."""
    argv = getattr(_sys, "orig_argv", [])
    as_module = any(argv[i] == "-m" and argv[i + 1] == __name__ for i in range(len(argv) - 1))
    script = bool(_sys.argv) and _sys.argv[0].rsplit("/", 1)[-1] == "torch-memory-saver"
    return as_module or script


try:
    _library.check_environment()  # a malformed TMS_* variable is a ValueError here, not at first use
except ValueError as e:
    if _started_as_command():
        raise SystemExit(f"{e}") from None
    raise
_library.warn_unknown_variables()

# After the check: the singleton's settings are built from the table _tms_env describes.
from ._errors import DiskBackupDirError, Error, IntegrityError, OutOfMemoryError  # noqa: E402
from ._preload import configure_subprocess  # noqa: E402
from ._report import DeviceReport, Report  # noqa: E402
from .entrypoint import TorchMemorySaver, _unknown_setting, setting_names as _setting_names  # noqa: E402

__version__ = "0.1.0"

torch_memory_saver = TorchMemorySaver()


class _Module(_types.ModuleType):
    """The module answers for the singleton: its functions are the singleton's
    bound methods, its settings and read-only properties forward to it (a plain
    module attribute would be set and silently ignored)."""

    def __setattr__(self, name, value):
        # A new name close to a setting is a misspelt one: it would be set and ignored.
        if (not name.startswith("_") and not isinstance(value, _types.ModuleType) and name not in vars(self)
                and not hasattr(type(self), name) and _difflib.get_close_matches(name, _setting_names(), n=1, cutoff=0.8)):
            raise AttributeError(_unknown_setting(name))
        super().__setattr__(name, value)


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
_sys.modules[__name__].__class__ = _Module
del _name, _member

if _TYPE_CHECKING:
    # What the loop above makes, as a type checker sees it: it runs no code, and a name
    # it cannot see is an error in the user's script (tests/test_typing.py holds this
    # list to the singleton's members).
    region = torch_memory_saver.region
    disable = torch_memory_saver.disable
    cuda_graph = torch_memory_saver.cuda_graph
    pause = torch_memory_saver.pause
    resume = torch_memory_saver.resume
    is_paused = torch_memory_saver.is_paused
    paused_tags = torch_memory_saver.paused_tags
    get_cpu_backup = torch_memory_saver.get_cpu_backup
    set_disk_backup_dir = torch_memory_saver.set_disk_backup_dir
    malloc = torch_memory_saver.malloc
    free = torch_memory_saver.free
    memory_report = torch_memory_saver.memory_report
    host_budget = torch_memory_saver.host_budget
    share = torch_memory_saver.share
    open_shared = torch_memory_saver.open_shared
    stats = torch_memory_saver.stats
    memory_summary = torch_memory_saver.memory_summary
    allocations = torch_memory_saver.allocations
    enabled: bool
    hook_mode: str
    preload_method: _Optional[str]
    disk_backup_dir: str
    retain_cpu_backup: bool
    backup_live_only: bool
    progress: bool
    memory_margin_bytes: int
    skip_unchanged: bool
    job: _Optional[str]
    spill_to_disk: bool
    verify_restore: bool

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess", "Error", "OutOfMemoryError", "IntegrityError",
           "DiskBackupDirError", "Report", "DeviceReport", "__version__",
           *sorted(n for n in vars(TorchMemorySaver) if not n.startswith("_") and n != "configure_subprocess")]
