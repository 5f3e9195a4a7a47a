/* The CPU implementation: one memcpy per segment (see kvbm_layout.h and
 * kvbm_paged.h). */
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

void kv_cpu_paged(const kvbm_paged *p, const kvbm_paged_addresses *a, const uint64_t *table)
{
    /* The table: bases, host ids (always, on the CPU), flat blocks. */
    const uint64_t *ids = table + kvbm_paged_bases(p), *flats = ids + p->nb;
    for (int64_t b = 0; b < p->nb; b++) {
        const int64_t id = (int64_t)ids[b];
        char *flat = a->flat_base ? (char *)(uintptr_t)(a->flat_base + (uint64_t)(b * a->flat_block))
                                  : (char *)(uintptr_t)flats[b];
        for (int64_t i = 0; i < p->nl; i++) {
            for (int64_t o = 0; o < p->no; o++) {
                char *cache_chunk =
                    (char *)(uintptr_t)table[kvbm_paged_base(p, i, o)] + kvbm_paged_cache_chunk(p, id, o);
                char *flat_chunk = flat + kvbm_paged_flat_chunk(p, i, o);
                for (uint32_t s = 0; s < (uint32_t)p->segments; s++) {
                    int64_t cache_off, flat_off;
                    kvbm_paged_segment(p, s, &cache_off, &flat_off);
                    if (p->to_flat)
                        memcpy(flat_chunk + flat_off, cache_chunk + cache_off, (size_t)p->segment_bytes);
                    else
                        memcpy(cache_chunk + cache_off, flat_chunk + flat_off, (size_t)p->segment_bytes);
                }
            }
        }
    }
}

void kv_cpu_to_cache(const kvbm_to_cache *m, const uint64_t *table)
{
    const kvbm_paged *p = &m->p;
    const int64_t bases = kvbm_to_cache_bases(m);
    const uint64_t *src_ids = table + kvbm_to_cache_src_ids_at(m), *dst_ids = src_ids + p->nb;
    for (int64_t b = 0; b < p->nb; b++) {
        /* Each (layer, outer) has a base of its own: the outer strides are 0. */
        for (int64_t entry = 0; entry < bases; entry++) {
            const char *src = (const char *)(uintptr_t)table[entry] + kvbm_paged_cache_chunk(p, (int64_t)src_ids[b], 0);
            char *dst = (char *)(uintptr_t)table[bases + entry] + kvbm_to_cache_dst_chunk(m, (int64_t)dst_ids[b], 0);
            for (uint32_t s = 0; s < (uint32_t)p->segments; s++) {
                int64_t src_off, dst_off;
                kvbm_paged_segment(p, s, &src_off, &dst_off);
                memcpy(dst + dst_off, src + src_off, (size_t)p->segment_bytes);
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
