"""A malformed environment fails the import (tests/test_api.py, test_bad_input.py,
test_host_backend.py, test_compat.py): a ValueError naming the variable and its value, every time the
import is tried (a failed import is not cached as success). And the variables the
environment table knows (tests/test_readme_promises.py).

No _prelude here: it imports the package, which is what these cases check."""
import importlib
import sys


def _raises_each_time(name, *fragments):
    for attempt in range(2):                           # a failed import is not cached as success
        try:
            importlib.import_module(name)
        except ValueError as e:
            assert all(f in str(e) for f in fragments), (name, str(e))
        else:
            raise AssertionError(f"import of {name} succeeded")


def package_and_variants(var, value):
    """The package and both native modules name var and 'value'."""
    for name in ("torch_memory_saver", "torch_memory_saver._tms_preload", "torch_memory_saver._tms_torch"):
        _raises_each_time(name, var, f"'{value}'")
    print("done")


def package(var, fragment):
    """The package names var, with fragment in the message."""
    _raises_each_time("torch_memory_saver", var, fragment)
    print("done")


def backend_variable(fragment):
    """The backend's own variables are checked at import too, before the backend loads."""
    for name in ("torch_memory_saver", "torch_memory_saver._tms_torch"):
        try:
            __import__(name)
        except ValueError as e:
            assert fragment in str(e), str(e)
        else:
            raise AssertionError(name)
    assert "torch_memory_saver._tms_preload" not in sys.modules
    print("done")


def pause_every_tag():
    """Imports the package and pauses every tag: the import raises first."""
    import torch_memory_saver

    torch_memory_saver.torch_memory_saver.pause()


def unknown_variables(names):
    """Of names, those the environment table does not know (by is_known, and by its list)."""
    import torch_memory_saver._tms_env as env

    return [n for n in names if not env.is_known(n)], sorted(set(names) - set(env.names()))


if __name__ == "__main__":
    globals()[sys.argv[1]](*sys.argv[2:])
