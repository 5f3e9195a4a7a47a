/* kvbm_ext._C: the module object, its state and its public functions. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "args.h"
#include "convert.h"
#include "paged.h"
#include "state.h"

#ifndef KVBM_VERSION
#error "KVBM_VERSION must be defined by the build"
#endif

static kv_state *state_of(PyObject *module) { return (kv_state *)PyModule_GetState(module); }

/* ------------------------------------------------------------ conversions */

#define SHAPES_DOC                                                                                                     \
    "Dimensions: nl layers, no outer chunks (2 for K and V, 1 for MLA), nh KV heads,\n"                                \
    "nt tokens per block, hd head dim, nb blocks.\n\n"                                                                 \
    "universals: a sequence of nb C-contiguous arrays, each [nh, nl, no, nt, hd]\n"                                    \
    "    (heads first: a tensor-parallel rank's heads are one contiguous slice);\n"                                    \
    "    a single 5-D array means nb = 1.\n"                                                                           \
    "blocks: a sequence of nb sequences, each holding nl*no C-contiguous chunk\n"                                      \
    "    arrays in [layer][outer] order (chunk l*no + o), each [nt, nh, hd] for\n"                                     \
    "    layout \"NHD\" (vLLM) or [nh, nt, hd] for \"HND\".\n"                                                         \
    "layout: \"NHD\" or \"HND\", any case.\n"                                                                          \
    "stream: None, an int cudaStream_t handle, or an object with __cuda_stream__() or\n"                               \
    "    .cuda_stream (torch.cuda.Stream, CuPy).  None runs where an operation of the\n"                                 \
    "    arrays' framework would: torch's current stream (so inside\n"                                                  \
    "    `with torch.cuda.stream(s)`, on s), a CAI v3 producer's stream, else the\n"                                    \
    "    legacy default stream.\n\n"                                                                                    \
    "Arrays: anything exposing DLPack, __cuda_array_interface__ (v2, v3),\n"                                           \
    "__array_interface__ or the buffer protocol: torch, CuPy, JAX, NumPy.  All\n"                                      \
    "have one element type (any 1-, 2-, 4- or 8-byte type; bytes are copied\n"                                        \
    "exactly).  If every array is in host memory the CPU implementation runs,\n"                                       \
    "without the GIL.  Otherwise every array is on one CUDA device or in pinned\n"                                     \
    "host memory (see backend); pageable host memory is rejected.\n\n"                                                \
    "Streams: the work is enqueued on `stream`, on the arrays' device, and the call\n"                                 \
    "returns without waiting for it.  Producers' pending work is ordered first:\n"                                     \
    "DLPack producers receive the stream in __dlpack__(stream=...), and a CAI v3\n"                                    \
    "array's `stream` is made to precede it with an event.\n\n"                                                        \
    "Every argument is checked before anything is written: ValueError for counts,\n"                                   \
    "shapes, layout, contiguity, placement and read-only destinations, TypeError\n"                                    \
    "for element types and non-arrays; the message names the argument, e.g.\n"                                        \
    "blocks[3][17].  nb = 0 does nothing.\n"

#define OPERATIONAL_DOC                                                                                                \
    "operationals: a sequence of nb C-contiguous arrays, each [nl, no, nt*nh*hd]:\n"                                   \
    "    one buffer per block (TensorRT-LLM), chunk (l, o) at operational[l, o, :]\n"                                  \
    "    in the chunk's own order; a single 3-D array means nb = 1.\n"

#define BACKEND_DOC                                                                                                    \
    "backend (for device or pinned arrays; all-host calls run on the CPU): \"auto\"\n"                                 \
    "    (default): the copy engines whenever pinned host memory takes part, the SM\n"                                 \
    "    kernel device to device.  \"copy_engines\": the copy engines carry every byte\n"                              \
    "    that crosses PCIe; where bytes are rearranged a kernel on a few CTAs permutes\n"                              \
    "    them into (or out of) device staging memory, pipelined with the copies\n"                                   \
    "    (set_staging()), so the SMs stay with the model running beside the transfer.\n"                              \
    "    \"batch\" and \"async\" are copy engines too, driven by cudaMemcpyBatchAsync or\n"                          \
    "    by one cudaMemcpyAsync per contiguous run.  \"kernel\": SM kernels move every\n"                             \
    "    byte, reading and writing pinned host memory directly.\n"                                                     \
    "num_ctas: None or the most CUDA blocks the kernel (or the staged permute) may\n"                                  \
    "    use.  None: no bound device to device; 8 when pinned host memory takes\n"                                   \
    "    part.  The bytes moved are the same.\n"                                                                       \
    "KVBM_EXT_DEBUG=1 logs the path that ran (staged, copy_engines, kernel) and why.\n"

