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

# "auto": copy engines (staged where bytes are rearranged) when pinned host
# memory takes part, the kernel device to device; "copy_engines" ("batch",
# "async": the same, driven by cudaMemcpyBatchAsync or cudaMemcpyAsync);
# "kernel": SM kernels read and write pinned memory directly.  Any case.
Backend = Literal["auto", "copy_engines", "kernel", "batch", "async"]

def block_to_universal(
    blocks: Sequence[Sequence[Array]],
    universals: Sequence[Array] | Array,
    layout: str = "NHD",
    *,
    backend: Backend | str = "auto",
    num_ctas: int | None = None,
    stream: Stream = None,
) -> None: ...
def universal_to_block(
    universals: Sequence[Array] | Array,
    blocks: Sequence[Sequence[Array]],
    layout: str = "NHD",
    *,
    backend: Backend | str = "auto",
    num_ctas: int | None = None,
    stream: Stream = None,
) -> None: ...

def block_to_operational(
    blocks: Sequence[Sequence[Array]],
    operationals: Sequence[Array] | Array,
    *,
    backend: Backend | str = "auto",
    num_ctas: int | None = None,
    stream: Stream = None,
) -> None: ...
def operational_to_block(
    operationals: Sequence[Array] | Array,
    blocks: Sequence[Sequence[Array]],
    *,
    backend: Backend | str = "auto",
    num_ctas: int | None = None,
    stream: Stream = None,
) -> None: ...
def universal_to_operational(
    universals: Sequence[Array] | Array,
    operationals: Sequence[Array] | Array,
    layout: str = "NHD",
    *,
    backend: Backend | str = "auto",
    num_ctas: int | None = None,
    stream: Stream = None,
) -> None: ...
def operational_to_universal(
    operationals: Sequence[Array] | Array,
    universals: Sequence[Array] | Array,
    layout: str = "NHD",
    *,
    backend: Backend | str = "auto",
    num_ctas: int | None = None,
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

# Block ids: a sequence of ints, or a 1-D int32/int64 array on the host or the cache's device.
BlockIds = Sequence[int] | Array

class PagedKVCache:
    def __init__(self, layers: Sequence[Array] | Array, dims: str) -> None: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def tokens_per_block(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def num_outer(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def itemsize(self) -> int: ...
    @property
    def device(self) -> str: ...
    @property
    def dims(self) -> str: ...
    @property
    def layers(self) -> Sequence[Array] | Array: ...
    def to_universal(
        self,
        block_ids: BlockIds,
        universals: Sequence[Array] | Array,
        /,
        *,
        layers: slice | range | None = None,
        layer_offset: int = 0,
        head_offset: int = 0,
        backend: Backend | str = "auto",
        num_ctas: int | None = None,
        stream: Stream = None,
    ) -> None: ...
    def from_universal(
        self,
        universals: Sequence[Array] | Array,
        block_ids: BlockIds,
        /,
        *,
        layers: slice | range | None = None,
        layer_offset: int = 0,
        head_offset: int = 0,
        backend: Backend | str = "auto",
        num_ctas: int | None = None,
        stream: Stream = None,
    ) -> None: ...
    def to_operational(
        self,
        block_ids: BlockIds,
        operationals: Sequence[Array] | Array,
        /,
        *,
        inner: str = "NHD",
        layers: slice | range | None = None,
        backend: Backend | str = "auto",
        num_ctas: int | None = None,
        stream: Stream = None,
    ) -> None: ...
    def from_operational(
        self,
        operationals: Sequence[Array] | Array,
        block_ids: BlockIds,
        /,
        *,
        inner: str = "NHD",
        layers: slice | range | None = None,
        backend: Backend | str = "auto",
        num_ctas: int | None = None,
        stream: Stream = None,
    ) -> None: ...

class StagingInfo(TypedDict):
    device: int
    size_bytes: int
    lanes: int
    lane_bytes: int
    allocated: bool
    capture_reserved: bool

def set_staging(size_bytes: int | None = None, *, lanes: int | None = None) -> None: ...
def reserve_staging(device: int | None = None) -> None: ...
def staging_info(device: int | None = None) -> StagingInfo: ...
def is_using_stubs() -> bool: ...
def build_info() -> BuildInfo: ...
def cuda_devices() -> list[CudaDevice]: ...
