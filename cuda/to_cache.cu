// Paged cache -> paged cache, blocks addressed by id on both sides.
//
// A chunk is (block b, moved layer i, outer o), at table entry i*no + o of
// each side (move_to_cache.h); CTAs move tiles of chunks in a grid-stride
// loop, as the paged kernel does, so `num_ctas` bounds the SMs a transfer
// takes without changing what it moves.  Where a byte goes is decided by
// move_to_cache.h and kvbm_paged.h, the code the CPU path runs too.
#include <stdint.h>

#include "kvbm_device.cuh"
#include "move_to_cache.h"

namespace {

using namespace kvbm;

struct Params {
    kvbm_to_cache m;
    kvbm_to_cache_ids ids;
    PagedTiling tiles;
    uint32_t bases;  // per side
    uint32_t src_ids_at, dst_ids_at;
};

template <class Table>
__device__ __forceinline__ int64_t block_id(const Table &table, const void *device_ids, int int32, uint32_t at,
                                            uint32_t b)
{
    if (device_ids == nullptr)
        return (int64_t)table[at + b];
    return int32 ? (int64_t)static_cast<const int32_t *>(device_ids)[b] : static_cast<const int64_t *>(device_ids)[b];
}

template <int V, class Table>
__global__ void __launch_bounds__(kThreads)
    to_cache_kernel(const __grid_constant__ Table table, const __grid_constant__ Params p)
{
    for_each_tile(p.tiles.tiling, [&](uint32_t chunk, uint32_t first) {  // chunk = b * nl * no + i * no + o
        const uint32_t b = kvbm_div(p.tiles.chunks_per_block, chunk);
        const uint32_t entry = chunk - b * p.tiles.chunks_per_block.divisor;  // i * no + o

        const int64_t src_id = block_id(table, p.ids.src_ids, p.ids.src_int32, p.src_ids_at, b);
        const int64_t dst_id = block_id(table, p.ids.dst_ids, p.ids.dst_int32, p.dst_ids_at, b);
        if (src_id < 0 || src_id >= p.m.p.num_blocks || dst_id < 0 || dst_id >= p.m.dst_num_blocks)
            return;  // device-resident ids are not checked on the host
        // Each (layer, outer) has a base of its own: the outer strides are 0.
        const char *src = reinterpret_cast<const char *>(table[entry]) + kvbm_paged_cache_chunk(&p.m.p, src_id, 0);
        char *dst = reinterpret_cast<char *>(table[p.bases + entry]) + kvbm_to_cache_dst_chunk(&p.m, dst_id, 0);

        move_vectors<V>(src, dst, first, p.tiles.tiling.tile_threads, p.tiles.tiling.vectors_per_chunk,
                        [&](uint32_t j, int64_t *from, int64_t *to) { paged_vector<V>(&p.m.p, p.tiles, j, from, to); });
    });
}

struct ToCacheKernels {
    template <int V, class Table>
    static auto kernel()
    {
        return to_cache_kernel<V, Table>;
    }
};

static_assert(sizeof(Params) + sizeof(TableByValue<uint64_t, kSmallTable>) <= 4096,
              "a small by-value launch stays under 4 KB of parameters");

}  // namespace

extern "C" cudaError_t kvbm_launch_to_cache(const kvbm_to_cache *move, const kvbm_to_cache_ids *ids,
                                            const uint64_t *host_table, const uint64_t *device_table, int vector_bytes,
                                            uint32_t num_ctas, cudaStream_t stream)
{
    Params p;
    unsigned grid, threads;
    if (!make_paged_tiling(&move->p, vector_bytes, num_ctas, &p.tiles, &grid, &threads))
        return cudaSuccess;
    p.m = *move;
    p.ids = *ids;
    p.bases = (uint32_t)kvbm_to_cache_bases(move);
    p.src_ids_at = (uint32_t)kvbm_to_cache_src_ids_at(move);
    p.dst_ids_at = (uint32_t)kvbm_to_cache_dst_ids_at(move, ids);
    const int64_t entries = kvbm_to_cache_table_entries(move, ids);

    return launch_family<ToCacheKernels>(vector_bytes, host_table, device_table, entries, p, grid, threads, stream);
}

KVBM_LOAD_AHEAD(load_family<ToCacheKernels, uint64_t>);
