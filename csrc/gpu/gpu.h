/* Everything that calls the CUDA runtime.  Built from the files of csrc/gpu/
 * (pieces.c included) when nvcc is available, from gpu_stub.c alone
 * otherwise; the other folders of csrc/ need no CUDA header. */
#ifndef KVBM_GPU_H
#define KVBM_GPU_H

#include "array.h"
#include "promise.h"

/* Per-module GPU resources (pointer-table staging, events), created lazily
 * per device. */
typedef struct kv_gpu kv_gpu;

kv_gpu *kv_gpu_new(void); /* NULL with MemoryError */
void kv_gpu_free(kv_gpu *gpu);

/* 1 when the CUDA kernels are compiled in. */
int kv_gpu_compiled(void);

/* Finds where an array lives for a call on the GPU: the device of a CAI
 * array, and whether host memory is pinned (then `data` becomes the address
 * kernels use).  Returns 0, or -1 with an exception naming `path`. */
int kv_gpu_locate(kv_array *a, const kv_path *path);

/* Makes `device` the calling thread's current CUDA device for the duration of
 * a producer call (torch exports through DLPack only tensors of the current
 * device).  *previous receives what kv_gpu_restore_device needs.  Returns 0,
 * or -1 with RuntimeError. */
int kv_gpu_use_device(int device, int *previous);
void kv_gpu_restore_device(int previous);

/* Where a call's work goes: `stream` of `device`, after the producers'
 * streams (CAI v3) have been ordered before it. */
typedef struct {
    int device;
    intptr_t stream;
    const intptr_t *producers;
    Py_ssize_t producer_count;
} kv_gpu_target;

/* Every GPU entry point below enqueues its work on the target and returns
 * without waiting for it; host tables are copied before return.  They
 * release the GIL and return 0, or -1 with RuntimeError naming the CUDA
 * error. */

/* A move between device memory and pinned host memory in which bytes are
 * rearranged can run "staged": a kernel permutes into (offload) or out of
 * (onload) device staging memory, and the copy engines carry the staging
 * over PCIe, piece by piece, the permute of one piece overlapping the copy
 * of another (staging.c).  The side of the call in pinned memory is
 * described as nb blocks of [mid][inner] units of unit_bytes contiguous
 * bytes; a piece is a box of them (pieces.h). */
typedef struct {
    int64_t nb, mid, inner, unit_bytes;
    const uint64_t *block_address; /* unit (b, m, i) at block_address[b] + m*mid_stride + i*inner_stride, */
    int64_t mid_stride, inner_stride;
    const uint64_t *unit_address; /* or at unit_address[b*inner + i] when not NULL (then mid == 1), each
                                      unit its own allocation */
    int one_allocation;           /* the blocks lie in one allocation (one array), not one each */
    int to_host;                  /* the bytes move into pinned memory */
    int flat_side;                /* the pinned side is the call's flat side (universals; a paged call's blocks) */
    int64_t max_blocks;           /* whole blocks a piece may hold (the kernel's by-value table) */
} kv_staged;

/* How a staged move is cut into pieces (pieces.h).  The first piece holds
 * about lead_bytes.  Then comes the ramp: while each piece has held less
 * than ramp_bytes, the next holds up to ramp_growth times more, but not
 * over ramp_bytes; those pieces are permuted on the edge CTAs, fast enough
 * to hide behind the copy of the small piece before them.  (Whole blocks
 * cut with a budget of ramp_bytes end the ramp too.)  After the ramp each
 * piece holds up to growth times what the one before holds.  No piece
 * holds more than piece_bytes. */
typedef struct {
    int64_t lead_bytes, ramp_bytes, ramp_growth, growth, piece_bytes;
} kv_cut;

/* The lead piece's bytes (route.c).  A move that describes its pinned side
 * itself keeps its units within it, so that the lead can be that short. */
#define KV_LEAD_BYTES ((int64_t)1 << 20)

