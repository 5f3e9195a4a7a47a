from typing import Any, Sequence, TypedDict

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
def is_using_stubs() -> bool: ...
def build_info() -> BuildInfo: ...
def cuda_devices() -> list[CudaDevice]: ...
