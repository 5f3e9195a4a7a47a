// Device-side pieces shared by the kernels: CTA shape, vector types, and
// tables carried by value in a launch's parameters.
#ifndef KVBM_DEVICE_CUH
#define KVBM_DEVICE_CUH

#include <stdint.h>

#include <type_traits>

#include "kvbm_kernels.h"
#include "kvbm_paged.h"

namespace kvbm {

constexpr int kThreads = 256;
// Vectors in flight per thread: move_vectors issues every load before any store, so that a thread's
// loads wait on HBM together rather than one by one.  What chose 4: benchmarks/README.md, "Defaults
// in the code".
constexpr int kUnroll = 4;
static_assert(kThreads * kUnroll == KVBM_TILE_MIN_BYTES, "the C side bounds a call's tiles with KVBM_TILE_MIN_BYTES");

template <int V>
struct VectorOf;
template <>
struct VectorOf<16> {
    using type = uint4;
};
template <>
struct VectorOf<8> {
    using type = uint2;
};
template <>
struct VectorOf<4> {
    using type = uint32_t;
};
template <>
struct VectorOf<2> {
    using type = uint16_t;
};
template <>
struct VectorOf<1> {
    using type = uint8_t;
};

// Returns launch(std::integral_constant<int, V>()) for V = vector_bytes, one
// of the widths above: the kernels are instantiated for each.
template <class Launch>
cudaError_t with_vector_bytes(int vector_bytes, const Launch &launch)
{
    switch (vector_bytes) {
    case 16: return launch(std::integral_constant<int, 16>());
    case 8: return launch(std::integral_constant<int, 8>());
    case 4: return launch(std::integral_constant<int, 4>());
    case 2: return launch(std::integral_constant<int, 2>());
    case 1: return launch(std::integral_constant<int, 1>());
    default: return cudaErrorInvalidValue;
    }
}

// CUDA loads a kernel at its first launch, and that launch waits for the
// device to be idle: loading the kernels ahead (kvbm_load_kernels,
// LoadAhead below) keeps it off the calls.  Asking for a kernel's attributes
// loads it.
template <class... Kernels>
cudaError_t load_kernels(Kernels... kernels)
{
    cudaFuncAttributes attributes;
    cudaError_t error = cudaSuccess;
    ((error = error != cudaSuccess ? error : cudaFuncGetAttributes(&attributes, (const void *)kernels)), ...);
    return error;
}

// load(std::integral_constant<int, V>()) for every width with_vector_bytes
// knows; the first error.
template <class Load>
cudaError_t load_every_width(const Load &load)
{
    cudaError_t error = cudaSuccess;
    for (const int vector_bytes : {16, 8, 4, 2, 1})
        if (error == cudaSuccess)
            error = with_vector_bytes(vector_bytes, load);
    return error;
}

// Moves the vectors j = first + k * stride (k < kUnroll, j < count) of V
// bytes from src to dst, issuing every load before any store so that each
// thread keeps kUnroll vectors in flight.  offsets(j, &from, &to) gives the
// byte offsets of vector j in the source and the destination.  Plain
// accesses: the evict-first hints (__ldcs, __stcs) were tried and lost
// (benchmarks/README.md, "Defaults in the code").
template <int V, class Offsets>
__device__ __forceinline__ void move_vectors(const char *src, char *dst, uint32_t first, uint32_t stride,
                                             uint32_t count, const Offsets &offsets)
{
    using Vec = typename VectorOf<V>::type;
    Vec values[kUnroll];
    int64_t to[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
        const uint32_t j = first + k * stride;
        if (j < count) {
            int64_t from;
            offsets(j, &from, &to[k]);
            values[k] = *reinterpret_cast<const Vec *>(src + from);
        }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
        const uint32_t j = first + k * stride;
        if (j < count)
            *reinterpret_cast<Vec *>(dst + to[k]) = values[k];
    }
}

// How a kernel splits its chunks into tiles.  A tile is the part of one
// chunk that tile_threads threads move, kUnroll vectors each; a CTA moves
// `groups` tiles at once, so that a chunk of a few KiB still makes a full
// CTA: a narrow CTA moves too few bytes per trip to memory, which a grid
// bounded to a few CTAs (the staged permute beside a model) cannot make up
// for.  CTAs stay at kThreads when the grid is bounded too: the bytes a
// bounded grid keeps in flight set its share of HBM beside a memory-bound
// model, so wider CTAs would slow the model more (benchmarks/README.md).
struct Tiling {
    kvbm_divisor tiles_per_chunk;
    uint32_t vectors_per_chunk;
    uint32_t vectors_per_tile;
    uint32_t tile_threads;
    uint32_t groups;
    uint32_t tiles;  // in all; below 2^31 (kvbm_fits_one_launch)
};

// The threads of a tile.  A chunk that one tile holds: the fewest warps
// that hold it.  A larger chunk: the tile of kThreads, or of a power of two
// fewer (one KVBM_TILE_MIN_BYTES at least), that leaves the fewest of the
// chunk's last tile empty, the larger on a tie: a CTA keeps kThreads *
// kUnroll vectors in flight only while its tiles are full, and a grid
// bounded to a few CTAs moves no faster than that (an 18 KiB chunk is nine
// warp tiles, not a full tile and an eighth of one).
inline uint32_t tile_threads_for(uint32_t vectors_per_chunk, int vector_bytes)
{
    if (vectors_per_chunk <= (uint32_t)(kThreads * kUnroll))
        return ((vectors_per_chunk + kUnroll - 1) / kUnroll + 31) / 32 * 32;
    const auto slots = [&](uint32_t tile_threads) {
        const uint64_t per_tile = (uint64_t)tile_threads * kUnroll;
        return (vectors_per_chunk + per_tile - 1) / per_tile * per_tile;
    };
    uint32_t best = kThreads;
    for (uint32_t tile_threads = kThreads / 2;
         tile_threads >= 32 && tile_threads * kUnroll * vector_bytes >= KVBM_TILE_MIN_BYTES; tile_threads /= 2)
        if (slots(tile_threads) < slots(best))
            best = tile_threads;
    return best;
}

// The tiling of `chunks` chunks of vectors_per_chunk vectors of
// vector_bytes each, and the launch shape: at most num_ctas CTAs (0: as
// many as there are tile groups).
inline Tiling make_tiling(uint32_t vectors_per_chunk, int vector_bytes, int64_t chunks, uint32_t num_ctas,
                          unsigned *grid, unsigned *threads)
{
    Tiling t;
    const uint32_t tile_threads = tile_threads_for(vectors_per_chunk, vector_bytes);
    t.vectors_per_chunk = vectors_per_chunk;
    t.tile_threads = tile_threads;
    t.vectors_per_tile = tile_threads * kUnroll;
    const uint32_t tiles_per_chunk = (vectors_per_chunk + t.vectors_per_tile - 1) / t.vectors_per_tile;
    t.tiles_per_chunk = kvbm_divisor_make(tiles_per_chunk);
    t.tiles = (uint32_t)(chunks * tiles_per_chunk);
    t.groups = kThreads / tile_threads;
    const uint32_t groups_needed = (t.tiles + t.groups - 1) / t.groups;
    *grid = num_ctas != 0 && num_ctas < groups_needed ? num_ctas : groups_needed;
    *threads = t.groups * tile_threads;
    return t;
}

// Runs body(chunk, first) for every tile this thread takes part in: chunk
// index, and the first vector of the chunk the thread moves (then every
// tile_threads-th, kUnroll of them: move_vectors).
template <class Body>
__device__ __forceinline__ void for_each_tile(const Tiling &t, const Body &body)
{
    const uint32_t group = threadIdx.x / t.tile_threads;
    const uint32_t lane = threadIdx.x - group * t.tile_threads;
    const uint32_t step = gridDim.x * t.groups;
    for (uint32_t tile_index = blockIdx.x * t.groups + group; tile_index < t.tiles; tile_index += step) {
        const uint32_t chunk = kvbm_div(t.tiles_per_chunk, tile_index);
        const uint32_t tile = tile_index - chunk * t.tiles_per_chunk.divisor;
        body(chunk, tile * t.vectors_per_tile + lane);
    }
}

// A table in device-readable memory, or carried by value in the kernel's
// parameters (small tables: no copy to stage before the launch).
template <class T>
struct TableInMemory {
    const T *items;
    __device__ T operator[](uint32_t i) const { return items[i]; }
};
template <class T, int N>
struct TableByValue {
    T items[N];
    __device__ T operator[](uint32_t i) const { return items[i]; }
};
// Three by-value sizes, because a launch copies its whole parameter block: a
// small call should not pay for 32 KB.  The two smaller ones keep the whole
// parameter block (table and the kernel's other parameters, under 512 bytes)
// under the 4 KB that launches carry cheapest: the tiny one a one-block call,
// the small one a paged call's 80 layers and 64 host ids.
constexpr int kTinyTable = 64;
constexpr int kSmallTable = 448;

template <class T, int N, class Params, class Kernel>
void launch_with(Kernel kernel, const T *host, int64_t count, const Params &p, unsigned grid, unsigned threads,
                 cudaStream_t stream)
{
    TableByValue<T, N> table;
    for (int64_t i = 0; i < count; ++i)
        table.items[i] = host[i];
    kernel<<<grid, threads, 0, stream>>>(table, p);
}

// Launches kernel<<<grid, threads>>>(table, params) with the table by value
// (count <= KVBM_TABLE_BY_VALUE_MAX entries read from `host`) in the smallest
// parameter block that holds it.
template <class T, class Params, class KernelTiny, class KernelSmall, class KernelMax>
void launch_by_value(KernelTiny tiny, KernelSmall small, KernelMax large, const T *host, int64_t count, const Params &p,
                     unsigned grid, unsigned threads, cudaStream_t stream)
{
    if (count <= kTinyTable)
        launch_with<T, kTinyTable>(tiny, host, count, p, grid, threads, stream);
    else if (count <= kSmallTable)
        launch_with<T, kSmallTable>(small, host, count, p, grid, threads, stream);
    else
        launch_with<T, KVBM_TABLE_BY_VALUE_MAX>(large, host, count, p, grid, threads, stream);
}

// Names a table type for a kernel family (launch_table).
template <class T>
struct TableType {
    using type = T;
};

// Launches kernel_for(TableType<Table>()), a kernel taking (Table, Params),
// <<<grid, threads>>> on `stream` with the table in device-readable memory
// (`device_table`), or, where that is NULL, by value (`count` entries read
// from `host_table`) in the smallest parameter block that holds it.
// Returns the launch's status.
template <class T, class KernelFor, class Params>
cudaError_t launch_table(const KernelFor &kernel_for, const T *host_table, const T *device_table, int64_t count,
                         const Params &p, unsigned grid, unsigned threads, cudaStream_t stream)
{
    if (device_table != nullptr) {
        const auto kernel = kernel_for(TableType<TableInMemory<T>>());
        kernel<<<grid, threads, 0, stream>>>(TableInMemory<T>{device_table}, p);
    }
    else {
        launch_by_value(kernel_for(TableType<TableByValue<T, kTinyTable>>()),
                        kernel_for(TableType<TableByValue<T, kSmallTable>>()),
                        kernel_for(TableType<TableByValue<T, KVBM_TABLE_BY_VALUE_MAX>>()), host_table, count, p, grid,
                        threads, stream);
    }
    return cudaGetLastError();
}

// Loads kernel_for(TableType<Table>()) for every table launch_table passes.
template <class T, class KernelFor>
cudaError_t load_table_kernels(const KernelFor &kernel_for)
{
    return load_kernels(kernel_for(TableType<TableInMemory<T>>()), kernel_for(TableType<TableByValue<T, kTinyTable>>()),
                        kernel_for(TableType<TableByValue<T, kSmallTable>>()),
                        kernel_for(TableType<TableByValue<T, KVBM_TABLE_BY_VALUE_MAX>>()));
}

// A kernel family: Family::kernel<V, Table>() is its kernel for vectors of
// V bytes and one table type.  A call launches one of them (launch_family),
// reserve_staging() loads them all (load_family): one list for both.
template <class Family, class T, class Params>
cudaError_t launch_family(int vector_bytes, const T *host_table, const T *device_table, int64_t count, const Params &p,
                          unsigned grid, unsigned threads, cudaStream_t stream)
{
    return with_vector_bytes(vector_bytes, [&](auto v) {
        constexpr int V = decltype(v)::value;
        return launch_table([](auto table) { return Family::template kernel<V, typename decltype(table)::type>(); },
                            host_table, device_table, count, p, grid, threads, stream);
    });
}

template <class Family, class T>
cudaError_t load_family()
{
    return load_every_width([](auto v) {
        constexpr int V = decltype(v)::value;
        return load_table_kernels<T>(
            [](auto table) { return Family::template kernel<V, typename decltype(table)::type>(); });
    });
}

// One kernel file's load, linked into the list kvbm_load_kernels runs
// (load_ahead.cu) as the library loads, before any call: each file names
// its own (KVBM_LOAD_AHEAD), so that no list of the files is kept by hand.
struct LoadAhead {
    cudaError_t (*load)();
    const LoadAhead *next;
    static inline const LoadAhead *first = nullptr;  // constant-initialized, before any file's entry

