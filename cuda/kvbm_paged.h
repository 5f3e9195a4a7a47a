/* Where a paged KV cache's rows go in universal and operational blocks,
 * shared by the CPU twin (csrc/moves/move_paged.c) and the CUDA kernel
 * (cuda/paged.cu).
 *
 * A paged cache is what a serving worker allocates: one array per layer (or
 * two, K and V), or one for all layers, with a block dimension indexed by
 * block id.  A call moves nl of its layers; the row (moved layer i, outer o,
 * block id, head h, token t) of row_bytes = hd * itemsize contiguous bytes
 * starts at
 *
 *     base(i, o) + cache_shift + o*cache_outer + id*cache_block + h*cache_head + t*cache_token
 *
 * with any strides the arrays have, base(i, o) the address of moved layer i
 * (in the call's table; of its outer o too when split_outer, cache_outer
 * then 0) and cache_shift selecting the first head a call moves.  The
 * "flat" side holds one buffer per moved block b (a universal or an
 * operational block), in which the same row starts at
 *
 *     flat(b) + flat_shift + i*flat_layer + o*flat_outer + h*flat_head + t*flat_token
 *
 * flat_shift places the cache inside a larger universal block (head_offset,
 * layer_offset, the first layer moved); flat_layer may be negative.
 *
 * A "chunk" is one (b, i, o): nh*nt rows.  It is moved as `segments` runs of
 * segment_bytes that are contiguous on both sides; run s starts at
 * (q, r) = (s / inner, s % inner) with byte strides (cache_q, cache_r) and
 * (flat_q, flat_r).  kvbm_paged_plan picks the longest runs the strides
 * allow.
 */
#ifndef KVBM_PAGED_H
#define KVBM_PAGED_H

#include "kvbm_layout.h"

typedef struct {
    int64_t nb; /* blocks in the call */
    int64_t nl; /* layers moved */
    int64_t no, nh, nt, row_bytes;
    int64_t num_blocks; /* ids outside [0, num_blocks) are skipped */
    int64_t cache_outer, cache_block, cache_head, cache_token, cache_shift;
    int64_t flat_layer, flat_outer, flat_head, flat_token, flat_shift;
    int to_flat;     /* the bytes move from the cache into the flat side */
    int split_outer; /* the table holds a base per (moved layer, outer): K and V apart */
    /* Filled by kvbm_paged_plan: */
    int64_t segment_bytes;
    int64_t segments; /* per chunk */
    kvbm_divisor inner;
    int64_t cache_q, cache_r, flat_q, flat_r;
} kvbm_paged;

/* The bases at the head of a call's table: one per moved layer, or one per
 * (moved layer, outer) when split_outer, and the entry of (i, o). */
KVBM_HOST_DEVICE int64_t kvbm_paged_bases(const kvbm_paged *p) { return p->split_outer ? p->nl * p->no : p->nl; }

KVBM_HOST_DEVICE int64_t kvbm_paged_base(const kvbm_paged *p, int64_t i, int64_t o)
{
    return p->split_outer ? i * p->no + o : i;
}

/* Where a call's addresses are.  The call's table (by value or in device
 * memory) holds, in this order: the bases (kvbm_paged_bases entries), the
 * nb block ids unless `ids` points at them on the device, then the nb flat
 * blocks' addresses unless they are one array (flat_base).  The cache's layer addresses travel with
 * every call, so a cache needs no device memory of its own. */
typedef struct {
    const void *ids; /* device-resident ids, int32 or int64, or NULL */
    int ids_int32;
    uint64_t flat_base; /* one flat array: block b at flat_base + b*flat_block; 0: in the table */
    int64_t flat_block;
} kvbm_paged_addresses;

KVBM_HOST_DEVICE int64_t kvbm_paged_table_entries(const kvbm_paged_addresses *a, int64_t bases, int64_t nb)
{
    return bases + (a->ids ? 0 : nb) + (a->flat_base ? 0 : nb);
}

/* Picks the segments: every token of one head when tokens are contiguous on
 * both sides (an HND cache into universal blocks), every head of one token
 * when heads are (an NHD cache into NHD operational blocks), else one row;
 * then the whole chunk when the segments themselves follow each other on
 * both sides. */
KVBM_HOST_DEVICE void kvbm_paged_plan(kvbm_paged *p)
{
    const int64_t rb = p->row_bytes;
    const int tokens_run = p->nt == 1 || (p->cache_token == rb && p->flat_token == rb);
    const int heads_run = p->nh == 1 || (p->cache_head == rb && p->flat_head == rb);
    uint32_t inner = 1;
    p->cache_r = p->flat_r = 0;
    if (tokens_run) {
        p->segment_bytes = p->nt * rb;
        p->segments = p->nh;
        p->cache_q = p->cache_head;
        p->flat_q = p->flat_head;
    }
    else if (heads_run) {
        p->segment_bytes = p->nh * rb;
        p->segments = p->nt;
        p->cache_q = p->cache_token;
        p->flat_q = p->flat_token;
    }
    else {
        p->segment_bytes = rb;
        p->segments = p->nh * p->nt;
        p->cache_q = p->cache_head;
        p->cache_r = p->cache_token;
        p->flat_q = p->flat_head;
        p->flat_r = p->flat_token;
        inner = (uint32_t)p->nt;
    }
    if (inner == 1 && (p->segments == 1 || (p->cache_q == p->segment_bytes && p->flat_q == p->segment_bytes))) {
        p->segment_bytes *= p->segments;
        p->segments = 1;
    }
    p->inner = kvbm_divisor_make(inner);
}

/* Byte offsets of segment s from the chunk's start, in the cache and in the
 * flat block. */
KVBM_HOST_DEVICE void kvbm_paged_segment(const kvbm_paged *p, uint32_t s, int64_t *cache_off, int64_t *flat_off)
{
    const uint32_t q = kvbm_div(p->inner, s);
    const uint32_t r = s - q * p->inner.divisor;
    *cache_off = q * p->cache_q + r * p->cache_r;
    *flat_off = q * p->flat_q + r * p->flat_r;
}

/* Where chunk (id or b, moved layer i, o) starts: in the cache, from its
 * base address, and in flat block b, from its start. */
KVBM_HOST_DEVICE int64_t kvbm_paged_cache_chunk(const kvbm_paged *p, int64_t id, int64_t o)
{
    return p->cache_shift + id * p->cache_block + o * p->cache_outer;
}

KVBM_HOST_DEVICE int64_t kvbm_paged_flat_chunk(const kvbm_paged *p, int64_t i, int64_t o)
{
    return p->flat_shift + i * p->flat_layer + o * p->flat_outer;
}

#endif /* KVBM_PAGED_H */
