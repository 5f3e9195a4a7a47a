/* The raw copies of vectorized_copy and memcpy_batch: address lists read,
 * checked and copied as they are. */
#ifndef KVBM_COPY_H
#define KVBM_COPY_H

#include "state.h"

/* The Python functions; each validates everything before copying.  Return
 * 0, or -1 with an exception set. */
int kv_vectorized_copy(kv_state *state, PyObject *src, PyObject *dst, PyObject *sizes, PyObject *stream);
int kv_memcpy_batch(kv_state *state, PyObject *src, PyObject *dst, PyObject *sizes, PyObject *mode, PyObject *stream);

#endif /* KVBM_COPY_H */