/* A layout move, described for the whole call: its kind (kv_move_kind),
 * the kind's description of the call (`args`) and the call's pointer
 * table in host memory.  A staged piece runs the same kernel over part of
 * the call (the kind's launch_piece rewrites the description for it). */
typedef struct kv_move_kind kv_move_kind;

typedef struct {
    const kv_move_kind *kind;
    const void *args;  /* the kind's description (kv_paged_move, ...: csrc/moves/move_<kind>.h) */
    const void *table; /* host memory: void * entries (block) or uint64_t (paged, to_cache), `entries` of them */
    int64_t entries;
    int vector_bytes; /* the loads' and stores' width, which every address allows */
} kv_move;

struct kv_box;

/* One kind of layout move: everything that differs between kinds, in one
 * place, so that a new kernel is its .cu file, its descriptor and its
 * tests.  Each kind is a file of csrc/moves/ (move_<kind>.c) that defines
 * its descriptor, with its header (move_<kind>.h) declaring it, the
 * description its call fills and its kernel's launch (the header the
 * kernel file reads too).  The kernel side is built with nvcc only
 * (NULL in a build without); its functions return a cudaError_t as an int
 * and take the stream as a void *, so that this header needs no CUDA
 * header.  The kernels themselves load with the others
 * (kvbm_load_kernels). */
struct kv_move_kind {
    const char *what; /* the launch step a CUDA error names */
    /* The kernel over the whole call: its table by value (device_table
     * NULL) or in device memory, on at most num_ctas CTAs (0: no bound). */
    int (*launch)(const kv_move *move, const void *host_table, const void *device_table, uint32_t num_ctas,
                  void *stream);
    /* The whole blocks a staged piece may hold, so that its table travels
     * by value; 0 when not even one block's does (`why` says so). */
    int64_t (*piece_blocks)(const kv_move *move, char *why, size_t why_size);
    /* The kernel over one piece (pieces.h) of a staged move: between the
     * device side of the call and `slot`, which holds the piece's units
     * packed. */
    int (*launch_piece)(const kv_move *move, const kv_staged *staged, const struct kv_box *box, char *slot,
                        uint32_t num_ctas, void *stream);
    /* The CPU twin, every address in host memory (needs no GIL), and the
     * bytes it moves (whether the GIL is released for it, gil.h). */
    void (*cpu)(const kv_move *move);
    int64_t (*cpu_bytes)(const kv_move *move);
    /* A copy of `args` that owns what it points to, laid out in `storage`
     * (owned_bytes of it), for a staged move whose pieces another thread
     * enqueues after the call returned (kv_move_plan, deferred); NULL: a
     * kind whose calls are not deferred. */
    const void *(*own_args)(const void *args, void *storage);
    size_t owned_bytes;
};

/* A descriptor's kernel side, in a build with nvcc: the static functions
 * <name>_launch, <name>_piece_blocks and <name>_launch_piece of its file. */
#ifdef KVBM_CUDA_VERSION
#define KV_MOVE_KERNEL(name)                                                                                           \
    .launch = name##_launch, .piece_blocks = name##_piece_blocks, .launch_piece = name##_launch_piece
#else
#define KV_MOVE_KERNEL(name) .launch = NULL
#endif

/* How a layout move runs, as the route decided it (route.c). */
typedef struct {
    const kv_staged *staged; /* NULL: the kernel alone, reading and writing pinned memory directly */
    uint32_t num_ctas;       /* the kernel's CTA bound, or the staged permute's (0: none) */
    uint32_t edge_num_ctas;  /* staged: the permute's bound for the pieces at a call's ends */
    int async_copies;        /* staged: one cudaMemcpyAsync per contiguous run, not cudaMemcpyBatchAsync */
    kv_cut cut;              /* staged: how pieces are cut; piece_bytes is the staging's to set */
    /* Staged: where the call leaves the outcome of its pieces when the
     * device's enqueue thread enqueues them (staging.c, "Deferred calls"),
     * which it does when this is not NULL and the kind can own its
     * arguments; left NULL where the call enqueued them itself. */
    kv_promise **deferred;
} kv_move_plan;

