/* Borrowing arrays from Python objects: DLPack (versioned and legacy
 * capsules), __cuda_array_interface__ (versions 2 and 3),
 * __array_interface__ and the buffer protocol, in that order of preference. */
#ifndef KVBM_ARRAY_H
#define KVBM_ARRAY_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

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
    int has_stream;   /* the producer named its stream (CAI v3, the C exchange API) */
    intptr_t stream;  /* that stream */
    /* The producer's current_work_stream(device_type, device_id, &stream)
     * where it was read through the C exchange API, else NULL. */
    int (*current_work_stream)(int32_t, int32_t, void **);
    PyObject *owner;  /* strong reference that keeps the borrow valid */
    Py_buffer view;   /* buffer-protocol borrows only */
    int has_view;
} kv_array;

/* Where an array sits in the call's arguments, e.g. blocks[3][17]; formatted
 * only when an error is raised. */
typedef struct {
    const char *name;
    Py_ssize_t index[2];
    int depth;
} kv_path;

/* Writes "name[i][j]" into buf. */
void kv_path_format(const kv_path *path, char *buf, size_t size);

/* Raises `type` with the message prefixed by "path: ". Returns -1. */
int kv_path_error(PyObject *type, const kv_path *path, const char *format, ...);

/* True when obj offers one of the array protocols above. */
int kv_is_array(PyObject *obj);

/* Fills *out from obj.  `dlpack_stream` is the value passed as the stream
 * argument of __dlpack__ for CUDA arrays (the consumer's stream, in DLPack's
 * encoding).  Returns 0, or -1 with an exception set and *out holding
 * nothing to release. */
int kv_array_from_object(PyObject *obj, const kv_path *path, PyObject *dlpack_stream,
                         kv_array *out);

/* The same for an array kept past the call (PagedKVCache), whose memory
 * must stay alive for as long as it is kept, even if the caller's object is
 * later re-pointed at other memory: a torch tensor (an object with detach
 * and set_) is borrowed through a detached alias, which shares the storage
 * and keeps it when set_ or resize_ re-point the original.  Other producers
 * cannot re-point an array. */
int kv_array_keep_from_object(PyObject *obj, const kv_path *path, PyObject *dlpack_stream, kv_array *out);

void kv_array_release(kv_array *a);

/* True when the array is C-contiguous (strides of size-1 dimensions ignored;
 * an array without elements always is). */
int kv_array_is_contiguous(const kv_array *a);

/* The number of elements: 0 when any extent is 0, else their product, which
 * kv_array_from_object has checked fits in int64. */
int64_t kv_array_elements(const kv_array *a);

/* The same for dimensions first .. ndim - 1 only (a stack of contiguous
 * arrays along the leading dimensions). */
int kv_array_is_contiguous_from(const kv_array *a, int first);

/* Lists a's producer stream (CAI v3, or the DLPack C exchange API's current
 * stream) in streams[0 .. *count) unless it is there already. */
void kv_array_add_producer(const kv_array *a, intptr_t *streams, Py_ssize_t *count);

/* The stream a GPU call given stream=None runs on, as an operation of the
 * arrays' own framework would: the current stream on `device` of the first
 * array read through a C exchange API (torch: torch.cuda.current_stream(),
 * which `with torch.cuda.stream(s)` sets), else the stream the first device
 * array's producer named (CAI v3), else the legacy default stream (0).
 * Returns 0, or -1 with an exception. */
int kv_arrays_default_stream(const kv_array *arrays, Py_ssize_t count, int device, intptr_t *stream);

/* A readable name for an element type, e.g. "bfloat16", "raw2". */
const char *kv_dtype_name(kv_dtype dtype, char *buf, size_t size);

#endif /* KVBM_ARRAY_H */
