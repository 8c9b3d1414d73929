"""The singleton's settings, in one store: each setting's type, its default, and
where it lives once the core is loaded."""
import re

_JOB_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")

# name -> (Python type it converts to, the core's getter and setter or None). A
# setting the core keeps is written to it from its first use on (the core checks
# what the value means); one it does not keep is read by the Python layer here.
# The defaults come from the core's TMS_* parsing (defaults()), except the margin.
TABLE = {
    "memory_margin_bytes": (int, ("get_memory_margin_bytes", "set_memory_margin_bytes")),
    "retain_cpu_backup": (bool, ("get_retain_cpu_backup", "set_retain_cpu_backup")),
    "spill_to_disk": (bool, ("get_spill_to_disk", "set_spill_to_disk")),
    "job": ((str, type(None)), ("get_job", "set_job")),
    "progress": (bool, None),
    "backup_live_only": (bool, None),
}


def _type_name(t):
    if isinstance(t, tuple):
        return " or ".join("None" if k is type(None) else _type_name(k) for k in t)
    return ("an " if t.__name__[0] in "aeiou" else "a ") + t.__name__


class Settings:
    """Values assigned before the core is loaded wait here, and go to the core when it
    loads (attach); after that, the settings the core keeps are read from and written
    to it, and the others stay here."""

    def __init__(self, defaults):
        self._defaults = defaults  # () -> the core's defaults() of the hook mode in use, loaded on demand
        self._values = {}
        self._core = None

    def get(self, name):
        kind, native = TABLE[name]
        if native and self._core is not None:
            return getattr(self._core, native[0])()
        if name in self._values:
            return self._values[name]
        return 0 if name == "memory_margin_bytes" else self._defaults()[name]

    def set(self, name, value):
        kind, native = TABLE[name]
        if isinstance(value, bool) is not (kind is bool) or not isinstance(value, kind):
            raise TypeError(f"torch_memory_saver: {name} must be {_type_name(kind)}, not {type(value).__name__}")
        if native and self._core is not None:
            getattr(self._core, native[1])(value)
            return
        if native:
            self._check(name, value)
        self._values[name] = value

    def attach(self, core):
        """The core is loaded: the values that waited go to it, in one go."""
        for name, value in self._values.items():
            native = TABLE[name][1]
            if native:
                getattr(core, native[1])(value)
        self._core = core

    def _check(self, name, value):
        """Before the core is loaded, a value it would refuse is refused now, as it
        would be after: the margin is the one setting whose value can be wrong."""
        if name == "memory_margin_bytes" and value < 0:
            raise ValueError(f"torch_memory_saver: memory_margin_bytes must be >= 0, got {value}")
        if name == "memory_margin_bytes" and value >= 1 << 64:
            raise ValueError(f"torch_memory_saver: memory_margin_bytes must be < 2**64, got {value}")
        if name == "job" and value is not None and not _JOB_NAME.fullmatch(value):
            raise ValueError(f"torch_memory_saver: job {value!r} is not a name of 1 to 64 letters, digits, '_', '-' "
                             f"or '.'")
