/* The address and size lists of vectorized_copy and memcpy_batch: a
 * sequence of ints, or a 1-D int64/uint64 array on the host or the device. */
#ifndef KVBM_ADDRESS_LIST_H
#define KVBM_ADDRESS_LIST_H

#include "array.h"

typedef struct {
    Py_ssize_t count;
    uint64_t *values; /* host values (owned), or the device array's data when on_device */
    int on_device;
    int device_id;    /* of a device array */
    int has_stream;   /* a CAI v3 device array named its producer's stream */
    intptr_t stream;
    kv_array array;   /* the borrowed device array */
} kv_address_list;

/* Reads `obj` into *out; `name` is the argument's name for errors.  Host
 * values are copied and checked to be non-negative ints; a device array is
 * borrowed (refused with ValueError unless `allow_device`), its values
 * unread.  Returns 0, or -1 with TypeError/ValueError and nothing to
 * release. */
int kv_address_list_from_object(PyObject *obj, const char *name, int allow_device, PyObject *dlpack_stream,
                                kv_address_list *out);

void kv_address_list_release(kv_address_list *list);

#endif /* KVBM_ADDRESS_LIST_H */
