"""Dynamo kvbm-kernels' Python API over kvbm_ext.

ai-dynamo/dynamo's `lib/kvbm-kernels` had Python bindings (`dynamo_kvbm_kernels`) for
its block, universal and operational layouts.  They are disabled upstream and its
operational kernel is gone; code written against them runs unchanged with one import:

    from kvbm_ext.compat import dynamo as ctk     # was: import dynamo_kvbm_kernels as ctk

    ctk.block_to_universal(blocks, universals, layout)
    ctk.universal_to_block(universals, blocks, layout)
    ctk.block_to_operational(blocks, operationals, backend=None)
    ctk.operational_to_block(operationals, blocks, backend=None)

- `blocks`: nb sequences of nl*no chunk tensors, chunk l*no + o, each [nt, nh, hd]
  (layout "NHD") or [nh, nt, hd] ("HND"); `universals`: nb tensors [nh, nl, no, nt, hd];
  `operationals`: nb tensors [nl, no, nt*nh*hd].  One tensor instead of a sequence is
  nb = 1.  No universals (or operationals) is a call that does nothing, whatever the blocks.
- `layout`: "NHD", "nhd", "Nhd", "HND", "hnd" or "Hnd", as Dynamo spelled them.
- `backend`: None (meaning "auto"), "auto", "kernel" ("kernel_only"), "async"
  ("memcpy_async", "cuda_memcpy_async") or "batch" ("memcpy_batch", "cuda_memcpy_batch"),
  any case, blanks around ignored; each is kvbm_ext's backend of the same name, so "auto"
  puts the copy engines on every byte that crosses PCIe and the kernel on device-to-device
  moves (README, "Transfers beside the model").
- Like Dynamo's, a call returns when its work is done: it runs on torch's current stream of
  the tensors' device, after the work already queued there, and synchronizes that stream.
- Errors are Dynamo's types with kvbm_ext's messages (which name the argument and the
  index), raised before anything is written: ValueError for counts, shapes, the layout,
  the backend, placement (a CPU tensor beside CUDA ones) and contiguity; TypeError for
  element types and objects that are not tensors; RuntimeError for a CUDA error.

Where kvbm_ext differs, it accepts more: every element type it moves (fp8, integers) where
Dynamo took fp16, bf16, fp32 and fp64; tensors on any device (Dynamo always used device
0); pinned host memory beside device memory; all-host tensors (the CPU path; Dynamo
refused CPU tensors).  One thing less: the chunks of a block <-> operational call must be
3-D (Dynamo's documented [nt, nh, hd]), where Dynamo took any shape of nt*nh*hd elements.
Bytes are copied exactly, so the tolerances of Dynamo's tests are never needed.
"""

import torch

import kvbm_ext

__all__ = ["block_to_operational", "block_to_universal", "operational_to_block", "universal_to_block"]

_LAYOUTS = {"NHD": "NHD", "nhd": "NHD", "Nhd": "NHD", "HND": "HND", "hnd": "HND", "Hnd": "HND"}
_BACKENDS = {
    "auto": "auto",
    "kernel": "kernel", "kernel_only": "kernel",
    "async": "async", "memcpy_async": "async", "cuda_memcpy_async": "async",
    "batch": "batch", "memcpy_batch": "batch", "cuda_memcpy_batch": "batch",
}


def block_to_universal(blocks, universals, layout):
    """Copies each block's nl*no chunks into its universal tensor [nh, nl, no, nt, hd]."""
    layout = _layout(layout)
    flats = _tensor_list(universals, "universals")
    if flats:
        _synchronized(kvbm_ext.block_to_universal, flats, blocks, flats, layout)


def universal_to_block(universals, blocks, layout):
    """Scatters each universal tensor back into its block's nl*no chunks (written in place)."""
    layout = _layout(layout)
    flats = _tensor_list(universals, "universals")
    if flats:
        _synchronized(kvbm_ext.universal_to_block, flats, flats, blocks, layout)


def block_to_operational(blocks, operationals, backend=None):
    """Copies each block's nl*no chunks into its operational tensor [nl, no, nt*nh*hd]."""
    backend = _backend(backend)
    flats = _tensor_list(operationals, "operationals")
    if flats:
        _synchronized(kvbm_ext.block_to_operational, flats, blocks, flats, backend=_backend_for(flats, backend))


def operational_to_block(operationals, blocks, backend=None):
    """Copies each operational tensor back into its block's nl*no chunks (written in place)."""
    backend = _backend(backend)
    flats = _tensor_list(operationals, "operationals")
    if flats:
        _synchronized(kvbm_ext.operational_to_block, flats, flats, blocks, backend=_backend_for(flats, backend))


def _layout(layout):
    if not isinstance(layout, str):
        raise TypeError(f"layout: expected a str ('NHD' or 'HND'), got {type(layout).__name__}")
    canonical = _LAYOUTS.get(layout)
    if canonical is None:
        raise ValueError(f"layout: unsupported layout {layout!r}, expected 'NHD' or 'HND'")
    return canonical


def _backend(backend):
    if backend is None:
        return "auto"
    if not isinstance(backend, str):
        raise TypeError(f"backend: expected None or a str, got {type(backend).__name__}")
    canonical = _BACKENDS.get(backend.strip().lower())
    if canonical is None:
        raise ValueError(f"backend: unknown backend {backend!r}, expected 'auto', 'kernel', 'async' or 'batch'")
    return canonical


def _runs_on_cpu(flats):
    """True when no operational is in device or pinned memory: then the call can only run
    on the CPU, or be refused for mixing pageable memory with device memory."""
    return not any(isinstance(f, torch.Tensor) and (f.is_cuda or f.is_pinned()) for f in flats)


def _backend_for(flats, backend):
    """Dynamo's backend picks a GPU path; kvbm_ext refuses one on the CPU, where Dynamo's
    spellings are read and checked and the CPU path runs."""
    return "auto" if _runs_on_cpu(flats) else backend


def _tensor_list(flats, name):
    """The universals or operationals as a list, read once: a tensor (an object with
    data_ptr, as Dynamo tested) is nb = 1."""
    if hasattr(flats, "data_ptr"):
        return [flats]
    try:
        return list(flats)
    except TypeError:
        raise TypeError(f"{name}: expected a tensor or a sequence of tensors, "
                        f"got {type(flats).__name__}") from None


def _synchronized(function, flats, *args, **kwargs):
    """Runs function on torch's current stream of flats[0]'s device and waits for it.  A
    call on host tensors runs on the CPU and is done when it returns."""
    first = flats[0]
    stream = torch.cuda.current_stream(first.device) if isinstance(first, torch.Tensor) and first.is_cuda else None
    function(*args, stream=stream, **kwargs)
    if stream is not None:
        stream.synchronize()
