/* What torch tensors need beyond their protocol: the conjugate, negative
 * and requires-grad checks, and the version-counter bump of a written
 * tensor.  See readers.h and array.h. */
#include "readers.h"

/* Whether `flag` (a method of obj's type, e.g. is_neg, or NULL for
 * obj.requires_grad) is set: 1, 0, or -1 with an exception. */
static int torch_flag(const kv_protocols *p, PyObject *obj, PyObject *flag)
{
    PyObject *value = flag != NULL ? PyObject_Vectorcall(flag, &obj, 1, NULL)
                                   : PyObject_GetAttr(obj, p->names[KV_NAME_REQUIRES_GRAD]);
    if (value == NULL)
        return -1;
    const int set = PyObject_IsTrue(value);
    Py_DECREF(value);
    return set;
}

/* What neither the C exchange API nor torch's __dlpack__ tells: a conjugate
 * or negative view's bytes are not its values (the bit is applied lazily,
 * by torch's own operations), and a tensor that requires grad cannot be
 * written behind autograd's back (torch refuses in-place writes to such a
 * leaf; on a non-leaf the graph would silently use the new values). */
int kv_torch_check_destination(const kv_protocols *p, PyObject *obj, const kv_path *path)
{
    const int set = torch_flag(p, obj, NULL);
    if (set == 0)
        return 0;
    return set < 0 ? -1
                   : kv_path_error(PyExc_ValueError, path,
                                   "destination tensor requires grad, and autograd cannot see "
                                   "this write; pass x.detach() (same memory) to write it anyway");
}

int kv_check_torch(const kv_protocols *p, PyObject *obj, const kv_type_facts *facts, const kv_path *path, int write,
                   kv_array *out)
{
    int set = out->dtype.code == kDLComplex ? torch_flag(p, obj, facts->is_conj) : 0; /* only complex can be */
    if (set != 0)
        return set < 0 ? -1
                       : kv_path_error(PyExc_ValueError, path,
                                       "a conjugate view (its conjugate bit is set): its bytes "
                                       "are not its values; pass x.resolve_conj()");
    if ((set = torch_flag(p, obj, facts->is_neg)) != 0)
        return set < 0 ? -1
                       : kv_path_error(PyExc_ValueError, path,
                                       "a negative view (its negative bit is set, e.g. "
                                       "x._neg_view() or the .imag of a conjugate view): its bytes are not its values; "
                                       "pass x.resolve_neg()");
    if (!write)
        return 0;
    if (kv_torch_check_destination(p, obj, path) < 0)
        return -1;
    out->written_tensor = Py_NewRef(obj);
    return 0;
}

PyObject *kv_torch_counter_owner(kv_protocols *p, PyObject *obj)
{
    kv_type_facts facts = kv_type_facts_of(p, Py_TYPE(obj));
    const int torch = facts.is_neg != NULL;
    kv_type_facts_release(&facts);
    if (!torch)
        return Py_NewRef(Py_None);
    PyObject *inference = PyObject_CallMethodNoArgs(obj, p->names[KV_NAME_IS_INFERENCE]);
    const int no_counter = inference == NULL ? -1 : PyObject_IsTrue(inference);
    Py_XDECREF(inference);
    if (no_counter != 0)
        return no_counter < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *base = PyObject_GetAttr(obj, p->names[KV_NAME_BASE]);
    if (base == Py_None)
        Py_SETREF(base, Py_NewRef(obj));
    return base;
}

/* torch.autograd.graph.increment_version, found once; None when this torch
 * has none.  Borrowed, or NULL with an exception.  The first value stored
 * stays until the module is cleared (a compare-and-swap from NULL: a
 * nested call, or another thread without the GIL, that found it too drops
 * its own), so the borrowed reference outlives the call. */
static PyObject *increment_version(kv_protocols *p)
{
    PyObject *known = __atomic_load_n(&p->increment_version, __ATOMIC_ACQUIRE);
    if (known != NULL)
        return known;
    PyObject *graph = PyImport_ImportModule("torch.autograd.graph");
    PyObject *found = graph == NULL ? NULL : PyObject_GetAttrString(graph, "increment_version");
    Py_XDECREF(graph);
    if (found == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_ImportError) && !PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
        found = Py_NewRef(Py_None);
    }
    if (!__atomic_compare_exchange_n(&p->increment_version, &known, found, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
        Py_DECREF(found);
        return known;
    }
    return found;
}

int kv_torch_written(kv_protocols *p, PyObject *tensors)
{
    PyObject *bump = increment_version(p);
    if (bump == NULL)
        return -1;
    if (bump == Py_None)
        return 0;
    PyObject *result = PyObject_CallOneArg(bump, tensors);
    Py_XDECREF(result);
    return result == NULL ? -1 : 0;
}

int kv_arrays_written(kv_protocols *p, const kv_array *arrays, Py_ssize_t count)
{
    Py_ssize_t n = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        n += arrays[i].written_tensor != NULL;
    if (n == 0)
        return 0;
    PyObject *tensors = PyTuple_New(n);
    if (tensors == NULL)
        return -1;
    for (Py_ssize_t i = 0, k = 0; i < count; i++)
        if (arrays[i].written_tensor != NULL)
            PyTuple_SET_ITEM(tensors, k++, Py_NewRef(arrays[i].written_tensor));
    const int rc = kv_torch_written(p, tensors);
    Py_DECREF(tensors);
    return rc;
}
