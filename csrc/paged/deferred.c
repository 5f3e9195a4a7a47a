/* kvbm_ext.Deferred.  See deferred.h. */
#include "deferred.h"

#include "errors.h"
#include "signatures.h"

typedef struct {
    PyObject_HEAD kv_promise *outcome; /* NULL: ran whole during the call */
} kv_deferred;

PyObject *kv_deferred_new(PyObject *type, kv_promise *outcome)
{
    kv_deferred *self = PyObject_New(kv_deferred, (PyTypeObject *)type);
    if (self == NULL) {
        kv_promise_release(outcome);
        return NULL;
    }
    self->outcome = outcome;
    return (PyObject *)self;
}

static void deferred_dealloc(PyObject *op)
{
    PyTypeObject *type = Py_TYPE(op);
    kv_promise_release(((kv_deferred *)op)->outcome);
    PyObject_Free(op);
    Py_DECREF(type);
}

static int settled(const kv_deferred *self) { return self->outcome == NULL || kv_promise_settled(self->outcome); }

PyDoc_STRVAR(done_doc,
             KV_DEFERRED_DONE_TEXT_SIGNATURE "Whether the call's pieces are enqueued, or failed to be; never waits.");

static PyObject *deferred_done(PyObject *op, PyObject *unused)
{
    (void)unused;
    return PyBool_FromLong(settled((kv_deferred *)op));
}

/* A timeout in seconds, at least 0 (None: -1, no bound). */
static int read_timeout(PyObject *value, double *seconds)
{
    *seconds = -1.0;
    if (value == NULL || value == Py_None)
        return 0;
    if (!PyFloat_Check(value) && !PyLong_Check(value))
        return kv_error(PyExc_TypeError, "timeout: expected a number of seconds or None, got %.100s",
                        Py_TYPE(value)->tp_name);
    *seconds = PyFloat_AsDouble(value);
    if (*seconds == -1.0 && PyErr_Occurred())
        return -1;
    if (!(*seconds >= 0.0))
        return kv_error(PyExc_ValueError, "timeout: expected a number of seconds, at least 0, or None");
    return 0;
}

PyDoc_STRVAR(result_doc, KV_DEFERRED_RESULT_TEXT_SIGNATURE
             "Waits (without the GIL) until the call's pieces are enqueued.  RuntimeError names\n"
             "the CUDA step where that failed; TimeoutError where `timeout` seconds passed first.\n"
             "The bytes are in place once work queued on the call's stream after it has run.");

static PyObject *deferred_result(PyObject *op, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    kv_deferred *self = (kv_deferred *)op;
    kv_deferred_args a;
    double seconds;
    if (kv_parse_arguments(&kv_deferred_result_signature, args, nargs, kwnames, &a) < 0
        || read_timeout(a.timeout, &seconds) < 0)
        return NULL;
    if (!settled(self)) {
        int ended;
        Py_BEGIN_ALLOW_THREADS
        ended = kv_promise_wait(self->outcome, seconds);
        Py_END_ALLOW_THREADS
        if (!ended)
            return PyErr_Format(PyExc_TimeoutError, "the call's pieces were not enqueued within %g s", seconds);
    }
    const char *failure = self->outcome != NULL ? kv_promise_failure(self->outcome) : NULL;
    if (failure != NULL)
        return PyErr_Format(PyExc_RuntimeError, "%s", failure);
    Py_RETURN_NONE;
}

static PyObject *deferred_repr(PyObject *op)
{
    const kv_deferred *self = (const kv_deferred *)op;
    const char *state = !settled(self)                                                       ? "pending"
                        : self->outcome != NULL && kv_promise_failure(self->outcome) != NULL ? "failed"
                                                                                             : "done";
    return PyUnicode_FromFormat("<kvbm_ext.Deferred %s>", state);
}

static PyMethodDef deferred_methods[] = {
    {"done", deferred_done, METH_NOARGS, done_doc},
    {"result", (PyCFunction)(void (*)(void))deferred_result, METH_FASTCALL | METH_KEYWORDS, result_doc},
    {NULL, NULL, 0, NULL},
};

static PyType_Slot deferred_slots[] = {
    {Py_tp_doc, (void *)"The outcome of PagedKVCache.to_cache(..., defer=True): the call's pieces are enqueued "
                        "on its device by the device's enqueue thread after the call returned, and work queued "
                        "on the call's stream afterwards waits for them all the same.  Not made from Python."},
    {Py_tp_dealloc, deferred_dealloc},
    {Py_tp_methods, deferred_methods},
    {Py_tp_repr, deferred_repr},
    {0, NULL},
};

static PyType_Spec deferred_spec = {
    .name = "kvbm_ext.Deferred",
    .basicsize = sizeof(kv_deferred),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_IMMUTABLETYPE | Py_TPFLAGS_DISALLOW_INSTANTIATION,
    .slots = deferred_slots,
};

int kv_deferred_add_type(PyObject *module, PyObject **type)
{
    *type = PyType_FromModuleAndSpec(module, &deferred_spec, NULL);
    return *type == NULL ? -1 : PyModule_AddObjectRef(module, "Deferred", *type);
}
