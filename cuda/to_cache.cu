// Paged cache -> paged cache, blocks addressed by id on both sides.
//
// A chunk is (block b, moved layer i, outer o), at table entry i*no + o of
// each side (kvbm_to_cache.h); CTAs move tiles of chunks in a grid-stride
// loop, as the paged kernel does, so `num_ctas` bounds the SMs a transfer
// takes without changing what it moves.  Where a byte goes is decided by
// kvbm_to_cache.h and kvbm_paged.h, the code the CPU path runs too.
#include <stdint.h>

#include "kvbm_kernels.h"
#include "kvbm_device.cuh"

namespace {

using namespace kvbm;

struct Params {
    kvbm_to_cache m;
    kvbm_to_cache_ids ids;
    Tiling tiling;
    kvbm_divisor vectors_per_segment;
    kvbm_divisor chunks_per_block;  // nl * no
    uint32_t bases;                 // per side
    uint32_t src_ids_at, dst_ids_at;
};

template <class Table>
__device__ __forceinline__ int64_t block_id(const Table &table, const void *device_ids, int int32, uint32_t at,
                                            uint32_t b)
{
    if (device_ids == nullptr)
        return (int64_t)table[at + b];
    return int32 ? (int64_t) static_cast<const int32_t *>(device_ids)[b] : static_cast<const int64_t *>(device_ids)[b];
}

template <int V, class Table>
__global__ void __launch_bounds__(kThreads)
to_cache_kernel(const __grid_constant__ Table table, const __grid_constant__ Params p)
{
    for_each_tile(p.tiling, [&](uint32_t chunk, uint32_t first) {  // chunk = b * nl * no + i * no + o
        const uint32_t b = kvbm_div(p.chunks_per_block, chunk);
        const uint32_t entry = chunk - b * p.chunks_per_block.divisor;  // i * no + o

        const int64_t src_id = block_id(table, p.ids.src_ids, p.ids.src_int32, p.src_ids_at, b);
        const int64_t dst_id = block_id(table, p.ids.dst_ids, p.ids.dst_int32, p.dst_ids_at, b);
        if (src_id < 0 || src_id >= p.m.p.num_blocks || dst_id < 0 || dst_id >= p.m.dst_num_blocks)
            return;  // device-resident ids are not checked on the host
        // Each (layer, outer) has a base of its own: the outer strides are 0.
        const char *src = reinterpret_cast<const char *>(table[entry]) + kvbm_paged_cache_chunk(&p.m.p, src_id, 0);
        char *dst = reinterpret_cast<char *>(table[p.bases + entry]) + kvbm_to_cache_dst_chunk(&p.m, dst_id, 0);

        move_vectors<V>(src, dst, first, p.tiling.tile_threads, p.tiling.vectors_per_chunk,
                        [&](uint32_t j, int64_t *from, int64_t *to) {
                            const uint32_t s = kvbm_div(p.vectors_per_segment, j);
                            const int64_t within = (int64_t)(j - s * p.vectors_per_segment.divisor) * V;
                            kvbm_paged_segment(&p.m.p, s, from, to);
                            *from += within;
                            *to += within;
                        });
    });
}

template <int V>
cudaError_t launch(const Params &p, const uint64_t *host_table, const uint64_t *device_table, unsigned grid,
                   unsigned threads, cudaStream_t stream)
{
    if (device_table != nullptr)
        to_cache_kernel<V><<<grid, threads, 0, stream>>>(TableInMemory<uint64_t>{device_table}, p);
    else
        launch_by_value(to_cache_kernel<V, TableByValue<uint64_t, kTinyTable>>,
                        to_cache_kernel<V, TableByValue<uint64_t, kSmallTable>>,
                        to_cache_kernel<V, TableByValue<uint64_t, KVBM_TABLE_BY_VALUE_MAX>>, host_table,
                        kvbm_to_cache_table_entries(&p.m, &p.ids), p, grid, threads, stream);
    return cudaGetLastError();
}

static_assert(sizeof(Params) + sizeof(TableByValue<uint64_t, kSmallTable>) <= 4096,
              "a small by-value launch stays under 4 KB of parameters");

}  // namespace

extern "C" cudaError_t kvbm_launch_to_cache(const kvbm_to_cache *move, const kvbm_to_cache_ids *ids,
                                            const uint64_t *host_table, const uint64_t *device_table,
                                            int vector_bytes, uint32_t num_ctas, cudaStream_t stream)
{
    // The caller has validated that the counts below fit in 32 bits and the
    // tiles below 2^31.
    const kvbm_paged *paged = &move->p;
    const uint32_t vectors_per_chunk = (uint32_t)(paged->segments * paged->segment_bytes / vector_bytes);
    const int64_t chunks = paged->nb * paged->nl * paged->no;
    if (chunks == 0 || vectors_per_chunk == 0)
        return cudaSuccess;

    Params p;
    p.m = *move;
    p.ids = *ids;
    unsigned grid, threads;
    p.tiling = make_tiling(vectors_per_chunk, chunks, num_ctas, &grid, &threads);
    p.vectors_per_segment = kvbm_divisor_make((uint32_t)(paged->segment_bytes / vector_bytes));
    p.chunks_per_block = kvbm_divisor_make((uint32_t)(paged->nl * paged->no));
    p.bases = (uint32_t)kvbm_to_cache_bases(move);
    p.src_ids_at = (uint32_t)kvbm_to_cache_src_ids_at(move);
    p.dst_ids_at = (uint32_t)kvbm_to_cache_dst_ids_at(move, ids);

    return with_vector_bytes(vector_bytes, [&](auto v) {
        return launch<decltype(v)::value>(p, host_table, device_table, grid, threads, stream);
    });
}

extern "C" cudaError_t kvbm_load_to_cache(void)
{
    return load_every_width([](auto v) {
        constexpr int V = decltype(v)::value;
        return load_kernels(to_cache_kernel<V, TableInMemory<uint64_t>>,
                            to_cache_kernel<V, TableByValue<uint64_t, kTinyTable>>,
                            to_cache_kernel<V, TableByValue<uint64_t, kSmallTable>>,
                            to_cache_kernel<V, TableByValue<uint64_t, KVBM_TABLE_BY_VALUE_MAX>>);
    });
}