/* Every conversion has the same form: (source, destination, [layout], *,
 * backend, num_ctas, stream), with the flat side first or second by
 * direction. */
typedef struct {
    const char *format; /* PyArg format, with the function's name */
    kv_conversion conversion;
    int to_flat;        /* the destination is the flat side (see convert.h) */
    int has_layout;
} kv_conversion_form;

static PyObject *convert(PyObject *module, PyObject *args, PyObject *kwargs, const kv_conversion_form *form)
{
    static char *with_layout[] = {"", "", "layout", "backend", "num_ctas", "stream", NULL};
    static char *without_layout[] = {"", "", "backend", "num_ctas", "stream", NULL};
    PyObject *source, *destination, *layout = NULL, *backend = NULL, *num_ctas = NULL, *stream = Py_None;
    const int parsed = form->has_layout
        ? PyArg_ParseTupleAndKeywords(args, kwargs, form->format, with_layout, &source, &destination, &layout,
                                      &backend, &num_ctas, &stream)
        : PyArg_ParseTupleAndKeywords(args, kwargs, form->format, without_layout, &source, &destination, &backend,
                                      &num_ctas, &stream);
    if (!parsed)
        return NULL;
    PyObject *flat = form->to_flat ? destination : source;
    PyObject *other = form->to_flat ? source : destination;
    if (kv_convert(state_of(module)->gpu, form->conversion, form->to_flat, flat, other, layout, backend, num_ctas,
                   stream) < 0)
        return NULL;
    Py_RETURN_NONE;
}

#define DEFINE_CONVERSION(name, format, conversion, to_flat, has_layout)                                               \
    static PyObject *name(PyObject *module, PyObject *args, PyObject *kwargs)                                          \
    {                                                                                                                  \
        static const kv_conversion_form form = {format, conversion, to_flat, has_layout};                             \
        return convert(module, args, kwargs, &form);                                                                   \
    }

PyDoc_STRVAR(block_to_universal_doc,
             "block_to_universal(blocks, universals, /, layout='NHD', *, backend='auto', num_ctas=None, "
             "stream=None)\n--\n\n"
             "Copy nb blocks from block-stack chunks into universal blocks:\n"
             "universals[b][h, l, o, t, :] = blocks[b][l*no + o][t, h, :] (NHD)\n"
             "                             or blocks[b][l*no + o][h, t, :] (HND).\n\n" SHAPES_DOC);
DEFINE_CONVERSION(block_to_universal, "OO|O$OOO:block_to_universal", KV_BLOCK_UNIVERSAL, 1, 1)

PyDoc_STRVAR(universal_to_block_doc,
             "universal_to_block(universals, blocks, /, layout='NHD', *, backend='auto', num_ctas=None, "
             "stream=None)\n--\n\n"
             "Copy nb universal blocks into block-stack chunks, the inverse of\n"
             "block_to_universal: blocks[b][l*no + o][t, h, :] = universals[b][h, l, o, t, :]\n"
             "for NHD ([h, t, :] for HND).\n\n" BACKEND_DOC "\n" SHAPES_DOC);
DEFINE_CONVERSION(universal_to_block, "OO|O$OOO:universal_to_block", KV_BLOCK_UNIVERSAL, 0, 1)

PyDoc_STRVAR(block_to_operational_doc,
             "block_to_operational(blocks, operationals, /, *, backend='auto', num_ctas=None, stream=None)\n--\n\n"
             "Copy nb blocks from block-stack chunks into operational blocks:\n"
             "operationals[b][l, o, :] = blocks[b][l*no + o].reshape(-1).  Chunks keep their\n"
             "own order (NHD or HND) and all have the shape of blocks[0][0].\n\n" OPERATIONAL_DOC BACKEND_DOC
             "\n" SHAPES_DOC);
DEFINE_CONVERSION(block_to_operational, "OO|$OOO:block_to_operational", KV_BLOCK_OPERATIONAL, 1, 0)

PyDoc_STRVAR(operational_to_block_doc,
             "operational_to_block(operationals, blocks, /, *, backend='auto', num_ctas=None, stream=None)\n--\n\n"
             "Copy nb operational blocks into block-stack chunks, the inverse of\n"
             "block_to_operational: blocks[b][l*no + o] = operationals[b][l, o, :] reshaped.\n\n" OPERATIONAL_DOC
             BACKEND_DOC "\n" SHAPES_DOC);
