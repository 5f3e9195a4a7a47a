/* The layout conversions between block stacks, universal blocks and
 * operational blocks: argument walking, validation and dispatch to the CPU
 * or the GPU. */
#ifndef KVBM_CONVERT_H
#define KVBM_CONVERT_H

#include "convert_run.h"

/* Validates every argument, then moves the bytes, into the flat side when
 * `to_flat`, else out of it.  Each side but a block stack is a sequence of
 * arrays or one array (one block, or a stack with a leading nb dimension).
 * `layout`, `backend`, `num_ctas` and `stream` may be NULL (not given; see
 * options.h).  Nothing is written unless every check passes.  Returns 0, or
 * -1 with an exception set. */
int kv_convert(kv_state *state, kv_conversion conversion, int to_flat, PyObject *flat, PyObject *other,
               PyObject *layout, PyObject *backend, PyObject *num_ctas, PyObject *stream);

#endif /* KVBM_CONVERT_H */
