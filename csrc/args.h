/* Argument helpers shared by the entry points. */
#ifndef KVBM_ARGS_H
#define KVBM_ARGS_H

#include "array.h"

/* Reads a name argument: `value` must be a str equal, ignoring case, to one
 * of `names`; *out receives its index.  NULL (not given) means `fallback`.
 * TypeError or ValueError (listing the valid names), naming `argument`. */
int kv_parse_name(PyObject *value, const char *argument, const char *const *names, int count, int fallback, int *out);

/* Reads an int argument from `minimum` to `maximum`: absent (NULL) gives
 * `fallback`, and so does None where `allow_none`.  TypeError (bool
 * included) or ValueError naming `name`. */
int kv_parse_int(PyObject *obj, const char *name, int64_t minimum, int64_t maximum, int64_t fallback, int allow_none,
                 int64_t *out);

/* A tuple holding the items of a sequence argument, taken once (new
 * reference).  Reading an array runs Python code (its protocols), which may
 * change the caller's list or drop the item being read; the tuple keeps what
 * the call sees, and every item alive, until the call ends.  Arrays and
 * strings are refused even though they are iterable.  TypeError naming
 * `path`, saying what was `expected`. */
PyObject *kv_as_sequence(PyObject *obj, const kv_path *path, const char *expected);

/* "(16, 8, 128)", or "(5,)" for one dimension. */
void kv_format_shape(const int64_t *shape, int ndim, char *buf, size_t size);

#endif /* KVBM_ARGS_H */
