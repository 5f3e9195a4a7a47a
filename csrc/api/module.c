/* kvbm_ext._C: the module object, its state and its public functions. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "checksum.h"
#include "convert.h"
#include "copy.h"
#include "deferred.h"
#include "host_buffer.h"
#include "nccl_comm.h"
#include "paged.h"
#include "signatures.h"
#include "staging_api.h"
#include "state.h"
#include "target.h"

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
    "    or one 6-D [nb, nh, nl, no, nt, hd] array whose blocks are each C-contiguous\n"                               \
    "    (any leading stride; a destination's blocks may not overlap); a single\n"                                     \
    "    5-D array means nb = 1.\n"                                                                                    \
    "blocks: a sequence of nb sequences, each holding nl*no C-contiguous chunk\n"                                      \
    "    arrays in [layer][outer] order (chunk l*no + o), each [nt, nh, hd] for\n"                                     \
    "    layout \"NHD\" (vLLM) or [nh, nt, hd] for \"HND\".\n"                                                         \
    "layout: \"NHD\" or \"HND\", any case.\n"                                                                          \
    "stream: None, an int cudaStream_t handle, or an object with __cuda_stream__() or\n"                               \
    "    .cuda_stream (torch.cuda.Stream, CuPy).  None runs where an operation of the\n"                               \
    "    arrays' framework would: torch's current stream (so inside\n"                                                 \
    "    `with torch.cuda.stream(s)`, on s), a CAI v3 producer's stream, else the\n"                                   \
    "    legacy default stream.\n\n"                                                                                   \
    "Arrays: anything exposing DLPack, __cuda_array_interface__ (v2, v3),\n"                                           \
    "__array_interface__ or the buffer protocol: torch, CuPy, JAX, NumPy.  All\n"                                      \
    "have one element type (any 1-, 2-, 4- or 8-byte type; bytes are copied\n"                                         \
    "exactly).  torch tensors with the conjugate or negative bit set are refused\n"                                    \
    "(their bytes are not their values: resolve_conj(), resolve_neg()), and so are\n"                                  \
    "destinations that require grad; a torch destination's version counter is\n"                                       \
    "bumped, as an in-place operation would.\n\n"                                                                      \
    "Memory, the same for every array argument: if every array is in host memory\n"                                    \
    "(pageable or pinned), the CPU implementation runs, without a GPU, releasing\n"                                    \
    "the GIL while it copies 64 KiB or more; backend, num_ctas and stream, which\n"                                    \
    "only a GPU move takes, must then keep their defaults (ValueError naming the\n"                                    \
    "one that does not).  Otherwise every array is in device memory of one CUDA\n"                                     \
    "device or in pinned (page-locked) host memory (see backend); pageable host\n"                                     \
    "memory is then rejected, and so are devices other than CUDA (e.g. torch's\n"                                      \
    "meta).\n\n"                                                                                                       \
    "Streams: the work is enqueued on `stream`, on the arrays' device, and the call\n"                                 \
    "returns without waiting for it.  Producers' pending work is ordered first:\n"                                     \
    "DLPack producers receive the stream in __dlpack__(stream=...), and a CAI v3\n"                                    \
    "array's `stream` is made to precede it with an event.\n\n"                                                        \
    "Every argument is checked before anything is written: ValueError for counts,\n"                                   \
    "shapes, layout, contiguity, placement and read-only destinations, TypeError\n"                                    \
    "for element types and non-arrays; the message names the argument, e.g.\n"                                         \
    "blocks[3][17].  nb = 0 does nothing.\n"

#define OPERATIONAL_DOC                                                                                                \
    "operationals: a sequence of nb C-contiguous arrays, each [nl, no, nt*nh*hd]:\n"                                   \
    "    one buffer per block (TensorRT-LLM), chunk (l, o) at operational[l, o, :]\n"                                  \
    "    in the chunk's own order; or one 4-D [nb, nl, no, nt*nh*hd] array whose\n"                                    \
    "    blocks are each C-contiguous; a single 3-D array means nb = 1.\n"

#define BACKEND_DOC                                                                                                    \
    "backend (calls with an array on a CUDA device; see Memory): \"auto\"\n"                                           \
    "    (default): the copy engines whenever pinned host memory takes part, the SM\n"                                 \
    "    kernel device to device.  \"copy_engines\": the copy engines carry every byte\n"                              \
    "    that crosses PCIe; where bytes are rearranged a kernel on a few CTAs permutes\n"                              \
    "    them into (or out of) device staging memory, pipelined with the copies\n"                                     \
    "    (set_staging()), so the SMs stay with the model running beside the transfer.\n"                               \
    "    \"batch\" and \"async\" are copy engines too, driven by cudaMemcpyBatchAsync or\n"                            \
    "    by one cudaMemcpyAsync per contiguous run.  \"kernel\": SM kernels move every\n"                              \
    "    byte, reading and writing pinned host memory directly.\n"                                                     \
    "num_ctas: None or the most CUDA blocks the kernel (or the staged permute) may\n"                                  \
    "    use.  None: no bound device to device; 8 when pinned host memory takes\n"                                     \
    "    part.  The bytes moved are the same.\n"                                                                       \
    "KVBM_EXT_DEBUG=1 logs the path that ran (staged, copy_engines, kernel) and why.\n"

/* Every conversion reads (source, destination, [layout], *, backend,
 * num_ctas, stream), in the order of its table (signatures.c), into one
 * struct.  Its flat side (the universal or operational blocks; the
 * universal ones between those two) is the destination when `to_flat`. */
