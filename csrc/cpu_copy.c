/* The CPU implementation: one memcpy per segment (see kvbm_layout.h). */
#include "cpu_copy.h"

#include <string.h>

void kv_cpu_block_universal(const kvbm_block_dims *dims, void *const *table, kvbm_direction direction)
{
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
                if (direction == KVBM_TO_UNIVERSAL)
                    memcpy(in_universal, in_chunk, (size_t)segment_bytes);
                else
                    memcpy(in_chunk, in_universal, (size_t)segment_bytes);
            }
        }
    }
}

void kv_cpu_copy_pairs(const kv_pairs *pairs)
{
    for (int64_t i = 0; i < pairs->count; i++)
        memcpy((void *)(uintptr_t)pairs->dst[i], (const void *)(uintptr_t)pairs->src[i],
               (size_t)(pairs->sizes ? pairs->sizes[i] : pairs->uniform_size));
}
