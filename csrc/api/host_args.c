/* kvbm_ext.pinned_empty's arguments: the shape, the element type from any of
 * its spellings, the node, threads, huge pages, device and shared region's
 * name.  See host_buffer.h. */
#include "host_buffer.h"

#include <stdlib.h>
#include <string.h>

#include "args.h"
#include "dlpack.h"

static const kv_host_dtype DTYPES[] = {
    {"bool", {kDLBool, 8}, "|b1", "?"},
    {"uint8", {kDLUInt, 8}, "|u1", "B"},
    {"int8", {kDLInt, 8}, "|i1", "b"},
    {"uint16", {kDLUInt, 16}, "<u2", "H"},
    {"int16", {kDLInt, 16}, "<i2", "h"},
    {"uint32", {kDLUInt, 32}, "<u4", "I"},
    {"int32", {kDLInt, 32}, "<i4", "i"},
    {"uint64", {kDLUInt, 64}, "<u8", "Q"},
    {"int64", {kDLInt, 64}, "<i8", "q"},
    {"float16", {kDLFloat, 16}, "<f2", "e"},
    {"float32", {kDLFloat, 32}, "<f4", "f"},
    {"float64", {kDLFloat, 64}, "<f8", "d"},
    {"bfloat16", {kDLBfloat, 16}, "<u2", "H"},
    {"float8_e4m3fn", {kDLFloat8_e4m3fn, 8}, "|u1", "B"},
    {"float8_e4m3fnuz", {kDLFloat8_e4m3fnuz, 8}, "|u1", "B"},
    {"float8_e5m2", {kDLFloat8_e5m2, 8}, "|u1", "B"},
    {"float8_e5m2fnuz", {kDLFloat8_e5m2fnuz, 8}, "|u1", "B"},
    {"float8_e8m0fnu", {kDLFloat8_e8m0fnu, 8}, "|u1", "B"},
};
#define DTYPE_COUNT ((int)(sizeof DTYPES / sizeof DTYPES[0]))

static int read_shape(PyObject *shape, kv_pool_request *r)
{
    const kv_path whole = {"shape", {0}, 0};
    if (PyIndex_Check(shape)) {
        r->ndim = 1;
        return kv_int64(shape, &whole, "an int or a tuple of ints", 0, INT64_MAX, &r->shape[0]);
    }
    PyObject *items = kv_as_sequence(shape, &whole, "an int or a tuple of ints");
    if (items == NULL)
        return -1;
    const Py_ssize_t ndim = PyTuple_GET_SIZE(items);
    int rc = ndim > KV_MAX_NDIM
                 ? kv_path_error(PyExc_ValueError, &whole, "%zd dimensions; at most %d", ndim, KV_MAX_NDIM)
                 : 0;
    for (Py_ssize_t i = 0; rc == 0 && i < ndim; i++) {
        const kv_path path = {"shape", {i}, 1};
        rc = kv_int64(PyTuple_GET_ITEM(items, i), &path, "an int", 0, INT64_MAX, &r->shape[i]);
    }
    r->ndim = (int)ndim;
    Py_DECREF(items);
    return rc;
}

/* The name `dtype` spells, as a str (new reference): a str; torch's dtype
 * by its str(), "torch.<name>"; a type (NumPy's scalar types) by its
 * __name__; else by its `name` attribute (NumPy's dtypes). */
static PyObject *dtype_text(PyObject *dtype)
{
    PyObject *text;
    if (PyUnicode_Check(dtype))
        text = Py_NewRef(dtype);
    else if (strcmp(Py_TYPE(dtype)->tp_name, "torch.dtype") == 0)
        text = PyObject_Str(dtype);
    else
        text = PyObject_GetAttrString(dtype, PyType_Check(dtype) ? "__name__" : "name");
    if (text != NULL && PyUnicode_Check(text))
        return text;
    const kv_path path = {"dtype", {0}, 0};
    const char *expected = "expected a torch dtype, a NumPy dtype or a name such as 'bfloat16', got %s";
    if (text == NULL)
        kv_path_error_from(PyExc_TypeError, &path, expected, Py_TYPE(dtype)->tp_name);
    else
        kv_path_error(PyExc_TypeError, &path, expected, Py_TYPE(dtype)->tp_name);
    Py_XDECREF(text);
    return NULL;
}

/* The element type `dtype` names.  torch's names lose their "torch."
 * prefix, a type's its trailing "_" (numpy.bool_). */
