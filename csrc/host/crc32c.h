/* CRC-32C (Castagnoli) of host bytes: the checksum the disk tier stores with
 * each block, computed where the bytes pass (pinned staging), with the
 * SSE4.2 instruction where the CPU has it. */
#ifndef KVBM_CRC32C_H
#define KVBM_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/* The CRC-32C of `size` bytes continuing from `crc` (0 to start), as
 * zlib.crc32 chains: crc32c(b, crc32c(a)) == crc32c(a + b). */
uint32_t kv_crc32c(uint32_t crc, const void *data, size_t size);

#endif /* KVBM_CRC32C_H */
