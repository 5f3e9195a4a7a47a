/* The block <-> universal layout definition, shared by the CPU twin
 * (csrc/moves/move_block_universal.c) and the CUDA kernels
 * (cuda/block_universal.cu), so the two cannot disagree about where a byte
 * goes; and what one launch of any kernel can take, which the C side checks
 * before it launches.
 *
 * A block stack holds `nchunks = nl * no` chunks per block, chunk c = l*no + o,
 * each [nt, nh, hd] (NHD) or [nh, nt, hd] (HND), each its own allocation.  An
 * operational block holds the same chunks in one buffer, chunk c at byte
 * c * chunk_stride.  A universal block is one
 * contiguous [nh, nl, no, nt, hd] buffer, which for the copy is [nh, nchunks,
 * nt, hd].  A "row" is the hd elements of one (head, token): row_bytes bytes,
 * contiguous on both sides.
 *
 * A "segment" is the longest run of rows that is contiguous on both sides:
 * for HND one head's nt rows; for NHD one row (or all nt rows when nh == 1).
 * Both implementations move whole segments: memcpy on the CPU, vectors on the
 * GPU.
 */
#ifndef KVBM_LAYOUT_H
#define KVBM_LAYOUT_H

#include <stdint.h>

#ifdef __CUDACC__
#define KVBM_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KVBM_HOST_DEVICE static inline
#endif

typedef enum {
    KVBM_NHD = 0,
    KVBM_HND = 1
} kvbm_layout;

typedef enum {
    KVBM_TO_UNIVERSAL = 0,
    KVBM_FROM_UNIVERSAL = 1
} kvbm_direction;

/* Division of 32-bit numbers by a divisor fixed for the whole call, as a
 * multiply and a shift (Granlund and Montgomery, "Division by invariant
 * integers using multiplication", 1994, figure 4.1), so that the GPU does not
 * run a division routine for every 16-byte vector.  Exact for every n and
 * every divisor from 1 to 2^32 - 1. */
typedef struct {
    uint32_t divisor;
    uint32_t multiplier;
    uint32_t shift;
} kvbm_divisor;

KVBM_HOST_DEVICE kvbm_divisor kvbm_divisor_make(uint32_t divisor)
{
    kvbm_divisor v;
    uint32_t shift = 0;
    while (shift < 32 && (UINT64_C(1) << shift) < divisor)
        shift++;
    v.divisor = divisor;
    v.shift = shift;
    v.multiplier = (uint32_t)((UINT64_C(1) << 32) * ((UINT64_C(1) << shift) - divisor) / divisor + 1);
    return v;
}

KVBM_HOST_DEVICE uint32_t kvbm_div(kvbm_divisor v, uint32_t n)
{
#ifdef __CUDA_ARCH__
    uint32_t high = __umulhi(n, v.multiplier);
#else
    uint32_t high = (uint32_t)(((uint64_t)n * v.multiplier) >> 32);
#endif
    return (uint32_t)(((uint64_t)high + n) >> v.shift);
}

/* What one launch can take, the same for every kernel. */

/* The widest vector (16, 8, 4, 2 or 1 bytes) that `bits`, the OR of every
 * address, stride and size a kernel moves, allows: its lowest set bit, 16
 * at most. */
KVBM_HOST_DEVICE int kvbm_vector_bytes(uint64_t bits)
{
    bits |= 16;
    return (int)(bits & (~bits + 1));
}

/* The least a tile moves of a chunk that spans several tiles: kThreads
 * (256) threads of kUnroll (4) vectors of at least one byte
 * (kvbm_device.cuh, Tiling). */
#define KVBM_TILE_MIN_BYTES 1024

/* Whether one launch can move `blocks` blocks of chunks_per_block chunks
 * of chunk_bytes each.  The kernels count in 32 bits: a chunk's vectors
 * (one-byte vectors at worst, so chunk_bytes below 2^32) and the call's
 * tiles (signed), of which a chunk has at most chunk_bytes /
 * KVBM_TILE_MIN_BYTES + 1; a call that moves nothing always fits. */
