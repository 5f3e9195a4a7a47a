"""Engines' KV caches as the engines allocate them, and plain-torch views of their blocks:
the one registry of engine caches, for the tests (tests/test_engine_caches.py,
tests/test_cache_to_cache.py, the disk and NIXL tests) and benchmarks/engines.py.

Each Engine allocates its memory in the shape its own source gives (docs/engines.md cites
the file), builds the argument PagedKVCache takes from that memory without a copy, and
says, with plain torch indexing written from the engine's documented shape (never from
kvbm_ext's layout string), where every block's rows are: `views(memory, dims)[l][o]` is a
view [blocks, nt, nh, hd] of layer l, outer o (K = 0, V = 1). The references move rows
through those views on CPU copies of the memory, and the tests compare every byte of it.
"""

from dataclasses import dataclass

import torch

from support.builders import random_tensor
from support.references import as_int


@dataclass(frozen=True)
class Dims:
    nl: int = 3
    nh: int = 2
    nt: int = 4  # tokens per block (page_size, block_size)
    hd: int = 8
    blocks: int = 7  # blocks the cache addresses, spare blocks included


@dataclass(frozen=True)
class Engine:
    name: str
    layout: str
    shapes: object  # Dims -> the shapes the engine allocates
    arg: object  # (memory (a list of tensors), Dims) -> the `layers` argument, no copy
    views: object  # (memory, Dims) -> [layer][outer] views [blocks, nt, nh, hd]
    no: int = 2
    heads: bool = True
    block_size: bool = False  # the layout groups t: pass block_size=nt
    reserved: tuple = (0, 0)  # blocks the engine never hands out: so many first, so many last

    def dims(self, d):
        return Dims(d.nl, d.nh if self.heads else 1, d.nt, d.hd, d.blocks)

    def usable(self, d):
        """The block ids the engine hands out (its spare blocks left out)."""
        first, last = self.reserved
        return range(first, d.blocks - last)

    def allocate(self, d, dtype, gen, device="cpu", pin=False):
        return [random_tensor(s, dtype, device, gen, pin) for s in self.shapes(self.dims(d))]

    def build(self, memory, d):
        import kvbm_ext

        kwargs = {"block_size": d.nt} if self.block_size else {}
        return kvbm_ext.PagedKVCache(self.arg(memory, self.dims(d)), self.layout, **kwargs)

    def rows(self, memory, d):
        """Integer views [layer][outer] of [blocks, nt, nh, hd] (bit-exact moves)."""
        return self.views([as_int(x) for x in memory], self.dims(d))


def by_stride_order(physical, order):
    """vLLM's view of a buffer allocated in physical order: get_kv_cache_shape's logical
    dimensions, where `order` (get_kv_cache_stride_order) lists the logical dimension
    each physical one holds."""
    inverse = [order.index(i) for i in range(len(order))]
    return physical.permute(*inverse)


def halves(x, d):
    """K and V of a packed K|V tensor: the first and second hd of the last dimension."""
    return [x[..., : d.hd], x[..., d.hd :]]


def pages(x, d):
    """A token-flat buffer [tokens, nh, hd] as [blocks, nt, nh, hd]."""
    return x.unflatten(0, (-1, d.nt))


def pairs_of(m, d=None):
    """(K, V) pairs from memory holding K of every layer, then V of every layer."""
    n = len(m) // 2
    return list(zip(m[:n], m[n:]))


ENGINES = {}


def engine(*args, **kwargs):
    e = Engine(*args, **kwargs)
    ENGINES[e.name] = e
    return e


# vLLM, K|V packed in the content dimension: get_kv_cache_shape (num_blocks, num_kv_heads,
# block_size, 2 * head_size) with NHD stride order (0, 2, 1, 3): memory is (num_blocks,
# block_size, num_kv_heads, 2 * head_size); each layer gets the logical view.
engine("vllm_packed", "bht(kd)", lambda d: [(d.blocks, d.nt, d.nh, 2 * d.hd)] * d.nl,
       lambda m, d: [by_stride_order(x, (0, 2, 1, 3)) for x in m], lambda m, d: [halves(x, d) for x in m])
# ... the same memory as it lies, unreshaped, and as a 5-D view of it.
engine("vllm_packed_memory", "bth(kd)", lambda d: [(d.blocks, d.nt, d.nh, 2 * d.hd)] * d.nl,
       lambda m, d: list(m), lambda m, d: [halves(x, d) for x in m])
engine("vllm_packed_5d", "bthkd", lambda d: [(d.blocks, d.nt, d.nh, 2 * d.hd)] * d.nl,
       lambda m, d: [x.unflatten(-1, (2, -1)) for x in m], lambda m, d: [halves(x, d) for x in m])
# vLLM FlashAttention before packing: (2, num_blocks, block_size, num_kv_heads, head_size).
engine("vllm_flash_attn", "kbthd", lambda d: [(2, d.blocks, d.nt, d.nh, d.hd)] * d.nl,
       lambda m, d: list(m), lambda m, d: [[x[0], x[1]] for x in m])
# FlashInfer before packing: (num_blocks, 2, block_size, num_kv_heads, head_size) with HND
# stride order (0, 1, 3, 2, 4): memory (num_blocks, 2, num_kv_heads, block_size, head_size).
engine("flashinfer_hnd", "bkthd", lambda d: [(d.blocks, 2, d.nh, d.nt, d.hd)] * d.nl,
       lambda m, d: [by_stride_order(x, (0, 1, 3, 2, 4)) for x in m],
       lambda m, d: [[x[:, o].transpose(1, 2) for o in range(2)] for x in m])
