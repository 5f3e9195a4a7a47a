/* The options every layout move takes.  See options.h. */
#include "options.h"

#include "args.h"

const char *const KV_BACKEND_NAMES[KV_BACKEND_COUNT] = {"kernel", "async", "batch", "auto", "copy_engines"};

static const char *const LAYOUT_NAMES[] = {"NHD", "HND"};

int kv_move_options_read(PyObject *backend, const char *backend_default, PyObject *num_ctas, PyObject *stream,
                         kv_move_options *out)
{
    int backend_index;
    int64_t bound;
    if (kv_parse_name(backend, "backend", KV_BACKEND_NAMES, KV_BACKEND_COUNT, backend_default, &backend_index) < 0
        || kv_parse_int(num_ctas, "num_ctas", 1, UINT32_MAX, 0, 1, &bound) < 0
        || kv_stream_from_object(stream != NULL ? stream : Py_None, &out->stream) < 0)
        return -1;
    out->backend = (kv_backend)backend_index;
    out->num_ctas = (uint32_t)bound;
    out->deferred = NULL; /* to_cache's defer= sets it */
    return 0;
}

int kv_move_options_check_host(const kv_move_options *o)
{
    static const char ON_THE_CPU[] = "no array of the call is on a CUDA device, so it runs on the CPU";
    if (o->backend != KV_BACKEND_AUTO)
        return kv_error(PyExc_ValueError,
                        "backend: \"%s\" picks how a GPU moves the bytes, but %s: pass "
                        "backend=\"auto\" (the default)",
                        KV_BACKEND_NAMES[o->backend], ON_THE_CPU);
    if (o->num_ctas != 0)
        return kv_error(PyExc_ValueError,
                        "num_ctas: %u bounds the CUDA blocks of a GPU move, but %s: pass "
                        "num_ctas=None (the default)",
                        o->num_ctas, ON_THE_CPU);
    if (o->stream != KV_STREAM_CURRENT)
        return kv_error(PyExc_ValueError,
                        "stream: orders a GPU move, but %s, synchronously: pass stream=None (the "
                        "default)",
                        ON_THE_CPU);
    return 0;
}

int kv_layout_read(PyObject *value, const char *argument, const char *fallback, kvbm_layout *out)
{
    int index;
    if (kv_parse_name(value, argument, LAYOUT_NAMES, 2, fallback, &index) < 0)
        return -1;
    *out = (kvbm_layout)index;
    return 0;
}

int kv_switch_read(PyObject *value, const char *argument, int fallback, int *out)
{
    *out = value == NULL ? fallback : value == Py_True;
    if (value == NULL || PyBool_Check(value))
        return 0;
    return kv_error(PyExc_TypeError, "%s: expected True or False, got %s", argument, Py_TYPE(value)->tp_name);
}
