/* Block stacks (or operational blocks) <-> universal blocks: the kind's
 * descriptor (gpu.h, kv_move_kind), its kernel side (cuda/block_universal.cu
 * over the whole call or one staged piece, built with nvcc only) and its CPU
 * twin.  See move_block_universal.h. */
#include "move_block_universal.h"

#include <string.h>

#include "gpu.h"

#ifdef KVBM_CUDA_VERSION
#include <stdio.h>

#include "kvbm_kernels.h"
#include "pieces.h"

static int block_universal_launch(const kv_move *m, const void *host_table, const void *device_table, uint32_t num_ctas,
                                  void *stream)
{
    const kv_block_move *a = m->args;
    return kvbm_launch_block_universal(a->dims, (void *const *)host_table, (void *const *)device_table, a->direction,
                                       m->vector_bytes, num_ctas, (cudaStream_t)stream);
}

static int64_t block_universal_piece_blocks(const kv_move *m, char *why, size_t why_size)
{
    /* Whole blocks up to the by-value table's size, and a block's table must
     * fit. */
    const kvbm_block_dims *d = ((const kv_block_move *)m->args)->dims;
    const int64_t blocks = KVBM_TABLE_BY_VALUE_MAX / (1 + (d->chunk_stride ? 1 : d->nchunks));
    if (blocks == 0)
        snprintf(why, why_size, "a block's table of %lld chunks does not fit in a launch's parameters",
                 (long long)d->nchunks);
    return blocks;
}

/* One piece.  Staged universals: the box's heads [m0, m0 + mn) and chunks
 * [i0, i0 + in) of its blocks, packed in the slot as [bn][mn][in][nt, hd],
 * taken from (or put into) the chunks on the device, which keep their own
 * strides (chunk_heads).  Staged chunks or operationals: the box's chunks,
 * packed in the slot, every head, with the universals on the device
 * keeping theirs (universal_chunks).  The piece's table goes by value:
 * max_blocks keeps it within KVBM_TABLE_BY_VALUE_MAX. */
static int block_universal_launch_piece(const kv_move *m, const kv_staged *s, const kv_box *box, char *slot,
                                        uint32_t num_ctas, void *stream)
{
    const kv_block_move *a = m->args;
    const kvbm_block_dims *d = a->dims;
    const int64_t unit = s->unit_bytes, rb = d->row_bytes;
    void *const *table = m->table;
    void *piece_table[KVBM_TABLE_BY_VALUE_MAX];
    kvbm_block_dims p = *d;
    p.nb = box->bn;
    p.nchunks = box->in;
    char **universals = (char **)piece_table, **chunks = (char **)piece_table + box->bn;
    const int64_t chunk_slots = d->chunk_stride ? 1 : box->in; /* table entries per block for the chunks */
    if (s->flat_side) {
        p.nh = box->mn;
        p.nh_divisor = kvbm_divisor_make((uint32_t)box->mn);
        p.universal_chunks = box->in;
        const int64_t head_shift = box->m0 * (d->layout == KVBM_NHD ? rb : d->nt * rb);
        for (int64_t k = 0; k < box->bn; k++) {
            const int64_t b = box->b0 + k;
            universals[k] = slot + k * box->mn * box->in * unit;
            for (int64_t c = 0; c < chunk_slots; c++)
                chunks[k * chunk_slots + c] = d->chunk_stride
                                                  ? (char *)table[d->nb + b] + box->i0 * d->chunk_stride + head_shift
                                                  : (char *)table[d->nb + b * d->nchunks + box->i0 + c] + head_shift;
        }
    }
    else {
        for (int64_t k = 0; k < box->bn; k++) {
            universals[k] = (char *)table[box->b0 + k] + box->i0 * d->nt * rb;
            for (int64_t c = 0; c < chunk_slots; c++)
                chunks[k * chunk_slots + c] = slot + (k * box->in + c) * unit;
        }
    }
    return kvbm_launch_block_universal(&p, piece_table, NULL, a->direction, m->vector_bytes, num_ctas,
                                       (cudaStream_t)stream);
}
#endif /* KVBM_CUDA_VERSION */

/* The CPU twin: the same table as the kernel's (kvbm_table_entries), one
 * memcpy per segment. */
static void block_universal_cpu(const kv_move *move)
{
    const kv_block_move *a = move->args;
    const kvbm_block_dims *dims = a->dims;
    void *const *table = move->table;
    const int64_t segment_bytes = kvbm_segment_rows(dims) * dims->row_bytes;
    const uint32_t segments = (uint32_t)kvbm_segments_per_chunk(dims);

    for (int64_t b = 0; b < dims->nb; b++) {
        char *universal = table[b];
        for (int64_t c = 0; c < dims->nchunks; c++) {
            char *chunk = (char *)table[kvbm_chunk_slot(dims, b, c)] + kvbm_chunk_shift(dims, c);
            for (uint32_t s = 0; s < segments; s++) {
                int64_t h, t;
                kvbm_segment_start(dims, s, &h, &t);
                char *in_chunk = chunk + kvbm_chunk_offset(dims, h, t);
                char *in_universal = universal + kvbm_universal_offset(dims, c, h, t);
                if (a->direction == KVBM_TO_UNIVERSAL)
                    memcpy(in_universal, in_chunk, (size_t)segment_bytes);
                else
                    memcpy(in_chunk, in_universal, (size_t)segment_bytes);
            }
        }
    }
}

static int64_t block_universal_bytes(const kv_move *move)
{
    const kvbm_block_dims *d = ((const kv_block_move *)move->args)->dims;
    return d->nb * d->nchunks * d->nh * d->nt * d->row_bytes;
}

const kv_move_kind kv_move_block_universal = {
    .what = "launching the block/universal kernel",
    KV_MOVE_KERNEL(block_universal),
    .cpu = block_universal_cpu,
    .cpu_bytes = block_universal_bytes,
};
