"""Release the GPU memory behind chosen tensors and give it back later at the
same virtual addresses, optionally keeping the contents on the host."""
import sys
import types

from . import _library
from ._errors import DiskBackupDirError, Error, OutOfMemoryError
from ._preload import configure_subprocess
from .entrypoint import TorchMemorySaver

_library.check_environment()  # a malformed TMS_* variable is a ValueError here, not at first use

__version__ = "0.1.0"

torch_memory_saver = TorchMemorySaver()
stats = torch_memory_saver.stats
memory_summary = torch_memory_saver.memory_summary
allocations = torch_memory_saver.allocations
memory_report = torch_memory_saver.memory_report
host_budget = torch_memory_saver.host_budget

# Settings a user may assign on the module as on the singleton; a plain module
# attribute would be set and silently ignored.
_SINGLETON_SETTINGS = ("progress", "hook_mode", "memory_margin_bytes", "retain_cpu_backup", "backup_live_only",
                       "spill_to_disk")


class _Module(types.ModuleType):
    pass


for _name in _SINGLETON_SETTINGS:
    setattr(_Module, _name, property(
        lambda self, n=_name: getattr(torch_memory_saver, n),
        lambda self, value, n=_name: setattr(torch_memory_saver, n, value),
        doc=getattr(TorchMemorySaver, _name).__doc__))
sys.modules[__name__].__class__ = _Module
del _name

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess", "stats", "memory_summary",
           "allocations", "memory_report", "host_budget", "Error", "OutOfMemoryError", "DiskBackupDirError", "__version__"]