static PyObject *convert(PyObject *module, const kv_signature *signature, kv_conversion conversion, int to_flat,
                         PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    kv_conversion_args a;
    if (kv_parse_arguments(signature, args, nargs, kwnames, &a) < 0)
        return NULL;
    PyObject *flat = conversion == KV_BLOCK_OPERATIONAL ? a.operationals : a.universals;
    PyObject *other = conversion == KV_UNIVERSAL_OPERATIONAL ? a.operationals : a.blocks;
    if (kv_convert(state_of(module), conversion, to_flat, flat, other, a.layout, a.backend, a.num_ctas,
                   a.stream != NULL ? a.stream : Py_None)
        < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* The conversion function `name`, whose arguments kv_<name>_signature
 * reads. */
#define DEFINE_CONVERSION(name, conversion, to_flat)                                                                   \
    static PyObject *name(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)                \
    {                                                                                                                  \
        return convert(module, &kv_##name##_signature, conversion, to_flat, args, nargs, kwnames);                     \
    }

PyDoc_STRVAR(block_to_universal_doc, KV_BLOCK_TO_UNIVERSAL_TEXT_SIGNATURE
             "Copy nb blocks from block-stack chunks into universal blocks:\n"
             "universals[b][h, l, o, t, :] = blocks[b][l*no + o][t, h, :] (NHD)\n"
             "                             or blocks[b][l*no + o][h, t, :] (HND).\n\n" BACKEND_DOC "\n" SHAPES_DOC);
DEFINE_CONVERSION(block_to_universal, KV_BLOCK_UNIVERSAL, 1)

PyDoc_STRVAR(universal_to_block_doc, KV_UNIVERSAL_TO_BLOCK_TEXT_SIGNATURE
             "Copy nb universal blocks into block-stack chunks, the inverse of\n"
             "block_to_universal: blocks[b][l*no + o][t, h, :] = universals[b][h, l, o, t, :]\n"
             "for NHD ([h, t, :] for HND).\n\n" BACKEND_DOC "\n" SHAPES_DOC);
DEFINE_CONVERSION(universal_to_block, KV_BLOCK_UNIVERSAL, 0)

PyDoc_STRVAR(block_to_operational_doc, KV_BLOCK_TO_OPERATIONAL_TEXT_SIGNATURE
             "Copy nb blocks from block-stack chunks into operational blocks:\n"
             "operationals[b][l, o, :] = blocks[b][l*no + o].reshape(-1).  Chunks keep their\n"
             "own order (NHD or HND) and all have the shape of blocks[0][0].\n\n" OPERATIONAL_DOC BACKEND_DOC
             "\n" SHAPES_DOC);
DEFINE_CONVERSION(block_to_operational, KV_BLOCK_OPERATIONAL, 1)

PyDoc_STRVAR(
    operational_to_block_doc, KV_OPERATIONAL_TO_BLOCK_TEXT_SIGNATURE
    "Copy nb operational blocks into block-stack chunks, the inverse of\n"
    "block_to_operational: blocks[b][l*no + o] = operationals[b][l, o, :] reshaped.\n\n" OPERATIONAL_DOC BACKEND_DOC
    "\n" SHAPES_DOC);
DEFINE_CONVERSION(operational_to_block, KV_BLOCK_OPERATIONAL, 0)

PyDoc_STRVAR(universal_to_operational_doc, KV_UNIVERSAL_TO_OPERATIONAL_TEXT_SIGNATURE
             "Copy nb universal blocks into operational blocks in one pass:\n"
             "operationals[b][l, o].view(nt, nh, hd)[t, h, :] = universals[b][h, l, o, t, :]\n"
             "for NHD (.view(nh, nt, hd)[h, t, :] for HND).\n\n" OPERATIONAL_DOC BACKEND_DOC "\n" SHAPES_DOC);
DEFINE_CONVERSION(universal_to_operational, KV_UNIVERSAL_OPERATIONAL, 0)

PyDoc_STRVAR(operational_to_universal_doc, KV_OPERATIONAL_TO_UNIVERSAL_TEXT_SIGNATURE
             "Copy nb operational blocks into universal blocks in one pass, the inverse of\n"
             "universal_to_operational.\n\n" OPERATIONAL_DOC BACKEND_DOC "\n" SHAPES_DOC);
DEFINE_CONVERSION(operational_to_universal, KV_UNIVERSAL_OPERATIONAL, 1)

/* ------------------------------------------------------------ raw copies */

#define PAIRS_DOC                                                                                                      \
    "src_ptrs, dst_ptrs: a sequence of int addresses, or a 1-D int64/uint64 array.\n"                                  \
    "sizes: one int (bytes, every pair; a NumPy integer scalar too) or one per\n"                                      \
    "    pair, in the same forms.  An int is an int or any object with __index__\n"                                    \
    "    (np.int64 and np.uint64 items of list(array) too), never a bool.\n"                                           \
    "stream: None (the legacy default stream), an int cudaStream_t handle, or an\n"                                    \
    "    object with __cuda_stream__() or .cuda_stream; the work is enqueued and not\n"                                \
    "    waited for.  The lists are read before the call returns.  Zero-size pairs\n"                                  \
    "    are skipped, and a call without pairs does nothing.\n"                                                        \
    "Raw copies run on a CUDA device, even between host buffers: without one (no\n"                                    \
    "GPU, no driver, or a build without CUDA) a call with pairs raises RuntimeError.\n"

PyDoc_STRVAR(vectorized_copy_doc, KV_VECTORIZED_COPY_TEXT_SIGNATURE
             "Copy sizes[i] bytes from src_ptrs[i] to dst_ptrs[i] for every pair, in one kernel\n"
             "launch.  Each pair moves with the widest vector (16, 8, 4, 2 or 1 bytes) that its\n"
             "two addresses and its size allow.\n\n"
             "Memory: the addresses point into device memory of one CUDA device or into pinned\n"
             "(page-locked) host memory, which the kernel reaches over PCIe; not into pageable\n"
             "host memory (use memcpy_batch).  The lists themselves are in host memory, or are\n"
             "CUDA arrays on that device, which the kernel reads itself (their addresses are\n"
             "then not checked).\n\n" PAIRS_DOC
             "Host lists are checked before anything is copied: no null address, no pageable\n"
             "host memory, every range inside one allocation, device memory on one device, no\n"
             "destination range overlapping another range (ValueError naming the entry).");

static PyObject *vectorized_copy(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    kv_copy_args a;
    if (kv_parse_arguments(&kv_vectorized_copy_signature, args, nargs, kwnames, &a) < 0
        || kv_vectorized_copy(state_of(module), a.src_ptrs, a.dst_ptrs, a.sizes, a.stream != NULL ? a.stream : Py_None)
               < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(memcpy_batch_doc, KV_MEMCPY_BATCH_TEXT_SIGNATURE
             "Copy every pair with the copy engines: cudaMemcpyBatchAsync where the build and\n"
             "the driver have it (CUDA 12.8+), else one cudaMemcpyAsync per pair.  On the legacy\n"
             "default stream, which the batch API rejects, the batch runs on an internal stream\n"
             "ordered after and before the caller's with events, so the stream semantics are\n"
             "unchanged.\n\n"
             "Memory: the addresses point into device memory of one CUDA device, pinned host\n"
             "memory, or pageable host memory (whose ranges the driver cannot bound, so they\n"
             "are not checked against their allocation; CUDA copies pageable memory through\n"
             "its own staging, synchronously with the host for some directions).  The lists\n"
             "themselves must be in host memory (sequences or host arrays).\n\n" PAIRS_DOC
             "mode: \"batched_with_fallback\" (batch, else the loop), \"fallback_only\" (the\n"
             "loop), \"batch_without_fallback\" (RuntimeError naming the CUDA error instead of\n"
             "falling back).  KVBM_EXT_DEBUG=1 logs what ran, and why (logger \"kvbm_ext\").");

static PyObject *memcpy_batch(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    kv_copy_args a;
    if (kv_parse_arguments(&kv_memcpy_batch_signature, args, nargs, kwnames, &a) < 0
        || kv_memcpy_batch(state_of(module), a.src_ptrs, a.dst_ptrs, a.sizes, a.mode,
                           a.stream != NULL ? a.stream : Py_None)
               < 0)
        return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(is_memcpy_batch_available_doc, KV_IS_MEMCPY_BATCH_AVAILABLE_TEXT_SIGNATURE
             "True when this build (CUDA 12.8 or newer) and the running driver both support\n"
             "cudaMemcpyBatchAsync.");

static PyObject *is_memcpy_batch_available(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyBool_FromLong(kv_gpu_batch_available());
}

PyDoc_STRVAR(crc32c_doc, KV_CRC32C_TEXT_SIGNATURE
             "The CRC-32C (Castagnoli) of the bytes of `data`, a C-contiguous array or buffer\n"
             "in host memory (pinned or not), continuing from `value` as zlib.crc32 does:\n"
             "crc32c(b, crc32c(a)) == crc32c(a + b).  The SSE4.2 instruction computes it where\n"
             "the CPU has one; the GIL is released for 64 KiB and more.");

static PyObject *crc32c(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    kv_crc32c_args a;
    if (kv_parse_arguments(&kv_crc32c_signature, args, nargs, kwnames, &a) < 0)
        return NULL;
    return kv_checksum(state_of(module), a.data, a.value);
}

/* ------------------------------------------------------------ build facts */

PyDoc_STRVAR(is_using_stubs_doc, KV_IS_USING_STUBS_TEXT_SIGNATURE
             "True when the package was built without nvcc: host arrays still work, and\n"
             "every call with a device array raises RuntimeError.");

static PyObject *is_using_stubs(PyObject *module, PyObject *unused)
{
    (void)module, (void)unused;
    return PyBool_FromLong(!kv_gpu_compiled());
}

PyDoc_STRVAR(build_info_doc,
             KV_BUILD_INFO_TEXT_SIGNATURE "How this extension was built: 'version', 'cuda_version' (the toolkit's, or\n"
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

PyDoc_STRVAR(cuda_devices_doc, KV_CUDA_DEVICES_TEXT_SIGNATURE
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
    {"block_to_universal", (PyCFunction)(void (*)(void))block_to_universal, METH_FASTCALL | METH_KEYWORDS,
     block_to_universal_doc},
    {"universal_to_block", (PyCFunction)(void (*)(void))universal_to_block, METH_FASTCALL | METH_KEYWORDS,
     universal_to_block_doc},
    {"block_to_operational", (PyCFunction)(void (*)(void))block_to_operational, METH_FASTCALL | METH_KEYWORDS,
     block_to_operational_doc},
    {"operational_to_block", (PyCFunction)(void (*)(void))operational_to_block, METH_FASTCALL | METH_KEYWORDS,
     operational_to_block_doc},
    {"universal_to_operational", (PyCFunction)(void (*)(void))universal_to_operational, METH_FASTCALL | METH_KEYWORDS,
     universal_to_operational_doc},
    {"operational_to_universal", (PyCFunction)(void (*)(void))operational_to_universal, METH_FASTCALL | METH_KEYWORDS,
     operational_to_universal_doc},
    {"vectorized_copy", (PyCFunction)(void (*)(void))vectorized_copy, METH_FASTCALL | METH_KEYWORDS,
     vectorized_copy_doc},
    {"memcpy_batch", (PyCFunction)(void (*)(void))memcpy_batch, METH_FASTCALL | METH_KEYWORDS, memcpy_batch_doc},
    {"is_memcpy_batch_available", is_memcpy_batch_available, METH_NOARGS, is_memcpy_batch_available_doc},
    {"set_staging", (PyCFunction)(void (*)(void))kv_set_staging, METH_FASTCALL | METH_KEYWORDS, kv_set_staging_doc},
    {"reserve_staging", (PyCFunction)(void (*)(void))kv_reserve_staging, METH_FASTCALL | METH_KEYWORDS,
     kv_reserve_staging_doc},
    {"staging_info", (PyCFunction)(void (*)(void))kv_staging_info, METH_FASTCALL | METH_KEYWORDS, kv_staging_info_doc},
    {"is_using_stubs", is_using_stubs, METH_NOARGS, is_using_stubs_doc},
    {"build_info", build_info, METH_NOARGS, build_info_doc},
    {"cuda_devices", cuda_devices, METH_NOARGS, cuda_devices_doc},
    {"pinned_empty", (PyCFunction)(void (*)(void))kv_pinned_empty, METH_FASTCALL | METH_KEYWORDS, kv_pinned_empty_doc},
    {"unlink_shared", (PyCFunction)(void (*)(void))kv_unlink_shared, METH_FASTCALL | METH_KEYWORDS,
     kv_unlink_shared_doc},
    {"crc32c", (PyCFunction)(void (*)(void))crc32c, METH_FASTCALL | METH_KEYWORDS, crc32c_doc},
    {NULL, NULL, 0, NULL},
};

static int module_exec(PyObject *module)
{
    kv_state *state = state_of(module);
    if (kv_protocols_init(&state->protocols) < 0)
        return -1;
    state->gpu = kv_gpu_new();
    if (state->gpu == NULL || kv_paged_add_type(module) < 0
        || kv_host_buffer_add_type(module, &state->host_buffer_type) < 0
        || kv_deferred_add_type(module, &state->deferred_type) < 0 || kv_nccl_comm_add_type(module) < 0)
        return -1;
    return PyModule_AddStringConstant(module, "__version__", KVBM_VERSION);
}

static int module_traverse(PyObject *module, visitproc visit, void *arg)
{
    kv_state *state = state_of(module);
    if (state != NULL) {
        Py_VISIT(state->host_buffer_type);
        Py_VISIT(state->deferred_type);
    }
    return state == NULL ? 0 : kv_protocols_traverse(&state->protocols, visit, arg);
}

static int module_clear(PyObject *module)
{
    kv_state *state = state_of(module);
    if (state != NULL) {
        kv_protocols_clear(&state->protocols);
        Py_CLEAR(state->host_buffer_type);
        Py_CLEAR(state->deferred_type);
    }
    return 0;
}

static void module_free(void *module)
{
    kv_state *state = state_of((PyObject *)module);
    if (state != NULL) {
        kv_protocols_clear(&state->protocols);
        Py_CLEAR(state->host_buffer_type);
        Py_CLEAR(state->deferred_type);
        kv_gpu_free(state->gpu);
        state->gpu = NULL;
    }
}

/* Thread safety: every mutable the module has, and what guards it.
 *
 * File scope: gpu_ranges.c's found_fn (the driver's cuPointerGetAttributes,
 * one per process, shared by every interpreter), an atomic that two threads
 * finding it at once set to the same value; module_def, which
 * PyModuleDef_Init fills in once, under the import lock.  Everything else
 * at file scope is const, or a method, slot or spec table only read.
 *
 * Module state (state.h), one per interpreter:
 * - gpu: set by module_exec, then only read.  What it points at (the
 *   per-device pointer-table rings, staging memory and its lanes, events,
 *   streams, the staging settings) is used with the GIL released, so it has
 *   its own PyThread lock on every build: each GPU call holds it from
 *   choosing a lane or a ring region to its last enqueue (kv_run_on_device),
 *   set_staging and staging_info take it too.  The build without CUDA
 *   keeps only the settings, under a kv_lock (lock.h).
 * - protocols: the names and argument tuples are made by module_exec, then
 *   only read; increment_version is stored once by compare-and-swap and
 *   not replaced before the module is cleared; the cache of type facts
 *   (types, next_type) is read and written under types_lock, a kv_lock.
 * - the PagedKVCache type: immutable.  A cache is written by its
 *   constructor, before another thread can see it, and by tp_clear and
 *   tp_dealloc, once none can; a call's scratch (its repeated-id bits) is
 *   its own.
 * kv_lock is a PyMutex on free-threaded CPython; with a GIL it is nothing,
 * since that GIL already serializes every user of what it guards.
 *
 * Arguments: sequences are read from a tuple snapshot (kv_as_sequence),
 * array-interface dicts from a copy, so no item is borrowed from a
 * container that another thread (or the item's own Python code) can change
 * while the call reads it.  The copies themselves (without the GIL from
 * 64 KiB up, gil.h) touch only the call's arrays and tables.
 *
 * Outside the module: the CUDA runtime is thread-safe, and a call restores
 * the calling thread's current device; KVBM_EXT_DEBUG is read with getenv
 * at each call, so changing the environment while other threads call in is
 * as unsafe as for any C code.
 *
 * So the module declares Py_mod_gil: importing it leaves the GIL of
 * free-threaded CPython off.  And each interpreter may have its own GIL:
 * what the module keeps lives in its state, but for found_fn. */
static PyModuleDef_Slot module_slots[] = {
    {Py_mod_exec, module_exec},
#if PY_VERSION_HEX >= 0x030C0000
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#if PY_VERSION_HEX >= 0x030D0000
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

PyDoc_STRVAR(module_doc, "kvbm_ext._C: KV-cache block layout conversions on CUDA GPUs and the CPU.");

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,         .m_name = "kvbm_ext._C",     .m_doc = module_doc,
    .m_size = sizeof(kv_state),    .m_methods = module_methods, .m_slots = module_slots,
    .m_traverse = module_traverse, .m_clear = module_clear,     .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }
