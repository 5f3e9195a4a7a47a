/* Registering host memory with the driver for kvbm_ext.pinned_empty, and
 * what the driver says of an address.  See gpu.h. */
#include "gpu_internal.h"

#include <stdio.h>
#include <stdlib.h>

#include "align.h"

/* The smallest piece a refused registration is split into: below it, the
 * refusal is not about size. */
#define KV_REGISTER_FLOOR ((size_t)1 << 30)

static void describe(char *why, size_t why_size, cudaError_t error, const char *what)
{
    snprintf(why, why_size, "CUDA error %s %s: %s", cudaGetErrorName(error), what, cudaGetErrorString(error));
}

/* Why nothing can be registered here (no driver, no device), or NULL. */
static const char *no_device(char *why, size_t why_size)
{
    int count = 0;
    const cudaError_t error = cudaGetDeviceCount(&count);
    if (error != cudaSuccess) {
        cudaGetLastError();
        snprintf(why, why_size, "no CUDA device (%s)", cudaGetErrorName(error));
        return why;
    }
    if (count == 0) {
        snprintf(why, why_size, "no CUDA device");
        return why;
    }
    return NULL;
}

static void unregister_pieces(const kv_host_registration *r)
{
    for (int i = 0; i < r->count; i++)
        if (cudaHostUnregister(r->pieces[i].start) != cudaSuccess)
            cudaGetLastError();
}

/* Kernels address a multi-piece range from its first piece's device
 * pointer: each piece must sit at its host address (unified addressing on a
 * device with cudaDevAttrCanUseHostPointerForRegisteredMem). */
static cudaError_t check_device_addresses(const kv_host_registration *r, const char **what)
{
    for (int i = 0; r->count > 1 && i < r->count; i++) {
        void *device_pointer = NULL;
        const cudaError_t error = cudaHostGetDevicePointer(&device_pointer, r->pieces[i].start, 0);
        if (error != cudaSuccess) {
            *what = "finding the device address of a registered piece";
            return error;
        }
        if (device_pointer != (void *)r->pieces[i].start) {
            *what = "registering in pieces (the device addresses them elsewhere than the host, so they are not one "
                    "array to kernels)";
            return cudaErrorNotSupported;
        }
    }
    return cudaSuccess;
}

/* The size every piece but the last is a multiple of: whole leading items
 * (a block of a pool, so that no single copy of one crosses two
 * registrations) and KV_HOST_ALIGN (pieces share no page).  `bytes`
 * where that is larger than the range. */
static size_t piece_unit(size_t item, size_t bytes)
{
    if (item == 0)
        return KV_HOST_ALIGN;
    size_t divisor = item, rest = KV_HOST_ALIGN; /* Euclid: their greatest common divisor */
    while (rest != 0) {
        const size_t next = divisor % rest;
        divisor = rest;
        rest = next;
    }
    const size_t items = KV_HOST_ALIGN / divisor; /* items in the least common multiple */
    return item > bytes / items ? bytes : item * items;
}

/* Registers [base, base + bytes) piece by piece, pieces a multiple of
 * `unit` but the last, halving a refused piece down to the floor; on
 * failure unregisters what was registered. */
static cudaError_t register_pieces(char *base, size_t bytes, size_t piece, size_t unit, kv_host_registration *r)
{
    piece = kv_round_up(piece, unit);
    piece = piece < bytes ? piece : bytes;
    const size_t least = kv_round_up(KV_REGISTER_FLOOR, unit);
    const size_t floor = piece < least ? piece : least;
    const size_t most = (bytes + floor - 1) / floor;
    r->pieces = malloc(most * sizeof *r->pieces);
    if (r->pieces == NULL)
        return cudaErrorMemoryAllocation;
    size_t done = 0;
    while (done < bytes) {
        const size_t size = bytes - done < piece ? bytes - done : piece;
        const cudaError_t error =
            cudaHostRegister(base + done, size, cudaHostRegisterPortable | cudaHostRegisterMapped);
        if (error == cudaSuccess) {
            r->pieces[r->count++] = (kv_host_piece){base + done, size};
            done += size;
            continue;
        }
        cudaGetLastError();
        if (piece <= floor) {
            unregister_pieces(r);
            return error;
        }
        piece = kv_round_up(piece / 2, unit);
        piece = piece < floor ? floor : piece;
    }
    return cudaSuccess;
}

int kv_gpu_host_register(int device, char *base, size_t bytes, size_t piece_limit, size_t item,
                         kv_host_registration *out, char *why, size_t why_size)
{
    out->pieces = NULL;
    out->count = 0;
    if (no_device(why, why_size) != NULL)
        return 1;
    int previous;
    cudaError_t error = kv_select_device(device, &previous);
    const char *what = "selecting the device";
    if (error == cudaSuccess) {
        what = "registering host memory (cudaHostRegister)";
        const size_t piece = piece_limit == 0 || piece_limit > bytes ? bytes : piece_limit;
        error = register_pieces(base, bytes, piece, piece_unit(item, bytes), out);
    }
    if (error == cudaSuccess && (error = check_device_addresses(out, &what)) != cudaSuccess)
        unregister_pieces(out);
    if (previous >= 0)
        cudaSetDevice(previous);
    if (error == cudaSuccess)
        return 0;
    cudaGetLastError();
    describe(why, why_size, error, what);
    free(out->pieces);
    out->pieces = NULL;
    out->count = 0;
    return -1;
}

int kv_gpu_host_unregister(kv_host_registration *registration, char *why, size_t why_size)
{
    int rc = 0;
    for (int i = 0; i < registration->count; i++) {
        const cudaError_t error = cudaHostUnregister(registration->pieces[i].start);
        if (error != cudaSuccess && rc == 0) {
            cudaGetLastError();
            describe(why, why_size, error, "unregistering host memory (cudaHostUnregister)");
            rc = -1;
        }
    }
    free(registration->pieces);
    registration->pieces = NULL;
    registration->count = 0;
    return rc;
}

int kv_gpu_pci_bus_id(int device, char *buf, size_t size)
{
    if (cudaDeviceGetPCIBusId(buf, (int)size, device) == cudaSuccess)
        return 0;
    cudaGetLastError();
    return -1;
}

const char *kv_gpu_pointer_kind(const void *address)
{
    struct cudaPointerAttributes attributes;
    const cudaError_t error = cudaPointerGetAttributes(&attributes, address);
    if (error != cudaSuccess) {
        cudaGetLastError();
        PyErr_Format(PyExc_RuntimeError, "CUDA error %s describing address %p: %s", cudaGetErrorName(error), address,
                     cudaGetErrorString(error));
        return NULL;
    }
    switch (attributes.type) {
    case cudaMemoryTypeDevice: return "device";
    case cudaMemoryTypeManaged: return "managed";
    case cudaMemoryTypeHost: return "pinned";
    default: return "pageable";
    }
}
