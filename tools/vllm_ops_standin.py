"""Stand-in for vLLM's compiled ops library (vllm/_C_stable_libtorch.*.so), which
vllm/platforms/cuda.py imports unconditionally: the vLLM files carried to run the
kv_offload tests on a GPU are its pure-Python files.  It registers only the three
capability queries that vllm.model_executor.layers.quantization.utils.w8a8_utils calls
when the v1 Scheduler is imported on CUDA, each answering False (no CUTLASS kernels)."""

import torch

_LIBRARY = torch.library.Library("_C", "FRAGMENT")
for _name in ("cutlass_scaled_mm_supports_fp8", "cutlass_scaled_mm_supports_block_fp8", "cutlass_group_gemm_supported"):
    _LIBRARY.define(f"{_name}(int cuda_device_capability) -> bool")
    _LIBRARY.impl(_name, lambda cuda_device_capability: False, "CompositeExplicitAutograd")
