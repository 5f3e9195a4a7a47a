/* The options every layout move takes.  See options.h. */
#include "options.h"

#include "args.h"

const char *const KV_BACKEND_NAMES[KV_BACKEND_COUNT] = {"kernel", "async", "batch", "auto", "copy_engines"};

static const char *const LAYOUT_NAMES[] = {"NHD", "HND"};

int kv_move_options_read(PyObject *backend, PyObject *num_ctas, PyObject *stream, kv_move_options *out)
{
    int backend_index;
    int64_t bound;
    if (kv_parse_name(backend, "backend", KV_BACKEND_NAMES, KV_BACKEND_COUNT, KV_BACKEND_AUTO, &backend_index) < 0
        || kv_parse_int(num_ctas, "num_ctas", 1, UINT32_MAX, 0, 1, &bound) < 0
        || kv_stream_from_object(stream != NULL ? stream : Py_None, &out->stream) < 0)
        return -1;
    out->backend = (kv_backend)backend_index;
    out->num_ctas = (uint32_t)bound;
    return 0;
}

int kv_layout_read(PyObject *value, const char *argument, kvbm_layout *out)
{
    int index;
    if (kv_parse_name(value, argument, LAYOUT_NAMES, 2, KVBM_NHD, &index) < 0)
        return -1;
    *out = (kvbm_layout)index;
    return 0;
}
