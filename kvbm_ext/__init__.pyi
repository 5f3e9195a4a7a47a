from typing import Any, Literal, Sequence, TypedDict

__version__: str

class BuildInfo(TypedDict):
    version: str
    cuda_version: str | None
    cuda_archs: list[str]
    with_cuda: bool

class CudaDevice(TypedDict):
    index: int
    name: str
    capability: tuple[int, int]
    total_memory: int
    multiprocessors: int

# Arrays: anything exposing DLPack, __cuda_array_interface__,
# __array_interface__ or the buffer protocol (torch, CuPy, JAX, NumPy).
Array = Any
# None (legacy default stream), an int cudaStream_t handle, or an object
# with __cuda_stream__() or .cuda_stream.
Stream = Any

def block_to_universal(
    blocks: Sequence[Sequence[Array]],
    universals: Sequence[Array] | Array,
    layout: str = "NHD",
    *,
    stream: Stream = None,
) -> None: ...
def universal_to_block(
    universals: Sequence[Array] | Array,
    blocks: Sequence[Sequence[Array]],
    layout: str = "NHD",
    *,
    stream: Stream = None,
) -> None: ...

Backend = Literal["kernel", "async", "batch", "auto"]

def block_to_operational(
    blocks: Sequence[Sequence[Array]],
    operationals: Sequence[Array] | Array,
    *,
    backend: Backend | str = "auto",
    stream: Stream = None,
) -> None: ...
def operational_to_block(
    operationals: Sequence[Array] | Array,
    blocks: Sequence[Sequence[Array]],
    *,
    backend: Backend | str = "auto",
    stream: Stream = None,
) -> None: ...
def universal_to_operational(
    universals: Sequence[Array] | Array,
    operationals: Sequence[Array] | Array,
    layout: str = "NHD",
    *,
    stream: Stream = None,
) -> None: ...
def operational_to_universal(
    operationals: Sequence[Array] | Array,
    universals: Sequence[Array] | Array,
    layout: str = "NHD",
    *,
    stream: Stream = None,
) -> None: ...

# A sequence of int addresses (or sizes), or a 1-D int64/uint64 array.
Addresses = Sequence[int] | Array

def vectorized_copy(
    src_ptrs: Addresses,
    dst_ptrs: Addresses,
    sizes: int | Addresses,
    *,
    stream: Stream = None,
) -> None: ...
def memcpy_batch(
    src_ptrs: Addresses,
    dst_ptrs: Addresses,
    sizes: int | Addresses,
    *,
    mode: Literal["batched_with_fallback", "fallback_only", "batch_without_fallback"] | str = "batched_with_fallback",
    stream: Stream = None,
) -> None: ...
def is_memcpy_batch_available() -> bool: ...
def is_using_stubs() -> bool: ...
def build_info() -> BuildInfo: ...
def cuda_devices() -> list[CudaDevice]: ...
