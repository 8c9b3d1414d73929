"""The C ABI (include/torch_memory_saver.h) through ctypes: upstream's private
`torch_memory_saver._impl._binary_wrapper.cdll`, which frameworks call."""
import ctypes
import os

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


# The GPU runtimes whose functions callers reach through `cdll` (the upstream
# library links the CUDA runtime, so its handle resolves them).
_RUNTIME_NAMES = ("libcudart.so", "libamdhip64.so")


def loaded_runtime():
    """A ctypes.CDLL of the CUDA (or HIP) runtime already loaded in this process,
    or None. Never loads one: the library does not depend on the runtime."""
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split(None, 5)[5].strip() for line in maps if line.count(" ") >= 5 and "/" in line]
    except OSError:
        return None
    for name in _RUNTIME_NAMES:
        for path in paths:
            if os.path.basename(path).startswith(name):
                try:
                    return ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW | os.RTLD_LOCAL)
                except OSError:
                    continue
    return None


class Library(ctypes.CDLL):
    """The library's handle; a name it does not define (cudaHostGetFlags,
    cudaGetLastError, ...) resolves in the GPU runtime loaded in the process."""

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__"):
                raise
            runtime = loaded_runtime()
            if runtime is None:
                raise AttributeError(f"torch_memory_saver: {name} is not a function of {self._name} and no CUDA or "
                                     f"HIP runtime is loaded in this process") from None
            try:
                fn = getattr(runtime, name)
            except AttributeError:
                raise AttributeError(f"torch_memory_saver: {name} is neither a function of {self._name} nor of "
                                     f"the loaded runtime {runtime._name}") from None
            setattr(self, name, fn)
            return fn


def load(path: str) -> ctypes.CDLL:
    """The library at path (the loaded copy: dlopen of a loaded file returns
    it), with every ABI function's signature set."""
    cdll = Library(path)
    for name, (argtypes, restype) in SIGNATURES.items():
        fn = getattr(cdll, name)
        fn.argtypes = argtypes
        fn.restype = restype
    return cdll


class BinaryWrapper:
    """What upstream's `_impl._binary_wrapper` is: holds `cdll`."""

    def __init__(self, path: str):
        self.cdll = load(path)
