/* Arrays that grow by doubling, for lists whose length a call learns as it
 * goes (the allocations a check meets, the producer streams of a call). */
#ifndef KVBM_GROW_H
#define KVBM_GROW_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

/* Room for one more item in `items`, which holds `count` of *capacity:
 * `items` itself while there is room, else the array reallocated to twice
 * the capacity (`first` items the first time), *capacity updated.  NULL
 * with MemoryError, `items` then untouched. */
static inline void *kv_room_for_one(void *items, Py_ssize_t count, Py_ssize_t *capacity, Py_ssize_t first,
                                    size_t item_size)
{
    if (count < *capacity)
        return items;
    const Py_ssize_t doubled = *capacity > 0 ? 2 * *capacity : first;
    void *grown = PyMem_Realloc(items, (size_t)doubled * item_size);
    if (grown == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    *capacity = doubled;
    return grown;
}

#endif /* KVBM_GROW_H */
