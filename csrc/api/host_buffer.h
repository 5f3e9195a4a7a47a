/* kvbm_ext.HostBuffer, the array kvbm_ext.pinned_empty returns: host memory
 * (host_pool.h), page-locked where a GPU can be reached, exported without a
 * copy through DLPack (host_dlpack.c), the buffer protocol and
 * __array_interface__ (host_buffer.c).  pinned_empty itself: host_new.c. */
#ifndef KVBM_HOST_BUFFER_H
#define KVBM_HOST_BUFFER_H

#include "array.h"
#include "host_pool.h"
#include "signatures.h"

/* An element type a HostBuffer may hold, with the spellings of each
 * protocol.  NumPy's buffer and interface formats have no bfloat16 or
 * float8: those export their bits as unsigned integers. */
typedef struct {
    const char *name; /* torch's and NumPy's name, e.g. "bfloat16" */
    kv_dtype dtype;   /* DLPack type code and bits */
    const char *typestr;
    const char *format;
} kv_host_dtype;

typedef struct {
    PyObject_HEAD kv_host_pool *pool; /* NULL once this object's hold is given up */
    char *data;
    int ndim;
    Py_ssize_t shape[KV_MAX_NDIM], strides[KV_MAX_NDIM]; /* strides in bytes, compact */
    int64_t nbytes;
    const kv_host_dtype *dtype;
    int pinned;
    PyObject *registrations; /* ((offset, nbytes), ...) of the pieces registered; () when not pinned */
    int numa_node;           /* -1: not placed */
    kv_huge_pages huge_pages;
    int threads;
    double seconds;
    int closed;
    PyObject *shared;          /* the shared region's name (a str), or None */
    int created;               /* this process made the memory (not so for a shared region it joined) */
    Py_ssize_t buffer_exports; /* live buffer-protocol views */
    /* __array_interface__ was read: a bare address went out, whose holder
     * keeps only this object alive, so the memory lives as long as it does. */
    int address_given;
} kv_host_buffer;

/* What pinned_empty was asked for (host_args.c), read and checked before
 * anything is mapped. */
#define KV_CURRENT_DEVICE (-1)
typedef struct {
    int ndim;
    int64_t shape[KV_MAX_NDIM];
    int64_t nbytes;
    const kv_host_dtype *dtype;
    int64_t numa_node; /* -1: not named */
    int64_t threads;
    int huge;   /* a kv_huge_pages */
    int device; /* KV_CURRENT_DEVICE or an index */
    int is_shared;
    char shared[KV_SHARED_NAME_MAX + 1]; /* the region's name, without '/' */
} kv_pool_request;

/* Reads pinned_empty's arguments, as kv_parse_arguments left them (NULL
 * where not given).  Returns 0, or -1 with an exception naming the
 * argument. */
int kv_read_pool_request(const kv_pinned_empty_args *a, kv_pool_request *r);

/* A shared region's name, `argument`: a str of 1 to KV_SHARED_NAME_MAX
 * bytes in UTF-8, without '/' or NUL, not "." or "..", copied into `out`
 * (KV_SHARED_NAME_MAX + 1 bytes); None too where `allow_none` (*given
 * then 0).  Returns 0, or -1 with an exception naming the argument. */
int kv_read_shared_name(PyObject *value, const char *argument, int allow_none, int *given, char *out);

/* Creates the HostBuffer type and adds it to `module`; *type receives a
 * strong reference (the module state's).  Returns 0, or -1 with an
 * exception. */
int kv_host_buffer_add_type(PyObject *module, PyObject **type);

/* A new HostBuffer of `type` owning `pool` (which it takes over; on
 * failure, NULL with an exception, the pool still the caller's). */
kv_host_buffer *kv_host_buffer_new(PyTypeObject *type, kv_host_pool *pool);

/* pinned_empty(...) (host_new.c), a module function. */
PyObject *kv_pinned_empty(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
extern const char kv_pinned_empty_doc[];

/* unlink_shared(name) (host_unlink.c), a module function. */
PyObject *kv_unlink_shared(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
extern const char kv_unlink_shared_doc[];

/* Sets OSError, of the subclass `error` makes (PermissionError, ...), with
 * errno and `message` (a str, stolen; NULL: an exception is set).  Returns
 * NULL. */
PyObject *kv_raise_os_error(int error, PyObject *message);

/* The DLPack methods of HostBuffer (host_dlpack.c). */
PyObject *kv_host_buffer_dlpack(kv_host_buffer *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames);
PyObject *kv_host_buffer_dlpack_device(kv_host_buffer *self, PyObject *unused);
extern const char kv_host_buffer_dlpack_doc[];
extern const char kv_host_buffer_dlpack_device_doc[];

/* 0, or -1 with BufferError when the buffer is closed (`what` is the
 * refused export). */
int kv_host_buffer_check_open(const kv_host_buffer *self, const char *what);

#endif /* KVBM_HOST_BUFFER_H */
