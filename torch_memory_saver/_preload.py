"""LD_PRELOAD handling for the preload hook mode."""
import contextlib
import os

from . import _library

_ENV = "LD_PRELOAD"


def _entries(value: str):
    # ld.so accepts both separators.
    return [e for e in value.replace(":", " ").split() if e]


def _is_ours(entry: str, ours) -> bool:
    for path in ours:
        try:
            if os.path.samefile(entry, path):
                return True
        except OSError:
            pass
    return False


def preload_env_value(current: str = "") -> str:
    """LD_PRELOAD with this package's preload library first, other entries kept.
    The upstream-named files (torch_memory_saver_hook_mode_preload*.abi3.so)
    count as ours: they load the same library."""
    ours = _library.path("preload")
    others = [e for e in _entries(current) if not _is_ours(e, [ours, *_library.upstream_paths("preload")])]
    return " ".join([ours] + others)


@contextlib.contextmanager
def configure_subprocess():
    """Within the block, child processes start with the preload library in
    LD_PRELOAD (in front of whatever else it holds); restored on exit."""
    previous = os.environ.get(_ENV)
    os.environ[_ENV] = preload_env_value(previous or "")
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(_ENV, None)
        else:
            os.environ[_ENV] = previous


def ensure_hooked(core) -> str:
    """Makes sure this process's cudaMalloc calls reach the preload library and says
    how: "ld_preload" if the library is interposed (LD_PRELOAD), else "relocation"
    after patching every loaded object's GOT entries (and those of objects loaded
    later). Raises if neither is possible (TMS_RELOC_HOOKS=0 without LD_PRELOAD)."""
    method = core.preload_method()
    if method:
        return method
    try:
        core.install_relocation_hooks()
    except NotImplementedError as e:
        off = str(e)
    else:
        _warn_if_segments_came_first()
        return core.preload_method()
    _, winner = core.preload_active()
    ours = core.library_path()
    where = f"the process's cudaMalloc comes from {winner}" if winner else "no cudaMalloc is interposed"
    raise RuntimeError(
        f"torch_memory_saver: hook_mode='preload' needs {ours} in LD_PRELOAD when the process starts "
        f"({where}; {off}). Start the process with `python -m torch_memory_saver run -- <command>`, or inside "
        f"`with torch_memory_saver.configure_subprocess():`, or with LD_PRELOAD={ours}; or unset "
        f"TMS_RELOC_HOOKS; or set torch_memory_saver.hook_mode = 'torch' before first use."
    )


def expandable_segments_on() -> bool:
    """PYTORCH_CUDA_ALLOC_CONF (or PyTorch's newer PYTORCH_ALLOC_CONF) asks for expandable segments."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF") or ""
    return "expandable_segments:true" in conf.replace(" ", "").lower()


def _warn_if_segments_came_first():
    """PyTorch looks up its cuMem* entry points once, when it makes its first
    expandable segment: hooks installed by relocation after that never see them."""
    import sys

    torch = sys.modules.get("torch")
    if torch is None or not expandable_segments_on() or not torch.cuda.is_initialized():
        return
    if any(torch.cuda.memory_reserved(d) for d in range(torch.cuda.device_count())):
        import warnings

        warnings.warn(
            "torch_memory_saver: expandable segments were in use before preload mode installed its hooks "
            "(no LD_PRELOAD): PyTorch already holds the driver's cuMem* functions, so region memory in "
            "expandable segments will not be pauseable in this process. Enter the first region (or read "
            "torch_memory_saver.preload_method) before the first CUDA allocation, or start the process with "
            "the library on LD_PRELOAD.", RuntimeWarning, stacklevel=4)