/* What a GPU move ran, for the KVBM_EXT_DEBUG line. */
typedef struct {
    int staged; /* the staged path ran; else the kernel alone */
    int64_t pieces, piece_bytes;
    int lane;           /* the staging lane, -1 for the capture lane */
    int deferred;       /* the pieces are the enqueue thread's to enqueue */
    char fallback[128]; /* why a staged move ran the kernel alone, or "" */
} kv_gpu_report;

/* Runs `move` on the target as `plan` says.  A staged move that cannot be
 * staged runs the kernel alone on plan->num_ctas CTAs (report->fallback
 * says why). */
int kv_gpu_move(kv_gpu *gpu, const kv_gpu_target *target, const kv_move *move, const kv_move_plan *plan,
                kv_gpu_report *report);

/* Staging memory per device: `bytes` (>= 0) split into `lanes`; a negative
 * value keeps the current one.  Staging already allocated is freed (after
 * the work that uses it) and allocated anew on next need.  Returns 0 or -1. */
int kv_gpu_set_staging(kv_gpu *gpu, int64_t bytes, int lanes);

/* Allocates `device`'s staging lanes and its capture lane now.  0 or -1. */
int kv_gpu_reserve_staging(kv_gpu *gpu, int device);

/* A dict describing `device`'s staging. */
PyObject *kv_gpu_staging_info(kv_gpu *gpu, int device);

/* A batch of raw copies.  Each list lives in host memory or, flagged
 * `*_on_device`, in device memory of the target's device (kernel only). */
typedef struct {
    int64_t count;
    uint64_t *src, *dst;
    uint64_t *sizes; /* NULL: every pair moves uniform_size bytes */
    uint64_t uniform_size;
    int src_on_device, dst_on_device, sizes_on_device;
    uint32_t num_ctas; /* the kernel's CTA bound (0: none) */
} kv_pairs;

/* How a batch of copies is carried out. */
typedef enum {
    KV_ENGINE_KERNEL, /* kvbm_launch_copy_pairs */
    KV_ENGINE_ASYNC,  /* one cudaMemcpyAsync per pair */
    KV_ENGINE_BATCH,  /* cudaMemcpyBatchAsync */
} kv_engine;

/* Runs the pairs with `engine`.  KV_ENGINE_BATCH falls back to
 * KV_ENGINE_ASYNC when the batch API is missing or fails and `fallback` is
 * set; *ran receives the engine that ran and `why` (may be NULL) the reason
 * for a fallback.  Host lists only, except for the kernel. */
int kv_gpu_copy_pairs(kv_gpu *gpu, const kv_gpu_target *target, const kv_pairs *pairs, kv_engine engine, int fallback,
                      kv_engine *ran, char *why, size_t why_size);

/* True when both this build and the driver have cudaMemcpyBatchAsync. */
int kv_gpu_batch_available(void);

/* Checks the host-resident address lists of `pairs` before a GPU copy: no
 * null address, every [address, address + size) inside one allocation of
 * device memory or pinned host memory (pageable host memory too when
 * `allow_pageable`), device memory on one device only.  Pinned addresses
 * are rewritten to their device addresses.  *device receives the device of
 * the device memory found, or -1.  `names` are the lists' argument names
 * for errors (ValueError).  Returns 0 or -1. */
int kv_gpu_check_pairs(kv_pairs *pairs, const char *const names[2], int allow_pageable, int *device);

/* The number of visible CUDA devices (0 without a driver or a CUDA build). */
int kv_gpu_device_count(void);

/* The current device, for calls that name none; -1 with RuntimeError. */
int kv_gpu_current_device(void);

/* A list of dicts describing the visible CUDA devices; [] when there are
 * none, no driver, or no CUDA build. */
PyObject *kv_gpu_devices(void);

/* Host memory page-locked for the devices (gpu_host.c), for
 * kvbm_ext.pinned_empty: registered with cudaHostRegister (portable and
 * mapped) as one range or, where the driver refuses that, in pieces. */
