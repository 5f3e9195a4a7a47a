/* Cutting a staged move into pieces.  See pieces.h. */
#include "pieces.h"

static int64_t smaller(int64_t a, int64_t b) { return a < b ? a : b; }

/* How many of the `left` items (of item_bytes each) that remain of the
 * move, a block or a mid a box takes: as many as `budget` holds, one at
 * least; or all of them rather than leave fewer than it takes, if they fit
 * in `cap`: the remnant would be a piece smaller than the one before it,
 * which the pipeline cannot use (a copy too short to hide the next permute
 * behind, or one more copy's start and gap for a few bytes). */
static int64_t take(int64_t left, int64_t item_bytes, int64_t budget, int64_t cap)
{
    const int64_t n = smaller(budget / item_bytes > 0 ? budget / item_bytes : 1, left);
    return left - n < n && left * item_bytes <= cap ? left : n;
}

/* The largest box that starts at unit (b, m, i), respects the nesting and
 * holds at most `budget` bytes (one unit at least; a box inside a block or
 * a mid as `take` says). */
static void next_box(const kv_staged *s, int64_t b, int64_t m, int64_t i, int64_t budget, int64_t cap, kv_box *box)
{
    const int64_t mid_bytes = s->inner * s->unit_bytes, block_bytes = s->mid * mid_bytes;
    box->b0 = b, box->bn = 1;
    box->m0 = m, box->mn = 1;
    box->i0 = i, box->in = s->inner - i;
    if (i == 0 && m == 0 && block_bytes <= budget) {
        box->bn =
            smaller(take(s->nb - b, block_bytes, budget, smaller(cap, s->max_blocks * block_bytes)), s->max_blocks);
        box->mn = s->mid;
    }
    else if (i == 0 && mid_bytes <= budget)
        box->mn = take(s->mid - m, mid_bytes, budget, cap);
    else
        box->in = take(s->inner - i, s->unit_bytes, budget, cap);
}

int64_t kv_pieces_cut(const kv_staged *s, const kv_cut *cut, kv_box *boxes, int64_t *max_units)
{
    int64_t b = 0, m = 0, i = 0, count = 0, budget = smaller(cut->lead_bytes, cut->piece_bytes);
    int edge = 1;
    *max_units = 0;
    while (b < s->nb) {
        kv_box box;
        next_box(s, b, m, i, budget, cut->piece_bytes, &box);
        box.edge = edge;
        if (boxes != NULL)
            boxes[count] = box;
        count++;
        const int64_t units = box.bn * box.mn * box.in;
        *max_units = units > *max_units ? units : *max_units;
        /* Step past the box. */
        if ((i = box.i0 + box.in) == s->inner) {
            i = 0;
            if ((m = box.m0 + box.mn) == s->mid) {
                m = 0;
                b = box.b0 + box.bn;
            }
        }
        /* The ramp ends at a box of ramp_bytes, or at whole blocks cut with
         * its last budget: blocks that do not divide ramp_bytes would never
         * reach it, and every piece would stay short and on the edge CTAs. */
        const int64_t bytes = units * s->unit_bytes, ramp = smaller(cut->ramp_bytes, cut->piece_bytes);
        const int whole_blocks = box.mn == s->mid && box.in == s->inner;
        edge = edge && bytes < ramp && !(whole_blocks && budget >= ramp);
        /* The next box grows from what this one holds, not from its budget,
         * so that a box cut short by a block's end is not followed by one
         * too large to hide behind its copy. */
        budget =
            smaller(edge ? smaller(bytes * cut->ramp_growth, cut->ramp_bytes) : bytes * cut->growth, cut->piece_bytes);
    }
    return count;
}

/* Appends [pinned, pinned + bytes), which follows the previous run in the
 * slot, to the previous run when `merge` allows it and it also follows it in
 * pinned memory.  Runs never merge across allocations: one copy may not
 * span two of them. */
static int64_t add_run(kv_run *runs, int64_t n, int merge, uint64_t pinned, uint64_t offset, uint64_t bytes)
{
    if (merge && n > 0 && runs[n - 1].pinned + runs[n - 1].bytes == pinned) {
        runs[n - 1].bytes += bytes;
        return n;
    }
    runs[n].pinned = pinned;
    runs[n].offset = offset;
    runs[n].bytes = bytes;
    return n + 1;
}

int64_t kv_box_runs(const kv_staged *s, const kv_box *box, kv_run *runs)
{
    const uint64_t unit = (uint64_t)s->unit_bytes;
    /* A mid's units are one run when they follow each other in pinned memory. */
    const int mid_is_run = s->unit_address == NULL && s->inner_stride == s->unit_bytes;
    uint64_t offset = 0;
    int64_t n = 0;
    for (int64_t b = box->b0; b < box->b0 + box->bn; b++) {
        /* A block is one allocation (units in a table are one each); blocks
         * share one where the side is one array. */
        int merge = s->unit_address == NULL && s->one_allocation;
        for (int64_t m = box->m0; m < box->m0 + box->mn; m++) {
            if (mid_is_run) {
                const uint64_t first = s->block_address[b] + (uint64_t)(m * s->mid_stride + box->i0 * s->inner_stride);
                n = add_run(runs, n, merge, first, offset, (uint64_t)box->in * unit);
                offset += (uint64_t)box->in * unit;
                merge = 1;
                continue;
            }
            for (int64_t i = box->i0; i < box->i0 + box->in; i++) {
                const uint64_t at = s->unit_address != NULL
                                        ? s->unit_address[b * s->inner + i]
                                        : s->block_address[b] + (uint64_t)(m * s->mid_stride + i * s->inner_stride);
                n = add_run(runs, n, merge, at, offset, unit);
                offset += unit;
                merge = s->unit_address == NULL;
            }
        }
    }
    return n;
}
