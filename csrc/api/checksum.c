/* kvbm_ext.crc32c: the checksum of an array's bytes in host memory.  See
 * checksum.h; the arithmetic is crc32c.c's. */
#include "checksum.h"

#include "args.h"
#include "crc32c.h"
#include "gil.h"
#include "signatures.h"

PyObject *kv_checksum(kv_state *state, PyObject *data, PyObject *value)
{
    int64_t start;
    if (kv_parse_int(value, "value", 0, UINT32_MAX, KV_CRC32C_ARGS_VALUE_DEFAULT, 0, &start) < 0)
        return NULL;
    const kv_reader reader = {&state->protocols, Py_None};
    const kv_path path = {"data", {0, 0}, 0};
    kv_array a;
    if (kv_array_read(&reader, data, &path, 0, &a) < 0)
        return NULL;
    int rc = 0;
    if (a.place == KV_DEVICE)
        rc = kv_path_error(PyExc_ValueError, &path, "on a CUDA device; the checksum reads host memory");
    else if (!kv_array_is_contiguous(&a))
        rc = kv_path_error(PyExc_ValueError, &path, "must be C-contiguous (its bytes are summed in memory order)");
    uint32_t crc = (uint32_t)start;
    if (rc == 0) {
        const int64_t bytes = kv_array_elements(&a) * a.itemsize;
        PyThreadState *released = kv_release_gil_for(bytes);
        crc = kv_crc32c(crc, a.data, (size_t)bytes);
        kv_retake_gil(released);
    }
    kv_array_release(&a);
    return rc < 0 ? NULL : PyLong_FromUnsignedLong(crc);
}
