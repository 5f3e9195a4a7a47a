/* kvbm_ext.PagedKVCache: its methods, attributes and the type.  See
 * paged.h and paged_internal.h. */
#include "paged_internal.h"

#include <stddef.h>

/* The four methods: their arguments read by kv_paged_<name>_signature
 * (signatures.c), their call by kv_paged_transfer. */
#define DEFINE_TRANSFER(name, to_flat, universal)                                                                      \
    static PyObject *name(kv_paged_cache *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)            \
    {                                                                                                                  \
        static const kv_paged_form form = {&kv_paged_##name##_signature, "PagedKVCache." #name, to_flat, universal};   \
        return kv_paged_transfer(self, args, nargs, kwnames, &form);                                                   \
    }

#define COMMON_DOC                                                                                                     \
    "block_ids: a sequence of ints, or a 1-D int32/int64 array in host memory or on the\n"                             \
    "    cache's device (nb = its length; nb = 0 does nothing).  Host ids must lie in\n"                               \
    "    [0, num_blocks) and, where the cache is written, appear once (ValueError).\n"                                 \
    "    Device ids are not read on the host (that would need a synchronization): the\n"                               \
    "    kernel skips a block whose id is outside [0, num_blocks), and repeated ids\n"                                 \
    "    are not detected.\n"                                                                                          \
    "layers: None (every layer), an int, a slice or a range of cache layers.  One rule\n"                              \
    "    for layers= and heads=: Python's meaning of negative indices and steps, but a\n"                              \
    "    bound outside the cache is a ValueError (not clipped), an empty selection is\n"                               \
    "    a ValueError, and a bound that is not an int (or whose __index__ raises) a\n"                                 \
    "    TypeError.  A call that writes the cache refuses to write two layers that\n"                                  \
    "    share memory (ValueError naming both).\n"                                                                     \
    "backend: \"auto\" (default): with universal or operational blocks in pinned host\n"                               \
    "    memory, the copy engines carry the bytes over PCIe and a kernel on a few CTAs\n"                              \
    "    rearranges them through device staging memory (set_staging(),\n"                                              \
    "    reserve_staging()), leaving the SMs to the model; device to device, the\n"                                    \
    "    kernel.  \"copy_engines\" (or \"batch\", or \"async\": one cudaMemcpyAsync per\n"                             \
    "    run) asks for the copy engines, \"kernel\" for SM kernels reading and writing\n"                              \
    "    pinned memory directly.  KVBM_EXT_DEBUG=1 logs the path taken and why.\n"                                     \
    "num_ctas: None or the most CUDA blocks the kernel (or the staged permute) may\n"                                  \
    "    use, to bound the SMs a transfer takes beside the model; None: no bound\n"                                    \
    "    device to device, 8 with pinned memory.  The bytes moved are the same.\n"                                     \
    "stream: None, an int cudaStream_t, or an object with __cuda_stream__() or\n"                                      \
    "    .cuda_stream.  None runs where an operation of the arrays' framework would:\n"                                \
    "    torch's current stream (inside `with torch.cuda.stream(s)`, on s), else the\n"                                \
    "    legacy default stream.  The work is enqueued and not waited for;\n"                                           \
    "    the call's arrays' producers are ordered before it (DLPack, CAI v3).  The\n"                                  \
    "    cache itself is read at construction: order its writers yourself.\n"                                          \
    "Universal or operational blocks live on the cache's device or in pinned host\n"                                   \
    "memory (host memory for a host cache).  Everything is checked before anything\n"                                  \
    "is written.  With device-resident block_ids and one flat array, a call stages\n"                                  \
    "nothing and synchronizes nothing, so it can be captured in a CUDA graph\n"                                        \
    "(pass the capturing stream) and replayed with new ids written into block_ids;\n"                                  \
    "on the staged path, call reserve_staging() before capturing.  A host cache runs\n"                                \
    "on the CPU: backend, num_ctas and stream keep their defaults there (ValueError).\n"

#define UNIVERSAL_DOC                                                                                                  \
    "universals: a sequence of nb C-contiguous arrays [NH, NL, no, nt, hd], or one\n"                                  \
    "    array [nb, NH, NL, no, nt, hd] whose blocks are C-contiguous, with\n"                                         \
    "    NH >= head_offset + len(heads), NL >= layer_offset + the highest layer moved + 1\n"                           \
    "    (layer_offset + len(layers) with pack_layers=True).\n"                                                        \
    "layer_offset: cache layer l is universal layer l + layer_offset: layers keep their\n"                             \
    "    cache index.  It may be negative down to minus the lowest layer moved, so that\n"                             \
    "    layers=range(a, b), layer_offset=-a fills a block of exactly b - a layers.\n"                                 \
    "    With pack_layers=True, where the packed layers start (at least 0).\n"                                         \
    "pack_layers: False (default): layers keep their cache index, so a stepped\n"                                      \
    "    selection keeps its gaps.  True: the layers moved are numbered as heads are,\n"                               \
    "    the j-th of `layers` on universal layer layer_offset + j, so any selection\n"                                 \
    "    (range(1, 6, 2), slice(None, None, -1)) fills exactly len(layers) layers.\n"                                  \
    "heads: None (every head), an int, a slice or a range of the cache's heads (the\n"                                 \
    "    rule of layers=): the heads moved, in that order, renumbered from head_offset\n"                              \
    "    (a receiver's share when resharding).\n"                                                                      \
    "head_offset: the heads moved are universal heads [head_offset, head_offset +\n"                                   \
    "    len(heads)) (a tensor-parallel rank's slice).  Other heads and layers are not\n"                              \
    "    touched.\n"

#define OPERATIONAL_BLOCKS_DOC                                                                                         \
    "operationals: a sequence of nb C-contiguous arrays [nl, no, nt*nh*hd] (every cache\n"                             \
    "    layer, whatever `layers` selects; nl = len(layers) with pack_layers=True), or\n"                              \
    "    one array [nb, nl, no, nt*nh*hd].\n"                                                                          \
    "pack_layers: False (default): cache layer l is operational layer l.  True: the\n"                                 \
    "    j-th of `layers` is operational layer j, so the operational blocks hold the\n"                                \
    "    layers moved and no other.\n"                                                                                 \
    "layout: the order inside each chunk, \"NHD\" ([nt, nh, hd]) or \"HND\" ([nh, nt, hd]),\n"                         \
    "    any case, as the list API's layout.\n"                                                                        \
    "inner: the deprecated spelling of layout, kept for one release (DeprecationWarning;\n"                            \
    "    TypeError when both are given).\n"

PyDoc_STRVAR(to_universal_doc, KV_PAGED_TO_UNIVERSAL_TEXT_SIGNATURE
             "Copy cache blocks into universal blocks:\n"
             "universals[b][head_offset + j, layer_offset + l, o, t, :] = cache row (block_ids[b], l, o, t, heads[j])\n"
             "for every layer l in `layers` and every j < len(heads) (with pack_layers=True,\n"
             "layer_offset + i for the i-th layer l of `layers`).\n\n" UNIVERSAL_DOC COMMON_DOC);
DEFINE_TRANSFER(to_universal, 1, 1)

PyDoc_STRVAR(from_universal_doc, KV_PAGED_FROM_UNIVERSAL_TEXT_SIGNATURE
             "Copy universal blocks into cache blocks, the inverse of to_universal.\n\n" UNIVERSAL_DOC COMMON_DOC);
DEFINE_TRANSFER(from_universal, 0, 1)

PyDoc_STRVAR(
    to_operational_doc, KV_PAGED_TO_OPERATIONAL_TEXT_SIGNATURE
    "Copy cache blocks into operational blocks:\n"
    "operationals[b][l, o].view(nt, nh, hd)[t, h, :] = cache row (block_ids[b], l, o, t, h)\n"
    "for layout \"NHD\" (.view(nh, nt, hd)[h, t, :] for \"HND\"), for every layer l in\n"
    "`layers` (with pack_layers=True, operationals[b][i] for the i-th layer l).\n\n" OPERATIONAL_BLOCKS_DOC COMMON_DOC);
DEFINE_TRANSFER(to_operational, 1, 0)

PyDoc_STRVAR(
    from_operational_doc, KV_PAGED_FROM_OPERATIONAL_TEXT_SIGNATURE
    "Copy operational blocks into cache blocks, the inverse of to_operational.\n\n" OPERATIONAL_BLOCKS_DOC COMMON_DOC);
DEFINE_TRANSFER(from_operational, 0, 0)

PyDoc_STRVAR(to_cache_doc, KV_PAGED_TO_CACHE_TEXT_SIGNATURE
             "Copy blocks src_ids[b] of this cache into blocks dst_ids[b] of dst, another\n"
             "PagedKVCache of the same num_outer, block_size, head_dim and dtype, in\n"
             "whatever layout each has:\n"
             "dst row (dst_ids[b], l + layer_offset, o, t, head_offset + j) = row (src_ids[b], l, o, t, heads[j])\n"
             "for every layer l in `layers` and every j < len(heads), as to_universal numbers\n"
             "them (with pack_layers=True, dst layer layer_offset + i for the i-th layer l).\n"
             "Other layers, heads and blocks of dst are not touched.\n\n"
             "dst: a PagedKVCache sharing no memory with this one; on the same CUDA device, or\n"
             "    one of the two in pinned host memory (the call runs on the device), or both\n"
             "    in host memory (the call runs on the CPU, releasing the GIL while it copies\n"
             "    64 KiB or more).\n"
             "src_ids, dst_ids: as block_ids below, of equal length; dst_ids name blocks of\n"
             "    dst (each once, where they are on the host).\n"
             "layers, heads: of this cache, as for to_universal.\n"
             "layer_offset, head_offset: where they land in dst, as for to_universal.\n"
             "pack_layers: False (default): source layer l lands on dst layer l + layer_offset.\n"
             "    True: the j-th of `layers` lands on dst layer layer_offset + j (layer_offset\n"
             "    at least 0), as to_universal numbers them.\n"
             "Device to device: one kernel launch for every layer and block.  With a cache in\n"
             "pinned host memory whose ids are on the host, \"auto\" stages the move: the copy\n"
             "engines carry the pinned cache's blocks in its own layout, and a kernel on a\n"
             "few CTAs rearranges them in device staging memory.\n"
             "defer: False (default): returns None.  True: a staged call's pieces are\n"
             "    enqueued by the device's enqueue thread after the call returns, the stream\n"
             "    made to wait for them; returns a kvbm_ext.Deferred, whose result() raises\n"
             "    where enqueuing them failed.\n" COMMON_DOC);

static PyObject *to_cache(kv_paged_cache *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    return kv_paged_to_cache(self, args, nargs, kwnames);
}

static PyMethodDef paged_methods[] = {
    {"to_universal", (PyCFunction)(void (*)(void))to_universal, METH_FASTCALL | METH_KEYWORDS, to_universal_doc},
    {"from_universal", (PyCFunction)(void (*)(void))from_universal, METH_FASTCALL | METH_KEYWORDS, from_universal_doc},
    {"to_operational", (PyCFunction)(void (*)(void))to_operational, METH_FASTCALL | METH_KEYWORDS, to_operational_doc},
    {"from_operational", (PyCFunction)(void (*)(void))from_operational, METH_FASTCALL | METH_KEYWORDS,
     from_operational_doc},
    {"to_cache", (PyCFunction)(void (*)(void))to_cache, METH_FASTCALL | METH_KEYWORDS, to_cache_doc},
    {NULL, NULL, 0, NULL},
};

/* ------------------------------------------------------------ attributes */

/* The int64 members, by offset, served by one getter. */
#define INT_MEMBER(name) (void *)offsetof(kv_paged_cache, name)

static PyObject *get_int(kv_paged_cache *self, void *offset)
{
    return PyLong_FromLongLong(*(const int64_t *)((const char *)self + (size_t)offset));
}

static PyObject *get_dtype(kv_paged_cache *self, void *unused)
{
    (void)unused;
    return self->dtype_object != NULL ? Py_NewRef(self->dtype_object) : kv_paged_dtype_name(self);
}

static PyObject *get_device(kv_paged_cache *self, void *unused)
{
    (void)unused;
    return self->device_object != NULL ? Py_NewRef(self->device_object) : kv_paged_device_name(self);
}

static PyObject *get_dtype_name(kv_paged_cache *self, void *unused)
{
    (void)unused;
    return kv_paged_dtype_name(self);
}

static PyObject *get_device_name(kv_paged_cache *self, void *unused)
{
    (void)unused;
    return kv_paged_device_name(self);
}

static PyObject *get_layout(kv_paged_cache *self, void *unused)
{
    (void)unused;
    return Py_NewRef(self->dims);
}

static PyObject *get_layers(kv_paged_cache *self, void *unused)
{
    (void)unused;
    return Py_NewRef(self->layers);
}

/* The names kept for one release: a DeprecationWarning naming the new one. */
static int deprecated(const char *alias, const char *name)
{
    return PyErr_WarnFormat(PyExc_DeprecationWarning, 1, "PagedKVCache.%s is deprecated, read PagedKVCache.%s", alias,
                            name);
}

static PyObject *get_tokens_per_block(kv_paged_cache *self, void *unused)
{
    (void)unused;
    return deprecated("tokens_per_block", "block_size") < 0 ? NULL : PyLong_FromLongLong(self->nt);
}

static PyObject *get_dims(kv_paged_cache *self, void *unused)
{
    (void)unused;
    return deprecated("dims", "layout") < 0 ? NULL : Py_NewRef(self->dims);
}

static PyGetSetDef paged_getset[] = {
    {"layout", (getter)get_layout, NULL, "the layout given at construction, in lower case", NULL},
    {"block_size", (getter)get_int, NULL,
     "nt: tokens per block (block_size= as given, or the size of the layout's 't')", INT_MEMBER(nt)},
    {"num_layers", (getter)get_int, NULL, "nl: layers in the cache", INT_MEMBER(nl)},
    {"num_blocks", (getter)get_int, NULL, "blocks per layer (valid ids: 0 .. num_blocks - 1)", INT_MEMBER(num_blocks)},
    {"num_heads", (getter)get_int, NULL, "nh: KV heads (1 without an 'h' in the layout)", INT_MEMBER(nh)},
    {"head_dim", (getter)get_int, NULL, "hd: elements per head and token", INT_MEMBER(hd)},
    {"num_outer", (getter)get_int, NULL, "no: 2 for K and V (a 'k' in the layout, or (K, V) pairs), else 1",
     INT_MEMBER(no)},
    {"itemsize", (getter)get_int, NULL, "bytes per element", INT_MEMBER(itemsize)},
    {"dtype", (getter)get_dtype, NULL,
     "element type, as the framework of the arrays names it: a torch.dtype for torch tensors, a numpy.dtype for "
     "NumPy arrays (where NumPy has the type), else dtype_name",
     NULL},
    {"device", (getter)get_device, NULL,
     "where the arrays are: a torch.device for torch tensors, else device_name ('cuda:N' or 'cpu')", NULL},
    {"dtype_name", (getter)get_dtype_name, NULL, "the element type's name, e.g. 'bfloat16'", NULL},
    {"device_name", (getter)get_device_name, NULL, "'cuda:N', or 'cpu' for a cache in host memory", NULL},
    {"layers", (getter)get_layers, NULL, "the arrays given at construction (the cache keeps them alive)", NULL},
    {"tokens_per_block", (getter)get_tokens_per_block, NULL,
     "deprecated alias of block_size, kept for one release (DeprecationWarning)", NULL},
    {"dims", (getter)get_dims, NULL, "deprecated alias of layout, kept for one release (DeprecationWarning)", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

/* Every value shown as repr() of its attribute, under the attribute's name
 * (the constructor's for layout and block_size). */
static PyObject *paged_repr(kv_paged_cache *self)
{
    PyObject *dtype = get_dtype(self, NULL);
    PyObject *device = dtype == NULL ? NULL : get_device(self, NULL);
    PyObject *repr = device == NULL ? NULL
                                    : PyUnicode_FromFormat("PagedKVCache(layout=%R, block_size=%lld, num_layers=%lld, "
                                                           "num_blocks=%lld, num_outer=%lld, num_heads=%lld, "
                                                           "head_dim=%lld, dtype=%R, device=%R)",
                                                           self->dims, (long long)self->nt, (long long)self->nl,
                                                           (long long)self->num_blocks, (long long)self->no,
                                                           (long long)self->nh, (long long)self->hd, dtype, device);
    Py_XDECREF(dtype);
    Py_XDECREF(device);
    return repr;
}

PyDoc_STRVAR(paged_doc, KV_PAGED_NEW_TEXT_SIGNATURE
             "A serving worker's KV cache, described once: the blocks of every layer are\n"
             "addressed by block id, and each call moves nb blocks to or from universal or\n"
             "operational blocks in one kernel launch, with a host cost that does not grow\n"
             "with the number of layers or chunks.\n\n"
             "layers: a sequence of nl per-layer arrays, a sequence of nl (K, V) pairs of\n"
             "    arrays (K and V in separate arrays: no = 2), or one array holding every\n"
             "    layer.\n"
             "layout: one letter per dimension of each array, in its logical order: l layer\n"
             "    (only for one all-layer array), k K/V (absent: no = 1, or 2 for pairs), b\n"
             "    block, t token, h head (absent: nh = 1), d head dim.  Letters in\n"
             "    parentheses share one dimension, their row-major product: t's size is\n"
             "    block_size, k's 2, and one other letter takes the rest.  E.g. \"kbthd\"\n"
             "    (vLLM FlashAttention before K|V packing, [2, num_blocks, nt, nh, hd]),\n"
             "    \"bth(kd)\" (vLLM's packed K|V in memory order), \"bkthd\" (FlashInfer),\n"
             "    \"btd\" (MLA), \"blkthd\" (one cross-layer array), \"(bt)hd\" (SGLang and\n"
             "    transformers, K and V pairs, with block_size=).\n"
             "block_size: the tokens of a block where the layout groups 't' with 'b'.\n"
             "autograd_checks: True (default): a call writing a torch layer refuses one that\n"
             "    requires grad and bumps its version counter, as an in-place op would\n"
             "    (about 0.1 us a layer a call).  False: neither, for caches autograd never\n"
             "    sees, such as a serving engine's KV cache.\n\n"
             "Attributes: layout and block_size read back as the constructor takes them\n"
             "(layout in lower case; block_size the tokens of a block, given or the size of\n"
             "'t'); num_layers, num_blocks, num_heads, head_dim, num_outer, itemsize, layers.\n"
             "dtype and device as the framework of the first array (layers[0], or its K) has\n"
             "them: a torch.dtype and a torch.device for torch tensors (torch.empty(n,\n"
             "dtype=cache.dtype, device=cache.device)), a numpy.dtype (where NumPy has the\n"
             "type) and \"cpu\" for NumPy arrays, else dtype_name and device_name.  Those two\n"
             "are always the names, e.g. \"bfloat16\" and \"cuda:0\" (what dtype and device\n"
             "were before; str(cache.device) gives it for torch too, str(cache.dtype) does\n"
             "not).  All are made once, at construction, from what the arrays' protocol\n"
             "reported, never from the arrays' own dtype or device attributes.\n"
             "tokens_per_block and dims, the old names of block_size and layout, are kept for\n"
             "one release (DeprecationWarning).\n\n"
             "Strides come from the arrays, so any physical order works (e.g. vLLM's HND\n"
             "memory order behind a \"kbthd\" view); 'd' must have stride 1 element and no\n"
             "stride may be negative.  Every array has one element type (1, 2, 4 or 8 bytes)\n"
             "and all are on one CUDA device, or all in host memory (then calls run on the\n"
             "CPU, releasing the GIL while they copy 64 KiB or more).  The cache keeps the\n"
             "memory of its arrays alive (for DLPack producers, through the capsules' managed\n"
             "tensors) and always moves that memory: re-pointing a layer tensor afterwards\n"
             "with torch's set_ does not change what the cache reads or writes.  A resize that\n"
             "reallocates a layer's memory would free it under the cache, so: NumPy refuses\n"
             "to resize a layer (or the array owning its memory) while the cache lives, even\n"
             "with refcheck=False (the cache holds weak references to them); a cache of one\n"
             "array read through DLPack's C exchange API (torch 2.11+) asks the array at\n"
             "every call where its memory is and raises ValueError naming it if it moved\n"
             "(torch's resize_ growing it, untyped_storage().resize_()); per-layer arrays get\n"
             "that check, one C call per layer moved, under KVBM_EXT_DEBUG=1 (other producers\n"
             "are read again through their protocol then).  Without it, do not resize a\n"
             "per-layer torch tensor the cache holds.  Layers may share memory (one tensor\n"
             "given twice): reading them is fine, a call writing two of them is refused.  The\n"
             "cache holds no device memory of its own: constructing or collecting it never\n"
             "allocates, frees or synchronizes on a device.\n\n"
             "torch tensors are written as a torch in-place operation would write them:\n"
             "from_universal and from_operational refuse a layer tensor that requires grad\n"
             "(asked at each call: autograd could not see the write; construct the cache\n"
             "from x.detach(), same memory, to write it anyway), and bump the version\n"
             "counter of every layer tensor they write; to_universal and to_operational do\n"
             "the same for their universals or operationals.");

static PyType_Slot paged_slots[] = {
    {Py_tp_doc, (void *)paged_doc},      {Py_tp_new, kv_paged_new},     {Py_tp_dealloc, kv_paged_dealloc},
    {Py_tp_traverse, kv_paged_traverse}, {Py_tp_clear, kv_paged_clear}, {Py_tp_methods, paged_methods},
    {Py_tp_getset, paged_getset},        {Py_tp_repr, paged_repr},      {0, NULL},
};

/* Not subclassable: methods find the module state through their own type. */
static PyType_Spec paged_spec = {
    .name = "kvbm_ext.PagedKVCache",
    .basicsize = sizeof(kv_paged_cache),
    .flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_IMMUTABLETYPE,
    .slots = paged_slots,
};

int kv_paged_add_type(PyObject *module)
{
    PyObject *type = PyType_FromModuleAndSpec(module, &paged_spec, NULL);
    if (type == NULL)
        return -1;
    const int rc = PyModule_AddObjectRef(module, "PagedKVCache", type);
    Py_DECREF(type);
    return rc;
}
