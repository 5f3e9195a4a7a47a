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
    int edge;       /* permuted on the edge CTAs: the first box, and the ramp */
} kv_box;

/* A contiguous run of pinned memory and where it sits in the piece's slot. */
typedef struct {
    uint64_t pinned, offset, bytes;
} kv_run;

/* Cuts the move into boxes, in unit order, as `cut` says (gpu.h), and
 * returns their count; fills `boxes` unless it is NULL.  No box holds more
 * than cut->piece_bytes (but each at least one unit), nor more than
 * s->max_blocks whole blocks; a box takes the rest of the move, or of the
 * block it lies within, rather than leave a smaller remnant.  Starting
 * small lets the copy engines start early; growing keeps the count, and so
 * the host's cost, low; run backwards (an onload), the same boxes shrink
 * step by step, so that each permute still hides behind the next copy.
 * *max_units receives the units of the largest box. */
int64_t kv_pieces_cut(const kv_staged *s, const kv_cut *cut, kv_box *boxes, int64_t *max_units);

/* Fills `runs` (room for the box's units) with the pinned runs of `box`, in
 * slot order, merging neighbours; returns their count. */
int64_t kv_box_runs(const kv_staged *s, const kv_box *box, kv_run *runs);

#endif /* KVBM_PIECES_H */
