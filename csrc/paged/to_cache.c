/* PagedKVCache.to_cache: reading and checking one call.  See
 * to_cache_run.h; to_cache_run.c runs it. */
#include "paged_internal.h"

#include <string.h>

#include "args.h"
#include "deferred.h"
#include "state.h"
#include "stream.h"
#include "to_cache_run.h"

/* dst is a cache of this cache's (no, nt, hd, dtype), writable. */
static int check_dst(const kv_to_cache_call *call, PyObject *dst)
{
    const kv_paged_cache *src = call->src;
    if (Py_TYPE(dst) != Py_TYPE(src))
        return kv_error(PyExc_TypeError, "dst: expected a kvbm_ext.PagedKVCache, got %s", Py_TYPE(dst)->tp_name);
    const kv_paged_cache *d = (const kv_paged_cache *)dst;
    const char *const names[] = {"num_outer", "block_size", "head_dim"};
    const int64_t ours[] = {src->no, src->nt, src->hd}, theirs[] = {d->no, d->nt, d->hd};
    for (int i = 0; i < 3; i++)
        if (ours[i] != theirs[i])
            return kv_error(PyExc_ValueError,
                            "dst: %s %lld differs from this cache's %lld; blocks move between "
                            "caches of one num_outer, block_size, head_dim and dtype",
                            names[i], (long long)theirs[i], (long long)ours[i]);
    if (d->dtype.code != src->dtype.code || d->dtype.bits != src->dtype.bits) {
        char got[48], want[48];
        return kv_error(PyExc_TypeError, "dst: element type %s differs from this cache's %s",
                        kv_dtype_name(d->dtype, got, sizeof got), kv_dtype_name(src->dtype, want, sizeof want));
    }
    if (d->readonly)
        return kv_error(PyExc_ValueError, "dst: the cache is read-only, so blocks cannot be written into it");
    return 0;
}

/* The heads and layers moved land inside dst: moved head j on dst head
 * head_offset + j, the layers on kv_paged_landing's. */
static int check_landing(const kv_to_cache_call *call)
{
    const kv_paged_options *o = &call->options;
    const kv_paged_cache *dst = call->dst;
    if (o->head_offset + o->heads.count > dst->nh)
        return kv_error(PyExc_ValueError, "head_offset: %lld + %lld heads moved exceed dst's %lld heads",
                        (long long)o->head_offset, (long long)o->heads.count, (long long)dst->nh);
    const kv_selection landing = kv_paged_landing(o);
    const int64_t low = kv_selection_bottom(&landing), high = kv_selection_top(&landing);
    if (low < 0 || high >= dst->nl)
        return kv_error(PyExc_ValueError,
                        "layer_offset: the layers moved, %lld to %lld, land on dst layers %lld to "
                        "%lld%s, but dst has layers 0 to %lld",
                        (long long)kv_selection_bottom(&o->layers), (long long)kv_selection_top(&o->layers),
                        (long long)low, (long long)high, o->pack_layers ? " (packed)" : "", (long long)dst->nl - 1);
    return 0;
}

/* Where the call runs: the device of the cache on a device (both on one),
 * else the CPU.  A cache in host memory beside a device cache must be in
 * pinned memory: its arrays are located for the device, copies kept in
 * call->located. */