DEFINE_CONVERSION(operational_to_block, "OO|$OOO:operational_to_block", KV_BLOCK_OPERATIONAL, 0, 0)

PyDoc_STRVAR(universal_to_operational_doc,
             "universal_to_operational(universals, operationals, /, layout='NHD', *, backend='auto', num_ctas=None, "
             "stream=None)\n--\n\n"
             "Copy nb universal blocks into operational blocks in one pass:\n"
             "operationals[b][l, o].view(nt, nh, hd)[t, h, :] = universals[b][h, l, o, t, :]\n"
             "for NHD (.view(nh, nt, hd)[h, t, :] for HND).\n\n" OPERATIONAL_DOC BACKEND_DOC "\n" SHAPES_DOC);
DEFINE_CONVERSION(universal_to_operational, "OO|O$OOO:universal_to_operational", KV_UNIVERSAL_OPERATIONAL, 0, 1)

PyDoc_STRVAR(operational_to_universal_doc,
             "operational_to_universal(operationals, universals, /, layout='NHD', *, backend='auto', num_ctas=None, "
             "stream=None)\n--\n\n"
             "Copy nb operational blocks into universal blocks in one pass, the inverse of\n"
             "universal_to_operational.\n\n" OPERATIONAL_DOC BACKEND_DOC "\n" SHAPES_DOC);
DEFINE_CONVERSION(operational_to_universal, "OO|O$OOO:operational_to_universal", KV_UNIVERSAL_OPERATIONAL, 1, 1)

/* ------------------------------------------------------------ raw copies */

#define PAIRS_DOC                                                                                                      \
    "src_ptrs, dst_ptrs: a sequence of int addresses, or a 1-D int64/uint64 array.\n"                                  \
    "sizes: one int (bytes, every pair) or one per pair, in the same forms.\n"                                         \
    "stream: as for the conversions; the work is enqueued and not waited for.\n"                                       \
    "The lists are read before the call returns.  Zero-size pairs are skipped.\n"

PyDoc_STRVAR(vectorized_copy_doc,
             "vectorized_copy(src_ptrs, dst_ptrs, sizes, *, stream=None)\n--\n\n"
             "Copy sizes[i] bytes from src_ptrs[i] to dst_ptrs[i] for every pair, in one kernel\n"
             "launch.  Each pair moves with the widest vector (16, 8, 4, 2 or 1 bytes) that its\n"
             "two addresses and its size allow.  Addresses are in device memory of one GPU or\n"
             "in pinned host memory, which the kernel reaches over PCIe.\n\n" PAIRS_DOC
             "The lists may also be CUDA device arrays, which the kernel reads itself; their\n"
             "addresses are then not checked.  Host lists are checked before anything is\n"
             "copied: no null address, no pageable host memory, every range inside one\n"
             "allocation, device memory on one device (ValueError naming the entry).");

static PyObject *vectorized_copy(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"src_ptrs", "dst_ptrs", "sizes", "stream", NULL};
    PyObject *src, *dst, *sizes, *stream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|$O:vectorized_copy", keywords, &src, &dst, &sizes, &stream))
        return NULL;
    if (kv_vectorized_copy(state_of(module)->gpu, src, dst, sizes, stream) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(memcpy_batch_doc,
             "memcpy_batch(src_ptrs, dst_ptrs, sizes, *, mode='batched_with_fallback', stream=None)\n--\n\n"
             "Copy every pair with the copy engines: cudaMemcpyBatchAsync where the build and\n"
             "the driver have it (CUDA 12.8+), else one cudaMemcpyAsync per pair.  Any memory\n"
             "cudaMemcpyAsync accepts (device, pinned or pageable host).  On the legacy default\n"
             "stream, which the batch API rejects, the batch runs on an internal stream ordered\n"
             "after and before the caller's with events, so the stream semantics are unchanged.\n\n" PAIRS_DOC
             "The lists must be in host memory.\n"
             "mode: \"batched_with_fallback\" (batch, else the loop), \"fallback_only\" (the\n"
             "loop), \"batch_without_fallback\" (RuntimeError naming the CUDA error instead of\n"
             "falling back).  KVBM_EXT_DEBUG=1 logs what ran, and why, to stderr.");

static PyObject *memcpy_batch(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"src_ptrs", "dst_ptrs", "sizes", "mode", "stream", NULL};
    PyObject *src, *dst, *sizes, *mode = NULL, *stream = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|$OO:memcpy_batch", keywords, &src, &dst, &sizes, &mode,
                                     &stream))
        return NULL;
    if (kv_memcpy_batch(state_of(module)->gpu, src, dst, sizes, mode, stream) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(is_memcpy_batch_available_doc,
             "is_memcpy_batch_available($module, /)\n--\n\n"
             "True when this build (CUDA 12.8 or newer) and the running driver both support\n"
             "cudaMemcpyBatchAsync.");

static PyObject *is_memcpy_batch_available(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyBool_FromLong(kv_gpu_batch_available());
}

/* ------------------------------------------------------------ staging */

/* The device a staging function names, from its one optional argument
 * `device` (`format` holds the function's name): None for the current one.
 * -1 with an exception. */
static int staging_device(PyObject *args, PyObject *kwargs, const char *format)
{
    static char *keywords[] = {"device", NULL};
    PyObject *device = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, format, keywords, &device))
        return -1;
    if (device == Py_None)
        return kv_gpu_current_device();
    int64_t index;
    if (kv_parse_int(device, "device", 0, INT32_MAX, 0, 0, &index) < 0)
        return -1;
    const int count = kv_gpu_device_count();
    if (index >= count) {
        PyErr_Format(PyExc_ValueError, "device: cuda:%lld does not exist (%d CUDA devices)", (long long)index, count);
        return -1;
    }
    return (int)index;
}

