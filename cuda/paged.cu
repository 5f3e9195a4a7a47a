// Paged KV cache <-> universal or operational blocks.
//
// A chunk is (block b, moved layer i, outer o); CTAs move tiles of chunks
// (Tiling, kvbm_device.cuh) in a grid-stride loop, so `num_ctas` bounds the
// SMs a transfer takes without changing what it moves.  Each thread moves
// kUnroll vectors (move_vectors).  Block ids and flat addresses come from the
// launch's parameters, the device or both; where a byte goes is decided by
// kvbm_paged.h, the code the CPU path runs too.
#include <stdint.h>

#include "kvbm_device.cuh"
#include "move_paged.h"

namespace {

using namespace kvbm;

struct Params {
    kvbm_paged p;
    kvbm_paged_addresses a;
    PagedTiling tiles;
    kvbm_divisor outers;  // no
    uint32_t bases;       // table entries before the ids (kvbm_paged_bases)
};

template <class Table>
__device__ __forceinline__ int64_t block_id(const Table &table, const Params &p, uint32_t b)
{
    if (p.a.ids == nullptr)
        return (int64_t)table[p.bases + b];
    return p.a.ids_int32 ? (int64_t)static_cast<const int32_t *>(p.a.ids)[b] : static_cast<const int64_t *>(p.a.ids)[b];
}

template <class Table>
__device__ __forceinline__ char *flat_block(const Table &table, const Params &p, uint32_t b)
{
    if (p.a.flat_base != 0)
        return reinterpret_cast<char *>(p.a.flat_base + (int64_t)b * p.a.flat_block);
    return reinterpret_cast<char *>(table[p.bases + (p.a.ids == nullptr ? p.p.nb : 0) + b]);
}

template <int V, class Table>
__global__ void __launch_bounds__(kThreads)
    paged_kernel(const __grid_constant__ Table table, const __grid_constant__ Params p)
{
    for_each_tile(p.tiles.tiling, [&](uint32_t chunk, uint32_t first) {  // chunk = (b * nl + i) * no + o
        const uint32_t b = kvbm_div(p.tiles.chunks_per_block, chunk);
        const uint32_t layer_outer = chunk - b * p.tiles.chunks_per_block.divisor;
        const uint32_t i = kvbm_div(p.outers, layer_outer);
        const uint32_t o = layer_outer - i * p.outers.divisor;

        const int64_t id = block_id(table, p, b);
        if (id < 0 || id >= p.p.num_blocks)
            return;  // device-resident ids are not checked on the host
        char *cache =
            reinterpret_cast<char *>(table[kvbm_paged_base(&p.p, i, o)]) + kvbm_paged_cache_chunk(&p.p, id, o);
        char *flat = flat_block(table, p, b) + kvbm_paged_flat_chunk(&p.p, i, o);
        const char *src = p.p.to_flat ? cache : flat;
        char *dst = p.p.to_flat ? flat : cache;

        move_vectors<V>(src, dst, first, p.tiles.tiling.tile_threads, p.tiles.tiling.vectors_per_chunk,
                        [&](uint32_t j, int64_t *from, int64_t *to) {
                            int64_t cache_off, flat_off;
                            paged_vector<V>(&p.p, p.tiles, j, &cache_off, &flat_off);
                            *from = p.p.to_flat ? cache_off : flat_off;
                            *to = p.p.to_flat ? flat_off : cache_off;
                        });
    });
}

struct PagedKernels {
    template <int V, class Table>
    static auto kernel()
    {
        return paged_kernel<V, Table>;
    }
};

static_assert(sizeof(Params) + sizeof(TableByValue<uint64_t, kSmallTable>) <= 4096,
              "a small by-value launch stays under 4 KB of parameters");

}  // namespace

extern "C" cudaError_t kvbm_launch_paged(const kvbm_paged *paged, const kvbm_paged_addresses *addresses,
                                         const uint64_t *host_table, const uint64_t *device_table, int vector_bytes,
                                         uint32_t num_ctas, cudaStream_t stream)
{
    Params p;
    unsigned grid, threads;
    if (!make_paged_tiling(paged, vector_bytes, num_ctas, &p.tiles, &grid, &threads))
        return cudaSuccess;
    p.p = *paged;
    p.a = *addresses;
    p.outers = kvbm_divisor_make((uint32_t)paged->no);
    p.bases = (uint32_t)kvbm_paged_bases(paged);
    const int64_t entries = kvbm_paged_table_entries(addresses, p.bases, paged->nb);

    return launch_family<PagedKernels>(vector_bytes, host_table, device_table, entries, p, grid, threads, stream);
}

KVBM_LOAD_AHEAD(load_family<PagedKernels, uint64_t>);
