"""The process singleton's public face: argument types converted here, what they mean
checked by the core, the work done by _impl.py."""
import contextlib
import difflib
import logging
import os
import threading
import warnings
from typing import TYPE_CHECKING, Any, ContextManager, Dict, Iterable, Iterator, List, Optional, Tuple, Union

from . import _library, _live, _observe, _preload, _report, _share
from ._errors import DiskBackupDirError, Error
from ._impl import _Impl, backup_across_pages
from ._settings import ROWS as _SETTING_ROWS, Settings, setting_property

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("torch_memory_saver")

_TAG_DEFAULT = "default"

# What pause() and resume() take: a tag, a list (or tuple) of tags, or None for every tag.
Tags = Union[None, str, List[str], Tuple[str, ...]]


def _article(noun):
    return ("an " if noun[:1] in "aeiou" else "a ") + noun


def _check_type(value, types, what):
    """Arguments are converted here; what they mean is checked by the core."""
    if not isinstance(value, types) or (bool not in types and isinstance(value, bool)):
        names = " or ".join("None" if t is type(None) else _article(t.__name__) for t in types)
        raise TypeError(f"torch_memory_saver: {what} must be {names}, not {type(value).__name__}")


def setting_names():
    """The names of the singleton's settings: its properties with a setter."""
    return sorted(n for n, v in vars(TorchMemorySaver).items() if isinstance(v, property) and v.fset is not None)


