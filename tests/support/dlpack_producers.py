"""Stand-in DLPack producers built with ctypes: a tensor description of the caller's
choosing, well formed or not (a NULL shape, NULL strides, any ndim, any element type),
handed over through the C exchange API (a type's `__dlpack_c_exchange_api__` capsule, whose
C function fills the description) or through `__dlpack__` capsules, versioned or legacy.

The producers' C functions are ctypes callbacks: they run with the GIL held, as a real
producer's would. Each producer keeps alive the memory it describes and every ctypes
object the description points to. Used by the tests and by tools/fuzz.py (NumPy and
ctypes only: no torch).
"""

import ctypes

import numpy as np

CPU, CUDA = 1, 2
DTYPE_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}


class Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", Device), ("ndim", ctypes.c_int32), ("dtype", DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


# The deleters stay NULL: the producer, not the capsule, owns what a description points to.
class ManagedLegacy(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


class ManagedVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64), ("dl_tensor", DLTensor)]


FROM_OBJECT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(DLTensor))
CURRENT_STREAM = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int32, ctypes.c_int32, ctypes.POINTER(ctypes.c_void_p))


class ExchangeAPI(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32), ("prev_api", ctypes.c_void_p),
                ("managed_tensor_allocator", ctypes.c_void_p), ("managed_tensor_from_py_object_no_sync", ctypes.c_void_p),
                ("managed_tensor_to_py_object_no_sync", ctypes.c_void_p),
                ("dltensor_from_py_object_no_sync", FROM_OBJECT), ("current_work_stream", CURRENT_STREAM)]


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype, _new_capsule.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class Description:
    """A DLTensor describing `array` (a NumPy array, kept alive), with any field replaced:
    `shape` / `strides` a sequence or None (a NULL pointer), `ndim`, `dtype` a (code, bits,
    lanes) triple, `device` a (type, id) pair, `data` an address. Strides are in elements
    (None in NumPy terms: compact)."""

    def __init__(self, array, *, ndim=None, shape="array", strides="array", dtype=None, device=(CPU, 0), data=None,
                 byte_offset=0):
        self.array = array
        itemsize = array.itemsize
        if shape == "array":
            shape = array.shape
        if strides == "array":
            strides = tuple(s // itemsize for s in array.strides)
        self.shape = None if shape is None else (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self.strides = None if strides is None else (ctypes.c_int64 * max(len(strides), 1))(*strides)
        self.ndim = ndim if ndim is not None else array.ndim if shape is None else len(shape)
        self.dtype = dtype or (DTYPE_CODES[array.dtype.kind], itemsize * 8, 1)
        self.device = device
        self.data = array.ctypes.data if data is None else data
        self.byte_offset = byte_offset

    def fill(self, out):
        out.data = self.data
        out.device = Device(*self.device)
        out.ndim = self.ndim
        out.dtype = DataType(*self.dtype)
        out.shape = ctypes.cast(self.shape, ctypes.POINTER(ctypes.c_int64)) if self.shape is not None else None
        out.strides = ctypes.cast(self.strides, ctypes.POINTER(ctypes.c_int64)) if self.strides is not None else None
        out.byte_offset = self.byte_offset


def exchange_producer(description):
    """An object of a new type whose C exchange API fills `description` (and whose
    current_work_stream says "no stream")."""

    def from_object(obj, out):
        description.fill(out[0])
        return 0

    def stream(device_type, device_id, out):
        out[0] = None
        return 0

    callbacks = (FROM_OBJECT(from_object), CURRENT_STREAM(stream))
    api = ExchangeAPI(1, 3, None, None, None, None, *callbacks)
    capsule = _new_capsule(ctypes.addressof(api), b"dlpack_exchange_api", None)
    # The class keeps the table and its callbacks alive for as long as its capsule.
    cls = type("ExchangeProducer", (), {"__dlpack_c_exchange_api__": capsule, "_keep": (api, callbacks, description)})
    return cls()


class CapsuleProducer:
    """`__dlpack__` returns a capsule over `description`: "dltensor_versioned" (version
    `major`.3, `flags`) or the legacy "dltensor"."""

    def __init__(self, description, versioned=True, major=1, flags=0):
        self.description, self.versioned = description, versioned
        self.managed = ManagedVersioned(major, 3, None, None, flags) if versioned else ManagedLegacy()
        description.fill(self.managed.dl_tensor)

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        name = b"dltensor_versioned" if self.versioned else b"dltensor"
        return _new_capsule(ctypes.addressof(self.managed), name, None)

    def __dlpack_device__(self):
        return self.description.device


def producers(description):
    """The same description through each route: the C exchange API, a versioned capsule, a
    legacy capsule."""
    return {"exchange": exchange_producer(description), "versioned": CapsuleProducer(description),
            "legacy": CapsuleProducer(description, versioned=False)}


def compact(shape, dtype, rng):
    """A random C-contiguous NumPy array (random bytes, never zeros)."""
    count = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer(rng.bytes(count), dtype=np.uint8).copy().view(dtype).reshape(shape)