static int place(kv_to_cache_call *call)
{
    const kv_paged_cache *src = call->src, *dst = call->dst;
    if (src->device >= 0 && dst->device >= 0 && src->device != dst->device)
        return kv_error(PyExc_ValueError, "dst: on cuda:%d, but the cache is on cuda:%d; a call runs on one device",
                        dst->device, src->device);
    call->device = src->device >= 0 ? src->device : dst->device;
    kv_target_init(&call->target, call->options.move.stream, call->device,
                   src->device >= 0 ? "the cache is" : "dst is");
    const kv_paged_cache *host = src->device < 0 ? src : dst;
    if (call->device < 0 || (src->device >= 0 && dst->device >= 0))
        return 0;
    if ((call->located = PyMem_Malloc((size_t)host->narrays * sizeof(kv_array))) == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    memcpy(call->located, host->arrays, (size_t)host->narrays * sizeof(kv_array));
    for (Py_ssize_t i = 0; i < host->narrays; i++) {
        kv_path path = kv_paged_layer_path(host, i);
        path.name = host == dst ? "dst.layers" : "layers";
        if (kv_target_add(&call->target, &call->located[i], &path) < 0)
            return -1;
    }
    return 0;
}

/* Reads block ids `name` of `cache`: on the call's device or in host memory;
 * host ids in range and, for dst, each once. */
static int read_ids(kv_to_cache_call *call, PyObject *obj, const char *name, const kv_paged_cache *cache,
                    kv_address_list *list, int *read)
{
    if (kv_address_list_read(&call->reader, obj, name, KV_LIST_BLOCK_IDS, call->device >= 0, list) < 0)
        return -1;
    *read = 1;
    if (list->on_device) {
        const kv_path path = {name, {0, 0}, 0};
        return kv_target_add(&call->target, &list->array, &path);
    }
    return kv_paged_check_ids((const int64_t *)list->values, list->count, cache->num_blocks, cache == call->dst, name);
}

/* Before any byte is read or written: both caches' memory where it was
 * built, dst's written layers sharing no byte with each other nor with
 * src's read ones (the heads moved of each). */
static int check_caches(const kv_to_cache_call *call)
{
    const kv_paged_options *o = &call->options;
    const kv_selection landing = kv_paged_landing(o), dst_heads = {o->head_offset, 1, o->heads.count};
    return kv_paged_check_layers(call->src, "layers", &call->reader, &o->layers) < 0
                   || kv_paged_check_layers(call->dst, "dst.layers", &call->reader, &landing) < 0
                   || kv_paged_check_written(call->dst, &landing, "dst.layers") < 0
                   || kv_paged_check_caches(call->src, &o->layers, &o->heads, call->dst, &landing, &dst_heads) < 0
               ? -1
               : 0;
}

/* What a call moves must fit the kernel's 32-bit counts: 0, or -1 with
 * ValueError. */
static int check_size(const kv_to_cache_call *call)
{
    const kv_paged_cache *c = call->src;
    const int64_t chunk_bytes = call->options.heads.count * c->nt * c->hd * c->itemsize;
    if (!kvbm_fits_one_launch(call->src_ids.count, call->options.layers.count * c->no, chunk_bytes))
        return kv_error(PyExc_ValueError,
                        "src_ids: too much data for one call (%zd blocks of %lld layers of %lld "
                        "bytes); split it into several calls",
                        call->src_ids.count, (long long)call->options.layers.count, (long long)(c->no * chunk_bytes));
    return 0;
}

static int read_call(kv_to_cache_call *call, const kv_paged_args *a)
{
    if (check_dst(call, a->dst) < 0)
        return -1;
    call->dst = (kv_paged_cache *)a->dst;
    if (kv_paged_read_options(call->src, kv_paged_to_cache_signature.name, a, &call->options) < 0
        || check_landing(call) < 0 || place(call) < 0)
        return -1;
    call->reader.protocols = &call->state->protocols;
    call->reader.dlpack_stream = kv_stream_for_dlpack(call->options.move.stream);
    if (call->reader.dlpack_stream == NULL
        || read_ids(call, a->src_ids, "src_ids", call->src, &call->src_ids, &call->src_ids_read) < 0
        || read_ids(call, a->dst_ids, "dst_ids", call->dst, &call->dst_ids, &call->dst_ids_read) < 0)
        return -1;
    if (call->dst_ids.count != call->src_ids.count)
        return kv_error(PyExc_ValueError, "dst_ids: has %zd ids, but src_ids has %zd", call->dst_ids.count,
                        call->src_ids.count);
    return check_caches(call) < 0 || check_size(call) < 0 ? -1 : 0;
}

static void release_call(kv_to_cache_call *call)
{
    if (call->src_ids_read)
        kv_address_list_release(&call->src_ids);
    if (call->dst_ids_read)
        kv_address_list_release(&call->dst_ids);
    kv_target_release(&call->target);
    PyMem_Free(call->located);
    Py_XDECREF(call->reader.dlpack_stream);
}

PyObject *kv_paged_to_cache(kv_paged_cache *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    kv_paged_args a;
    if (kv_parse_arguments(&kv_paged_to_cache_signature, args, nargs, kwnames, &a) < 0)
        return NULL;
    kv_to_cache_call call;
    memset(&call, 0, sizeof call);
    call.src = self;
    call.state = PyType_GetModuleState(Py_TYPE(self)); /* not subclassable: the module's own type */
    call.device = -1;
    int defer = 0;
    kv_promise *outcome = NULL; /* set where the pieces are left to the enqueue thread */
    int rc = kv_switch_read(a.defer, "defer", KV_PAGED_ARGS_DEFER_DEFAULT, &defer) < 0 ? -1 : read_call(&call, &a);
    call.options.move.deferred = defer ? &outcome : NULL;
    const kv_paged_options *o = &call.options;
    if (rc == 0 && call.src_ids.count > 0 && o->layers.count > 0 && o->heads.count > 0) {
        const kv_selection written = kv_paged_landing(o);
        rc = call.device < 0 ? kv_move_options_check_host(&o->move) : 0;
        if (rc == 0)
            rc = kv_paged_mark_written(call.dst, &call.state->protocols, &written);
        if (rc == 0)
            rc = kv_to_cache_run(&call);
    }
    release_call(&call);
    if (rc < 0) {
        kv_promise_release(outcome);
        return NULL;
    }
    if (defer)
        return kv_deferred_new(call.state->deferred_type, outcome);
    Py_RETURN_NONE;
}
