"""Stand-in producers: objects that offer exactly ONE array or stream protocol, so a test
knows which path of the library read them."""

import torch


class DLPackOnly:
    """Forwards the (versioned-capable) DLPack protocol of a torch tensor; records the calls."""

    def __init__(self, t):
        self._t = t
        self.calls = []

    @property
    def tensor(self):
        return self._t

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        self.calls.append({"stream": stream, "max_version": max_version, "dl_device": dl_device, "copy": copy})
        return self._t.__dlpack__(stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


class LegacyDLPackOnly:
    """A pre-1.0 DLPack producer: __dlpack__ knows no max_version and returns a legacy capsule."""

    def __init__(self, t):
        self._t = t
        self.calls = 0

    def __dlpack__(self, stream=None):
        self.calls += 1
        return torch.utils.dlpack.to_dlpack(self._t)

    def __dlpack_device__(self):
        return self._t.__dlpack_device__()


class ArrayInterfaceOnly:
    """Exposes only NumPy's __array_interface__ (keeps the array alive)."""

    def __init__(self, a):
        self._a = a

    @property
    def __array_interface__(self):
        return self._a.__array_interface__


class CudaArrayInterfaceOnly:
    """Exposes only __cuda_array_interface__ of a device array (torch, CuPy...), kept alive."""

    def __init__(self, obj):
        self._obj = obj

    @property
    def __cuda_array_interface__(self):
        return self._obj.__cuda_array_interface__


class DLPackWithDecoyArrayInterface(DLPackOnly):
    """DLPack of one tensor plus an __array_interface__ describing a DIFFERENT array:
    a library that prefers DLPack (as specified) sees the tensor's bytes."""

    def __init__(self, t, decoy):
        super().__init__(t)
        self._decoy = decoy

    @property
    def __array_interface__(self):
        return self._decoy.__array_interface__


class FakeDeviceArray:
    """Only a __cuda_array_interface__ (v2, fp16) pointing at a made-up device address:
    enough to make a build without CUDA refuse it, never to be dereferenced."""

    def __init__(self, shape):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": "<f2", "data": (0x10000, False), "version": 2, "strides": None,
        }


def wrap(x, cls):
    """Apply cls to every array of a nested list (or a single array)."""
    if isinstance(x, (list, tuple)):
        return [wrap(v, cls) for v in x]
    return cls(x)


# --------------------------------------------------------------------------
# Streams.
# --------------------------------------------------------------------------


class CudaStreamProtocolOnly:
    """Only the cuda.core protocol: __cuda_stream__() -> (0, handle)."""

    def __init__(self, s):
        self._s = s

    def __cuda_stream__(self):
        return (0, self._s.cuda_stream)


class CudaStreamAttributeOnly:
    """Only a .cuda_stream attribute (like older torch / numba streams)."""

    def __init__(self, s):
        self.cuda_stream = s.cuda_stream


# The `stream=` argument forms of a torch.cuda.Stream.
STREAM_FORMS = {
    "torch.cuda.Stream": lambda s: s,
    "int": lambda s: s.cuda_stream,
    "__cuda_stream__": CudaStreamProtocolOnly,
    ".cuda_stream": CudaStreamAttributeOnly,
}
