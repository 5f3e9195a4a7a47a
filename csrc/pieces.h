/* How a staged move (gpu.h, kv_staged) is cut into pieces, and which
 * contiguous runs of pinned memory each piece's staging slot maps to.  No
 * CUDA here: the planning is plain arithmetic over the units of the pinned
 * side.
 *
 * The pinned side is nb blocks of [mid][inner] units.  A piece is a box
 * whose units are consecutive in that order, so that its staging is one
 * packed buffer [bn][mn][in][unit]: whole blocks, or a range of mids of one
 * block, or a range of inners of one (block, mid).  A universal block is
 * [heads][layers] of units, so a block larger than a piece is cut by heads,
 * then by layers; an operational one is [1][layers]. */
#ifndef KVBM_PIECES_H
#define KVBM_PIECES_H

#include "gpu.h"

typedef struct kv_box {
    int64_t b0, bn; /* blocks */
    int64_t m0, mn; /* mids of each block */
    int64_t i0, in; /* inners of each mid */
} kv_box;

/* A contiguous run of pinned memory and where it sits in the piece's slot. */
typedef struct {
    uint64_t pinned, offset, bytes;
} kv_run;

typedef struct {
    int level;         /* 0: whole blocks; 1: mids of one block; 2: inners of one (block, mid) */
    int64_t step;      /* blocks, mids or inners per piece */
    int64_t per_block; /* pieces per block (levels 1 and 2) */
    int64_t count;     /* pieces */
    int64_t max_bytes; /* of the largest piece */
    int64_t max_units; /* of the largest piece: a bound on its runs */
} kv_pieces;

/* Cuts the move into pieces of at most `piece_bytes` (or one unit, if that
 * is larger). */
void kv_pieces_plan(const kv_staged *s, int64_t piece_bytes, kv_pieces *out);

/* The box of piece k. */
void kv_pieces_box(const kv_staged *s, const kv_pieces *p, int64_t k, kv_box *box);

/* Fills `runs` (room for p->max_units) with the pinned runs of `box`, in
 * slot order, merging neighbours; returns their count. */
int64_t kv_box_runs(const kv_staged *s, const kv_box *box, kv_run *runs);

#endif /* KVBM_PIECES_H */
