"""Locating and loading the two builds of the native core (_tms_preload, _tms_torch)."""
import importlib
import importlib.util
import os
import sys
from pathlib import Path

HOOK_MODES = ("preload", "torch")
# The upstream library's file names, installed at the site-packages root as
# shims that load our library of the same variant (src/hooks/shim.c).
UPSTREAM_SUFFIXES = ("", "_cu12", "_cu13")


def module_name(hook_mode: str) -> str:
    return f"torch_memory_saver._tms_{hook_mode}"


def load(hook_mode: str):
    """Imports the variant. The preload variant is the very file LD_PRELOAD
    names, so the import reuses the already-loaded copy: one core per process."""
    return importlib.import_module(module_name(hook_mode))


def check_environment():
    """Raises ValueError naming the first malformed TMS_* variable: the small
    _tms_env module parses them with the core's own parser, without loading
    a core (the variants check them again when they load)."""
    importlib.import_module("torch_memory_saver._tms_env")


def warn_unknown_variables():
    """A TMS_* variable the library does not read is most likely a misspelt one:
    a RuntimeWarning names it and the variable it is close to; one close to none
    (another program's) is named only at TMS_LOG=debug."""
    import difflib
    import sys
    import warnings

    env = importlib.import_module("torch_memory_saver._tms_env")
    known = env.names()
    for name in sorted(n for n in os.environ if n.startswith("TMS_") and not env.is_known(n)):
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
        if close:
            warnings.warn(f"torch_memory_saver: {name} is not a variable of this library and is ignored; "
                          f"did you mean {close[0]}?", RuntimeWarning, stacklevel=3)
        elif env.env_choice("log") == "debug":
            print(f"[torch_memory_saver {os.getpid()}] {name} is not a variable of this library; ignored",
                  file=sys.stderr)


def torch_module(what: str):
    """PyTorch, imported for `what` (a call that cannot work without it), or an
    ImportError saying so."""
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"torch_memory_saver: {what} needs PyTorch, which cannot be imported here ({e}); "
                          f"pip install torch (>= 2.3)") from None
    return torch


def is_tensor(x) -> bool:
    """Whether x is a torch.Tensor, without importing torch (a tensor exists only once
    torch is imported)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, getattr(torch, "Tensor", ()))


def path(hook_mode: str) -> str:
    """Absolute path of a variant's shared library, without importing it."""
    spec = importlib.util.find_spec(module_name(hook_mode))
    if spec is None or not spec.origin:
        raise ImportError(
            f"torch_memory_saver: the {hook_mode} library is not built; reinstall with `pip install .`"
        )
    return os.path.realpath(spec.origin)


def site_root() -> Path:
    """The directory holding the package: site-packages, or the source tree."""
    return Path(__file__).resolve().parent.parent


def upstream_paths(hook_mode=None):
    """Paths of the upstream-named libraries (of one variant, or both) that exist."""
    modes = HOOK_MODES if hook_mode is None else (hook_mode,)
    names = [f"torch_memory_saver_hook_mode_{m}{s}.abi3.so" for m in modes for s in UPSTREAM_SUFFIXES]
    return [site_root() / n for n in names if (site_root() / n).exists()]