typedef struct {
    char *start;
    size_t bytes;
} kv_host_piece;

typedef struct {
    kv_host_piece *pieces; /* malloc'ed: freed without the GIL */
    int count;             /* 0: not registered */
} kv_host_registration;

/* Registers [base, base + bytes) with `device` current, in pieces of at
 * most `piece_limit` bytes (0: no limit); a piece the driver refuses is
 * split in halves down to a floor, each piece reachable by kernels at its
 * own host address, so that the range is still one array to them.  Every
 * boundary between pieces falls on a multiple of `item` bytes (a piece
 * grows to whole items where one is larger than the limit).  Returns
 * 0; 1 where nothing can be registered here (a build without CUDA, no
 * driver, no device: `why` says which); or -1 on a CUDA error (`why` names
 * it), with nothing left registered.  Safe without the GIL. */
int kv_gpu_host_register(int device, char *base, size_t bytes, size_t piece_limit, size_t item,
                         kv_host_registration *out, char *why, size_t why_size);

/* Unregisters every piece and frees the record.  Returns 0, or -1 with
 * `why` naming the first CUDA error.  Safe without the GIL. */
int kv_gpu_host_unregister(kv_host_registration *registration, char *why, size_t why_size);

/* The PCI address of `device` ("0000:1B:00.0").  Returns 0, or -1 without
 * a device.  Safe without the GIL. */
int kv_gpu_pci_bus_id(int device, char *buf, size_t size);

/* What the driver says `address` is: "device", "managed", "pinned" or
 * "pageable".  NULL with RuntimeError when the driver cannot say (or the
 * build has no CUDA). */
const char *kv_gpu_pointer_kind(const void *address);

/* NCCL point-to-point between the GPUs of a process group, for a
 * Resharder's messages (gpu_nccl.c): a communicator of our own, NCCL loaded
 * from libnccl.so.2 at first use.  Each returns 0 (or the object), or -1
 * (NULL) with an exception: RuntimeError where NCCL cannot be loaded, CUDA
 * or NCCL fails (or the build has no CUDA), TimeoutError from kv_nccl_swap. */
#define KV_NCCL_ID_BYTES 128
/* The largest record kv_nccl_swap carries: a reshard header (128 bytes) or a
 * checked call's description (kvbm_ext._transport's gather slot, 4 KiB). */
#define KV_NCCL_RECORD_MAX 8192
typedef struct kv_nccl kv_nccl;
typedef struct {
    int peer, send; /* the peer's rank in the group; a send, else a receive */
    uintptr_t address;
    size_t bytes;
} kv_nccl_op;

int kv_nccl_load(void);
int kv_nccl_unique_id(unsigned char id[KV_NCCL_ID_BYTES]);
/* Blocks (without the GIL) until every rank of the group opened its own. */
kv_nccl *kv_nccl_open(const unsigned char id[KV_NCCL_ID_BYTES], int nranks, int rank, int device);
void kv_nccl_close(kv_nccl *c);
/* Enqueues `ops` on `stream` as one NCCL group. */
int kv_nccl_post(kv_nccl *c, intptr_t stream, const kv_nccl_op *ops, Py_ssize_t n);
/* Sends records[i] (record_bytes each, at most KV_NCCL_RECORD_MAX) to
 * peers[i] and receives one of the same size from each into received[i],
 * on a stream of its own, and waits for
 * them on the host (GIL released) until `timeout` seconds passed: then, or
 * on any failure, the communicator is aborted (every later call raises). */
int kv_nccl_swap(kv_nccl *c, const int *peers, Py_ssize_t n, size_t record_bytes, const unsigned char *records,
                 unsigned char *received, double timeout);
/* Ends every operation of the communicator that is still pending, for good. */
void kv_nccl_abort(kv_nccl *c);
/* Whether the communicator was aborted; never waits (a swap may hold it for its timeout). */
int kv_nccl_aborted(kv_nccl *c);

#endif /* KVBM_GPU_H */
