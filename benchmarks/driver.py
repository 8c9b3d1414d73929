"""The CUDA driver's virtual memory calls through ctypes, with no library and no
PyTorch in between: the floors and the driver-alone rows of the switch suite."""
import ctypes as C
import time

P, U64, SZ = C.POINTER, C.c_ulonglong, C.c_size_t
POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR


class _Loc(C.Structure):
    _fields_ = [("type", C.c_int), ("id", C.c_int)]


class _Prop(C.Structure):  # CUmemAllocationProp
    _fields_ = [("type", C.c_int), ("handle_types", C.c_int), ("loc", _Loc), ("win32", C.c_void_p),
                ("compression", C.c_ubyte), ("rdma", C.c_ubyte), ("usage", C.c_ushort), ("reserved", C.c_ubyte * 4)]


class _Access(C.Structure):  # CUmemAccessDesc
    _fields_ = [("loc", _Loc), ("flags", C.c_int)]


_SIGNATURES = {
    "cuInit": [C.c_uint], "cuDeviceGet": [P(C.c_int), C.c_int], "cuDevicePrimaryCtxRetain": [P(C.c_void_p), C.c_int],
    "cuCtxSetCurrent": [C.c_void_p], "cuCtxSynchronize": [], "cuMemGetInfo_v2": [P(SZ), P(SZ)],
    "cuGetErrorName": [C.c_int, P(C.c_char_p)], "cuMemGetAllocationGranularity": [P(SZ), P(_Prop), C.c_int],
    "cuMemAddressReserve": [P(U64), SZ, SZ, U64, U64], "cuMemAddressFree": [U64, SZ],
    "cuMemCreate": [P(U64), SZ, P(_Prop), U64], "cuMemRelease": [U64], "cuMemMap": [U64, SZ, SZ, U64, U64],
    "cuMemUnmap": [U64, SZ], "cuMemSetAccess": [U64, SZ, P(_Access), SZ], "cuMemsetD8_v2": [U64, C.c_ubyte, SZ],
    "cuMemExportToShareableHandle": [P(C.c_int), U64, C.c_int, U64],
    "cuMemImportFromShareableHandle": [P(U64), C.c_void_p, C.c_int]}


class Driver:
    """The primary context of one device made current on the calling thread (the one
    PyTorch uses, where the process has it). Every call is checked."""

    def __init__(self, device=0):
        self.cu, self.device = C.CDLL("libcuda.so.1"), device
        for fn, args in _SIGNATURES.items():
            getattr(self.cu, fn).argtypes = args
        dev, ctx, gran = C.c_int(), C.c_void_p(), SZ()
        self.call("cuInit", 0)
        self.call("cuDeviceGet", C.byref(dev), device)
        self.call("cuDevicePrimaryCtxRetain", C.byref(ctx), dev)
        self.call("cuCtxSetCurrent", ctx)
        self.call("cuMemGetAllocationGranularity", C.byref(gran), C.byref(self.prop(False)), 0)
        self.granularity = gran.value

    def name(self, rc):
        s = C.c_char_p()
        return s.value.decode() if self.cu.cuGetErrorName(rc, C.byref(s)) == 0 and s.value else f"CUresult {rc}"

    def call(self, fn, *args):
        rc = getattr(self.cu, fn)(*args)
        if rc:
            raise RuntimeError(f"{fn}: {self.name(rc)} ({rc})")

    def prop(self, exportable):
        p = _Prop(type=1, handle_types=POSIX_FD if exportable else 0)  # CU_MEM_ALLOCATION_TYPE_PINNED
        p.loc.type, p.loc.id = 1, self.device  # CU_MEM_LOCATION_TYPE_DEVICE
        return p

    def mem_info(self):
        free, total = SZ(), SZ()
        self.call("cuMemGetInfo_v2", C.byref(free), C.byref(total))
        return free.value, total.value

    def sync(self):
        self.call("cuCtxSynchronize")

    def create(self, size, exportable=False):
        h = U64()
        self.call("cuMemCreate", C.byref(h), size, C.byref(self.prop(exportable)), 0)
        return h.value

    def export_fd(self, handle):
        """(descriptor, 0), or (None, the driver's error code)."""
        fd = C.c_int(-1)
        rc = self.cu.cuMemExportToShareableHandle(C.byref(fd), handle, POSIX_FD, 0)
        return (fd.value, 0) if rc == 0 else (None, rc)

    def import_fd(self, fd):
        h = U64()
        self.call("cuMemImportFromShareableHandle", C.byref(h), C.c_void_p(fd), POSIX_FD)
        return h.value


class Block:
    """size bytes at one reserved range, backed by handles of chunk bytes each (one
    handle by default); the range stays reserved until close(), as the library keeps
    an allocation's. What a failed make() left behind, drop() releases."""

    def __init__(self, drv, size, chunk=None, exportable=False):
        g = drv.granularity
        self.drv, self.chunk, self.exportable, self.handles, self.mapped = drv, -(-(chunk or size) // g) * g, \
            exportable, [], 0
        self.size = -(-size // self.chunk) * self.chunk
        va = U64()
        drv.call("cuMemAddressReserve", C.byref(va), self.size, 0, 0, 0)
        self.va = va.value

    def make(self, handles=None):
        """Creates the handles (or takes these), then maps them: (create seconds, map seconds)."""
        t0 = time.perf_counter()
        if handles is not None:
            self.handles = list(handles)
        while len(self.handles) < self.size // self.chunk:
            self.handles.append(self.drv.create(self.chunk, self.exportable))
        t1 = time.perf_counter()
        access = _Access(flags=3)  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        access.loc.type, access.loc.id = 1, self.drv.device
        for h in self.handles:
            va = self.va + self.mapped * self.chunk
            self.drv.call("cuMemMap", va, self.chunk, 0, h, 0)
            self.mapped += 1
            self.drv.call("cuMemSetAccess", va, self.chunk, C.byref(access), 1)
        return t1 - t0, time.perf_counter() - t1

    def fill(self, value=0x5A):
        self.drv.call("cuMemsetD8_v2", self.va, value, self.size)
        self.drv.sync()

    def drop(self):
        while self.handles:
            if self.mapped == len(self.handles):
                self.mapped -= 1
                self.drv.call("cuMemUnmap", self.va + self.mapped * self.chunk, self.chunk)
            self.drv.call("cuMemRelease", self.handles.pop())

    def close(self):
        self.drop()
        self.drv.call("cuMemAddressFree", self.va, self.size)