KVBM_HOST_DEVICE int kvbm_fits_one_launch(int64_t blocks, int64_t chunks_per_block, int64_t chunk_bytes)
{
    if (blocks == 0 || chunks_per_block == 0 || chunk_bytes == 0)
        return 1;
    if (chunk_bytes > (int64_t)UINT32_MAX)
        return 0;
    const int64_t tiles_per_chunk = chunk_bytes / KVBM_TILE_MIN_BYTES + 1;
    return blocks <= (int64_t)INT32_MAX / tiles_per_chunk / chunks_per_block;
}

typedef struct {
    int64_t nb;        /* blocks in the call */
    int64_t nchunks;   /* nl * no chunks per block */
    int64_t nh;        /* heads */
    int64_t nt;        /* tokens per block */
    int64_t row_bytes; /* hd * itemsize */
    kvbm_layout layout;
    kvbm_divisor nh_divisor; /* kvbm_divisor_make(nh) */
    int64_t chunk_stride;    /* bytes between the chunks of an operational block; 0 for block stacks */
    /* The layouts' own sizes, which a call that moves part of each buffer
     * (a staged piece: some heads, some chunks) needs for the strides: */
    int64_t universal_chunks; /* chunks per head of the universal buffers (nchunks for a whole call) */
    int64_t chunk_heads;      /* heads of the chunks (nh for a whole call) */
} kvbm_block_dims;

/* The pointer table of a call holds nb universal pointers, then the chunks'
 * pointers: one per chunk of a block stack, block-major, or one per
 * operational block.  Chunk c of block b starts at
 * table[kvbm_chunk_slot(d, b, c)] + kvbm_chunk_shift(d, c). */
KVBM_HOST_DEVICE int64_t kvbm_table_entries(const kvbm_block_dims *d)
{
    return d->nb * (d->chunk_stride ? 2 : 1 + d->nchunks);
}

KVBM_HOST_DEVICE int64_t kvbm_chunk_slot(const kvbm_block_dims *d, int64_t b, int64_t c)
{
    return d->nb + (d->chunk_stride ? b : b * d->nchunks + c);
}

KVBM_HOST_DEVICE int64_t kvbm_chunk_shift(const kvbm_block_dims *d, int64_t c) { return c * d->chunk_stride; }

/* Rows per segment: a head's tokens are contiguous in an HND chunk, and in
 * an NHD chunk of one head. */
KVBM_HOST_DEVICE int64_t kvbm_segment_rows(const kvbm_block_dims *d)
{
    return (d->layout == KVBM_HND || d->chunk_heads == 1) ? d->nt : 1;
}

/* Segments per chunk. */
KVBM_HOST_DEVICE int64_t kvbm_segments_per_chunk(const kvbm_block_dims *d)
{
    return d->nh * d->nt / kvbm_segment_rows(d);
}

/* The (head, first token) of segment s of a chunk.  Segments per chunk fit
 * in 32 bits (kvbm_fits_one_launch). */
KVBM_HOST_DEVICE void kvbm_segment_start(const kvbm_block_dims *d, uint32_t s, int64_t *h, int64_t *t)
{
    if (kvbm_segment_rows(d) == d->nt) {
        *h = s;
        *t = 0;
    }
    else {
        uint32_t token = kvbm_div(d->nh_divisor, s);
        *t = token;
        *h = s - token * (uint32_t)d->nh;
    }
}

/* Byte offset of row (h, t) inside a chunk. */
KVBM_HOST_DEVICE int64_t kvbm_chunk_offset(const kvbm_block_dims *d, int64_t h, int64_t t)
{
    int64_t row = d->layout == KVBM_HND ? h * d->nt + t : t * d->chunk_heads + h;
    return row * d->row_bytes;
}

/* Byte offset of row (c, h, t) inside a universal block [nh, nchunks, nt, hd]. */
KVBM_HOST_DEVICE int64_t kvbm_universal_offset(const kvbm_block_dims *d, int64_t c, int64_t h, int64_t t)
{
    return ((h * d->universal_chunks + c) * d->nt + t) * d->row_bytes;
}

#endif /* KVBM_LAYOUT_H */
