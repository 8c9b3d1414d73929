"""Upstream's `torch_memory_saver.utils` helper that frameworks import to find the libraries."""
from pathlib import Path

from . import _library


def get_binary_path_from_package(stem: str) -> Path:
    """Path of the library named `stem` (e.g. "torch_memory_saver_hook_mode_preload",
    optionally with "_cu12"/"_cu13") at the site-packages root, as upstream returns it.
    Every name of a variant leads to the same loaded library."""
    for path in _library.upstream_paths():
        if path.name == f"{stem}.abi3.so":
            return path
    raise RuntimeError(f"torch_memory_saver: no library named {stem}.abi3.so in {_library.site_root()} "
                       f"(known: {', '.join(p.name for p in _library.upstream_paths())}); "
                       f"reinstall with `pip install .`")
