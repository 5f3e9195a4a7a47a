/* A layout move's kernel (gpu.h, kv_move), launched over the whole call or
 * over one staged piece.  A piece is the same kernel run over part of the
 * call, with the pinned side replaced by the piece's slot, where the
 * piece's units lie packed: the launchers below rewrite the call's
 * description for one box.  A new kind of move adds a case to each. */
#include "gpu_internal.h"

#include <stdio.h>
#include <string.h>

#include "kvbm_kernels.h"
#include "pieces.h"

cudaError_t kv_move_launch(const kv_move *m, const void *host_table, const void *device_table, uint32_t num_ctas,
                           cudaStream_t stream)
{
    switch (m->kind) {
    case KV_MOVE_BLOCK_UNIVERSAL:
        return kvbm_launch_block_universal(m->block.dims, (void *const *)host_table, (void *const *)device_table,
                                           m->block.direction, m->vector_bytes, num_ctas, stream);
    case KV_MOVE_PAGED:
        return kvbm_launch_paged(m->paged.paged, m->paged.addresses, host_table, device_table, m->vector_bytes,
                                 num_ctas, stream);
    case KV_MOVE_TO_CACHE:
        return kvbm_launch_to_cache(m->to_cache.move, m->to_cache.ids, host_table, device_table, m->vector_bytes,
                                    num_ctas, stream);
    }
    return cudaErrorInvalidValue;
}

const char *kv_move_what(const kv_move *m)
{
    switch (m->kind) {
    case KV_MOVE_PAGED: return "launching the paged cache kernel";
    case KV_MOVE_TO_CACHE: return "launching the cache-to-cache kernel";
    default: return "launching the block/universal kernel";
    }
}

int64_t kv_move_piece_blocks(const kv_move *m, char *why, size_t why_size)
{
    if (m->kind == KV_MOVE_TO_CACHE)
        return kv_to_cache_piece_blocks(m, why, why_size);
    if (m->kind == KV_MOVE_PAGED) {
        /* A piece's layers, and its host ids, travel by value. */
        const kvbm_paged *p = m->paged.paged;
        const int64_t bases = kvbm_paged_bases(p);
        if (bases >= KVBM_TABLE_BY_VALUE_MAX) {
            snprintf(why, why_size, "a table of %lld layers does not fit in a launch's parameters", (long long)p->nl);
            return 0;
        }
        return m->paged.addresses->ids != NULL ? INT64_MAX : KVBM_TABLE_BY_VALUE_MAX - bases;
    }
    /* Whole blocks up to the by-value table's size, and a block's table must
     * fit. */
    const kvbm_block_dims *d = m->block.dims;
    const int64_t blocks = KVBM_TABLE_BY_VALUE_MAX / (1 + (d->chunk_stride ? 1 : d->nchunks));
    if (blocks == 0)
        snprintf(why, why_size, "a block's table of %lld chunks does not fit in a launch's parameters",
                 (long long)d->nchunks);
    return blocks;
}

/* One piece of a block stack (or operational) <-> universal move.  Staged
 * universals: the box's heads [m0, m0 + mn) and chunks [i0, i0 + in) of
 * its blocks, packed in the slot as [bn][mn][in][nt, hd], taken from (or
 * put into) the chunks on the device, which keep their own strides
 * (chunk_heads).  Staged chunks or operationals: the box's chunks, packed
 * in the slot, every head, with the universals on the device keeping
 * theirs (universal_chunks).  The piece's table goes by value: max_blocks
 * keeps it within KVBM_TABLE_BY_VALUE_MAX. */
static cudaError_t launch_block_universal_piece(const kv_move *m, const kv_staged *s, const kv_box *box, char *slot,
                                                uint32_t num_ctas, cudaStream_t stream)
{
    const kvbm_block_dims *d = m->block.dims;
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
    return kvbm_launch_block_universal(&p, piece_table, NULL, m->block.direction, m->vector_bytes, num_ctas, stream);
}

/* One piece of a paged move: blocks [b0, b0 + bn), moved layers [i0, i0 +
 * in) and, for universals (staged as [heads][layers] of units; with one
 * head the two packings agree), the cache's heads [m0, m0 + mn), into (or
 * out of) the slot as packed flat blocks: [mn, in, no, nt, hd] universals,
 * [in, no, nt*nh*hd] operationals (each chunk in its own order).  Its
 * table, by value: the piece's layers' bases (one per layer, or one per
 * (layer, outer) when K and V are separate arrays), then its host ids. */
static cudaError_t launch_paged_piece(const kv_move *m, const kv_staged *s, const kv_box *box, char *slot,
                                      uint32_t num_ctas, cudaStream_t stream)
{
    const kvbm_paged *whole = m->paged.paged;
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
    kvbm_paged_addresses addresses = *m->paged.addresses;
    addresses.flat_base = (uint64_t)(uintptr_t)slot;
    addresses.flat_block = box->mn * box->in * s->unit_bytes;
    uint64_t piece_table[KVBM_TABLE_BY_VALUE_MAX];
    const int64_t per_layer = whole->split_outer ? whole->no : 1, bases = box->in * per_layer;
    memcpy(piece_table, table + box->i0 * per_layer, (size_t)bases * sizeof *piece_table);
    if (addresses.ids != NULL)
        addresses.ids = (const char *)addresses.ids + box->b0 * (addresses.ids_int32 ? 4 : 8);
    else
        memcpy(piece_table + bases, table + kvbm_paged_bases(whole) + box->b0, (size_t)box->bn * sizeof *piece_table);
    return kvbm_launch_paged(&p, &addresses, piece_table, NULL, m->vector_bytes, num_ctas, stream);
}

cudaError_t kv_move_launch_piece(const kv_move *m, const kv_staged *s, const kv_box *box, char *slot, uint32_t num_ctas,
                                 cudaStream_t stream)
{
    switch (m->kind) {
    case KV_MOVE_BLOCK_UNIVERSAL: return launch_block_universal_piece(m, s, box, slot, num_ctas, stream);
    case KV_MOVE_PAGED: return launch_paged_piece(m, s, box, slot, num_ctas, stream);
    case KV_MOVE_TO_CACHE: return kv_to_cache_launch_piece(m, s, box, slot, num_ctas, stream);
    }
    return cudaErrorInvalidValue;
}