static const kv_host_dtype *read_dtype(PyObject *dtype)
{
    PyObject *text = dtype_text(dtype);
    if (text == NULL)
        return NULL;
    Py_ssize_t n = 0;
    const char *s = PyUnicode_AsUTF8AndSize(text, &n);
    if (s == NULL)
        PyErr_Clear(); /* a lone surrogate: a name that matches nothing */
    else if (!PyUnicode_Check(dtype) && strcmp(Py_TYPE(dtype)->tp_name, "torch.dtype") == 0 && n > 6
             && memcmp(s, "torch.", 6) == 0) {
        s += 6;
        n -= 6;
    }
    else if (PyType_Check(dtype) && n > 1 && s[n - 1] == '_')
        n--;
    for (int i = 0; s != NULL && i < DTYPE_COUNT; i++) {
        if ((size_t)n == strlen(DTYPES[i].name) && memcmp(s, DTYPES[i].name, (size_t)n) == 0) {
            Py_DECREF(text);
            return &DTYPES[i];
        }
    }
    /* An exact copy to show: a str subclass's __repr__ is not run. */
    PyObject *shown = PyUnicode_Substring(text, 0, PyUnicode_GET_LENGTH(text));
    Py_DECREF(text);
    if (shown != NULL) {
        PyErr_Format(PyExc_ValueError,
                     "dtype: %R is not an element type pinned_empty makes; it makes bool, "
                     "(u)int8/16/32/64, float16/32/64, bfloat16 and float8_e4m3fn, float8_e4m3fnuz, float8_e5m2, "
                     "float8_e5m2fnuz, float8_e8m0fnu",
                     shown);
        Py_DECREF(shown);
    }
    return NULL;
}

/* The device argument: None (the current device), an int, or "cuda" /
 * "cuda:N" as a str or a torch.device. */
static int read_device(PyObject *device, int *out)
{
    const kv_path path = {"device", {0}, 0};
    *out = KV_CURRENT_DEVICE;
    if (device == NULL || device == Py_None)
        return 0;
    if (PyIndex_Check(device)) {
        int64_t index;
        if (kv_int64(device, &path, "an int", 0, INT32_MAX, &index) < 0)
            return -1;
        *out = (int)index;
        return 0;
    }
    const int is_torch = strcmp(Py_TYPE(device)->tp_name, "torch.device") == 0;
    PyObject *text = PyUnicode_Check(device) ? Py_NewRef(device) : is_torch ? PyObject_Str(device) : NULL;
    Py_ssize_t size = 0;
    const char *s = text != NULL && PyUnicode_Check(text) ? PyUnicode_AsUTF8AndSize(text, &size) : NULL;
    char *end = NULL;
    long index = KV_CURRENT_DEVICE;
    /* The whole string is read: "cuda\0:7" is no device. */
    int valid = s != NULL && (size_t)size == strlen(s) && strncmp(s, "cuda", 4) == 0
                && (s[4] == '\0' || (s[4] == ':' && s[5] >= '0' && s[5] <= '9'));
    if (valid && s[4] == ':') {
        index = strtol(s + 5, &end, 10);
        valid = *end == '\0' && end - (s + 5) <= 9;
    }
    PyErr_Clear();
    if (!valid) {
        /* A str is shown as given; another object by its type. */
        const int rc = text != NULL ? kv_path_error(PyExc_ValueError, &path,
                                                    "expected None, an int, 'cuda' or 'cuda:N' (a str or a "
                                                    "torch.device), got %R",
                                                    text)
                                    : kv_path_error(PyExc_ValueError, &path,
                                                    "expected None, an int, 'cuda' or 'cuda:N' (a str or a "
                                                    "torch.device), got %s",
                                                    Py_TYPE(device)->tp_name);
        Py_XDECREF(text);
        return rc;
    }
    Py_DECREF(text);
    *out = (int)index;
    return 0;
}

/* The name as a message shows it: its first 40 characters, then "..." where
 * there are more (an exact str: a subclass's __repr__ is not run). */
static PyObject *shown_name(PyObject *value)
{
    const Py_ssize_t length = PyUnicode_GET_LENGTH(value);
    PyObject *start = PyUnicode_Substring(value, 0, length > 40 ? 40 : length);
    if (start == NULL || length <= 40)
        return start;
    PyObject *shown = PyUnicode_FromFormat("%U...", start);
    Py_DECREF(start);
    return shown;
}

