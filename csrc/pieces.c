/* Cutting a staged move into pieces.  See pieces.h. */
#include "pieces.h"

static int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

void kv_pieces_plan(const kv_staged *s, int64_t piece_bytes, kv_pieces *out)
{
    const int64_t mid_bytes = s->inner * s->unit_bytes;
    const int64_t block_bytes = s->mid * mid_bytes;
    if (block_bytes <= piece_bytes) {
        int64_t step = piece_bytes / block_bytes;
        step = step < s->max_blocks ? step : s->max_blocks;
        step = step < s->nb ? step : s->nb;
        out->level = 0;
        out->step = step;
        out->per_block = 0;
        out->count = ceil_div(s->nb, step);
        out->max_units = step * s->mid * s->inner;
    }
    else if (mid_bytes <= piece_bytes) {
        out->level = 1;
        out->step = piece_bytes / mid_bytes;
        out->per_block = ceil_div(s->mid, out->step);
        out->count = s->nb * out->per_block;
        out->max_units = out->step * s->inner;
    }
    else {
        const int64_t step = piece_bytes / s->unit_bytes;
        out->level = 2;
        out->step = step > 0 ? step : 1;
        out->per_block = s->mid * ceil_div(s->inner, out->step);
        out->count = s->nb * out->per_block;
        out->max_units = out->step;
    }
    out->max_bytes = out->max_units * s->unit_bytes;
}

void kv_pieces_box(const kv_staged *s, const kv_pieces *p, int64_t k, kv_box *box)
{
    if (p->level == 0) {
        box->b0 = k * p->step;
        box->bn = s->nb - box->b0 < p->step ? s->nb - box->b0 : p->step;
        box->m0 = 0, box->mn = s->mid;
        box->i0 = 0, box->in = s->inner;
        return;
    }
    const int64_t j = k % p->per_block;
    box->b0 = k / p->per_block, box->bn = 1;
    if (p->level == 1) {
        box->m0 = j * p->step;
        box->mn = s->mid - box->m0 < p->step ? s->mid - box->m0 : p->step;
        box->i0 = 0, box->in = s->inner;
        return;
    }
    const int64_t per_mid = ceil_div(s->inner, p->step);
    box->m0 = j / per_mid, box->mn = 1;
    box->i0 = (j % per_mid) * p->step;
    box->in = s->inner - box->i0 < p->step ? s->inner - box->i0 : p->step;
}

/* Appends [pinned, pinned + bytes), which follows the previous run in the
 * slot, to the previous run when it also follows it in pinned memory. */
static int64_t add_run(kv_run *runs, int64_t n, uint64_t pinned, uint64_t offset, uint64_t bytes)
{
    if (n > 0 && runs[n - 1].pinned + runs[n - 1].bytes == pinned) {
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
        for (int64_t m = box->m0; m < box->m0 + box->mn; m++) {
            if (mid_is_run) {
                const uint64_t first = s->block_address[b] + (uint64_t)(m * s->mid_stride + box->i0 * s->inner_stride);
                n = add_run(runs, n, first, offset, (uint64_t)box->in * unit);
                offset += (uint64_t)box->in * unit;
                continue;
            }
            for (int64_t i = box->i0; i < box->i0 + box->in; i++) {
                const uint64_t at = s->unit_address != NULL
                                        ? s->unit_address[b * s->inner + i]
                                        : s->block_address[b] + (uint64_t)(m * s->mid_stride + i * s->inner_stride);
                n = add_run(runs, n, at, offset, unit);
                offset += unit;
            }
        }
    }
    return n;
}
