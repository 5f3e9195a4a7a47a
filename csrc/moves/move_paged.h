/* A paged cache <-> universal or operational blocks: one kind of layout
 * move (gpu.h, kv_move_kind), defined in move_paged.c, described by
 * PagedKVCache's calls (paged/paged_run.c). */
#ifndef KVBM_MOVE_PAGED_H
#define KVBM_MOVE_PAGED_H

#include "gpu.h"
#include "kvbm_paged.h"

/* The call, beside its table (kvbm_paged.h). */
typedef struct {
    const kvbm_paged *paged;
    const kvbm_paged_addresses *addresses;
} kv_paged_move;

extern const kv_move_kind kv_move_paged;

#endif /* KVBM_MOVE_PAGED_H */
