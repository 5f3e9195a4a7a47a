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
    int torch_written; /* a torch tensor read to be written: kv_arrays_written bumps its version counter */
    PyObject *owner;  /* strong reference that keeps the borrow valid (NULL for a kv_array_block view) */
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

/* The same in place of the exception being raised by Python code the
 * argument ran (an __index__, a producer's __dlpack_device__): its type
 * and message are appended, and it becomes the new one's __cause__.
 * MemoryError and exceptions that are not Exceptions (KeyboardInterrupt)
 * are left as they are.  Returns -1. */
int kv_path_error_from(PyObject *type, const kv_path *path, const char *format, ...);

/* True when obj offers one of the array protocols above (lists and tuples
 * never do). */
int kv_is_array(PyObject *obj);

/* The names and per-type facts that reading arrays needs, made once per
 * module (they live in its state, state.h), not once per array. */
enum {
    KV_NAME_DLPACK,
    KV_NAME_DLPACK_DEVICE,
    KV_NAME_CUDA_ARRAY_INTERFACE,
    KV_NAME_ARRAY_INTERFACE,
    KV_NAME_EXCHANGE_API,
    KV_NAME_DEVICE,
    KV_NAME_IS_NEG,
    KV_NAME_IS_CONJ,
    KV_NAME_REQUIRES_GRAD,
    KV_NAME_TYPESTR,
    KV_NAME_SHAPE,
    KV_NAME_STRIDES,
    KV_NAME_DATA,
    KV_NAME_MASK,
    KV_NAME_STREAM,
    KV_NAME_TORCH,
    KV_NAME_TENSOR,
    KV_NAME_COUNT
};

/* What is known of a type whose instances were read: checked once, since
 * asking a type costs attribute lookups (an AttributeError for most), far
 * more than reading an array. */
typedef struct {
    PyTypeObject *type; /* strong reference, so that its address is not reused while cached; NULL: free */
    const struct DLPackExchangeAPI *exchange; /* its DLPack C exchange API, or NULL */
    /* For torch.Tensor and its subclasses, what the type has as is_neg and
     * is_conj (strong references, called with the tensor), else NULL. */
    PyObject *is_neg, *is_conj;
} kv_type_facts;

#define KV_TYPES_CACHED 8

typedef struct {
    PyObject *names[KV_NAME_COUNT]; /* interned */
    PyObject *dlpack_keywords;      /* ("stream", "max_version") */
    PyObject *stream_keyword;       /* ("stream",) */
    PyObject *max_version;          /* (1, 3) */
    PyObject *increment_version;    /* torch.autograd.graph.increment_version, found on first need (None: absent) */
    kv_type_facts types[KV_TYPES_CACHED]; /* recently seen types, recycled in turn */
    int next_type;
} kv_protocols;

int kv_protocols_init(kv_protocols *p);   /* 0, or -1 with an exception */
int kv_protocols_traverse(kv_protocols *p, visitproc visit, void *arg);
void kv_protocols_clear(kv_protocols *p);

/* How one call reads its arrays: the module's names and the value passed as
 * the stream argument of __dlpack__ for CUDA arrays (the consumer's stream,
 * in DLPack's encoding).  `protocols` NULL (a caller without the module
 * state) makes the names for each array, which costs about a microsecond
 * more. */
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

/* kv_array_read (for reading) and kv_array_keep for callers not handed the
 * module's state: the state is looked up in sys.modules (kv_find_state). */
int kv_array_from_object(PyObject *obj, const kv_path *path, PyObject *dlpack_stream, kv_array *out);
int kv_array_keep_from_object(PyObject *obj, const kv_path *path, PyObject *dlpack_stream, kv_array *out);

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
