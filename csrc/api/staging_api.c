/* kvbm_ext.set_staging(), reserve_staging() and staging_info(): their
 * arguments, read and checked, for the GPU side (gpu_staging.c; gpu_stub.c
 * without nvcc).  See staging_api.h. */
#include "staging_api.h"

#include "args.h"
#include "signatures.h"
#include "state.h"
#include "target.h"

/* The device a staging function names, from its one optional argument
 * `device`: None for the current one.  -1 with an exception. */
static int staging_device(const kv_signature *signature, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    kv_staging_args a;
    if (kv_parse_arguments(signature, args, nargs, kwnames, &a) < 0
        || kv_require_device(signature->name, "its staging memory is device memory") < 0)
        return -1;
    if (a.device == NULL || a.device == Py_None)
        return kv_gpu_current_device();
    int64_t index;
    if (kv_parse_int(a.device, "device", 0, INT32_MAX, 0, 0, &index) < 0)
        return -1;
    const int count = kv_gpu_device_count();
    if (index >= count) {
        PyErr_Format(PyExc_ValueError, "device: cuda:%lld does not exist (%d CUDA devices)", (long long)index, count);
        return -1;
    }
    return (int)index;
}

const char kv_set_staging_doc[] =
    KV_SET_STAGING_TEXT_SIGNATURE "Size the device staging memory of the copy-engine path (backend \"auto\" or\n"
                                  "\"copy_engines\" with pinned host memory): size_bytes per CUDA device (at least\n"
                                  "1 MiB; default 96 MiB), split into `lanes` (1 to 16; default 2).  A lane serves\n"
                                  "one stream at a time: calls on up to `lanes` streams at once never share staging,\n"
                                  "more queue behind each other.  None keeps the current value.  Staging already\n"
                                  "allocated is freed (after the work that uses it) and allocated anew, at the new\n"
                                  "size, by the next call that needs it.";

PyObject *kv_set_staging(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    kv_staging_args a;
    int64_t bytes, count;
    if (kv_parse_arguments(&kv_set_staging_signature, args, nargs, kwnames, &a) < 0
        || kv_parse_int(a.size_bytes, "size_bytes", (int64_t)1 << 20, (int64_t)1 << 40, -1, 1, &bytes) < 0
        || kv_parse_int(a.lanes, "lanes", 1, 16, -1, 1, &count) < 0
        || kv_gpu_set_staging(((kv_state *)PyModule_GetState(module))->gpu, bytes, (int)count) < 0)
        return NULL;
    Py_RETURN_NONE;
}

const char kv_reserve_staging_doc[] =
    KV_RESERVE_STAGING_TEXT_SIGNATURE "Allocate the staging memory of `device` (an index; None: the current device)\n"
                                      "now rather than on first need, and the lane that staged calls use while their\n"
                                      "stream is captured into a CUDA graph.  Call it before capturing such calls.\n"
                                      "It also loads every kernel of the extension on the device: CUDA loads a kernel\n"
                                      "at its first launch, and that launch waits until the device is idle.\n"
                                      "Graphs holding staged calls share that lane: do not replay two of them at once\n"
                                      "on different streams.  RuntimeError without a CUDA device.";

PyObject *kv_reserve_staging(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    const int index = staging_device(&kv_reserve_staging_signature, args, nargs, kwnames);
    if (index < 0 || kv_gpu_reserve_staging(((kv_state *)PyModule_GetState(module))->gpu, index) < 0)
        return NULL;
    Py_RETURN_NONE;
}

const char kv_staging_info_doc[] =
    KV_STAGING_INFO_TEXT_SIGNATURE "The staging memory of `device` (None: the current device): {\"device\",\n"
                                   "\"size_bytes\", \"lanes\", \"lane_bytes\", \"allocated\", \"capture_reserved\"}.\n"
                                   "RuntimeError without a CUDA device.";

PyObject *kv_staging_info(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    const int index = staging_device(&kv_staging_info_signature, args, nargs, kwnames);
    return index < 0 ? NULL : kv_gpu_staging_info(((kv_state *)PyModule_GetState(module))->gpu, index);
}
