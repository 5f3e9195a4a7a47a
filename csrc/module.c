/* kvbm_ext._C: the module object, its state and its public functions. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "convert.h"
#include "gpu.h"

#ifndef KVBM_VERSION
#error "KVBM_VERSION must be defined by the build"
#endif

typedef struct {
    kv_gpu *gpu;
} kv_state;

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
    "stream: None (the legacy default stream), an int cudaStream_t handle, or an\n"                                    \
    "    object with __cuda_stream__() or .cuda_stream (torch.cuda.Stream, CuPy).\n\n"                                 \
    "Arrays: anything exposing DLPack, __cuda_array_interface__ (v2, v3),\n"                                           \
    "__array_interface__ or the buffer protocol: torch, CuPy, JAX, NumPy.  All\n"                                      \
    "have one element type (any 1-, 2-, 4- or 8-byte type; bytes are copied\n"                                        \
    "exactly).  If every array is in host memory the CPU implementation runs,\n"                                       \
    "without the GIL.  Otherwise every array is on one CUDA device or in pinned\n"                                     \
    "host memory, which the kernel reads or writes directly; pageable host memory\n"                                   \
    "is rejected.\n\n"                                                                                                 \
    "Streams: the work is enqueued on `stream`, on the arrays' device, and the call\n"                                 \
    "returns without waiting for it.  Producers' pending work is ordered first:\n"                                     \
    "DLPack producers receive the stream in __dlpack__(stream=...), and a CAI v3\n"                                    \
    "array's `stream` is made to precede it with an event.\n\n"                                                        \
    "Every argument is checked before anything is written: ValueError for counts,\n"                                   \
    "shapes, layout, contiguity, placement and read-only destinations, TypeError\n"                                    \
    "for element types and non-arrays; the message names the argument, e.g.\n"                                        \
    "blocks[3][17].  nb = 0 does nothing.\n"

static char *convert_keywords[] = {"", "", "layout", "stream", NULL};

/* Both public conversions: the same arguments, blocks and universals in the
 * order of the direction. */
static PyObject *convert(PyObject *module, PyObject *args, PyObject *kwargs, kvbm_direction direction)
{
    PyObject *source, *destination, *layout = NULL, *stream = Py_None;
    const char *format = direction == KVBM_TO_UNIVERSAL ? "OO|O$O:block_to_universal" : "OO|O$O:universal_to_block";
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, format, convert_keywords, &source, &destination, &layout, &stream))
        return NULL;
    PyObject *blocks = direction == KVBM_TO_UNIVERSAL ? source : destination;
    PyObject *universals = direction == KVBM_TO_UNIVERSAL ? destination : source;
    if (kv_block_universal(state_of(module)->gpu, blocks, universals, layout, stream, direction) < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(block_to_universal_doc,
             "block_to_universal(blocks, universals, layout=\"NHD\", *, stream=None) -> None\n\n"
             "Copy nb blocks from block-stack chunks into universal blocks:\n"
             "universals[b][h, l, o, t, :] = blocks[b][l*no + o][t, h, :] (NHD)\n"
             "                             or blocks[b][l*no + o][h, t, :] (HND).\n\n" SHAPES_DOC);

static PyObject *block_to_universal(PyObject *module, PyObject *args, PyObject *kwargs)
{
    return convert(module, args, kwargs, KVBM_TO_UNIVERSAL);
}

PyDoc_STRVAR(universal_to_block_doc,
             "universal_to_block(universals, blocks, layout=\"NHD\", *, stream=None) -> None\n\n"
             "Copy nb universal blocks into block-stack chunks, the inverse of\n"
             "block_to_universal: blocks[b][l*no + o][t, h, :] = universals[b][h, l, o, t, :]\n"
             "for NHD ([h, t, :] for HND).\n\n" SHAPES_DOC);

static PyObject *universal_to_block(PyObject *module, PyObject *args, PyObject *kwargs)
{
    return convert(module, args, kwargs, KVBM_FROM_UNIVERSAL);
}

/* ------------------------------------------------------------ build facts */

PyDoc_STRVAR(is_using_stubs_doc,
             "is_using_stubs() -> bool\n\n"
             "True when the package was built without nvcc: host arrays still work, and\n"
             "every call with a device array raises RuntimeError.");

static PyObject *is_using_stubs(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyBool_FromLong(!kv_gpu_compiled());
}

PyDoc_STRVAR(build_info_doc,
             "build_info() -> dict\n\n"
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
             "cuda_devices() -> list[dict]\n\n"
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
    {"is_using_stubs", is_using_stubs, METH_NOARGS, is_using_stubs_doc},
    {"build_info", build_info, METH_NOARGS, build_info_doc},
    {"cuda_devices", cuda_devices, METH_NOARGS, cuda_devices_doc},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *module)
{
    kv_state *state = state_of(module);
    state->gpu = kv_gpu_new();
    if (state->gpu == NULL)
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
