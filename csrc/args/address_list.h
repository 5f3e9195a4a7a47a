/* Lists of ints read from Python: the address and size lists of
 * vectorized_copy and memcpy_batch (a sequence of ints, or a 1-D
 * int64/uint64 array), and the block ids of PagedKVCache (a sequence of ints,
 * or a 1-D int32/int64 array), on the host or the device.  An int is an int
 * or any object with __index__ (NumPy and torch integer scalars), never a
 * bool. */
#ifndef KVBM_ADDRESS_LIST_H
#define KVBM_ADDRESS_LIST_H

#include "array.h"

typedef enum {
    KV_LIST_ADDRESSES, /* non-negative, up to 2**64 - 1; int64/uint64 arrays */
    KV_LIST_SIZES,     /* the same, or one size for every entry: an int or a 0-d integer array */
    KV_LIST_BLOCK_IDS, /* any int64 (the caller checks the range); int32/int64 arrays */
} kv_list_kind;

typedef struct {
    Py_ssize_t count;
    uint64_t *values; /* host values (owned; block ids as int64), or the device array's data when on_device */
    int one_value;    /* KV_LIST_SIZES given one size: `value`, for any count (values is NULL) */
    uint64_t value;
    int on_device;
    int int32;      /* the device array holds int32 block ids */
    int device_id;  /* of a device array */
    kv_array array; /* the borrowed device array */
} kv_address_list;

/* Reads `obj` into *out; `name` is the argument's name for errors.  Host
 * values are copied and checked as `kind` says; a device array is borrowed
 * (refused with ValueError unless `allow_device`), its values unread.
 * Returns 0, or -1 with TypeError/ValueError and nothing to release. */
int kv_address_list_read(const kv_reader *reader, PyObject *obj, const char *name, kv_list_kind kind, int allow_device,
                         kv_address_list *out);

void kv_address_list_release(kv_address_list *list);

#endif /* KVBM_ADDRESS_LIST_H */
