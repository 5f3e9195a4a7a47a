/* A conversion's call as convert.c reads and checks its arguments
 * (kv_call), and running it once they are (convert_run.c). */
#ifndef KVBM_CONVERT_RUN_H
#define KVBM_CONVERT_RUN_H

#include "kvbm_layout.h"
#include "options.h"
#include "state.h"

/* The three conversions, by the arrays on each side. */
typedef enum {
    KV_BLOCK_UNIVERSAL,       /* flat side: universals; other: blocks */
    KV_UNIVERSAL_OPERATIONAL, /* flat side: universals; other: operationals */
    KV_BLOCK_OPERATIONAL,     /* flat side: operationals; other: blocks */
} kv_conversion;

/* One side of a call as given: a sequence of arrays, one per block, or one
 * array, either a single block (a 5-D universal, a 3-D operational) or a
 * stack whose leading dimension counts the blocks (6-D, 4-D), as
 * PagedKVCache takes them. */
typedef struct {
    const char *name;
    PyObject *items; /* the argument, snapshotted as a tuple (kv_array_items) */
    kv_array whole;  /* the one array, borrowed (has_whole) */
    int has_whole;
    int stacked; /* whole has a leading block dimension */
    Py_ssize_t nb;
} kv_side;

/* One call's arguments as they are walked and checked.  Two sides: `flat`,
 * whose first block fixes the dimensions (universals, or operationals when
 * the other side is a block stack), and `other` (a block stack, or
 * operationals).  `arrays` holds flat's nb blocks, then other's (nb *
 * nchunks chunks, block-major, or nb operationals): the order of the
 * kernels' pointer table.  The blocks of a side given as one array are
 * views of it (kv_array_block), holding no reference. */
typedef struct {
    kv_conversion conversion;
    int to_flat; /* the bytes move into the flat side */
    kvbm_layout layout;
    kv_move_options options;
    const char *function;
    kv_state *state;
    kv_reader reader;
    kv_side flat, other;
    int other_is_blocks;
    int empty; /* flat[0] has no element: the call moves nothing */
    Py_ssize_t nb;
    int64_t nchunks;
    int64_t flat_shape[5];
    int flat_ndim;
    int64_t other_shape[3]; /* of every chunk, or of every operational */
    kv_array *arrays;
    Py_ssize_t parsed; /* arrays[0 .. parsed) hold borrows to release */
} kv_call;

static inline Py_ssize_t kv_call_count(const kv_call *call)
{
    return call->nb * (1 + (call->other_is_blocks ? call->nchunks : 1));
}

/* Whether arrays[i] is written by the call. */
static inline int kv_call_writes(const kv_call *call, Py_ssize_t i) { return (i < call->nb) == call->to_flat; }

/* The side arrays[i] belongs to, or NULL for a chunk of `blocks`. */
static inline const kv_side *kv_call_side(const kv_call *call, Py_ssize_t i)
{
    return i < call->nb ? &call->flat : call->other_is_blocks ? NULL : &call->other;
}

/* Where arrays[i] sits in the arguments. */
kv_path kv_call_path(const kv_call *call, Py_ssize_t i);

/* Runs a call whose arrays are all read and checked: places them (one
 * device, pinned or device memory), refuses aliasing, tells the
 * destinations' frameworks, and moves the bytes with the layout kernel, the
 * copy backends or the CPU.  Returns 0, or -1 with an exception. */
int kv_convert_run(kv_call *call);

#endif /* KVBM_CONVERT_RUN_H */
