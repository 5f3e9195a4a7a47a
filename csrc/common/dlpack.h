/* The DLPack ABI (https://github.com/dmlc/dlpack, Apache-2.0), the parts this
 * extension reads: the tensor descriptor, both capsule payloads and the C
 * exchange API of DLPack 1.3. */
#ifndef KVBM_DLPACK_H
#define KVBM_DLPACK_H

#include <stdint.h>

enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3,
    kDLCUDAManaged = 13,
};

enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLOpaqueHandle = 3,
    kDLBfloat = 4,
    kDLComplex = 5,
    kDLBool = 6,
    kDLFloat8_e3m4 = 7,
    kDLFloat8_e4m3 = 8,
    kDLFloat8_e4m3b11fnuz = 9,
    kDLFloat8_e4m3fn = 10,
    kDLFloat8_e4m3fnuz = 11,
    kDLFloat8_e5m2 = 12,
    kDLFloat8_e5m2fnuz = 13,
    kDLFloat8_e8m0fnu = 14,
};

#define DLPACK_FLAG_BITMASK_READ_ONLY (UINT64_C(1) << 0)

typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* The C exchange API: a producer's type attribute __dlpack_c_exchange_api__
 * is a capsule "dlpack_exchange_api" holding this table, valid for the life
 * of the process.  New minor versions only append members.  Only the two
 * members read here are spelled out; the others are opaque pointers. */
typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

typedef struct DLPackExchangeAPI {
    DLPackExchangeAPIHeader header;
    void *managed_tensor_allocator;
    void *managed_tensor_from_py_object_no_sync;
    void *managed_tensor_to_py_object_no_sync;
    /* Fills *out (shape and strides owned by the producer, valid while
     * py_object lives) without a Python call and without any stream
     * synchronization; 0, or -1 with a Python exception.  May be NULL. */
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
    /* The producer's current stream on a device; 0, or -1 with an exception. */
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out_current_stream);
} DLPackExchangeAPI;

#endif /* KVBM_DLPACK_H */
