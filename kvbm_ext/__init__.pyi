import dataclasses
from typing import Any, Callable, Literal, Protocol, Sequence, SupportsIndex, TypedDict, final, overload

from typing_extensions import deprecated

__all__ = [
    "Deferred",
    "EngineLayout",
    "HostBuffer",
    "PagedKVCache",
    "ReshardHandle",
    "ReshardStats",
    "ReshardTransfer",
    "Resharder",
    "TorchTransport",
    "Transport",
    "__version__",
    "block_to_operational",
    "block_to_universal",
    "build_info",
    "crc32c",
    "cuda_devices",
    "is_memcpy_batch_available",
    "is_using_stubs",
    "memcpy_batch",
    "operational_to_block",
    "operational_to_universal",
    "pinned_empty",
    "plan_reshard",
    "reserve_staging",
    "reshard",
    "set_staging",
    "staging_info",
    "universal_to_block",
    "universal_to_operational",
    "unlink_shared",
    "vectorized_copy",
]

__version__: str

class _BuildInfo(TypedDict):
    version: str
    cuda_version: str | None
    cuda_archs: list[str]
    with_cuda: bool

class _CudaDevice(TypedDict):
    index: int
    name: str
    capability: tuple[int, int]
    total_memory: int
    multiprocessors: int

# Arrays: anything exposing DLPack, __cuda_array_interface__,
# __array_interface__ or the buffer protocol (torch, CuPy, JAX, NumPy).
_Array = Any
# None (legacy default stream), an int cudaStream_t handle (an int or any
# object with __index__, e.g. numpy.uint64), or an object
# with __cuda_stream__() or .cuda_stream.
_Stream = Any

# "auto": copy engines (staged where bytes are rearranged) when pinned host
# memory takes part, the kernel device to device; "copy_engines" ("batch",
# "async": the same, driven by cudaMemcpyBatchAsync or cudaMemcpyAsync);
# "kernel": SM kernels read and write pinned memory directly.  Any case.
_Backend = Literal["auto", "copy_engines", "kernel", "batch", "async"]

def block_to_universal(
    blocks: Sequence[Sequence[_Array]],
    universals: Sequence[_Array] | _Array,
    /,
    layout: str = "NHD",
    *,
    backend: _Backend | str = "auto",
    num_ctas: SupportsIndex | None = None,
    stream: _Stream = None,
) -> None: ...
def universal_to_block(
    universals: Sequence[_Array] | _Array,
    blocks: Sequence[Sequence[_Array]],
    /,
    layout: str = "NHD",
    *,
    backend: _Backend | str = "auto",
    num_ctas: SupportsIndex | None = None,
    stream: _Stream = None,
) -> None: ...

def block_to_operational(
    blocks: Sequence[Sequence[_Array]],
    operationals: Sequence[_Array] | _Array,
    /,
    *,
    backend: _Backend | str = "auto",
    num_ctas: SupportsIndex | None = None,
    stream: _Stream = None,
) -> None: ...
def operational_to_block(
    operationals: Sequence[_Array] | _Array,
    blocks: Sequence[Sequence[_Array]],
    /,
    *,
    backend: _Backend | str = "auto",
    num_ctas: SupportsIndex | None = None,
    stream: _Stream = None,
) -> None: ...
def universal_to_operational(
    universals: Sequence[_Array] | _Array,
    operationals: Sequence[_Array] | _Array,
    /,
    layout: str = "NHD",
    *,
    backend: _Backend | str = "auto",
    num_ctas: SupportsIndex | None = None,
    stream: _Stream = None,
) -> None: ...
def operational_to_universal(
    operationals: Sequence[_Array] | _Array,
    universals: Sequence[_Array] | _Array,
    /,
    layout: str = "NHD",
    *,
    backend: _Backend | str = "auto",
    num_ctas: SupportsIndex | None = None,
    stream: _Stream = None,
) -> None: ...

# A sequence of int addresses (or sizes), or a 1-D int64/uint64 array; an int is anything
# with __index__ (np.int64 too) but a bool.
_Addresses = Sequence[SupportsIndex] | _Array

def vectorized_copy(
    src_ptrs: _Addresses,
    dst_ptrs: _Addresses,
    sizes: SupportsIndex | _Addresses,
    *,
    stream: _Stream = None,
) -> None: ...
def memcpy_batch(
    src_ptrs: _Addresses,
    dst_ptrs: _Addresses,
    sizes: SupportsIndex | _Addresses,
    *,
    mode: Literal["batched_with_fallback", "fallback_only", "batch_without_fallback"] | str = "batched_with_fallback",
    stream: _Stream = None,
) -> None: ...
def is_memcpy_batch_available() -> bool: ...

# Block ids: a sequence of ints, or a 1-D int32/int64 array on the host or the cache's device.
_BlockIds = Sequence[int] | _Array

