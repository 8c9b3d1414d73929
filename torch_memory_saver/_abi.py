"""The C ABI (include/torch_memory_saver.h) through ctypes: upstream's private
`torch_memory_saver._impl._binary_wrapper.cdll`, which frameworks call."""
import ctypes

_BOOL, _INT, _STR = ctypes.c_bool, ctypes.c_int, ctypes.c_char_p

# name: (argtypes, restype), as include/torch_memory_saver.h declares them.
SIGNATURES = {
    "tms_set_interesting_region": ([_BOOL], _INT),
    "tms_get_interesting_region": ([], _BOOL),
    "tms_set_current_tag": ([_STR], _INT),
    "tms_get_current_tag": ([], _STR),
    "tms_set_enable_cpu_backup": ([_BOOL], _INT),
    "tms_get_enable_cpu_backup": ([], _BOOL),
    "tms_set_cpu_backup_backend": ([_STR], _INT),
    "tms_get_cpu_backup_backend": ([], _STR),
    "tms_set_enable_disk_backup": ([_BOOL], _INT),
    "tms_get_enable_disk_backup": ([], _BOOL),
    "tms_set_disk_backup_dir": ([_STR], _INT),
    "set_memory_margin_bytes": ([ctypes.c_uint64], _INT),
    "tms_set_retain_cpu_backup": ([_BOOL], _INT),
    "tms_get_retain_cpu_backup": ([], _BOOL),
    "tms_pause": ([_STR], _INT),
    "tms_resume": ([_STR], _INT),
    "tms_get_cpu_backup_pointer": ([ctypes.POINTER(ctypes.c_uint8), ctypes.c_uint64], ctypes.POINTER(ctypes.c_uint8)),
    "tms_get_last_error": ([], _STR),
}


def load(path: str) -> ctypes.CDLL:
    """ctypes.CDLL of the library at path (the loaded copy: dlopen of a loaded
    file returns it), with every ABI function's signature set."""
    cdll = ctypes.CDLL(path)
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(cdll, name)
        fn.argtypes = argtypes
        fn.restype = restype
    return cdll


class BinaryWrapper:
    """What upstream's `_impl._binary_wrapper` is: holds `cdll`."""

    def __init__(self, path: str):
        self.cdll = load(path)
