/* The layout moves on the GPU: block stack (or operational) <-> universal,
 * and paged cache <-> flat blocks, by the kernel alone or staged (see
 * staging.c).  A staged piece is the same kernel run over part of the call,
 * with the pinned side replaced by the piece's slot, where the piece's units
 * lie packed: the launchers below rewrite the call's description for one
 * box. */
#include "gpu_internal.h"

#include <stdio.h>
#include <string.h>

#include "kvbm_kernels.h"
#include "pieces.h"

/* Runs the kernel alone, or staged; a move that cannot be staged runs the
 * kernel alone (report->fallback says why). */
int kv_run_move(kv_gpu *gpu, kv_ring *ring, cudaStream_t stream, const kv_staged *staged, kv_box_launch box_launch,
                kv_table_launch whole_launch, const void *args, const void *table, int64_t entries, uint32_t max_ctas,
                kv_gpu_report *report, const char *what, kv_failure *f)
{
    if (staged != NULL) {
        const int rc = kv_staging_run(gpu, ring, stream, staged, box_launch, args, max_ctas, report, f);
        if (rc <= 0)
            return rc;
    }
    if (staged != NULL && max_ctas == 0)
        max_ctas = KV_PINNED_CTAS; /* pinned memory read directly: the default bound */
    report->staged = 0;
    report->ctas = max_ctas;
    return kv_launch_with_table(ring, stream, table, entries, whole_launch, args, what, f);
}

/* ------------------------------------------------------------ block stacks */

typedef struct {
    const kvbm_block_dims *dims;
    kvbm_direction direction;
    void *const *table;
    int vector_bytes;
    uint32_t max_ctas;
    const kv_staged *staged;
    kv_gpu_report *report;
} kv_block_universal_args;

static cudaError_t launch_block_universal(const void *args, const void *host_table, const void *device_table,
                                          cudaStream_t stream)
{
    const kv_block_universal_args *a = args;
    return kvbm_launch_block_universal(a->dims, (void *const *)host_table, (void *const *)device_table, a->direction,
                                       a->vector_bytes, a->max_ctas, stream);
}

/* One piece.  Staged universals: the box's heads [m0, m0 + mn) and chunks
 * [i0, i0 + in) of its blocks, packed in the slot as [bn][mn][in][nt, hd],
 * taken from (or put into) the chunks on the device, which keep their own
 * strides (chunk_heads).  Staged chunks or operationals: the box's chunks,
 * packed in the slot, every head, with the universals on the device keeping
 * theirs (universal_chunks).  The piece's table goes by value: max_blocks
 * keeps it within KVBM_TABLE_BY_VALUE_MAX. */
