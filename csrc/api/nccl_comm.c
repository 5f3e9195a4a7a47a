/* kvbm_ext._C._NcclComm: the NCCL communicator a TorchTransport opens over
 * its process group for a Resharder's messages (kvbm_ext/_transport.py),
 * over gpu.h's kv_nccl.  Private: its arguments come from that transport,
 * so they are plain ints, bytes and tuples, read without running Python
 * code; a wrong one is still an exception, never a crash. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "nccl_comm.h"

#include "gpu.h"

typedef struct {
    PyObject_HEAD kv_nccl *comm;
    int nranks, rank, device;
} nccl_comm;

/* A plain int in [low, high], or -1 with ValueError / TypeError naming `what`. */
static int read_int(PyObject *value, long long low, long long high, const char *what, long long *out)
{
    if (!PyLong_CheckExact(value)) {
        PyErr_Format(PyExc_TypeError, "%s: expected an int, got %.100s", what, Py_TYPE(value)->tp_name);
        return -1;
    }
    const long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < low || v > high) {
        PyErr_Format(PyExc_ValueError, "%s: %lld is outside [%lld, %lld]", what, v, low, high);
        return -1;
    }
    *out = v;
    return 0;
}

static PyObject *comm_new(PyTypeObject *type, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"unique_id", "nranks", "rank", "device", NULL};
    Py_buffer id;
    int nranks, rank, device;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*iii:_NcclComm", names, &id, &nranks, &rank, &device))
        return NULL;
    const int good_id = id.len == KV_NCCL_ID_BYTES;
    unsigned char unique[KV_NCCL_ID_BYTES];
    if (good_id)
        memcpy(unique, id.buf, KV_NCCL_ID_BYTES);
    PyBuffer_Release(&id);
    if (!good_id)
        return PyErr_Format(PyExc_ValueError, "unique_id: expected %d bytes", KV_NCCL_ID_BYTES);
    if (nranks < 1 || rank < 0 || rank >= nranks || device < 0)
        return PyErr_Format(PyExc_ValueError,
                            "rank %d of %d ranks on device %d: expected 0 <= rank < nranks and "
                            "a device >= 0",
                            rank, nranks, device);
    nccl_comm *self = (nccl_comm *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->nranks = nranks, self->rank = rank, self->device = device;
    self->comm = kv_nccl_open(unique, nranks, rank, device);
    if (self->comm == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void comm_dealloc(PyObject *op)
{
    nccl_comm *self = (nccl_comm *)op;
    PyTypeObject *type = Py_TYPE(op);
    kv_nccl_close(self->comm);
    type->tp_free(op);
    Py_DECREF(type);
}

static PyObject *comm_load(PyObject *unused, PyObject *noargs)
{
    (void)unused, (void)noargs;
    if (kv_nccl_load() < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *comm_unique_id(PyObject *unused, PyObject *noargs)
{
    (void)unused, (void)noargs;
    unsigned char id[KV_NCCL_ID_BYTES];
    if (kv_nccl_unique_id(id) < 0)
        return NULL;
    return PyBytes_FromStringAndSize((const char *)id, KV_NCCL_ID_BYTES);
}

/* One operation of post(): (peer, send, address, bytes). */
static int read_op(const nccl_comm *self, PyObject *item, Py_ssize_t i, kv_nccl_op *op)
{
    long long peer, send, address, bytes;
    if (!PyTuple_CheckExact(item) || PyTuple_GET_SIZE(item) != 4) {
        PyErr_Format(PyExc_TypeError, "ops[%zd]: expected a tuple (peer, send, address, bytes)", i);
        return -1;
    }
    if (read_int(PyTuple_GET_ITEM(item, 0), 0, self->nranks - 1, "ops[i][0] (peer)", &peer) < 0
        || read_int(PyTuple_GET_ITEM(item, 1), 0, 1, "ops[i][1] (send)", &send) < 0
        || read_int(PyTuple_GET_ITEM(item, 2), 1, LLONG_MAX, "ops[i][2] (address)", &address) < 0
        || read_int(PyTuple_GET_ITEM(item, 3), 0, LLONG_MAX, "ops[i][3] (bytes)", &bytes) < 0)
        return -1;
    if (peer == self->rank) {
        PyErr_Format(PyExc_ValueError, "ops[%zd]: peer %lld is this rank", i, peer);
        return -1;
    }
    *op = (kv_nccl_op){(int)peer, (int)send, (uintptr_t)address, (size_t)bytes};
    return 0;
}

/* Room for `n` items of `size` bytes: `on_stack`, an array of ON_STACK such items, where they
 * fit (a call with a few peers allocates nothing), else a new heap array; NULL with MemoryError.
 * free_items gives it back. */
enum {
    ON_STACK = 16
};

static void *items_for(void *on_stack, Py_ssize_t n, size_t size)
{
    if (n <= ON_STACK)
        return on_stack;
    void *heap = PyMem_Calloc((size_t)n, size);
    if (heap == NULL)
        PyErr_NoMemory();
    return heap;
}

static void free_items(void *items, void *on_stack)
{
    if (items != on_stack)
        PyMem_Free(items);
}

static PyObject *comm_post(PyObject *op, PyObject *args)
{
    nccl_comm *self = (nccl_comm *)op;
    PyObject *stream_obj, *ops_obj;
    long long stream;
    kv_nccl_op on_stack[ON_STACK];
    if (!PyArg_ParseTuple(args, "OO!:post", &stream_obj, &PyTuple_Type, &ops_obj)
        || read_int(stream_obj, 0, LLONG_MAX, "stream", &stream) < 0)
        return NULL;
    const Py_ssize_t n = PyTuple_GET_SIZE(ops_obj);
    kv_nccl_op *ops = items_for(on_stack, n, sizeof *ops);
    if (ops == NULL)
        return NULL;
    int rc = 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++)
        rc = read_op(self, PyTuple_GET_ITEM(ops_obj, i), i, &ops[i]);
    if (rc == 0)
        rc = kv_nccl_post(self->comm, (intptr_t)stream, ops, n);
    free_items(ops, on_stack);
    if (rc < 0)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *comm_swap(PyObject *op, PyObject *args)
{
    nccl_comm *self = (nccl_comm *)op;
    PyObject *peers_obj, *records;
    double timeout;
    if (!PyArg_ParseTuple(args, "O!O!d:swap", &PyTuple_Type, &peers_obj, &PyBytes_Type, &records, &timeout))
        return NULL;
    const Py_ssize_t n = PyTuple_GET_SIZE(peers_obj), total = PyBytes_GET_SIZE(records);
    /* One record per peer, all of one size, which both ranks of a pair must post alike. */
    const Py_ssize_t R = n > 0 ? total / n : 0;
    if (n < 1 || n > self->nranks || R < 1 || R > KV_NCCL_RECORD_MAX || R * n != total || !(timeout > 0))
        return PyErr_Format(PyExc_ValueError,
                            "swap: expected 1 to %d peers, records of 1 to %d bytes each (%zd bytes for %zd "
                            "peers) and a timeout above 0",
                            self->nranks, KV_NCCL_RECORD_MAX, total, n);
    int on_stack[ON_STACK];
    int *peers = items_for(on_stack, n, sizeof *peers);
    if (peers == NULL)
        return NULL;
    PyObject *received = PyBytes_FromStringAndSize(NULL, total);
    int rc = received == NULL ? -1 : 0;
    for (Py_ssize_t i = 0; i < n && rc == 0; i++) {
        long long peer;
        rc = read_int(PyTuple_GET_ITEM(peers_obj, i), 0, self->nranks - 1, "peers[i]", &peer);
        peers[i] = (int)peer;
    }
    if (rc == 0)
        rc = kv_nccl_swap(self->comm, peers, n, (size_t)R, (const unsigned char *)PyBytes_AS_STRING(records),
                          (unsigned char *)PyBytes_AS_STRING(received), timeout);
    free_items(peers, on_stack);
    if (rc < 0)
        Py_CLEAR(received);
    return received;
}

static PyObject *comm_abort(PyObject *op, PyObject *noargs)
{
    (void)noargs;
    kv_nccl_abort(((nccl_comm *)op)->comm);
    Py_RETURN_NONE;
}

static PyMethodDef comm_methods[] = {
    {"load", comm_load, METH_NOARGS | METH_STATIC,
     "load(): load NCCL (libnccl.so.2) now; RuntimeError saying why where it cannot be."},
    {"unique_id", comm_unique_id, METH_NOARGS | METH_STATIC,
     "unique_id() -> bytes: a new communicator's id, made on one rank and given to all."},
    {"post", comm_post, METH_VARARGS,
     "post(stream, ops): enqueue ops, a tuple of (peer, send, address, bytes), on the int cudaStream_t "
     "`stream` as one NCCL group."},
    {"swap", comm_swap, METH_VARARGS,
     "swap(peers, records, timeout) -> bytes: send records[i] (len(records) // len(peers) bytes each, at most "
     "_NCCL_RECORD_MAX) to peers[i], receive one of that size from each, and wait for them on the host; TimeoutError "
     "after `timeout` seconds (the communicator is then "
     "aborted)."},
    {"abort", comm_abort, METH_NOARGS, "abort(): end every pending operation; every later call raises."},
    {NULL, NULL, 0, NULL},
};

static PyObject *comm_aborted(PyObject *op, void *closure)
{
    (void)closure;
    return PyBool_FromLong(kv_nccl_aborted(((nccl_comm *)op)->comm));
}

static PyGetSetDef comm_getset[] = {
    {"aborted", comm_aborted, NULL, "Whether abort() ran, or a swap failed or timed out.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyType_Slot comm_slots[] = {
    {Py_tp_doc, (void *)"_NcclComm(unique_id, nranks, rank, device): an NCCL communicator over the ranks of a "
                        "process group (every rank opens its own, with one id; blocks until all did)."},
    {Py_tp_new, comm_new},
    {Py_tp_dealloc, comm_dealloc},
    {Py_tp_methods, comm_methods},
    {Py_tp_getset, comm_getset},
    {0, NULL},
};

static PyType_Spec comm_spec = {
    .name = "kvbm_ext._C._NcclComm",
    .basicsize = sizeof(nccl_comm),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = comm_slots,
};

int kv_nccl_comm_add_type(PyObject *module)
{
    PyObject *type = PyType_FromModuleAndSpec(module, &comm_spec, NULL);
    if (type == NULL)
        return -1;
    const int rc = PyModule_AddObjectRef(module, "_NcclComm", type);
    Py_DECREF(type);
    /* The largest record swap() takes, for a test to hold the records Python swaps within it. */
    return rc < 0 ? -1 : PyModule_AddIntConstant(module, "_NCCL_RECORD_MAX", KV_NCCL_RECORD_MAX);
}
