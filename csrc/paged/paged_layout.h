/* The layout string of kvbm_ext.PagedKVCache: one letter per logical
 * dimension of each array, l layer, k K/V, b block, t token, h head, d head
 * dim, and letters grouped in parentheses for one array dimension that is
 * their row-major product: "(bt)hd" for an engine's flat token dimension
 * [num_blocks * block_size, nh, hd], "bth(kd)" for K and V packed in the
 * last dimension.  In a group every letter's size is known but one's, which
 * takes the rest of the dimension: t's is block_size, k's is 2. */
#ifndef KVBM_PAGED_LAYOUT_H
#define KVBM_PAGED_LAYOUT_H

#include "array.h"

/* The dimension letters. */
enum {
    DIM_L,
    DIM_K,
    DIM_B,
    DIM_T,
    DIM_H,
    DIM_D,
    DIM_COUNT
};

/* "lkbthd", and each letter's name ("layer", ...), for errors. */
extern const char KV_LAYOUT_LETTERS[DIM_COUNT + 1];
extern const char *const KV_LAYOUT_NAMES[DIM_COUNT];

typedef struct {
    int ndim;                          /* array dimensions it names */
    int dim[DIM_COUNT];                /* the array dimension of each letter, -1 when absent */
    int letters[KV_MAX_NDIM];          /* letters in each array dimension */
    int group[KV_MAX_NDIM][DIM_COUNT]; /* each dimension's letters, outermost first */
} kv_layout;

/* Parses `text` (letters in either case): ValueError or TypeError naming
 * "layout" for anything but a str of known letters, each once, with b, t
 * and d, and groups that neither nest nor are empty.  Returns 0 or -1. */
int kv_layout_parse(PyObject *text, kv_layout *out);

/* The layout in lower case, groups in parentheses (new reference). */
PyObject *kv_layout_text(const kv_layout *layout);

/* Array dimension d as the layout spells it ("b", "(kd)"), for errors. */
void kv_layout_dim_text(const kv_layout *layout, int d, char *buf, size_t size);

/* Each letter's size and stride in bytes (1 and 0 for an absent letter)
 * from the shape and strides of `a`, whose dimension count has been
 * checked.  block_size (0: not given) is t's size in a group, and must
 * match a t of its own.  ValueError naming `path` (or block_size) when a
 * group's dimension does not divide.  Returns 0 or -1. */
int kv_layout_geometry(const kv_layout *layout, const kv_array *a, int64_t block_size, const kv_path *path,
                       int64_t size[DIM_COUNT], int64_t stride[DIM_COUNT]);

#endif /* KVBM_PAGED_LAYOUT_H */
