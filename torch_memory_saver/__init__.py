"""Release the GPU memory behind chosen tensors and give it back later at the
same virtual addresses, optionally keeping the contents on the host."""
from . import _library
from ._errors import DiskBackupDirError, Error, OutOfMemoryError
from ._preload import configure_subprocess
from .entrypoint import TorchMemorySaver

_library.check_environment()  # a malformed TMS_* variable is a ValueError here, not at first use

__version__ = "0.1.0"

torch_memory_saver = TorchMemorySaver()
stats = torch_memory_saver.stats
memory_summary = torch_memory_saver.memory_summary

__all__ = ["TorchMemorySaver", "torch_memory_saver", "configure_subprocess", "stats", "memory_summary", "Error",
           "OutOfMemoryError", "DiskBackupDirError", "__version__"]