@final
class PagedKVCache:
    def __new__(
        cls,
        layers: Sequence[_Array] | Sequence[tuple[_Array, _Array] | list[_Array]] | _Array,
        layout: str,
        *,
        block_size: SupportsIndex | None = None,
        autograd_checks: bool = True,
    ) -> PagedKVCache: ...
    # The constructor's layout (in lower case) and block size (tokens per block, given or
    # read from the layout's 't').
    @property
    def layout(self) -> str: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def num_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def num_outer(self) -> int: ...
    # In the arrays' framework: torch.dtype and torch.device for torch tensors; numpy.dtype
    # (where NumPy has the type) and "cpu" for NumPy arrays; else dtype_name and device_name.
    @property
    def dtype(self) -> Any: ...
    @property
    def device(self) -> Any: ...
    @property
    def dtype_name(self) -> str: ...
    @property
    def device_name(self) -> str: ...
    @property
    def itemsize(self) -> int: ...
    @property
    def layers(self) -> Sequence[_Array] | Sequence[tuple[_Array, _Array]] | _Array: ...
    # The names before block_size and layout, kept for one release.
    @property
    @deprecated("PagedKVCache.tokens_per_block is deprecated, read PagedKVCache.block_size")
    def tokens_per_block(self) -> int: ...
    @property
    @deprecated("PagedKVCache.dims is deprecated, read PagedKVCache.layout")
    def dims(self) -> str: ...
    def to_universal(
        self,
        block_ids: _BlockIds,
        universals: Sequence[_Array] | _Array,
        /,
        *,
        layers: SupportsIndex | slice | range | None = None,
        layer_offset: int = 0,
        heads: SupportsIndex | slice | range | None = None,
        head_offset: int = 0,
        pack_layers: bool = False,
        backend: _Backend | str = "auto",
        num_ctas: int | None = None,
        stream: _Stream = None,
    ) -> None: ...
    def from_universal(
        self,
        universals: Sequence[_Array] | _Array,
        block_ids: _BlockIds,
        /,
        *,
        layers: SupportsIndex | slice | range | None = None,
        layer_offset: int = 0,
        heads: SupportsIndex | slice | range | None = None,
        head_offset: int = 0,
        pack_layers: bool = False,
        backend: _Backend | str = "auto",
        num_ctas: int | None = None,
        stream: _Stream = None,
    ) -> None: ...
    def to_operational(
        self,
        block_ids: _BlockIds,
        operationals: Sequence[_Array] | _Array,
        /,
        *,
        layout: str = "NHD",
        layers: SupportsIndex | slice | range | None = None,
        pack_layers: bool = False,
        backend: _Backend | str = "auto",
        num_ctas: int | None = None,
        stream: _Stream = None,
        inner: str | None = None,
    ) -> None: ...
    def from_operational(
        self,
        operationals: Sequence[_Array] | _Array,
        block_ids: _BlockIds,
        /,
        *,
        layout: str = "NHD",
        layers: SupportsIndex | slice | range | None = None,
        pack_layers: bool = False,
        backend: _Backend | str = "auto",
        num_ctas: int | None = None,
        stream: _Stream = None,
        inner: str | None = None,
    ) -> None: ...
    def to_cache(
        self,
        dst: PagedKVCache,
        src_ids: _BlockIds,
        dst_ids: _BlockIds,
        *,
        layers: SupportsIndex | slice | range | None = None,
        heads: SupportsIndex | slice | range | None = None,
        layer_offset: int = 0,
        head_offset: int = 0,
        pack_layers: bool = False,
        backend: _Backend | str = "auto",
        num_ctas: int | None = None,
        stream: _Stream = None,
        defer: bool = False,
    ) -> Deferred | None: ...

class _StagingInfo(TypedDict):
    device: int
    size_bytes: int
    lanes: int
    lane_bytes: int
    allocated: bool
    capture_reserved: bool

def set_staging(size_bytes: SupportsIndex | None = None, *, lanes: SupportsIndex | None = None) -> None: ...
def reserve_staging(device: SupportsIndex | None = None) -> None: ...
def staging_info(device: SupportsIndex | None = None) -> _StagingInfo: ...
def is_using_stubs() -> bool: ...
def build_info() -> _BuildInfo: ...
def cuda_devices() -> list[_CudaDevice]: ...
def crc32c(data: Any, /, value: SupportsIndex = 0) -> int: ...

# Resharding between engines of different TP / PP sizes (kvbm_ext/_plan.py, _transport.py, _reshard.py).
# Tensors here are torch tensors; torch is imported only when a Resharder is built.
_Tensor = Any

@dataclasses.dataclass(frozen=True)
class EngineLayout:
    tp_size: int
    pp_size: int = 1
    ranks: Sequence[int] | None = None
    layer_ranges: Sequence[range | tuple[int, int]] | None = None
    def __post_init__(self) -> None: ...
    @property
    def size(self) -> int: ...
    def rank_of(self, pp_stage: int, tp_rank: int) -> int: ...
    def position_of(self, rank: int) -> tuple[int, int] | None: ...
    def heads_of(self, tp_rank: int, num_heads: int) -> range: ...
    def tp_ranks_holding(self, head: int, num_heads: int) -> range: ...
    def layers_of(self, pp_stage: int, num_layers: int) -> range: ...

