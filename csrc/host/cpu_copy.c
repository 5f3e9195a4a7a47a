/* The CPU implementation: one memcpy per segment (see kvbm_layout.h and
 * kvbm_paged.h); and the descriptor of each kind of layout move (gpu.h,
 * kv_move_kind), its CPU twin beside it.  A new kind adds its twin and its
 * descriptor here, its kernel side in csrc/gpu/. */
#include "cpu_copy.h"

#include <string.h>

/* Same table as kvbm_launch_block_universal (see kvbm_table_entries). */
static void cpu_block_universal(const kv_move *move)
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

/* Same arguments as kvbm_launch_paged. */
static void cpu_paged(const kv_move *move)
{
    const kvbm_paged *p = ((const kv_paged_move *)move->args)->paged;
    const kvbm_paged_addresses *a = ((const kv_paged_move *)move->args)->addresses;
    const uint64_t *table = move->table;
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

/* Same arguments as kvbm_launch_to_cache, the ids in the table. */
static void cpu_to_cache(const kv_move *move)
{
    const kvbm_to_cache *m = ((const kv_to_cache_move *)move->args)->move;
    const uint64_t *table = move->table;
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

static int64_t block_universal_bytes(const kv_move *move)
{
    const kvbm_block_dims *d = ((const kv_block_move *)move->args)->dims;
    return d->nb * d->nchunks * d->nh * d->nt * d->row_bytes;
}

static int64_t paged_bytes(const kvbm_paged *p) { return p->nb * p->nl * p->no * p->nh * p->nt * p->row_bytes; }

static int64_t paged_move_bytes(const kv_move *move) { return paged_bytes(((const kv_paged_move *)move->args)->paged); }

static int64_t to_cache_bytes(const kv_move *move)
{
    return paged_bytes(&((const kv_to_cache_move *)move->args)->move->p);
}

KV_MOVE_KERNEL_DECLARE(block_universal);
KV_MOVE_KERNEL_DECLARE(paged);
KV_MOVE_KERNEL_DECLARE(to_cache);

/* Block stacks (or operationals) <-> universals (cuda/block_universal.cu). */
const kv_move_kind kv_move_block_universal = {
    .what = "launching the block/universal kernel",
    KV_MOVE_KERNEL(block_universal),
    .cpu = cpu_block_universal,
    .cpu_bytes = block_universal_bytes,
};

/* A paged cache <-> universals or operationals (cuda/paged.cu). */
const kv_move_kind kv_move_paged = {
    .what = "launching the paged cache kernel",
    KV_MOVE_KERNEL(paged),
    .cpu = cpu_paged,
    .cpu_bytes = paged_move_bytes,
};

/* One paged cache into another (cuda/to_cache.cu; staged pieces:
 * gpu_to_cache.c). */
const kv_move_kind kv_move_to_cache = {
    .what = "launching the cache-to-cache kernel",
    KV_MOVE_KERNEL(to_cache),
    .cpu = cpu_to_cache,
    .cpu_bytes = to_cache_bytes,
};

const kv_move_kind *const kv_move_kinds[] = {&kv_move_block_universal, &kv_move_paged, &kv_move_to_cache};
const int kv_move_kind_count = (int)(sizeof kv_move_kinds / sizeof *kv_move_kinds);

void kv_cpu_copy_pairs(const kv_pairs *pairs)
{
    for (int64_t i = 0; i < pairs->count; i++)
        memcpy((void *)(uintptr_t)pairs->dst[i], (const void *)(uintptr_t)pairs->src[i],
               (size_t)(pairs->sizes ? pairs->sizes[i] : pairs->uniform_size));
}
