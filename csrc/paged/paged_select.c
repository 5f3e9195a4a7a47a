/* kvbm_ext.PagedKVCache: the layers= and heads= selections of a call.  See
 * paged_internal.h. */
#include "paged_internal.h"

/* A slice bound: None (*given = 0) or an index, clamped to the Py_ssize_t
 * range as Python's slices clamp theirs. */
static int slice_bound(PyObject *bound, const char *name, Py_ssize_t *out, int *given)
{
    *given = bound != Py_None;
    if (!*given)
        return 0;
    const kv_path path = {name, {0, 0}, 0};
    PyObject *index = kv_index(bound, &path, "ints or None as the slice's start, stop and step");
    if (index == NULL)
        return -1;
    *out = PyNumber_AsSsize_t(index, NULL);
    Py_DECREF(index);
    return 0;
}

/* A slice of the n entries: Python's rules for negative bounds, but a bound
 * outside the entries is an error rather than clipped. */
static int read_slice(PyObject *obj, int64_t n, const char *name, const char *what, kv_selection *sel)
{
    const PySliceObject *slice = (const PySliceObject *)obj;
    Py_ssize_t bound[3] = {0, 0, 1};
    int given[3];
    PyObject *const parts[3] = {slice->start, slice->stop, slice->step};
    for (int i = 0; i < 3; i++)
        if (slice_bound(parts[i], name, &bound[i], &given[i]) < 0)
            return -1;
    /* Negatable, as Python's slices keep it. */
    const Py_ssize_t step = bound[2] < -PY_SSIZE_T_MAX ? -PY_SSIZE_T_MAX : bound[2];
    if (step == 0)
        return kv_error(PyExc_ValueError, "%s: %R has step 0", name, obj);
    /* Going down, a bound names an entry (None, not -1, runs past entry 0). */
    const int64_t highest = step > 0 ? n : n - 1;
    for (int i = 0; i < 2; i++) {
        const int64_t at = bound[i] < 0 ? (int64_t)bound[i] + n : (int64_t)bound[i];
        if (given[i] && (at < 0 || at > highest))
            return kv_error(PyExc_ValueError,
                            "%s: %R reaches outside the cache's %lld %ss: its %s must be from %lld to "
                            "%lld",
                            name, obj, (long long)n, what, i == 0 ? "start" : "stop", (long long)-n,
                            (long long)highest);
    }
    Py_ssize_t start = given[0] ? bound[0] : step > 0 ? 0 : PY_SSIZE_T_MAX;
    Py_ssize_t stop = given[1] ? bound[1] : step > 0 ? PY_SSIZE_T_MAX : PY_SSIZE_T_MIN;
    sel->count = PySlice_AdjustIndices((Py_ssize_t)n, &start, &stop, step);
    sel->first = start, sel->step = step;
    return 0;
}

/* A range whose every value is an entry. */
static int read_range(PyObject *obj, int64_t n, const char *name, const char *what, kv_selection *sel)
{
    PyObject *start = PyObject_GetAttrString(obj, "start"), *step = PyObject_GetAttrString(obj, "step");
    sel->first = start == NULL ? -1 : PyLong_AsLongLong(start);
    sel->step = step == NULL ? -1 : PyLong_AsLongLong(step);
    sel->count = PyErr_Occurred() ? -1 : PyObject_Size(obj);
    Py_XDECREF(start);
    Py_XDECREF(step);
    int64_t last = 0;
    if (!PyErr_Occurred() && sel->count > 0
        && (__builtin_mul_overflow(sel->count - 1, sel->step, &last)
            || __builtin_add_overflow(last, sel->first, &last)))
        PyErr_SetString(PyExc_OverflowError, "");
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return kv_error(PyExc_ValueError, "%s: %R selects %ss outside the cache's 0 to %lld", name, obj, what,
                        (long long)n - 1);
    }
    if (sel->count > 0 && (sel->first < 0 || sel->first >= n || last < 0 || last >= n))
        return kv_error(PyExc_ValueError, "%s: %R selects %s %lld, but the cache has %ss 0 to %lld", name, obj, what,
                        (long long)(sel->first < 0 || sel->first >= n ? sel->first : last), what, (long long)n - 1);
    return 0;
}

/* An index, by Python's rules for a negative one. */
static int read_index(PyObject *obj, int64_t n, const char *name, const char *what, kv_selection *sel)
{
    int64_t index;
    if (kv_parse_int(obj, name, INT64_MIN, INT64_MAX, 0, 0, &index) < 0)
        return -1;
    if (index < -n || index >= n)
        return kv_error(PyExc_ValueError, "%s: %s %lld is outside the cache's %lld %ss", name, what, (long long)index,
                        (long long)n, what);
    sel->first = index < 0 ? index + n : index, sel->count = 1;
    return 0;
}

int kv_read_selection(PyObject *obj, int64_t n, const char *name, const char *what, kv_selection *sel)
{
    sel->first = 0, sel->step = 1, sel->count = n;
    if (obj == NULL || obj == Py_None)
        return 0;
    int rc;
    if (PySlice_Check(obj))
        rc = read_slice(obj, n, name, what, sel);
    else if (PyObject_TypeCheck(obj, &PyRange_Type))
        rc = read_range(obj, n, name, what, sel);
    else if (!PyBool_Check(obj) && PyIndex_Check(obj))
        rc = read_index(obj, n, name, what, sel);
    else
        return kv_error(PyExc_TypeError, "%s: expected None, an int, a slice or a range of %s indices, got %s", name,
                        what, Py_TYPE(obj)->tp_name);
    if (rc == 0 && sel->count == 0)
        return kv_error(PyExc_ValueError, "%s: %R selects no %s; select at least one", name, obj, what);
    /* One entry has no step: a huge one would overflow step * stride. */
    if (rc == 0 && sel->count == 1)
        sel->step = 1;
    return rc;
}

int64_t kv_selection_top(const kv_selection *sel)
{
    return sel->step > 0 ? sel->first + (sel->count - 1) * sel->step : sel->first;
}

int64_t kv_selection_bottom(const kv_selection *sel)
{
    return sel->step > 0 ? sel->first : sel->first + (sel->count - 1) * sel->step;
}
