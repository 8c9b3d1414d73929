"""The singleton's settings, as the C table describes them (src/platform/config.h,
its RUN rows): a setting's name, type, variable, default and doc come from
_tms_env.settings(), and every value is checked by C, the same way before the core is
loaded (_tms_env.check_setting) as after (the core's set_<name>). Nothing here knows
one setting from another."""
import importlib

_env = importlib.import_module("torch_memory_saver._tms_env")

# name -> its row of the table: the settings that change at run time, in table order.
ROWS = {row["name"]: row for row in _env.settings() if row["run"]}


class Settings:
    """Values assigned before the core is loaded wait here, and go to the core when it
    loads (attach); after that, every setting is read from and written to the core."""

    def __init__(self, load):
        self._load = load  # () -> the native module of the hook mode in use, loaded on demand
        self._values = {}
        self._core = None

    def get(self, name):
        if self._core is not None:
            return getattr(self._core, "get_" + name)()
        if name in self._values:
            return self._values[name]
        row = ROWS[name]
        # A variable's default is the core's reading of it; one without a variable has the table's.
        return row["default"] if row["env"] is None else getattr(self._load(), "get_" + name)()

    def set(self, name, value):
        if self._core is not None:
            getattr(self._core, "set_" + name)(value)
            return
        _env.check_setting(name, value)  # what the core would refuse is refused now, as it would be after
        self._values[name] = value

    def attach(self, core):
        """The core is loaded: the values that waited go to it, in one go."""
        for name, value in self._values.items():
            getattr(core, "set_" + name)(value)
        self._core = core


def setting_property(name):
    """The singleton's property of setting `name` (its Settings is `_settings`), with the table's doc."""
    return property(lambda self: self._settings.get(name), lambda self, value: self._settings.set(name, value),
                    doc=ROWS[name]["doc"])
