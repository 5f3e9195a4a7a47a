/* A layout move's kernel (gpu.h, kv_move), launched over the whole call or
 * over one staged piece.  A piece is the same kernel run over part of the
 * call, with the pinned side replaced by the piece's slot, where the
 * piece's units lie packed: the launchers below rewrite the call's
 * description for one box.  Each kind's descriptor (gpu.h, kv_move_kind)
 * points at its functions here; a new kind adds its own. */
#include "gpu_internal.h"

#include <stdio.h>
#include <string.h>

#include "kvbm_kernels.h"
#include "pieces.h"

KV_MOVE_KERNEL_DECLARE(block_universal);
KV_MOVE_KERNEL_DECLARE(paged);

int kv_block_universal_launch(const kv_move *m, const void *host_table, const void *device_table, uint32_t num_ctas,
                              void *stream)
{
    const kv_block_move *a = m->args;
    return kvbm_launch_block_universal(a->dims, (void *const *)host_table, (void *const *)device_table, a->direction,
                                       m->vector_bytes, num_ctas, (cudaStream_t)stream);
}

int kv_paged_launch(const kv_move *m, const void *host_table, const void *device_table, uint32_t num_ctas, void *stream)
{
    const kv_paged_move *a = m->args;
    return kvbm_launch_paged(a->paged, a->addresses, host_table, device_table, m->vector_bytes, num_ctas,
                             (cudaStream_t)stream);
}

int kv_block_universal_load(void) { return kvbm_load_block_universal(); }
int kv_paged_load(void) { return kvbm_load_paged(); }

int64_t kv_paged_piece_blocks(const kv_move *m, char *why, size_t why_size)
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

int64_t kv_block_universal_piece_blocks(const kv_move *m, char *why, size_t why_size)
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

/* One piece of a block stack (or operational) <-> universal move.  Staged
 * universals: the box's heads [m0, m0 + mn) and chunks [i0, i0 + in) of
 * its blocks, packed in the slot as [bn][mn][in][nt, hd], taken from (or
 * put into) the chunks on the device, which keep their own strides
 * (chunk_heads).  Staged chunks or operationals: the box's chunks, packed
 * in the slot, every head, with the universals on the device keeping
 * theirs (universal_chunks).  The piece's table goes by value: max_blocks
 * keeps it within KVBM_TABLE_BY_VALUE_MAX. */
int kv_block_universal_launch_piece(const kv_move *m, const kv_staged *s, const kv_box *box, char *slot,
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

/* One piece of a paged move: blocks [b0, b0 + bn), moved layers [i0, i0 +
 * in) and, for universals (staged as [heads][layers] of units; with one
 * head the two packings agree), the cache's heads [m0, m0 + mn), into (or
 * out of) the slot as packed flat blocks: [mn, in, no, nt, hd] universals,
 * [in, no, nt*nh*hd] operationals (each chunk in its own order).  Its
 * table, by value: the piece's layers' bases (one per layer, or one per
 * (layer, outer) when K and V are separate arrays), then its host ids. */
int kv_paged_launch_piece(const kv_move *m, const kv_staged *s, const kv_box *box, char *slot, uint32_t num_ctas,
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
