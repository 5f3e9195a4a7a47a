/* The protocol readers behind kv_array_read (array_read.c), one file per
 * family: dlpack_read.c (DLPack capsules and the C exchange API),
 * interface_read.c (the typestr interfaces and the buffer protocol), and
 * torch.c (what torch tensors need beyond their protocol).  Each fills a
 * cleared kv_array (everything but what kv_array_read checks afterwards)
 * and returns 0, or -1 with an exception naming `path`. */
#ifndef KVBM_READERS_H
#define KVBM_READERS_H

#include "array.h"
#include "dlpack.h"

/* obj.__dlpack__(), asked of the array's device. */
int kv_from_dlpack(const kv_reader *reader, PyObject *obj, const kv_path *path, kv_array *out);

/* Through the producer's C function; 1 when the producer cannot describe
 * obj (the Python protocols then try). */
int kv_from_exchange(PyObject *obj, const DLPackExchangeAPI *api, const kv_path *path, kv_array *out);

/* __cuda_array_interface__ or __array_interface__ (`name`, a KV_NAME_*). */
int kv_from_interface(const kv_protocols *p, PyObject *obj, const kv_path *path, int name, kv_array *out);

int kv_from_buffer(PyObject *obj, const kv_path *path, kv_array *out);

/* For a torch tensor (facts->is_neg set): refuses conjugate and negative
 * views and, where `write`, a tensor that requires grad; marks a written one
 * for kv_arrays_written. */
int kv_check_torch(const kv_protocols *p, PyObject *obj, const kv_type_facts *facts, const kv_path *path, int write,
                   kv_array *out);

#endif /* KVBM_READERS_H */
