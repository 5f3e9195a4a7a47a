/* Borrowing arrays from Python objects: DLPack (versioned and legacy
 * capsules), __cuda_array_interface__ (versions 2 and 3),
 * __array_interface__ and the buffer protocol, in that order of preference.
 * array.c answers what can be asked of a kv_array; array_read.c reads one
 * (kv_array_read, kv_array_keep) through the readers of readers.h, and
 * torch.c tells torch about the writes. */
#ifndef KVBM_ARRAY_H
#define KVBM_ARRAY_H

#include <stdint.h>

#include "errors.h"
#include "protocols.h"

#define KV_MAX_NDIM 8

/* Where an array lives, as far as its protocol tells. */
typedef enum {
    KV_HOST,        /* host memory, pinned or not (DLPack CPU, buffers, __array_interface__) */
    KV_HOST_PINNED, /* page-locked host memory (DLPack CUDAHost, or found by the GPU code) */
    KV_DEVICE,      /* CUDA device memory; device_id < 0 until the GPU code looks it up (CAI) */
} kv_place;

/* Element type: a DLPack type code and width; KV_RAW_CODE for typestr 'V'
 * (raw bytes, which is how torch's CAI exports bf16 and fp8). */
#define KV_RAW_CODE 255
typedef struct {
    uint8_t code;
    uint8_t bits;
} kv_dtype;

typedef struct {
    char *data;
    int ndim;
    int64_t shape[KV_MAX_NDIM];
    int64_t strides[KV_MAX_NDIM]; /* bytes */
    int64_t itemsize;
    kv_dtype dtype;
    kv_place place;
    int device_id;
    int readonly;
    int has_stream;  /* the producer named its stream (CAI v3, the C exchange API) */
    intptr_t stream; /* that stream */
    /* The producer's current_work_stream(device_type, device_id, &stream)
     * where it was read through the C exchange API, else NULL. */
    int (*current_work_stream)(int32_t, int32_t, void **);
    /* A torch tensor read to be written (strong reference): kv_arrays_written
     * bumps its version counter.  Not `owner`, which is a capsule when the
     * tensor was read through __dlpack__. */
    PyObject *written_tensor;
    PyObject *owner; /* strong reference that keeps the borrow valid (NULL for a kv_array_block view) */
    Py_buffer view;  /* buffer-protocol borrows only */
    int has_view;
} kv_array;

/* True when obj offers one of the array protocols above (lists and tuples
 * never do). */
int kv_is_array(PyObject *obj);

/* How one call reads its arrays: the module's names (its state's) and the
 * value passed as the stream argument of __dlpack__ for CUDA arrays (the
 * consumer's stream, in DLPack's encoding). */
typedef struct {
    kv_protocols *protocols;
    PyObject *dlpack_stream;
} kv_reader;

/* Fills *out from obj.  `write`: the call writes the array, which must then
 * be writable (ValueError when read-only, or for a torch tensor that
 * requires grad: autograd could not see the write).  torch tensors with the
 * conjugate or negative bit set are refused (ValueError): their bytes are
 * not their values, and neither the C exchange API nor torch's __dlpack__
 * applies the bit.  A device neither DLPack nor kvbm_ext can read (torch's
 * meta) is a ValueError naming it.  Returns 0, or -1 with an exception set
 * and *out holding nothing to release. */
int kv_array_read(const kv_reader *reader, PyObject *obj, const kv_path *path, int write, kv_array *out);

/* The same, for reading, of an array kept past the call (PagedKVCache),
 * whose memory must stay alive for as long as it is kept, even if the
 * caller's object is later re-pointed at other memory: a torch tensor (an
 * object with detach and set_) is borrowed through a detached alias, which
 * shares the storage and keeps it when set_ or resize_ re-point the
 * original.  Other producers cannot re-point an array. */
int kv_array_keep(const kv_reader *reader, PyObject *obj, const kv_path *path, kv_array *out);

/* The current stream of the producer of `a` (read through DLPack's C
 * exchange API: a->current_work_stream is set) on a device.  Returns 0, or
 * -1 with an exception, also where the producer broke the API's contract
 * (failed without an exception, or set one and returned success), so that
 * no Python code runs with an exception set. */
int kv_array_current_stream(const kv_array *a, int32_t device_type, int32_t device_id, void **stream);

/* Block `b` of a stack (an array whose leading dimension counts blocks): a
 * view holding no reference, valid while `stack` is borrowed. */
void kv_array_block(const kv_array *stack, int64_t b, kv_array *out);

/* Tells the framework of every array of arrays[0 .. count) read with
 * `write` that it is about to be written, as an in-place operation of its
 * own would: torch tensors get their version counters bumped (through
 * torch.autograd.graph.increment_version), so that autograd notices a
 * tensor it saved being overwritten.  Call it after every check and before
 * the write.  Returns 0, or -1 with an exception. */
int kv_arrays_written(kv_protocols *protocols, const kv_array *arrays, Py_ssize_t count);

/* For an array kept to be written later (PagedKVCache's layers): the
 * tensor whose version counter a write of obj's memory must bump, as a new
 * reference.  A torch view shares its base's counter, so that is the base
 * (layers that are views of one buffer then need one bump, not one each);
 * another torch tensor is its own.  Py_None where there is nothing to tell
 * torch: another framework's array, or an inference tensor, which has no
 * counter and which autograd can never have saved, so that no write of it
 * can change a gradient.  NULL with an exception. */
PyObject *kv_torch_counter_owner(kv_protocols *protocols, PyObject *obj);

/* For a torch tensor kept and written now (a layer whose counter owner is
 * not None): what kv_array_read checks of a destination that may have
 * changed since, requires_grad, asked of `obj` as given (the detached alias
 * kv_array_keep reads never requires grad).  Returns 0, or -1 with an
 * exception naming `path`. */
int kv_torch_check_destination(const kv_protocols *protocols, PyObject *obj, const kv_path *path);

/* Bumps the version counters of the torch tensors `tensors` holds (a
 * sequence), as kv_arrays_written does.  Returns 0, or -1 with an
 * exception. */
int kv_torch_written(kv_protocols *protocols, PyObject *tensors);

void kv_array_release(kv_array *a);

/* True when the array is C-contiguous (strides of size-1 dimensions ignored;
 * an array without elements always is). */
int kv_array_is_contiguous(const kv_array *a);

/* The number of elements: 0 when any extent is 0, else their product, which
 * kv_array_read has checked fits in int64. */
int64_t kv_array_elements(const kv_array *a);

/* The same for dimensions first .. ndim - 1 only (a stack of contiguous
 * arrays along the leading dimensions). */
int kv_array_is_contiguous_from(const kv_array *a, int first);

/* The layout moves take elements of 1, 2, 4 or 8 bytes: 0, or -1 with
 * TypeError naming `path`. */
int kv_check_itemsize(const kv_array *a, const kv_path *path);

/* A readable name for an element type, e.g. "bfloat16", "raw2". */
const char *kv_dtype_name(kv_dtype dtype, char *buf, size_t size);

/* Steps that reading an array takes whatever its protocol (array_read.c
 * and the readers of readers.h): an empty array to fill (host memory, no
 * device); compact row-major strides from the shape; a dimension count
 * refused beyond KV_MAX_NDIM (ValueError naming `path`). */
void kv_array_clear(kv_array *out);
void kv_set_compact_strides(kv_array *a);
int kv_check_ndim(const kv_path *path, Py_ssize_t ndim);

/* True when some extent is 0 (the array has no element, whatever the
 * other extents). */
int kv_array_has_empty_dimension(const kv_array *a);

#endif /* KVBM_ARRAY_H */