int kv_read_shared_name(PyObject *value, const char *argument, int allow_none, int *given, char *out)
{
    *given = 0;
    out[0] = '\0';
    if (allow_none && value == Py_None)
        return 0;
    if (!PyUnicode_Check(value)) {
        PyErr_Format(PyExc_TypeError, "%s: expected %sa str, got %s", argument, allow_none ? "None or " : "",
                     Py_TYPE(value)->tp_name);
        return -1;
    }
    PyObject *shown = shown_name(value);
    if (shown == NULL)
        return -1;
    Py_ssize_t n = 0;
    const char *s = PyUnicode_AsUTF8AndSize(value, &n);
    if (s == NULL) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: %R is not valid UTF-8 (it holds a lone surrogate)", argument, shown);
    }
    else if (n == 0)
        PyErr_Format(PyExc_ValueError, "%s: '' is empty; expected a name such as 'kvbm-pool'", argument);
    else if (strlen(s) != (size_t)n)
        PyErr_Format(PyExc_ValueError, "%s: %R holds a NUL", argument, shown);
    else if (strchr(s, '/') != NULL)
        PyErr_Format(PyExc_ValueError,
                     "%s: %R holds a '/'; a shared region's name is one file name in /dev/shm, without '/'", argument,
                     shown);
    else if (strcmp(s, ".") == 0 || strcmp(s, "..") == 0)
        PyErr_Format(PyExc_ValueError, "%s: %R is not a name of a file in /dev/shm", argument, shown);
    else if (n > KV_SHARED_NAME_MAX)
        PyErr_Format(PyExc_ValueError, "%s: %R is %zd bytes (UTF-8); at most %d (NAME_MAX)", argument, shown, n,
                     KV_SHARED_NAME_MAX);
    else {
        memcpy(out, s, (size_t)n + 1);
        *given = 1;
    }
    Py_DECREF(shown);
    return *given ? 0 : -1;
}

int kv_read_pool_request(const kv_pinned_empty_args *a, kv_pool_request *r)
{
    static const char *const huge_names[] = {"transparent", "explicit", "none"};
    if (read_shape(a->shape, r) < 0 || (r->dtype = read_dtype(a->dtype)) == NULL
        || kv_parse_int(a->numa_node, "numa_node", 0, KV_MAX_NODES - 1, -1, 1, &r->numa_node) < 0
        || kv_parse_int(a->threads, "threads", 1, 1024, 0, 1, &r->threads) < 0
        || kv_parse_name(a->huge_pages, "huge_pages", huge_names, 3, KV_PINNED_EMPTY_ARGS_HUGE_PAGES_DEFAULT, &r->huge)
               < 0
        || read_device(a->device, &r->device) < 0
        || kv_read_shared_name(a->shared == NULL ? Py_None : a->shared, "shared", 1, &r->is_shared, r->shared) < 0)
        return -1;
    if (r->is_shared && r->huge == KV_HUGE_EXPLICIT) {
        PyObject *name = PyUnicode_FromString(r->shared);
        if (name != NULL)
            PyErr_Format(PyExc_ValueError,
                         "huge_pages: 'explicit' cannot be shared (shared=%R): explicit huge pages are not in "
                         "/dev/shm; shared memory takes transparent huge pages as "
                         "/sys/kernel/mm/transparent_hugepage/shmem_enabled says (huge_pages='transparent'), or none",
                         name);
        Py_XDECREF(name);
        return -1;
    }
    /* The strides exported are those of the extents without the zeros
     * (an empty array's too, as NumPy's): they must fit, whatever the count. */
    int64_t span = 1, empty = 0;
    int overflow = 0;
    for (int i = 0; i < r->ndim; i++) {
        empty |= r->shape[i] == 0;
        overflow |= r->shape[i] != 0 && __builtin_mul_overflow(span, r->shape[i], &span);
    }
    overflow = overflow || __builtin_mul_overflow(span, (int64_t)(r->dtype->dtype.bits / 8), &span)
               || span > INT64_MAX - (int64_t)(2 * KV_HOST_ALIGN);
    if (overflow) {
        char shape[160];
        kv_format_shape(r->shape, r->ndim, shape, sizeof shape);
        PyErr_Format(PyExc_ValueError, "shape: %s of %s %s more than 2**63 bytes", shape, r->dtype->name,
                     empty ? "is empty, but its other extents span" : "holds");
        return -1;
    }
    r->nbytes = empty ? 0 : span;
    if (r->threads == 0)
        r->threads = kv_cpu_count();
    return 0;
}