@dataclasses.dataclass(frozen=True)
class ReshardTransfer:
    src_rank: int
    dst_rank: int
    heads: range
    layers: range
    src_heads: range
    src_layers: range
    dst_heads: range
    dst_layers: range
    @property
    def is_local(self) -> bool: ...

@dataclasses.dataclass(frozen=True)
class ReshardStats:
    messages_sent: int = 0
    messages_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    local_copies: int = 0
    bytes_copied: int = 0

def plan_reshard(
    num_heads: int, num_layers: int, src: EngineLayout, dst: EngineLayout
) -> tuple[ReshardTransfer, ...]: ...

class ReshardHandle:
    stats: ReshardStats
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> ReshardStats: ...
    def wait_stream(self, stream: Any = None, timeout: float | None = None) -> None: ...

# A transport's handle on one call's exchange (kvbm_ext._driver.Handle).
class _Handle(Protocol):
    def done(self) -> bool: ...
    def wait(self, timeout: float | None = None) -> None: ...
    def wait_stream(self, stream: Any = None, timeout: float | None = None) -> None: ...

class Transport(Protocol):
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    def all_gather_object(self, obj: Any, timeout: float) -> list[Any]: ...
    def exchange(self, call: Any, background: bool) -> _Handle: ...

class TorchTransport:
    group: Any
    pairwise: bool
    def __init__(self, group: Any = None, *, own_nccl: bool = True) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def carries_headers(self) -> bool: ...
    def prepare(self, timeout: float) -> None: ...
    def check_device(self, device: str) -> None: ...
    def all_gather_object(self, obj: Any, timeout: float) -> list[Any]: ...
    def exchange(self, call: Any, background: bool) -> _Handle: ...

class Resharder:
    plan: tuple[ReshardTransfer, ...]
    num_heads: int
    num_layers: int
    src: EngineLayout
    dst: EngineLayout
    transport: Transport
    rank: int
    num_messages: int
    def __init__(
        self,
        num_heads: int,
        num_layers: int,
        src: EngineLayout,
        dst: EngineLayout,
        *,
        group: Any = None,
        transport: Transport | None = None,
        timeout: float = 120.0,
    ) -> None: ...
    @property
    def staging_nbytes(self) -> int: ...
    @overload
    def __call__(
        self,
        src_cache: PagedKVCache | None,
        src_block_ids: _BlockIds | None,
        dst_cache: PagedKVCache | None,
        dst_block_ids: _BlockIds | None,
        *,
        stream: _Stream = None,
        check: bool = True,
        timeout: float = 120.0,
        wait: Literal[True] = True,
    ) -> ReshardStats: ...
    @overload
    def __call__(
        self,
        src_cache: PagedKVCache | None,
        src_block_ids: _BlockIds | None,
        dst_cache: PagedKVCache | None,
        dst_block_ids: _BlockIds | None,
        *,
        stream: _Stream = None,
        check: bool = True,
        timeout: float = 120.0,
        wait: Literal[False],
    ) -> ReshardHandle: ...

def reshard(
    src_cache: PagedKVCache | None,
    src_block_ids: _BlockIds | None,
    dst_cache: PagedKVCache | None,
    dst_block_ids: _BlockIds | None,
    *,
    num_heads: int,
    num_layers: int,
    src: EngineLayout,
    dst: EngineLayout,
    group: Any = None,
    transport: Transport | None = None,
    stream: _Stream = None,
    check: bool = True,
    timeout: float = 120.0,
) -> ReshardStats: ...

# Host pools: pinned host memory for the offload tier.
_HugePages = Literal["transparent", "explicit", "none"]
# A torch dtype, a NumPy dtype or scalar type, or a name ("bfloat16", "float16", "uint8", ...).
_DType = Any

@final
class Deferred:
    def done(self) -> bool: ...
    def result(self, timeout: float | None = None) -> None: ...

@final
class HostBuffer:
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def pinned(self) -> bool: ...
    @property
    def registrations(self) -> tuple[tuple[int, int], ...]: ...
    @property
    def numa_node(self) -> int | None: ...
    @property
    def huge_pages(self) -> _HugePages: ...
    @property
    def threads(self) -> int: ...
    @property
    def seconds(self) -> float: ...
    @property
    def closed(self) -> bool: ...
    @property
    def shared(self) -> str | None: ...
    @property
    def created(self) -> bool: ...
    @property
    def __array_interface__(self) -> dict[str, Any]: ...
    def __dlpack__(
        self,
        *,
        stream: int | None = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> tuple[int, int]: ...
    def close(self) -> None: ...
    def __enter__(self) -> HostBuffer: ...
    def __exit__(self, *exc_info: object) -> bool: ...

def pinned_empty(
    shape: SupportsIndex | Sequence[SupportsIndex],
    dtype: _DType,
    *,
    numa_node: SupportsIndex | None = None,
    threads: SupportsIndex | None = None,
    huge_pages: _HugePages = "transparent",
    device: SupportsIndex | str | Any | None = None,
    shared: str | None = None,
) -> HostBuffer: ...
def unlink_shared(name: str) -> bool: ...
