"""The library's exception types. Both native variants raise these (module.c imports
this module), so `except torch_memory_saver.Error` catches what either hook mode raises."""


class Error(RuntimeError):
    """A torch_memory_saver operation failed: a state error (pause of a paused tag),
    a driver error, or a failure on the way; the message names the operation, tag,
    pointer, size and driver code."""


class OutOfMemoryError(Error, MemoryError):
    """Device or host memory ran out, or an allocation would cross memory_margin_bytes."""


class DiskBackupDirError(ValueError, OSError):
    """The disk backup directory cannot be used: it cannot be made or opened, or
    another user could replace its files. A ValueError (a bad argument) and an
    OSError (what os.makedirs raised for it before)."""


# Shown and pickled under the public package name.
Error.__module__ = OutOfMemoryError.__module__ = DiskBackupDirError.__module__ = "torch_memory_saver"
