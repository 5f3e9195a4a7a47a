"""Plain-torch stand-ins for PagedKVCache.to_cache and kvbm_ext.pinned_empty, limited to the
forms kvbm_ext.integrations.transformers uses (K/V pairs per layer "(bt)hd" with
block_size=, one universal pool "bhlktd").  Only for checking that integration's wiring on
builds of kvbm_ext that do not have those calls (install_if_missing); tests on the GPU use
the real calls."""

import numpy as np
import torch

import kvbm_ext


class StandInPagedKVCache:
    def __init__(self, layers, layout, *, block_size=None):
        if layout == "(bt)hd":
            # per (layer, K/V): [num_blocks, nt, nh, hd]
            self.chunks = [[part.view(-1, block_size, *part.shape[1:]) for part in pair] for pair in layers]
        elif layout == "bhlktd":
            by_layer = layers.permute(2, 3, 0, 4, 1, 5)          # [nl, 2, N, nt, nh, hd]
            self.chunks = [[by_layer[l, o] for o in range(2)] for l in range(by_layer.shape[0])]
        else:
            raise ValueError(f"stand-in: layout {layout!r} is not one the integration uses")
        self.num_blocks = self.chunks[0][0].shape[0]

    def to_cache(self, dst, src_ids, dst_ids, *, stream=None):
        src_ids, dst_ids = list(src_ids), list(dst_ids)
        assert len(src_ids) == len(dst_ids), (src_ids, dst_ids)
        assert len(set(dst_ids)) == len(dst_ids), f"repeated destination ids {dst_ids}"
        assert all(0 <= i < self.num_blocks for i in src_ids) and all(0 <= i < dst.num_blocks for i in dst_ids)
        context = torch.cuda.stream(stream) if stream is not None else torch.no_grad()
        with context:
            for src_pair, dst_pair in zip(self.chunks, dst.chunks):
                for src, out in zip(src_pair, dst_pair):
                    index = torch.tensor(src_ids, device=src.device)
                    out[torch.tensor(dst_ids, device=out.device)] = src[index].to(out.device)


class StandInHostBuffer:
    """What the integration reads of a HostBuffer: DLPack export, pinned, nbytes."""

    def __init__(self, shape, dtype):
        torch_dtype = torch.from_numpy(np.empty(0, dtype=dtype)).dtype
        self.tensor = torch.empty(shape, dtype=torch_dtype, pin_memory=torch.cuda.is_available())
        self.pinned = self.tensor.is_pinned()
        self.nbytes = self.tensor.nbytes

    def __dlpack__(self, **kwargs):
        return self.tensor.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.tensor.__dlpack_device__()


def stand_in_pinned_empty(shape, dtype, **_):
    return StandInHostBuffer(shape, dtype)


def install_if_missing(monkeypatch):
    """Puts a stand-in in kvbm_ext for each call it lacks; returns their names."""
    installed = []
    if not hasattr(kvbm_ext.PagedKVCache, "to_cache"):
        monkeypatch.setattr(kvbm_ext, "PagedKVCache", StandInPagedKVCache)
        installed.append("PagedKVCache.to_cache")
    if not hasattr(kvbm_ext, "pinned_empty"):
        monkeypatch.setattr(kvbm_ext, "pinned_empty", stand_in_pinned_empty, raising=False)
        installed.append("pinned_empty")
    return installed