# vLLM cross-layer blocks: one buffer, logical (num_layers,) + get_kv_cache_shape, laid out
# by get_kv_cache_stride_order(include_num_layers_dimension=True). FlashAttention NHD before
# packing, (2, 0, 1, 3, 4, 5): memory (num_blocks, num_layers, 2, block_size, nkv, hd).
engine("vllm_cross_layer", "blkthd", lambda d: [(d.blocks, d.nl, 2, d.nt, d.nh, d.hd)], lambda m, d: m[0],
       lambda m, d: [[m[0][:, l, o] for o in range(2)] for l in range(d.nl)])
# ... packed K|V, (1, 0, 3, 2, 4): memory (num_blocks, num_layers, block_size, nkv, 2 * hd),
# described through the logical view (num_layers, num_blocks, nkv, block_size, 2 * hd).
engine("vllm_cross_layer_packed", "lbht(kd)", lambda d: [(d.blocks, d.nl, d.nt, d.nh, 2 * d.hd)],
       lambda m, d: by_stride_order(m[0], (1, 0, 3, 2, 4)), lambda m, d: [halves(m[0][:, l], d) for l in range(d.nl)])
# MLA: (num_blocks, block_size, head_size) per layer: one latent vector a token.
engine("mla", "btd", lambda d: [(d.blocks, d.nt, d.hd)] * d.nl, lambda m, d: list(m),
       lambda m, d: [[x.unsqueeze(2)] for x in m], no=1, heads=False)
# SGLang MHATokenToKVPool: k_buffer[l] and v_buffer[l], each (size + page_size, head_num,
# head_dim): blocks * page_size rows (the first page is the padding slot).
engine("sglang_mha", "(bt)hd", lambda d: [(d.blocks * d.nt, d.nh, d.hd)] * (2 * d.nl), pairs_of,
       lambda m, d: [[pages(k, d), pages(v, d)] for k, v in pairs_of(m)], block_size=True, reserved=(1, 0))
# transformers PagedAttentionCache: key_cache[l], value_cache[l], each
# ((num_blocks + 2) * block_size, num_kv_heads, head_dim): two spare blocks at the end.
engine("transformers", "(bt)hd", lambda d: [(d.blocks * d.nt, d.nh, d.hd)] * (2 * d.nl), pairs_of,
       lambda m, d: [[pages(k, d), pages(v, d)] for k, v in pairs_of(m)], block_size=True, reserved=(0, 2))
# A universal pool: [N, nh, nl, no, nt, hd], one universal block per id.
engine("universal_pool", "bhlktd", lambda d: [(d.blocks, d.nh, d.nl, 2, d.nt, d.hd)], lambda m, d: m[0],
       lambda m, d: [[m[0][:, :, l, o].transpose(1, 2) for o in range(2)] for l in range(d.nl)])
# SGLang HiCache host pools (MHATokenToKVPoolHost.init_kv_buffer): layer_first
# (2, layer_num, size, head_num, head_dim), page_first (2, size, layer_num, head_num,
# head_dim), page_first_direct (2, page_num, layer_num, page_size, head_num, head_dim),
# page_head (2, page_num, head_num, page_size, layer_num, head_dim).
engine("hicache_layer_first", "kl(bt)hd", lambda d: [(2, d.nl, d.blocks * d.nt, d.nh, d.hd)], lambda m, d: m[0],
       lambda m, d: [[pages(m[0][o, l], d) for o in range(2)] for l in range(d.nl)], block_size=True)
engine("hicache_page_first", "k(bt)lhd", lambda d: [(2, d.blocks * d.nt, d.nl, d.nh, d.hd)], lambda m, d: m[0],
       lambda m, d: [[pages(m[0][o, :, l], d) for o in range(2)] for l in range(d.nl)], block_size=True)
engine("hicache_page_first_direct", "kblthd", lambda d: [(2, d.blocks, d.nl, d.nt, d.nh, d.hd)], lambda m, d: m[0],
       lambda m, d: [[m[0][o, :, l] for o in range(2)] for l in range(d.nl)])
engine("hicache_page_head", "kbhtld", lambda d: [(2, d.blocks, d.nh, d.nt, d.nl, d.hd)], lambda m, d: m[0],
       lambda m, d: [[m[0][o, :, :, :, l].transpose(1, 2) for o in range(2)] for l in range(d.nl)])
# TensorRT-LLM's block pool (BlockManager::allocatePools): (num_blocks, num_layers, 2,
# block_size_elements), each block's elements [num_kv_heads, tokens_per_block, head_dim]
# (KVBlockArray::getKVLocalIdx); described through a 6-D view of the pool.
engine("trtllm_pool", "blkhtd", lambda d: [(d.blocks, d.nl, 2, d.nh * d.nt * d.hd)],
       lambda m, d: m[0].unflatten(-1, (d.nh, d.nt, d.hd)),
       lambda m, d: [[m[0][:, l, o].unflatten(-1, (d.nh, d.nt, d.hd)).transpose(1, 2) for o in range(2)]
                     for l in range(d.nl)])

# Engines whose memory lives in host pools (the others are device caches, testable on the
# CPU too).
HOST_POOLS = ["universal_pool", "hicache_layer_first", "hicache_page_first", "hicache_page_first_direct",
              "hicache_page_head", "trtllm_pool"]