static cudaError_t launch_block_universal_box(const void *ctx, const kv_box *box, char *slot, uint32_t max_ctas,
                                              cudaStream_t stream)
{
    const kv_block_universal_args *a = ctx;
    const kvbm_block_dims *d = a->dims;
    const int64_t unit = a->staged->unit_bytes, rb = d->row_bytes;
    void *const *table = a->table;
    void *piece_table[KVBM_TABLE_BY_VALUE_MAX];
    kvbm_block_dims p = *d;
    p.nb = box->bn;
    p.nchunks = box->in;
    char **universals = (char **)piece_table, **chunks = (char **)piece_table + box->bn;
    const int64_t chunk_slots = d->chunk_stride ? 1 : box->in; /* table entries per block for the chunks */
    if (a->staged->flat_side) {
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
    return kvbm_launch_block_universal(&p, piece_table, NULL, a->direction, a->vector_bytes, max_ctas, stream);
}

static int enqueue_block_universal(kv_gpu *gpu, kv_ring *ring, cudaStream_t stream, const void *args, kv_failure *f)
{
    const kv_block_universal_args *a = args;
    return kv_run_move(gpu, ring, stream, a->staged, launch_block_universal_box, launch_block_universal, args,
                       a->table, kvbm_table_entries(a->dims), a->max_ctas, a->report,
                       "launching the block/universal kernel", f);
}

int kv_gpu_block_universal(kv_gpu *gpu, const kv_gpu_target *target, const kvbm_block_dims *dims,
                           kvbm_direction direction, void *const *table, int vector_bytes, uint32_t max_ctas,
                           const kv_staged *staged, kv_gpu_report *report)
{
    /* A piece's table goes by value: whole blocks up to its size, and a
     * block's table must fit. */
    kv_staged bounded;
    if (staged != NULL) {
        bounded = *staged;
        bounded.max_blocks = KVBM_TABLE_BY_VALUE_MAX / (1 + (dims->chunk_stride ? 1 : dims->nchunks));
        if (bounded.max_blocks == 0) {
            snprintf(report->fallback, sizeof report->fallback, "a block's table of %lld chunks does not fit in a "
                     "launch's parameters", (long long)dims->nchunks);
            staged = NULL;
        }
        else
            staged = &bounded;
    }
    const kv_block_universal_args args = {dims, direction, table, vector_bytes, max_ctas, staged, report};
    return kv_run_on_device(gpu, target, enqueue_block_universal, &args);
}

/* ------------------------------------------------------------ paged caches */

typedef struct {
    const kvbm_paged *paged;
    const kvbm_paged_addresses *addresses;
    const uint64_t *table;
    int vector_bytes;
    uint32_t max_ctas;
    const kv_staged *staged;
    int universal; /* the flat blocks are universals (else operationals) */
    kv_gpu_report *report;
} kv_paged_args;

static cudaError_t launch_paged(const void *args, const void *host_table, const void *device_table,
                                cudaStream_t stream)
{
    const kv_paged_args *a = args;
    return kvbm_launch_paged(a->paged, a->addresses, host_table, device_table, a->vector_bytes, a->max_ctas, stream);
}

/* One piece: blocks [b0, b0 + bn), moved layers [i0, i0 + in) and, for
 * universals, the cache's heads [m0, m0 + mn), into (or out of) the slot as
 * packed flat blocks: [mn, in, no, nt, hd] universals, [in, no, nt*nh*hd]
 * operationals (each chunk in its inner order).  Its table, by value: the
 * piece's layers, then its host ids. */
static cudaError_t launch_paged_box(const void *ctx, const kv_box *box, char *slot, uint32_t max_ctas,
                                    cudaStream_t stream)
{
    const kv_paged_args *a = ctx;
    const kvbm_paged *whole = a->paged;
    kvbm_paged p = *whole;
    p.nb = box->bn;
    p.nl = box->in;
    if (a->universal) {
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
    addresses.flat_block = box->mn * box->in * a->staged->unit_bytes;
    uint64_t table[KVBM_TABLE_BY_VALUE_MAX];
    const int64_t per_layer = whole->split_outer ? whole->no : 1, bases = box->in * per_layer;
    memcpy(table, a->table + box->i0 * per_layer, (size_t)bases * sizeof *table);
    if (addresses.ids != NULL)
        addresses.ids = (const char *)addresses.ids + box->b0 * (addresses.ids_int32 ? 4 : 8);
    else
        memcpy(table + bases, a->table + kvbm_paged_bases(whole) + box->b0, (size_t)box->bn * sizeof *table);
    return kvbm_launch_paged(&p, &addresses, table, NULL, a->vector_bytes, max_ctas, stream);
}

static int enqueue_paged(kv_gpu *gpu, kv_ring *ring, cudaStream_t stream, const void *args, kv_failure *f)
{
    const kv_paged_args *a = args;
    return kv_run_move(gpu, ring, stream, a->staged, launch_paged_box, launch_paged, args, a->table,
                       kvbm_paged_table_entries(a->addresses, kvbm_paged_bases(a->paged), a->paged->nb), a->max_ctas,
                       a->report, "launching the paged cache kernel", f);
}

int kv_gpu_paged(kv_gpu *gpu, const kv_gpu_target *target, const kvbm_paged *paged,
                 const kvbm_paged_addresses *addresses, const uint64_t *table, int vector_bytes, uint32_t max_ctas,
                 const kv_staged *staged, kv_gpu_report *report)
{
    /* Universals are staged as [heads][layers] of units, operationals as
     * [1][layers]; with one head the two packings agree. */
    const int universal = staged != NULL && staged->mid > 1;
    /* A piece's layers, and its host ids, travel by value. */
    kv_staged bounded;
    if (staged != NULL) {
        bounded = *staged;
        const int64_t bases = kvbm_paged_bases(paged);
        bounded.max_blocks = addresses->ids != NULL ? INT64_MAX : KVBM_TABLE_BY_VALUE_MAX - bases;
        if (bases >= KVBM_TABLE_BY_VALUE_MAX) {
            snprintf(report->fallback, sizeof report->fallback, "a table of %lld layers does not fit in a launch's "
                     "parameters", (long long)paged->nl);
            staged = NULL;
        }
        else
            staged = &bounded;
    }
    const kv_paged_args args = {paged, addresses, table, vector_bytes, max_ctas, staged, universal, report};
    return kv_run_on_device(gpu, target, enqueue_paged, &args);
}
