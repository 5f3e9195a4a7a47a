/* kvbm_ext.unlink_shared, and the OSError of a shared region's system
 * call.  See host_buffer.h; the rule of a shared region's name is
 * host_shared.h's. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "host_buffer.h"

#include <errno.h>

#include "args.h"
#include "host_shared.h"

PyObject *kv_raise_os_error(int error, PyObject *message)
{
    PyObject *exception = message == NULL ? NULL : PyObject_CallFunction(PyExc_OSError, "iO", error, message);
    if (exception != NULL) {
        PyErr_SetObject((PyObject *)Py_TYPE(exception), exception);
        Py_DECREF(exception);
    }
    Py_XDECREF(message);
    return NULL;
}

const char kv_unlink_shared_doc[] = KV_UNLINK_SHARED_TEXT_SIGNATURE
    "Unlink the shared region `name` (/dev/shm/<name>, made by pinned_empty(...,\n"
    "shared=name)) now: True where it was there, False where there was none.\n\n"
    "name: the region's name, as pinned_empty's `shared` takes it (a str without '/').\n\n"
    "Processes that map the region keep their memory until they let go of it; the\n"
    "next pinned_empty of the name makes a new region.  pinned_empty unlinks a name on\n"
    "its own when the last process that maps it lets go: call this for a region left\n"
    "by processes that were killed (no process maps it), or right after every process\n"
    "has mapped it, so that nothing stays in /dev/shm whatever happens to them.\n"
    "OSError (with errno's text) where the system refuses.";

PyObject *kv_unlink_shared(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    (void)module;
    kv_unlink_shared_args given;
    char name[KV_SHARED_NAME_MAX + 1], why[KV_SHARED_NAME_MAX + 160];
    int named, rc, error = 0;
    if (kv_parse_arguments(&kv_unlink_shared_signature, args, nargs, kwnames, &given) < 0
        || kv_read_shared_name(given.name, "name", 0, &named, name) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = kv_shared_unlink(name, why, sizeof why);
    error = errno;
    Py_END_ALLOW_THREADS
    if (rc < 0)
        return kv_raise_os_error(error, PyUnicode_FromFormat("name: %s", why));
    return PyBool_FromLong(rc);
}