    explicit LoadAhead(cudaError_t (*load_)()) : load(load_), next(first) { first = this; }
};

// What the kernels moving kvbm_paged chunks (paged.cu, to_cache.cu) share:
// a chunk is (block b, moved layer i, outer o), b * nl * no + i * no + o,
// of `segments` runs of segment_bytes each (kvbm_paged.h).
struct PagedTiling {
    Tiling tiling;
    kvbm_divisor vectors_per_segment;
    kvbm_divisor chunks_per_block;  // nl * no
};

// The tiling of `paged`'s chunks in vectors of vector_bytes, and the launch
// shape (make_tiling); false when there is nothing to move.  The call fits
// one launch (kvbm_fits_one_launch): a chunk's vectors and segments in 32
// bits, the call's tiles below 2^31.
inline bool make_paged_tiling(const kvbm_paged *paged, int vector_bytes, uint32_t num_ctas, PagedTiling *out,
                              unsigned *grid, unsigned *threads)
{
    const uint32_t vectors_per_chunk = (uint32_t)(paged->segments * paged->segment_bytes / vector_bytes);
    const int64_t chunks = paged->nb * paged->nl * paged->no;
    if (chunks == 0 || vectors_per_chunk == 0)
        return false;
    out->tiling = make_tiling(vectors_per_chunk, vector_bytes, chunks, num_ctas, grid, threads);
    out->vectors_per_segment = kvbm_divisor_make((uint32_t)(paged->segment_bytes / vector_bytes));
    out->chunks_per_block = kvbm_divisor_make((uint32_t)(paged->nl * paged->no));
    return true;
}

// The byte offsets of vector j of a chunk (of V bytes) on the cache side
// and on the flat side, from the chunk's starts (kvbm_paged_segment).
template <int V>
__device__ __forceinline__ void paged_vector(const kvbm_paged *p, const PagedTiling &t, uint32_t j, int64_t *cache_off,
                                             int64_t *flat_off)
{
    const uint32_t s = kvbm_div(t.vectors_per_segment, j);
    const int64_t within = (int64_t)(j - s * t.vectors_per_segment.divisor) * V;
    kvbm_paged_segment(p, s, cache_off, flat_off);
    *cache_off += within;
    *flat_off += within;
}

}  // namespace kvbm

// At namespace scope in a kernel file: KVBM_LOAD_AHEAD(load), `load` (a
// function taking nothing and returning a cudaError_t) loading its kernels;
// variadic because load_family<Family, T> holds a comma.
#define KVBM_LOAD_AHEAD(...)                                                                                           \
    namespace {                                                                                                        \
    const kvbm::LoadAhead load_ahead_(__VA_ARGS__);                                                                    \
    }

#endif  // KVBM_DEVICE_CUH
