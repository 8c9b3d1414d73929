"""Locating and loading the two builds of the native core (_tms_preload, _tms_torch)."""
import importlib
import importlib.util
import os

HOOK_MODES = ("preload", "torch")


def module_name(hook_mode: str) -> str:
    return f"torch_memory_saver._tms_{hook_mode}"


def load(hook_mode: str):
    """Imports the variant. The preload variant is the very file LD_PRELOAD
    names, so the import reuses the already-loaded copy: one core per process."""
    return importlib.import_module(module_name(hook_mode))


def path(hook_mode: str) -> str:
    """Absolute path of a variant's shared library, without importing it."""
    spec = importlib.util.find_spec(module_name(hook_mode))
    if spec is None or not spec.origin:
        raise ImportError(
            f"torch_memory_saver: the {hook_mode} library is not built; reinstall with `pip install .`"
        )
    return os.path.realpath(spec.origin)
