"""kvbm_ext: KV-cache block layout conversions on CUDA GPUs and the CPU.

Layouts (nl layers, no outer chunks, nh heads, nt tokens per block, hd head dim):
  block stack NHD: nl*no chunk arrays per block, each [nt, nh, hd] (vLLM)
  block stack HND: nl*no chunk arrays per block, each [nh, nt, hd]
  universal:       one contiguous [nh, nl, no, nt, hd] array per block
"""

try:
    from ._C import (
        __version__,
        block_to_universal,
        build_info,
        cuda_devices,
        is_using_stubs,
        universal_to_block,
    )
except ImportError as error:  # pragma: no cover - only without a build
    raise ImportError(
        "kvbm_ext._C is not built: install with `pip install -e .` "
        "(or run `python setup.py build_ext --inplace`) from the source tree"
    ) from error

__all__ = [
    "__version__",
    "block_to_universal",
    "build_info",
    "cuda_devices",
    "is_using_stubs",
    "universal_to_block",
]
