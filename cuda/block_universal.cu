// Block stack (or operational) <-> universal kernels.
//
// The work is pure data movement, so the kernel is shaped around memory
// traffic: every thread moves kUnroll vectors of V bytes (move_vectors), and
// CTAs move tiles of chunks (Tiling, kvbm_device.cuh) in a grid-stride loop,
// so `num_ctas` bounds the SMs a transfer takes without changing what it
// moves.  Where a byte goes is decided by kvbm_layout.h, the same code the
// CPU path uses.
#include <stdint.h>

#include "kvbm_device.cuh"
#include "move_block_universal.h"

namespace {

using namespace kvbm;

struct Params {
    kvbm_block_dims dims;
    Tiling tiling;
    kvbm_divisor vectors_per_segment;  // segment bytes / V
    kvbm_divisor chunks_per_block;
    int to_universal;
};

// Byte offsets, inside the chunk and inside the universal block, of vector j
// of chunk c.
template <int V>
__device__ __forceinline__ void vector_offsets(const Params &p, uint32_t c, uint32_t j, int64_t *chunk_off,
                                               int64_t *universal_off)
{
    uint32_t segment = kvbm_div(p.vectors_per_segment, j);
    int64_t within = (int64_t)(j - segment * p.vectors_per_segment.divisor) * V;
    int64_t h, t;
    kvbm_segment_start(&p.dims, segment, &h, &t);
    *chunk_off = kvbm_chunk_offset(&p.dims, h, t) + within;
    *universal_off = kvbm_universal_offset(&p.dims, c, h, t) + within;
}

template <int V, class Table>
__global__ void __launch_bounds__(kThreads)
    block_universal_kernel(const __grid_constant__ Table table, const __grid_constant__ Params p)
{
    for_each_tile(p.tiling, [&](uint32_t chunk_index, uint32_t first) {  // chunk_index = b * nchunks + c
        const uint32_t block = kvbm_div(p.chunks_per_block, chunk_index);
        const uint32_t c = chunk_index - block * p.chunks_per_block.divisor;

        char *universal = static_cast<char *>(table[block]);
        char *chunk = static_cast<char *>(table[kvbm_chunk_slot(&p.dims, block, c)]) + kvbm_chunk_shift(&p.dims, c);
        char *src_base = p.to_universal ? chunk : universal;
        char *dst_base = p.to_universal ? universal : chunk;

        move_vectors<V>(src_base, dst_base, first, p.tiling.tile_threads, p.tiling.vectors_per_chunk,
                        [&](uint32_t j, int64_t *from, int64_t *to) {
                            int64_t chunk_off, universal_off;
                            vector_offsets<V>(p, c, j, &chunk_off, &universal_off);
                            *from = p.to_universal ? chunk_off : universal_off;
                            *to = p.to_universal ? universal_off : chunk_off;
                        });
    });
}

struct BlockUniversalKernels {
    template <int V, class Table>
    static auto kernel()
    {
        return block_universal_kernel<V, Table>;
    }
};

static_assert(sizeof(Params) + sizeof(TableByValue<void *, kSmallTable>) <= 4096,
              "a small by-value launch stays under 4 KB of parameters");

}  // namespace

extern "C" cudaError_t kvbm_launch_block_universal(const kvbm_block_dims *dims, void *const *host_table,
                                                   void *const *device_table, kvbm_direction direction,
                                                   int vector_bytes, uint32_t num_ctas, cudaStream_t stream)
{
    // The call fits one launch (kvbm_fits_one_launch): a chunk's vectors
    // and segments in 32 bits, the call's tiles below 2^31.
    const int64_t segment_bytes = kvbm_segment_rows(dims) * dims->row_bytes;
    const uint32_t vectors_per_chunk = (uint32_t)(kvbm_segments_per_chunk(dims) * segment_bytes / vector_bytes);
    if (dims->nb == 0 || vectors_per_chunk == 0)
        return cudaSuccess;

    Params p;
    p.dims = *dims;
    unsigned grid, threads;
    p.tiling = make_tiling(vectors_per_chunk, vector_bytes, dims->nb * dims->nchunks, num_ctas, &grid, &threads);
    p.vectors_per_segment = kvbm_divisor_make((uint32_t)(segment_bytes / vector_bytes));
    p.chunks_per_block = kvbm_divisor_make((uint32_t)dims->nchunks);
    p.to_universal = direction == KVBM_TO_UNIVERSAL;

    return launch_family<BlockUniversalKernels>(vector_bytes, host_table, device_table, kvbm_table_entries(dims), p,
                                                grid, threads, stream);
}

KVBM_LOAD_AHEAD(load_family<BlockUniversalKernels, void *>);
