/* kvbm_ext.crc32c(data, /, value=0): the CRC-32C of a host array's bytes,
 * continuing from `value`, with the GIL released for 64 KiB and more. */
#ifndef KVBM_CHECKSUM_H
#define KVBM_CHECKSUM_H

#include "state.h"

/* Returns a new int, or NULL with ValueError/TypeError naming `data` or
 * `value` (a device array, a non-contiguous one, a value outside 32 bits). */
PyObject *kv_checksum(kv_state *state, PyObject *data, PyObject *value);

#endif /* KVBM_CHECKSUM_H */
