/* A paged cache <-> universal or operational blocks: the kind's descriptor
 * (gpu.h, kv_move_kind), its kernel side (cuda/paged.cu over the whole call
 * or one staged piece, built with nvcc only) and its CPU twin.  See
 * move_paged.h. */
#include "move_paged.h"

#include <string.h>

#include "gpu.h"

#ifdef KVBM_CUDA_VERSION
#include <stdio.h>

#include "kvbm_kernels.h"
#include "pieces.h"

static int paged_launch(const kv_move *m, const void *host_table, const void *device_table, uint32_t num_ctas,
                        void *stream)
{
    const kv_paged_move *a = m->args;
    return kvbm_launch_paged(a->paged, a->addresses, host_table, device_table, m->vector_bytes, num_ctas,
                             (cudaStream_t)stream);
}

static int64_t paged_piece_blocks(const kv_move *m, char *why, size_t why_size)
{
    /* A piece's layers, and its host ids, travel by value. */
    const kv_paged_move *a = m->args;
    const int64_t bases = kvbm_paged_bases(a->paged);
    if (bases >= KVBM_TABLE_BY_VALUE_MAX) {
        snprintf(why, why_size, "a table of %lld layers does not fit in a launch's parameters",
                 (long long)a->paged->nl);
        return 0;
    }
    return a->addresses->ids != NULL ? INT64_MAX : KVBM_TABLE_BY_VALUE_MAX - bases;
}

/* One piece: blocks [b0, b0 + bn), moved layers [i0, i0 + in) and, for
 * universals (staged as [heads][layers] of units; with one head the two
 * packings agree), the cache's heads [m0, m0 + mn), into (or out of) the
 * slot as packed flat blocks: [mn, in, no, nt, hd] universals, [in, no,
 * nt*nh*hd] operationals (each chunk in its own order).  Its table, by
 * value: the piece's layers' bases (one per layer, or one per (layer,
 * outer) when K and V are separate arrays), then its host ids. */
static int paged_launch_piece(const kv_move *m, const kv_staged *s, const kv_box *box, char *slot, uint32_t num_ctas,
                              void *stream)
{
    const kv_paged_move *a = m->args;
    const kvbm_paged *whole = a->paged;
    const uint64_t *table = m->table;
    kvbm_paged p = *whole;
    p.nb = box->bn;
    p.nl = box->in;
    if (s->mid > 1) {
        p.nh = box->mn;
        p.cache_shift = whole->cache_shift + box->m0 * whole->cache_head;
        p.flat_token = whole->row_bytes;
        p.flat_outer = whole->nt * whole->row_bytes;
        p.flat_layer = whole->no * p.flat_outer;
        p.flat_head = box->in * p.flat_layer;
    }
    else {
        p.flat_outer = whole->nt * whole->nh * whole->row_bytes;
        p.flat_layer = whole->no * p.flat_outer;
    }
    p.flat_shift = 0;
    kvbm_paged_plan(&p);
    kvbm_paged_addresses addresses = *a->addresses;
    addresses.flat_base = (uint64_t)(uintptr_t)slot;
    addresses.flat_block = box->mn * box->in * s->unit_bytes;
    uint64_t piece_table[KVBM_TABLE_BY_VALUE_MAX];
    const int64_t per_layer = whole->split_outer ? whole->no : 1, bases = box->in * per_layer;
    memcpy(piece_table, table + box->i0 * per_layer, (size_t)bases * sizeof *piece_table);
    if (addresses.ids != NULL)
        addresses.ids = (const char *)addresses.ids + box->b0 * (addresses.ids_int32 ? 4 : 8);
    else
        memcpy(piece_table + bases, table + kvbm_paged_bases(whole) + box->b0, (size_t)box->bn * sizeof *piece_table);
    return kvbm_launch_paged(&p, &addresses, piece_table, NULL, m->vector_bytes, num_ctas, (cudaStream_t)stream);
}
#endif /* KVBM_CUDA_VERSION */

/* The CPU twin: the same arguments as the kernel's, the ids always in the
 * table (bases, host ids, flat blocks), one memcpy per segment. */
static void paged_cpu(const kv_move *move)
{
    const kvbm_paged *p = ((const kv_paged_move *)move->args)->paged;
    const kvbm_paged_addresses *a = ((const kv_paged_move *)move->args)->addresses;
    const uint64_t *table = move->table;
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

static int64_t paged_bytes(const kv_move *move)
{
    const kvbm_paged *p = ((const kv_paged_move *)move->args)->paged;
    return p->nb * p->nl * p->no * p->nh * p->nt * p->row_bytes;
}

const kv_move_kind kv_move_paged = {
    .what = "launching the paged cache kernel",
    KV_MOVE_KERNEL(paged),
    .cpu = paged_cpu,
    .cpu_bytes = paged_bytes,
};
