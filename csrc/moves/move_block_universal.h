/* Block stacks (or operational blocks) <-> universal blocks: one kind of
 * layout move (gpu.h, kv_move_kind), defined in move_block_universal.c,
 * described by a conversion (plan/convert_run.c). */
#ifndef KVBM_MOVE_BLOCK_UNIVERSAL_H
#define KVBM_MOVE_BLOCK_UNIVERSAL_H

#include "gpu.h"
#include "kvbm_layout.h"

/* The call, beside its table (kvbm_layout.h, kvbm_table_entries). */
typedef struct {
    const kvbm_block_dims *dims;
    kvbm_direction direction;
} kv_block_move;

extern const kv_move_kind kv_move_block_universal;

#endif /* KVBM_MOVE_BLOCK_UNIVERSAL_H */
