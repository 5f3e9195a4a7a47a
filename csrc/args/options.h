/* The options every layout move takes, the list API's conversions and
 * PagedKVCache's methods alike: backend=, num_ctas= and stream=, read once
 * into one description (kv_move_options), the chunk order (layout=), and
 * the switches (pack_layers=). */
#ifndef KVBM_OPTIONS_H
#define KVBM_OPTIONS_H

#include "kvbm_layout.h"
#include "promise.h"
#include "stream.h"

/* The `backend` argument: one knob, one meaning.  "kernel": SM kernels
 * move every byte, reading and writing pinned host memory directly.
 * "copy_engines": the copy engines carry every byte that crosses PCIe,
 * staged through device memory where bytes are rearranged (staging.c);
 * "batch" (cudaMemcpyBatchAsync) and "async" (one cudaMemcpyAsync per
 * contiguous run) are that too, naming the call that drives the engines.
 * "auto": the copy engines whenever pinned host memory takes part, the
 * kernel device to device.  route.c decides what each means for a call. */
typedef enum {
    KV_BACKEND_KERNEL,
    KV_BACKEND_ASYNC,
    KV_BACKEND_BATCH,
    KV_BACKEND_AUTO,
    KV_BACKEND_COPY_ENGINES,
    KV_BACKEND_COUNT
} kv_backend;

extern const char *const KV_BACKEND_NAMES[KV_BACKEND_COUNT];

typedef struct {
    kv_backend backend;
    uint32_t num_ctas; /* the most CTAs a kernel may use; 0: not given (route.c picks) */
    intptr_t stream;   /* a handle, or KV_STREAM_CURRENT (stream.h) */
    /* defer=True: where a staged call leaves its outcome when the device's
     * enqueue thread enqueues its pieces (gpu.h, kv_move_plan); NULL: not
     * asked. */
    kv_promise **deferred;
} kv_move_options;

/* Reads the three options (NULL: not given; the backend then is the name
 * `backend_default`, the table's) into *out.  Returns 0, or -1 with
 * TypeError/ValueError naming the argument. */
int kv_move_options_read(PyObject *backend, const char *backend_default, PyObject *num_ctas, PyObject *stream,
                         kv_move_options *out);

/* For a call that runs on the CPU (no array on a CUDA device): the options
 * that only a GPU move takes must keep their defaults (backend "auto",
 * num_ctas and stream None).  Returns 0, or -1 with ValueError naming the
 * first that does not. */
int kv_move_options_check_host(const kv_move_options *options);

/* Reads a chunk order, "NHD" or "HND" in any case (NULL: the name
 * `fallback`), named `argument` in errors.  Returns 0, or -1 with
 * TypeError/ValueError. */
int kv_layout_read(PyObject *value, const char *argument, const char *fallback, kvbm_layout *out);

/* Reads a switch, True or False (NULL: `fallback`), named `argument` in
 * errors: any other object is a TypeError, so that no __bool__ runs and a
 * value such as "no" or 0 is not taken for one.  Returns 0, or -1. */
int kv_switch_read(PyObject *value, const char *argument, int fallback, int *out);

#endif /* KVBM_OPTIONS_H */
