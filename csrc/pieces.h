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

/* Cuts the move into boxes, in unit order, and returns their count; fills
 * `boxes` unless it is NULL.  The first box holds about `lead_bytes`, each
 * next one up to `growth` times its predecessor's budget, none more than
 * `piece_bytes` (but at least one unit), and none more than s->max_blocks
 * whole blocks.  Starting small lets the copy engines start early; growing
 * keeps the count, and so the host's cost, low.  *max_units receives the
 * units of the largest box. */
int64_t kv_pieces_cut(const kv_staged *s, int64_t lead_bytes, int64_t growth, int64_t piece_bytes, kv_box *boxes,
                      int64_t *max_units);

/* Fills `runs` (room for the box's units) with the pinned runs of `box`, in
 * slot order, merging neighbours; returns their count. */
int64_t kv_box_runs(const kv_staged *s, const kv_box *box, kv_run *runs);

#endif /* KVBM_PIECES_H */
