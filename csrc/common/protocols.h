/* The names and per-type facts that reading arrays needs, made once per
 * module (they live in its state, state.h), not once per array. */
#ifndef KVBM_PROTOCOLS_H
#define KVBM_PROTOCOLS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "lock.h"

enum {
    KV_NAME_DLPACK,
    KV_NAME_DLPACK_DEVICE,
    KV_NAME_CUDA_ARRAY_INTERFACE,
    KV_NAME_ARRAY_INTERFACE,
    KV_NAME_EXCHANGE_API,
    KV_NAME_DEVICE,
    KV_NAME_IS_NEG,
    KV_NAME_IS_CONJ,
    KV_NAME_REQUIRES_GRAD,
    KV_NAME_IS_INFERENCE,
    KV_NAME_BASE,
    KV_NAME_TYPESTR,
    KV_NAME_SHAPE,
    KV_NAME_STRIDES,
    KV_NAME_DATA,
    KV_NAME_MASK,
    KV_NAME_STREAM,
    KV_NAME_TORCH,
    KV_NAME_TENSOR,
    KV_NAME_NUMPY,
    KV_NAME_NDARRAY,
    KV_NAME_DTYPE,
    KV_NAME_COUNT
};

/* What is known of a type whose instances were read: checked once, since
 * asking a type costs attribute lookups (an AttributeError for most), far
 * more than reading an array. */
typedef struct {
    PyTypeObject *type; /* strong reference, so that its address is not reused while cached; NULL: free */
    const struct DLPackExchangeAPI *exchange; /* its DLPack C exchange API, or NULL */
    PyObject *exchange_capsule;               /* the capsule holding it (strong reference: the type may drop its own) */
    /* For torch.Tensor and its subclasses, what the type has as is_neg and
     * is_conj (strong references, called with the tensor), else NULL. */
    PyObject *is_neg, *is_conj;
} kv_type_facts;

#define KV_TYPES_CACHED 8

typedef struct {
    PyObject *names[KV_NAME_COUNT]; /* interned */
    PyObject *dlpack_keywords;      /* ("stream", "max_version") */
    PyObject *stream_keyword;       /* ("stream",) */
    PyObject *max_version;          /* (1, 3) */
    PyObject *increment_version;    /* torch.autograd.graph.increment_version, found on first need (None: absent) */
    kv_lock types_lock;             /* guards types and next_type */
    kv_type_facts types[KV_TYPES_CACHED]; /* recently seen types, recycled in turn */
    int next_type;
} kv_protocols;

int kv_protocols_init(kv_protocols *p); /* 0, or -1 with an exception */
int kv_protocols_traverse(kv_protocols *p, visitproc visit, void *arg);
void kv_protocols_clear(kv_protocols *p);

/* The facts of `type`, from the cache or found (and cached) now; safe from
 * several threads at once (types_lock).  The caller gets its own references
 * to is_neg, is_conj and the exchange capsule, which it gives back with
 * kv_type_facts_release: finding facts runs Python code, which may call
 * into this module again and recycle any slot. */
kv_type_facts kv_type_facts_of(kv_protocols *p, PyTypeObject *type);
void kv_type_facts_release(kv_type_facts *facts);

#endif /* KVBM_PROTOCOLS_H */
