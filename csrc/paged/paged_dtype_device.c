/* kvbm_ext.PagedKVCache's dtype and device: their names, and the objects
 * the framework of the first array has for them, made once at
 * construction.  See paged_internal.h. */
#include "paged_internal.h"

PyObject *kv_paged_dtype_name(const kv_paged_cache *self)
{
    char name[48];
    return PyUnicode_FromString(kv_dtype_name(self->dtype, name, sizeof name));
}

PyObject *kv_paged_device_name(const kv_paged_cache *self)
{
    return self->device >= 0 ? PyUnicode_FromFormat("cuda:%d", self->device) : PyUnicode_FromString("cpu");
}

/* attr of obj, or NULL: *absent when it has none (AttributeError cleared),
 * else an exception. */
static PyObject *optional_attr(PyObject *obj, PyObject *attr, int *absent)
{
    PyObject *value = PyObject_GetAttr(obj, attr);
    *absent = value == NULL && PyErr_ExceptionMatches(PyExc_AttributeError);
    if (*absent)
        PyErr_Clear();
    return value;
}

/* The framework object replacing `*slot` (a name) when it is an instance
 * of `type`: 0 with *slot replaced or left (value NULL and an AttributeError
 * or TypeError, cleared: the framework has no such dtype), or -1. */
static int take(PyObject **slot, PyObject *value, PyObject *type)
{
    if (value == NULL) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError) && !PyErr_ExceptionMatches(PyExc_TypeError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    if (PyType_Check(type) && PyObject_TypeCheck(value, (PyTypeObject *)type))
        Py_SETREF(*slot, value);
    else
        Py_DECREF(value);
    return 0;
}

/* torch's names: torch.<dtype name> (torch.bfloat16) and torch.device. */
static int torch_types(kv_paged_cache *self, kv_protocols *p, PyObject *torch)
{
    int absent;
    PyObject *dtype_type = optional_attr(torch, p->names[KV_NAME_DTYPE], &absent);
    if (dtype_type == NULL)
        return absent ? 0 : -1;
    PyObject *device_type = optional_attr(torch, p->names[KV_NAME_DEVICE], &absent);
    int rc = device_type == NULL ? (absent ? 0 : -1)
                                 : take(&self->dtype_object, PyObject_GetAttr(torch, self->dtype_object), dtype_type);
    if (rc == 0 && device_type != NULL) {
        PyObject *device = self->device >= 0 ? PyObject_CallFunction(device_type, "si", "cuda", self->device)
                                             : PyObject_CallFunction(device_type, "s", "cpu");
        rc = device == NULL ? -1 : take(&self->device_object, device, device_type);
    }
    Py_DECREF(dtype_type);
    Py_XDECREF(device_type);
    return rc;
}

/* NumPy's name of the element type, numpy.dtype(name), where NumPy has it
 * ("raw2", "bfloat16" and the float8 types, which it has not, stay names);
 * the device stays "cpu", as NumPy's own ndarray.device says. */
static int numpy_types(kv_paged_cache *self, kv_protocols *p, PyObject *numpy, PyObject *first)
{
    int absent;
    PyObject *ndarray = optional_attr(numpy, p->names[KV_NAME_NDARRAY], &absent);
    if (ndarray == NULL)
        return absent ? 0 : -1;
    int rc = 0;
    /* The type itself, not isinstance(): __class__ is the object's to say. */
    if (PyType_Check(ndarray) && PyType_IsSubtype(Py_TYPE(first), (PyTypeObject *)ndarray)) {
        PyObject *dtype_type = optional_attr(numpy, p->names[KV_NAME_DTYPE], &absent);
        rc = dtype_type == NULL
                 ? (absent ? 0 : -1)
                 : take(&self->dtype_object, PyObject_CallOneArg(dtype_type, self->dtype_object), dtype_type);
        Py_XDECREF(dtype_type);
    }
    Py_DECREF(ndarray);
    return rc;
}

int kv_paged_name_types(kv_paged_cache *self, kv_protocols *p)
{
    if ((self->dtype_object = kv_paged_dtype_name(self)) == NULL
        || (self->device_object = kv_paged_device_name(self)) == NULL)
        return -1;
    PyObject *first = kv_paged_layer(self, 0);
    kv_type_facts facts = kv_type_facts_of(p, Py_TYPE(first));
    const int is_torch = facts.is_neg != NULL; /* a torch.Tensor, torch imported */
    kv_type_facts_release(&facts);
    PyObject *module = PyImport_GetModule(p->names[is_torch ? KV_NAME_TORCH : KV_NAME_NUMPY]);
    if (module == NULL)
        return PyErr_Occurred() ? -1 : 0;
    const int rc = is_torch ? torch_types(self, p, module) : numpy_types(self, p, module, first);
    Py_DECREF(module);
    return rc;
}
