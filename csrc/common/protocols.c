/* Protocol names and per-type facts.  See protocols.h. */
#include "protocols.h"

#include <string.h>

#include "dlpack.h"

static const char *const NAME_TEXT[KV_NAME_COUNT] = {
    [KV_NAME_DLPACK] = "__dlpack__",
    [KV_NAME_DLPACK_DEVICE] = "__dlpack_device__",
    [KV_NAME_CUDA_ARRAY_INTERFACE] = "__cuda_array_interface__",
    [KV_NAME_ARRAY_INTERFACE] = "__array_interface__",
    [KV_NAME_EXCHANGE_API] = "__dlpack_c_exchange_api__",
    [KV_NAME_DEVICE] = "device",
    [KV_NAME_IS_NEG] = "is_neg",
    [KV_NAME_IS_CONJ] = "is_conj",
    [KV_NAME_REQUIRES_GRAD] = "requires_grad",
    [KV_NAME_IS_INFERENCE] = "is_inference",
    [KV_NAME_BASE] = "_base",
    [KV_NAME_TYPESTR] = "typestr",
    [KV_NAME_SHAPE] = "shape",
    [KV_NAME_STRIDES] = "strides",
    [KV_NAME_DATA] = "data",
    [KV_NAME_MASK] = "mask",
    [KV_NAME_STREAM] = "stream",
    [KV_NAME_TORCH] = "torch",
    [KV_NAME_TENSOR] = "Tensor",
    [KV_NAME_NUMPY] = "numpy",
    [KV_NAME_NDARRAY] = "ndarray",
    [KV_NAME_DTYPE] = "dtype",
};

int kv_protocols_init(kv_protocols *p)
{
    memset(p, 0, sizeof *p);
    for (int i = 0; i < KV_NAME_COUNT; i++)
        if ((p->names[i] = PyUnicode_InternFromString(NAME_TEXT[i])) == NULL)
            goto fail;
    p->dlpack_keywords = Py_BuildValue("(ss)", "stream", "max_version");
    p->stream_keyword = Py_BuildValue("(s)", "stream");
    p->max_version = Py_BuildValue("(ii)", 1, 3);
    if (p->dlpack_keywords != NULL && p->stream_keyword != NULL && p->max_version != NULL)
        return 0;
fail:
    kv_protocols_clear(p);
    return -1;
}

int kv_protocols_traverse(kv_protocols *p, visitproc visit, void *arg)
{
    for (int i = 0; i < KV_TYPES_CACHED; i++) {
        Py_VISIT(p->types[i].type);
        Py_VISIT(p->types[i].is_neg);
        Py_VISIT(p->types[i].is_conj);
        Py_VISIT(p->types[i].exchange_capsule);
    }
    Py_VISIT(p->increment_version);
    return 0;
}

static void clear_facts(kv_type_facts *facts)
{
    Py_CLEAR(facts->type);
    Py_CLEAR(facts->is_neg);
    Py_CLEAR(facts->is_conj);
    Py_CLEAR(facts->exchange_capsule);
    facts->exchange = NULL;
}

void kv_protocols_clear(kv_protocols *p)
{
    for (int i = 0; i < KV_NAME_COUNT; i++)
        Py_CLEAR(p->names[i]);
    Py_CLEAR(p->dlpack_keywords);
    Py_CLEAR(p->stream_keyword);
    Py_CLEAR(p->max_version);
    Py_CLEAR(p->increment_version);
    for (int i = 0; i < KV_TYPES_CACHED; i++)
        clear_facts(&p->types[i]);
}

/* The C exchange API a type offers, and the capsule holding it (a new
 * reference), or both NULL.  Errors are cleared: a type without a usable
 * one is read through the Python protocols. */