def _unknown_setting(name):
    """What setting `name` on the singleton says: the closest setting, and them all."""
    close = difflib.get_close_matches(name, setting_names(), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else "."
    return f"torch_memory_saver: there is no setting {name!r}{hint} The settings: {', '.join(setting_names())}"


def _check_tags(op, tag):
    """A pause's or resume's tags are a str, a list or tuple of str, or None."""
    if tag is None or isinstance(tag, str):
        return
    if not isinstance(tag, (list, tuple)):
        raise TypeError(f"torch_memory_saver: {op}: tag must be a str, a list of str or None, not {type(tag).__name__}")
    for t in tag:
        if not isinstance(t, str):
            raise TypeError(f"torch_memory_saver: {op}: tag in the list must be a str, not {type(t).__name__}")


def _policy(policy):
    """A region's (enable_cpu_backup, cpu_backup_backend, enable_disk_backup) in words."""
    backup, kind, disk = policy
    return "disk backup" if disk else f"CPU backup ({kind})" if backup else "no backup"


class TorchMemorySaver:
    """Process-wide entry point (use the `torch_memory_saver` instance)."""

    def __init__(self) -> None:
        self._hook_mode = "preload"
        self._impl: Optional[_Impl] = None
        self._init_lock = threading.Lock()
        self._settings = Settings(lambda: _library.load(self._hook_mode))
        self._tags_seen: set = set()    # every tag a region of this process entered or an allocation carried
        self._tags_warned: set = set()  # the unknown tags pause/resume already warned about
        self._entered = threading.local()  # per thread: [(tag, backup policy)] of the region blocks it is in

    if TYPE_CHECKING:
        # The settings the table adds below the class, as a type checker sees them: it
        # runs no code (tests/test_typing.py holds these to the table).
        retain_cpu_backup: bool
        backup_live_only: bool
        progress: bool
        memory_margin_bytes: int
        skip_unchanged: bool
        job: Optional[str]
        spill_to_disk: bool
        verify_restore: bool
    else:
        # Hidden from type checkers, which would then accept any name set on the singleton.
        def __setattr__(self, name, value):
            # A misspelt setting would otherwise be a new attribute that nothing reads.
            # Members of the class (settings, methods a test replaces) and private names
            # (upstream's and frameworks' own) are set as ever.
            if not name.startswith("_") and not hasattr(type(self), name):
                raise AttributeError(_unknown_setting(name))
            object.__setattr__(self, name, value)

    # ---- configuration -------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """True. Kept for code written against the upstream library (its older
        versions answered False when the hook was not preloaded; here that case is
        a clear error at the first region)."""
        return True

    @property
    def hook_mode(self) -> str:
        """How allocations reach the library: "preload" (the default; cudaMalloc is
        interposed through LD_PRELOAD, which also catches CUDA graphs' and
        extensions' allocations) or "torch" (a PyTorch pluggable allocator; no
        LD_PRELOAD). Set it before the first region, pause or resume."""
        return self._hook_mode

    @hook_mode.setter
    def hook_mode(self, value: str):
        if value not in _library.HOOK_MODES:
            raise ValueError(f"torch_memory_saver: hook_mode must be 'preload' or 'torch', got {value!r}")
        if self._impl is not None and value != self._hook_mode:
            raise RuntimeError(
                f"torch_memory_saver: hook_mode is already {self._hook_mode!r} (in use since the first "
                f"region/pause/resume); set hook_mode before first use")
        self._hook_mode = value

    # The settings that change at run time (progress, backup_live_only,
    # memory_margin_bytes, retain_cpu_backup, spill_to_disk, ...) are properties made
    # from the C table below the class: one row of src/platform/config.h each.

    def host_budget(self) -> Dict[str, Any]:
        """The host backup budget this process shares: name, limit (0: none),
        reserved (by every process of the ledger), mine, free, the host's
        mem_total and mem_available, safety (5 % kept available without a
        limit), spill_to_disk."""
        return self._ensure_initialized().core.host_budget()

    # ---- regions -------------------------------------------------------------

    @contextlib.contextmanager
    def region(self, tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False, enable_disk_backup: bool = False,
               cpu_backup_backend: Optional[str] = None, skip_unchanged: Optional[bool] = None,
               restore: Optional[str] = None) -> Iterator[None]:
        """Allocations made by this thread inside are pauseable under `tag`.
        enable_cpu_backup keeps their contents in host memory across a pause;
        enable_disk_backup in a file each, in the disk backup directory (see
        set_disk_backup_dir), with host memory flat. (Upstream's parameter order.)
        skip_unchanged: pauses copy only what changed since the backup was written
        (None: the skip_unchanged setting decides). restore: what memory paused
        without backup holds after resume: "none" (undefined, the fastest), "zero"
        (every byte 0) or "poison" (every byte 0xFF: NaN in every float dtype, -1 in
        signed integers); None: TMS_RESTORE, else "none"."""
        kind = self._check_region(tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup)
        if skip_unchanged is not None and not isinstance(skip_unchanged, bool):
            raise TypeError(f"torch_memory_saver: region(skip_unchanged=...) must be a bool or None, "
                            f"not {type(skip_unchanged).__name__}")
        if restore is not None and not isinstance(restore, str):
            raise TypeError(f"torch_memory_saver: region(restore=...) must be a str or None, not {type(restore).__name__}")
        if restore is not None and restore not in ("none", "zero", "poison"):
            raise ValueError(f"torch_memory_saver: region(tag={tag!r}, restore={restore!r}) must be 'none', 'zero' or "
                             f"'poison'")
        if skip_unchanged and not enable_cpu_backup:
            raise ValueError(f"torch_memory_saver: region(tag={tag!r}, skip_unchanged=True) needs "
                             f"enable_cpu_backup=True: unchanged memory is found by comparing with a host backup")
        impl = self._ensure_initialized()
        self._tags_seen.add(tag)
        with self._nested("region", tag, (enable_cpu_backup, kind, enable_disk_backup)):
            with impl.region(tag, enable_cpu_backup, kind, enable_disk_backup, skip_unchanged, restore):
                yield

    @contextlib.contextmanager
    def disable(self) -> Iterator[None]:
        """Allocations inside are ordinary memory, even within a region; what is
        allocated and freed inside goes back to the driver when the block ends."""
        impl = self._ensure_initialized()
        with impl.disable():
            yield

    @contextlib.contextmanager
    def cuda_graph(self, cuda_graph, pool=None, stream=None, capture_error_mode="global",
                   tag: str = _TAG_DEFAULT, enable_cpu_backup: bool = False,
                   cpu_backup_backend: Optional[str] = None) -> Iterator[None]:
        """Like `torch.cuda.graph`, with the graph's memory pauseable under `tag`."""
        kind = self._check_region(tag, enable_cpu_backup, cpu_backup_backend, False)
        impl = self._ensure_initialized()
        self._tags_seen.add(tag)
        with self._nested("cuda_graph", tag, (enable_cpu_backup, kind, False)):
            with impl.cuda_graph(cuda_graph, pool, stream, capture_error_mode, tag, enable_cpu_backup, kind):
                yield

    @contextlib.contextmanager
    def _nested(self, what, tag, policy):
        """Keeps this thread's stack of region blocks. Re-entering a tag inside a
        block of the same tag with another backup policy would give one tag
        allocations backed up two ways, which pause() treats as one: refused."""
        stack = self._entered.__dict__.setdefault("stack", [])
        for outer_tag, outer in stack:
            if outer_tag == tag and outer != policy:
                raise ValueError(f"torch_memory_saver: {what}(tag={tag!r}) with {_policy(policy)} inside a region "
                                 f"of the same tag with {_policy(outer)}: a tag has one backup policy; give the inner "
                                 f"block another tag, or the outer one's settings")
        stack.append((tag, policy))
        try:
            yield
        finally:
            stack.pop()

    # ---- pause / resume ------------------------------------------------------

    def pause(self, tag: Tags = None, *, measure_free: bool = False) -> _report.Report:
        """Release the memory of `tag` (a tag, a list of tags, or None: every tag);
        backed-up tags copy to host first (only PyTorch's live blocks, see
        backup_live_only). Returns a Report of what it did; measure_free (or the
        INFO log line) also asks the driver for its free memory around the call."""
        return self._pause_or_resume("pause", tag, measure_free)

    def resume(self, tag: Tags = None, *, measure_free: bool = False) -> _report.Report:
        """Map the memory of `tag` (a tag, a list of tags, or None: every tag) back at
        the same addresses; backed-up contents are restored. Returns a Report."""
        return self._pause_or_resume("resume", tag, measure_free)

    def is_paused(self, tag: str) -> bool:
        """True if `tag` holds paused memory and nothing active (so pause(tag) would
        raise and resume(tag) would map it back). A tag with no allocations, or
        with memory allocated into it after a pause, is not paused. Never raises
        for an unknown tag."""
        _check_type(tag, (str,), "tag")
        return tag in self.paused_tags()

    def paused_tags(self) -> List[str]:
        """Sorted list of the tags for which is_paused() is True."""
        rows = _observe.tag_bytes(self._ensure_initialized().core)
        return sorted(t for t, (mapped, paused) in rows.items() if paused and not mapped)

    def _pause_or_resume(self, op, tag, measure_free):
        # A list or tuple of tags (ours beyond upstream) is all or nothing: the core
        # decides for all of them under one lock. One call into the core checks the
        # tags, asks for PyTorch's free blocks only if the pause backs something up,
        # and pauses; the first use checks the tags before it loads anything.
        _check_tags(op, tag)
        if self._impl is None:
            _library.load(self._hook_mode).check_tags(op, tag)
        impl = self._ensure_initialized()
        core, tag = impl.core, list(tag) if isinstance(tag, tuple) else tag
        if not isinstance(measure_free, bool):
            raise TypeError(f"torch_memory_saver: {op}: measure_free must be a bool, not {type(measure_free).__name__}")
        measure_free = measure_free or _observe.logs_calls()
        if op == "pause":
            skip = _live.free_spans if self.backup_live_only and impl.on_gpu() else None
            fn, args = core.pause, (tag, skip, measure_free)
        else:
            fn, args = core.resume, (tag, measure_free)
        try:
            report = _observe.logged(core, fn, args, op, tag, lambda raw: _report.Report(op, raw), self.progress)
        except (Error, DiskBackupDirError) as e:  # what the call did before it failed travels with the exception
            raw = getattr(e, "report_raw", None)
            if raw is not None:
                e.report = _report.Report(op, raw)
            raise
        if tag is not None:  # after the call: a tag the core refuses raises instead
            self._warn_unknown_tags(op, [tag] if isinstance(tag, str) else tag, core)
        return report

    def _warn_unknown_tags(self, op, tags, core):
        """A tag no region or allocation of this process has used is most likely a
        misspelt one: pause/resume of it does nothing, so a RuntimeWarning (once per
        tag) names the tags that exist, the closest first."""
        if all(t in self._tags_seen for t in tags):
            return
        self._tags_seen.update(row["tag"] for row in core.stats())  # the C ABI's and TMS_INIT_ENABLE's tags too
        for tag in tags:
            if tag in self._tags_seen or tag in self._tags_warned:
                continue
            self._tags_warned.add(tag)
            close = difflib.get_close_matches(tag, sorted(self._tags_seen), n=3, cutoff=0.6)
            known = close + sorted(self._tags_seen.difference(close))
            hint = f"; did you mean {close[0]!r}?" if close else "."
            exist = f"Tags used here: {', '.join(map(repr, known))}." if known else "No tag is used here yet."
            warnings.warn(f"torch_memory_saver: {op} of the tag {tag!r} does nothing: no region or allocation of this "
                          f"process has used it{hint} {exist}", RuntimeWarning, stacklevel=4)

    def _check_region(self, tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup):
        """The CPU backup backend the region gets; the core's policy decides the rest
        (checked before first use: a bad region starts nothing)."""
        _check_type(enable_cpu_backup, (bool,), "enable_cpu_backup")
        _check_type(enable_disk_backup, (bool,), "enable_disk_backup")
        _check_type(tag, (str,), "tag")
        _check_type(cpu_backup_backend, (str, type(None)), "cpu_backup_backend")
        native = _library.load(self._hook_mode)
        return native.check_region(tag, enable_cpu_backup, cpu_backup_backend, enable_disk_backup)

    def get_cpu_backup(self, x: "torch.Tensor", zero_copy: bool = False) -> Optional["torch.Tensor"]:
        """Host copy of tensor `x` while its allocation is paused with backup (or
        retained), else None. zero_copy=True aliases the backup instead of copying."""
        if not _library.is_tensor(x):
            raise TypeError(f"torch_memory_saver: get_cpu_backup expects a torch.Tensor, not {type(x).__name__}")
        _check_type(zero_copy, (bool,), "get_cpu_backup(zero_copy=...)")
        import torch

        core = self._ensure_initialized().core
        if x.numel() == 0:
            return torch.empty(x.shape, dtype=x.dtype)
        span = _share.span_bytes(x)
        try:
            view = core.get_cpu_backup(x.data_ptr(), span, zero_copy, not zero_copy)
        except ValueError:
            # An expandable segment's pages are allocations of their own: a tensor
            # may span several, each with its own backup.
            pages, flat = backup_across_pages(core, x.data_ptr(), span)
            if not pages:
                raise
            if flat is None:
                return None
            return flat.view(x.dtype).as_strided(x.shape, x.stride())  # a copy, whatever zero_copy says
        if view is None:
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only view when not zero_copy: cloned at once
            host = torch.frombuffer(view, dtype=torch.uint8).view(x.dtype).as_strided(x.shape, x.stride())
        return host if zero_copy else host.clone(memory_format=torch.contiguous_format)

    def share(self, tensor: "torch.Tensor") -> _share.SharedTensor:
        """A SharedTensor (small, picklable) for `tensor`, whose memory is this
        library's: another process of the same user maps it with open_shared().
        While one holds it open, pause() of its tag raises naming that process."""
        return _share.share(self._ensure_initialized().core, tensor)

    def open_shared(self, shared: _share.SharedTensor, device: Optional[int] = None) -> "torch.Tensor":
        """The tensor another process shared (what its share() returned), mapped
        here on `device` (default: the current one) without a copy: writes are seen
        both ways. Held until this tensor and every view of it are freed."""
        impl = self._ensure_initialized()
        on_gpu = impl.on_gpu()
        return _share.open_shared(impl.core, shared, device, on_gpu)

    def stats(self) -> Dict[int, Dict[str, Dict[str, Any]]]:
        """{device: {tag: {field: value}}}: allocations, bytes requested/reserved/
        mapped/paused, host backup bytes by kind, pause/resume counts, time and
        bytes copied. Reads counters only (no driver call): cheap every step."""
        return _observe.stats(self._ensure_initialized().core)

    def allocations(self) -> List[Dict[str, Any]]:
        """One dict per allocation the library holds: ptr, size, reserved, device,
        tag, state ("active", "paused", or "pausing"/"resuming" while a call moves
        it), cpu_backup / disk_backup (backed up on pause), cpu_backup_backend,
        has_cpu_backup / has_disk_backup (a backup exists now),
        cpu_backup_page_locked, chunks, adopted (an expandable-segment page). A
        copy: it does not change under you."""
        return self._ensure_initialized().core.allocations()

    def memory_report(self, devices: Iterable[int] = ()) -> Dict[int, Dict[str, int]]:
        """{device: {field: bytes}}: each device's memory as the driver counts it
        (total, free, used) and who holds the used part: this library's active
        allocations (ours_active), PyTorch's cache outside them (torch_outside,
        of which torch_outside_free is free blocks), and the rest (other: CUDA
        context, NCCL, cuBLAS workspaces, other processes). ours_paused: bytes
        reserved whose memory is released. Asks the driver and, with torch,
        takes one allocator snapshot: not for every step. Every device holding
        memory of ours or PyTorch's appears, and the current device, even in a
        process that allocated nothing yet; others only if listed in `devices`."""
        if isinstance(devices, (str, bytes)) or not hasattr(devices, "__iter__"):
            raise TypeError(f"torch_memory_saver: memory_report(devices=...) takes device indices (a list of ints), "
                            f"not {type(devices).__name__}")
        devices = list(devices)
        for d in devices:
            _check_type(d, (int,), f"memory_report(devices=...): device {d!r}")
        impl = self._ensure_initialized()
        on_gpu = impl.on_gpu()
        current = _library.torch_module("memory_report").cuda.current_device() if on_gpu else impl.core.current_device()
        return _report.memory_report(impl.core, on_gpu, [current, *devices])

    def memory_summary(self) -> str:
        """A readable table of stats(), like torch.cuda.memory_summary()."""
        return _observe.memory_summary(self._ensure_initialized().core)

    def malloc(self, nbytes: int, device: Optional[int] = None) -> int:
        """Allocates nbytes through the library with this thread's region settings,
        as the hooks do for PyTorch, and returns the address. Must be called inside
        a region. On the host backend (TMS_BACKEND=host) this is how Python code gets
        pauseable memory to read and write (e.g. with ctypes); on a GPU, allocate
        tensors instead. device: None for the current one."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"torch_memory_saver: nbytes must be an int, not {type(nbytes).__name__}")
        if device is not None and (isinstance(device, bool) or not isinstance(device, int)):
            raise TypeError(f"torch_memory_saver: device must be an int or None, not {type(device).__name__}")
        impl = self._ensure_initialized()
        if impl.disabled_here() and not impl.core.get_region()[0]:  # a region inside disable() allocates
            raise ValueError(f"torch_memory_saver: malloc of {nbytes} bytes inside disable(): memory allocated "
                             f"there is ordinary, not the library's; call malloc() outside disable()")
        core = impl.core
        return core.malloc(nbytes) if device is None else core.malloc(nbytes, device)

    def free(self, ptr: int) -> None:
        """Frees an address malloc() returned (active or paused)."""
        _check_type(ptr, (int,), "free: pointer")
        if not 0 <= ptr < 1 << 64:
            raise ValueError(f"torch_memory_saver: free: pointer {ptr} is not a 64-bit address")
        self._ensure_initialized().core.free(ptr)

    def set_disk_backup_dir(self, path: Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]) -> None:
        """Directory for the backup files of regions with enable_disk_backup=True
        (created, mode 0700, with any missing parents; a relative path is resolved now),
        process-wide, for the files made from now on. It must be safe: owned by
        you and writable by no one else, or sticky like /tmp, with the
        directories above it likewise (TMS_DISK_BACKUP_TRUST_DIR=1 vouches for
        one that is not). Files left there by processes that died are removed.
        Default: TMS_DISK_BACKUP_DIR, else $TMPDIR, else /tmp. Raises
        DiskBackupDirError (a ValueError and an OSError) naming the path."""
        if not isinstance(path, (str, bytes, os.PathLike)):
            raise TypeError(f"torch_memory_saver: set_disk_backup_dir expects a path, not {type(path).__name__}")
        path = os.fsdecode(os.fspath(path))
        if not path:
            raise ValueError("torch_memory_saver: set_disk_backup_dir needs a non-empty path")
        core = self._ensure_initialized().core
        try:
            core.set_disk_backup_dir(path)
        except (ValueError, core.Error) as e:
            said = str(e)  # the core's messages name the path; the path converter's do not
            if not said.startswith("torch_memory_saver"):
                said = f"torch_memory_saver: the disk backup directory {path!r}: {said}"
            raise DiskBackupDirError(said) from None

    @property
    def disk_backup_dir(self) -> str:
        """The directory disk backups are written to now (see set_disk_backup_dir)."""
        return self._ensure_initialized().core.disk_backup_dir()

    @property
    def preload_method(self) -> Optional[str]:
        """How cudaMalloc calls reach the library in preload mode: "ld_preload" (the
        library was on LD_PRELOAD at start) or "relocation" (it was not: the GOT
        entries of every loaded object, and of objects loaded later, were pointed at
        its hooks). Installs the hooks if needed; None in torch mode or without a GPU."""
        impl = self._ensure_initialized()
        if self._hook_mode != "preload" or not impl.on_gpu():
            return None
        return impl.preload_method

    @staticmethod
    def configure_subprocess() -> ContextManager[None]:
        """Context manager: child processes started inside it have the preload
        library on LD_PRELOAD (see torch_memory_saver.configure_subprocess).
        Optional: a child that imports the package without it hooks itself by
        relocation (see preload_method)."""
        return _preload.configure_subprocess()

    # ---- internals -----------------------------------------------------------

    def _ensure_initialized(self) -> "_Impl":
        """Loads the core for hook_mode (first use); upstream's name, which frameworks call."""
        if self._impl is None:
            with self._init_lock:
                if self._impl is None:
                    impl = _Impl(self._hook_mode)
                    self._settings.attach(impl.core)
                    self._impl = impl
        return self._impl

    @property
    def _core(self):
        """The native module in use (for tests and the host backend)."""
        return self._ensure_initialized().core




for _name in _SETTING_ROWS:
    setattr(TorchMemorySaver, _name, setting_property(_name))
del _name
