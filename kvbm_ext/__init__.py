"""kvbm_ext: KV-cache block layout conversions on CUDA GPUs and the CPU.

Layouts (nl layers, no outer chunks, nh heads, nt tokens per block, hd head dim):
  block stack NHD: nl*no chunk arrays per block, each [nt, nh, hd] (vLLM)
  block stack HND: nl*no chunk arrays per block, each [nh, nt, hd]
  universal:       one contiguous [nh, nl, no, nt, hd] array per block
  operational:     one contiguous [nl, no, nt*nh*hd] array per block (TensorRT-LLM)

PagedKVCache describes a serving worker's cache once (per-layer arrays or one
array, blocks addressed by id) and moves blocks to and from universal and
operational blocks with one kernel launch per call.

Where pinned host memory takes part, the copy engines carry the bytes over
PCIe and a kernel on a few CTAs only rearranges them, through device staging
memory (backend="auto"), so a transfer leaves the SMs to the model running
beside it; set_staging, reserve_staging and staging_info manage that memory.

Raw batched copies between device and pinned host memory: vectorized_copy
(one kernel launch) and memcpy_batch (the copy engines).

pinned_empty makes the host tier's memory: a HostBuffer of pinned memory,
touched by parallel threads, placed near the GPU, usable by every function
here and by torch and NumPy without a copy; crc32c sums a host array's bytes
(the checksum a tier stores with each block).

Resharder (and reshard) moves blocks between engines of different tensor /
pipeline parallel sizes over torch.distributed, or over NIXL between engines that
share no process group (kvbm_ext.nixl, imported on its own): one packed message per
pair of ranks that share heads and layers, in pieces (EngineLayout, plan_reshard,
Transport).
"""

try:
    from ._C import (
        Deferred,
        HostBuffer,
        PagedKVCache,
        __version__,
        block_to_operational,
        block_to_universal,
        build_info,
        crc32c,
        cuda_devices,
        is_memcpy_batch_available,
        is_using_stubs,
        memcpy_batch,
        operational_to_block,
        operational_to_universal,
        pinned_empty,
        reserve_staging,
        set_staging,
        staging_info,
        universal_to_block,
        universal_to_operational,
        unlink_shared,
        vectorized_copy,
    )
except ImportError as error:  # pragma: no cover - only without a build
    raise ImportError(
        "kvbm_ext._C is not built: install with `pip install -e .` "
        "(or run `python setup.py build_ext --inplace`) from the source tree"
    ) from error

from ._plan import EngineLayout, ReshardTransfer, plan_reshard
from ._reshard import ReshardHandle, Resharder, ReshardStats, reshard
from ._transport import TorchTransport, Transport

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
