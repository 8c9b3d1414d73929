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


class IntegrityError(Error):
    """A resume restored bytes other than those its pause backed up: their
    fingerprints differ (a backup changed while paused: bit rot, a rewritten
    file, a bad host page). The message names the tag, pointer, size and the
    first offset that differs; the allocation stays paused with its backup, so a
    repaired backup can be resumed again."""


# Shown and pickled under the public package name.
for _cls in (Error, OutOfMemoryError, DiskBackupDirError, IntegrityError):
    _cls.__module__ = "torch_memory_saver"