PyDoc_STRVAR(set_staging_doc,
             "set_staging(size_bytes=None, *, lanes=None)\n--\n\n"
             "Size the device staging memory of the copy-engine path (backend \"auto\" or\n"
             "\"copy_engines\" with pinned host memory): size_bytes per CUDA device (at least\n"
             "1 MiB; default 64 MiB), split into `lanes` (1 to 16; default 2).  A lane serves\n"
             "one stream at a time: calls on up to `lanes` streams at once never share staging,\n"
             "more queue behind each other.  None keeps the current value.  Staging already\n"
             "allocated is freed (after the work that uses it) and allocated anew, at the new\n"
             "size, by the next call that needs it.");

static PyObject *set_staging(PyObject *module, PyObject *args, PyObject *kwargs)
{
    static char *keywords[] = {"size_bytes", "lanes", NULL};
    PyObject *size = Py_None, *lanes = Py_None;
    int64_t bytes, count;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|O$O:set_staging", keywords, &size, &lanes)
        || kv_parse_int(size, "size_bytes", (int64_t)1 << 20, (int64_t)1 << 40, -1, 1, &bytes) < 0
        || kv_parse_int(lanes, "lanes", 1, 16, -1, 1, &count) < 0
        || kv_gpu_set_staging(state_of(module)->gpu, bytes, (int)count) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(reserve_staging_doc,
             "reserve_staging(device=None)\n--\n\n"
             "Allocate the staging memory of `device` (an index; None: the current device)\n"
             "now rather than on first need, and the lane that staged calls use while their\n"
             "stream is captured into a CUDA graph.  Call it before capturing such calls.\n"
             "Graphs holding staged calls share that lane: do not replay two of them at once\n"
             "on different streams.  RuntimeError without a CUDA device.");

static PyObject *reserve_staging(PyObject *module, PyObject *args, PyObject *kwargs)
{
    const int index = staging_device(args, kwargs, "|O:reserve_staging");
    if (index < 0 || kv_gpu_reserve_staging(state_of(module)->gpu, index) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(staging_info_doc,
             "staging_info(device=None)\n--\n\n"
             "The staging memory of `device` (None: the current device): {\"device\",\n"
             "\"size_bytes\", \"lanes\", \"lane_bytes\", \"allocated\", \"capture_reserved\"}.\n"
             "RuntimeError without a CUDA device.");

static PyObject *staging_info(PyObject *module, PyObject *args, PyObject *kwargs)
{
    const int index = staging_device(args, kwargs, "|O:staging_info");
    return index < 0 ? NULL : kv_gpu_staging_info(state_of(module)->gpu, index);
}

/* ------------------------------------------------------------ build facts */

PyDoc_STRVAR(is_using_stubs_doc,
             "is_using_stubs($module, /)\n--\n\n"
             "True when the package was built without nvcc: host arrays still work, and\n"
             "every call with a device array raises RuntimeError.");

static PyObject *is_using_stubs(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyBool_FromLong(!kv_gpu_compiled());
}

PyDoc_STRVAR(build_info_doc,
             "build_info($module, /)\n--\n\n"
             "How this extension was built: 'version', 'cuda_version' (the toolkit's, or\n"
             "None), 'cuda_archs' (the GPU code embedded: sm_XX machine code, compute_XX\n"
             "PTX) and 'with_cuda'.");

static PyObject *build_info(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
#ifdef KVBM_CUDA_VERSION
    PyObject *joined = PyUnicode_FromString(KVBM_CUDA_ARCHS); /* "sm_80;sm_90;compute_90" */
    PyObject *separator = PyUnicode_FromString(";");
    PyObject *archs = joined && separator ? PyUnicode_Split(joined, separator, -1) : NULL;
    Py_XDECREF(joined);
    Py_XDECREF(separator);
    PyObject *info = archs == NULL ? NULL
                                   : Py_BuildValue("{s:s,s:s,s:O,s:O}", "version", KVBM_VERSION, "cuda_version",
                                                   KVBM_CUDA_VERSION, "cuda_archs", archs, "with_cuda", Py_True);
    Py_XDECREF(archs);
    return info;
#else
    return Py_BuildValue("{s:s,s:O,s:[],s:O}", "version", KVBM_VERSION, "cuda_version", Py_None, "cuda_archs",
                         "with_cuda", Py_False);
#endif
}

PyDoc_STRVAR(cuda_devices_doc,
             "cuda_devices($module, /)\n--\n\n"
             "The visible CUDA devices: 'index', 'name', 'capability' (major, minor),\n"
             "'total_memory' (bytes) and 'multiprocessors'.  Empty when there is no GPU,\n"
             "no driver, or no CUDA in this build.");

static PyObject *cuda_devices(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return kv_gpu_devices();
}

/* ------------------------------------------------------------ the module */

static PyMethodDef module_methods[] = {
    {"block_to_universal", (PyCFunction)(void (*)(void))block_to_universal, METH_VARARGS | METH_KEYWORDS,
     block_to_universal_doc},
    {"universal_to_block", (PyCFunction)(void (*)(void))universal_to_block, METH_VARARGS | METH_KEYWORDS,
     universal_to_block_doc},
    {"block_to_operational", (PyCFunction)(void (*)(void))block_to_operational, METH_VARARGS | METH_KEYWORDS,
     block_to_operational_doc},
    {"operational_to_block", (PyCFunction)(void (*)(void))operational_to_block, METH_VARARGS | METH_KEYWORDS,
     operational_to_block_doc},
    {"universal_to_operational", (PyCFunction)(void (*)(void))universal_to_operational,
     METH_VARARGS | METH_KEYWORDS, universal_to_operational_doc},
    {"operational_to_universal", (PyCFunction)(void (*)(void))operational_to_universal,
     METH_VARARGS | METH_KEYWORDS, operational_to_universal_doc},
    {"vectorized_copy", (PyCFunction)(void (*)(void))vectorized_copy, METH_VARARGS | METH_KEYWORDS,
     vectorized_copy_doc},
    {"memcpy_batch", (PyCFunction)(void (*)(void))memcpy_batch, METH_VARARGS | METH_KEYWORDS, memcpy_batch_doc},
    {"is_memcpy_batch_available", is_memcpy_batch_available, METH_NOARGS, is_memcpy_batch_available_doc},
    {"set_staging", (PyCFunction)(void (*)(void))set_staging, METH_VARARGS | METH_KEYWORDS, set_staging_doc},
    {"reserve_staging", (PyCFunction)(void (*)(void))reserve_staging, METH_VARARGS | METH_KEYWORDS,
     reserve_staging_doc},
    {"staging_info", (PyCFunction)(void (*)(void))staging_info, METH_VARARGS | METH_KEYWORDS, staging_info_doc},
    {"is_using_stubs", is_using_stubs, METH_NOARGS, is_using_stubs_doc},
    {"build_info", build_info, METH_NOARGS, build_info_doc},
    {"cuda_devices", cuda_devices, METH_NOARGS, cuda_devices_doc},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *module)
{
    kv_state *state = state_of(module);
    state->gpu = kv_gpu_new();
    if (state->gpu == NULL || kv_paged_add_type(module) < 0)
        return -1;
    return PyModule_AddStringConstant(module, "__version__", KVBM_VERSION);
}

static void module_free(void *module)
{
    kv_state *state = state_of((PyObject *)module);
    if (state != NULL) {
        kv_gpu_free(state->gpu);
        state->gpu = NULL;
    }
}

static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
    {0, NULL},
};

PyDoc_STRVAR(module_doc, "kvbm_ext._C: KV-cache block layout conversions on CUDA GPUs and the CPU.");

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "kvbm_ext._C",
    .m_doc = module_doc,
    .m_size = sizeof(kv_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
