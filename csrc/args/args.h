/* Argument helpers shared by the entry points. */
#ifndef KVBM_ARGS_H
#define KVBM_ARGS_H

#include "array.h"

/* Reads a name argument: `value` must be a str equal, ignoring case, to one
 * of `names`; *out receives its index.  NULL (not given) means the name
 * `fallback`, the table's default (signatures.h).  TypeError or ValueError
 * (listing the valid names), naming `argument`. */
int kv_parse_name(PyObject *value, const char *argument, const char *const *names, int count, const char *fallback,
                  int *out);

/* The value of an int argument as an int (new reference): an int or any
 * object with __index__ (NumPy and torch integer scalars); a bool is
 * refused, as everywhere an int is taken.  NULL with TypeError naming
 * `path`, saying what was `expected` (an __index__ that raises becomes
 * that TypeError's cause). */
PyObject *kv_index(PyObject *obj, const kv_path *path, const char *expected);

/* kv_index, then a range check: ValueError "expected an int from minimum to
 * maximum" naming `path`. */
int kv_int64(PyObject *obj, const kv_path *path, const char *expected, int64_t minimum, int64_t maximum, int64_t *out);

/* The same from 0 to 2**64 - 1 (addresses and sizes). */
int kv_uint64(PyObject *obj, const kv_path *path, uint64_t *out);

/* Reads an int argument `name` from `minimum` to `maximum` as kv_int64
 * does: absent (NULL) gives `fallback`, and so does None where
 * `allow_none`. */
int kv_parse_int(PyObject *obj, const char *name, int64_t minimum, int64_t maximum, int64_t fallback, int allow_none,
                 int64_t *out);

/* A tuple holding the items of a sequence argument, taken once (new
 * reference).  Reading an array runs Python code (its protocols), which may
 * change the caller's list or drop the item being read; the tuple keeps what
 * the call sees, and every item alive, until the call ends.  Arrays and
 * strings are refused even though they are iterable.  TypeError naming
 * `path`, saying what was `expected`. */
PyObject *kv_as_sequence(PyObject *obj, const kv_path *path, const char *expected);

/* An argument that is one array or a sequence of arrays, snapshotted as
 * kv_as_sequence does: a tuple of the items, or of the one array, when
 * *single is set.  New reference, or NULL with TypeError naming `path`. */
PyObject *kv_array_items(PyObject *obj, const kv_path *path, const char *expected, int *single);

/* "(16, 8, 128)", or "(5,)" for one dimension. */
void kv_format_shape(const int64_t *shape, int ndim, char *buf, size_t size);

#endif /* KVBM_ARGS_H */