static void find_exchange_api(const kv_protocols *p, PyTypeObject *type, kv_type_facts *facts)
{
    PyObject *capsule = PyObject_GetAttr((PyObject *)type, p->names[KV_NAME_EXCHANGE_API]);
    if (capsule == NULL) {
        PyErr_Clear();
        return;
    }
    const DLPackExchangeAPI *api =
        PyCapsule_IsValid(capsule, "dlpack_exchange_api") ? PyCapsule_GetPointer(capsule, "dlpack_exchange_api") : NULL;
    /* A major version other than 1 may have another layout. */
    if (api == NULL || api->header.version.major != 1 || api->dltensor_from_py_object_no_sync == NULL
        || api->current_work_stream == NULL) {
        Py_DECREF(capsule);
        return;
    }
    facts->exchange = api;
    facts->exchange_capsule = capsule;
}

/* For torch.Tensor and its subclasses, the type's is_neg and is_conj
 * (new references), looked up on the type once rather than on each tensor;
 * else both NULL.  torch is looked up among the imported modules only:
 * before torch is imported there is no tensor.  Errors are cleared. */
static void find_torch_flags(const kv_protocols *p, PyTypeObject *type, kv_type_facts *facts)
{
    PyObject *torch = PyImport_GetModule(p->names[KV_NAME_TORCH]);
    PyObject *tensor = torch == NULL ? NULL : PyObject_GetAttr(torch, p->names[KV_NAME_TENSOR]);
    if (tensor != NULL && PyType_Check(tensor) && PyType_IsSubtype(type, (PyTypeObject *)tensor)) {
        facts->is_neg = PyObject_GetAttr((PyObject *)type, p->names[KV_NAME_IS_NEG]);
        facts->is_conj = PyObject_GetAttr((PyObject *)type, p->names[KV_NAME_IS_CONJ]);
        if (facts->is_neg == NULL || facts->is_conj == NULL) {
            Py_CLEAR(facts->is_neg);
            Py_CLEAR(facts->is_conj);
        }
    }
    Py_XDECREF(tensor);
    Py_XDECREF(torch);
    PyErr_Clear();
}

/* The slot caching `type`, or -1.  Under the lock. */
static int slot_of(const kv_protocols *p, PyTypeObject *type)
{
    for (int i = 0; i < KV_TYPES_CACHED; i++)
        if (p->types[i].type == type)
            return i;
    return -1;
}

/* Caches `facts` in the next slot, unless another thread cached the type
 * meanwhile; *evicted receives what the slot held, for the caller to clear
 * once the lock is released.  Under the lock. */
static void cache_facts(kv_protocols *p, const kv_type_facts *facts, kv_type_facts *evicted)
{
    memset(evicted, 0, sizeof *evicted);
    if (slot_of(p, facts->type) >= 0)
        return;
    kv_type_facts *slot = &p->types[p->next_type];
    p->next_type = (p->next_type + 1) % KV_TYPES_CACHED;
    *evicted = *slot;
    slot->type = (PyTypeObject *)Py_NewRef(facts->type);
    slot->exchange = facts->exchange;
    slot->exchange_capsule = Py_XNewRef(facts->exchange_capsule);
    slot->is_neg = Py_XNewRef(facts->is_neg);
    slot->is_conj = Py_XNewRef(facts->is_conj);
}

kv_type_facts kv_type_facts_of(kv_protocols *p, PyTypeObject *type)
{
    kv_type_facts facts = {type, NULL, NULL, NULL, NULL};
    kv_lock_acquire(&p->types_lock);
    const int cached = slot_of(p, type);
    if (cached >= 0) {
        facts = p->types[cached];
        Py_XINCREF(facts.is_neg);
        Py_XINCREF(facts.is_conj);
        Py_XINCREF(facts.exchange_capsule);
    }
    kv_lock_release(&p->types_lock);
    if (cached >= 0)
        return facts;
    /* Found outside the lock: finding runs Python code, which may call into
     * this module again, on this thread or another. */
    find_exchange_api(p, type, &facts);
    find_torch_flags(p, type, &facts);
    kv_type_facts evicted;
    kv_lock_acquire(&p->types_lock);
    cache_facts(p, &facts, &evicted);
    kv_lock_release(&p->types_lock);
    clear_facts(&evicted); /* last: freeing a type may run Python code */
    return facts;
}

void kv_type_facts_release(kv_type_facts *facts)
{
    Py_CLEAR(facts->is_neg);
    Py_CLEAR(facts->is_conj);
    Py_CLEAR(facts->exchange_capsule);
}
