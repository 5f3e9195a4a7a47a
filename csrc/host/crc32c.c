/* CRC-32C.  See crc32c.h. */
#include "crc32c.h"

#include <string.h>

#define POLY 0x82f63b78u /* Castagnoli, reflected */

/* Slicing-by-8 tables for CPUs without SSE4.2, filled once. */
static uint32_t table[8][256];
static int table_ready;

static void fill_table(void)
{
    for (uint32_t n = 0; n < 256; n++) {
        uint32_t c = n;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? (c >> 1) ^ POLY : c >> 1;
        table[0][n] = c;
    }
    for (uint32_t n = 0; n < 256; n++)
        for (int k = 1; k < 8; k++)
            table[k][n] = (table[k - 1][n] >> 8) ^ table[0][table[k - 1][n] & 0xff];
    __atomic_store_n(&table_ready, 1, __ATOMIC_RELEASE);
}

static uint32_t crc32c_software(uint32_t crc, const unsigned char *p, size_t size)
{
    if (!__atomic_load_n(&table_ready, __ATOMIC_ACQUIRE))
        fill_table(); /* idempotent: two threads write the same values */
    for (; size >= 8; p += 8, size -= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        word ^= crc;
        crc = table[7][word & 0xff] ^ table[6][(word >> 8) & 0xff] ^ table[5][(word >> 16) & 0xff]
              ^ table[4][(word >> 24) & 0xff] ^ table[3][(word >> 32) & 0xff] ^ table[2][(word >> 40) & 0xff]
              ^ table[1][(word >> 48) & 0xff] ^ table[0][word >> 56];
    }
    for (; size > 0; p++, size--)
        crc = (crc >> 8) ^ table[0][(crc ^ *p) & 0xff];
    return crc;
}

#if defined(__x86_64__)
/* The instruction's latency, not its throughput, bounds one chain of it:
 * three chains run over three neighbouring stretches, and their registers
 * are joined by shifting one over STRETCH zero bytes, a linear map applied
 * with four lookups (Mark Adler's method). */
#define STRETCH 4096

static uint32_t shift_table[4][256];
static int shift_ready;

__attribute__((target("sse4.2"))) static uint32_t chain(uint32_t crc, const unsigned char *p, size_t size)
{
    uint64_t c = crc;
    for (; size >= 8; p += 8, size -= 8) {
        uint64_t word;
        memcpy(&word, p, 8);
        c = __builtin_ia32_crc32di(c, word);
    }
    uint32_t c32 = (uint32_t)c;
    for (; size > 0; p++, size--)
        c32 = __builtin_ia32_crc32qi(c32, *p);
    return c32;
}

/* The register after STRETCH zero bytes from each single-bit register,
 * spread into one table per register byte. */
static void fill_shift_table(void)
{
    static const unsigned char zeros[STRETCH];
    uint32_t bit_image[32];
    for (int b = 0; b < 32; b++)
        bit_image[b] = chain(1u << b, zeros, STRETCH);
    for (int k = 0; k < 4; k++)
        for (uint32_t n = 0; n < 256; n++) {
            uint32_t image = 0;
            for (int b = 0; b < 8; b++)
                if (n & (1u << b))
                    image ^= bit_image[8 * k + b];
            shift_table[k][n] = image;
        }
    __atomic_store_n(&shift_ready, 1, __ATOMIC_RELEASE);
}

static uint32_t shift(uint32_t crc)
{
    return shift_table[0][crc & 0xff] ^ shift_table[1][(crc >> 8) & 0xff] ^ shift_table[2][(crc >> 16) & 0xff]
           ^ shift_table[3][crc >> 24];
}

__attribute__((target("sse4.2"))) static uint32_t crc32c_sse42(uint32_t crc, const unsigned char *p, size_t size)
{
    if (size >= 3 * STRETCH && !__atomic_load_n(&shift_ready, __ATOMIC_ACQUIRE))
        fill_shift_table(); /* idempotent: two threads write the same values */
    for (; size >= 3 * STRETCH; p += 3 * STRETCH, size -= 3 * STRETCH) {
        uint64_t a = crc, b = 0, c = 0;
        for (size_t i = 0; i < STRETCH; i += 8) {
            uint64_t x, y, z;
            memcpy(&x, p + i, 8);
            memcpy(&y, p + STRETCH + i, 8);
            memcpy(&z, p + 2 * STRETCH + i, 8);
            a = __builtin_ia32_crc32di(a, x);
            b = __builtin_ia32_crc32di(b, y);
            c = __builtin_ia32_crc32di(c, z);
        }
        crc = shift(shift((uint32_t)a) ^ (uint32_t)b) ^ (uint32_t)c;
    }
    return chain(crc, p, size);
}
#endif

uint32_t kv_crc32c(uint32_t crc, const void *data, size_t size)
{
    crc = ~crc;
#if defined(__x86_64__)
    if (__builtin_cpu_supports("sse4.2"))
        return ~crc32c_sse42(crc, data, size);
#endif
    return ~crc32c_software(crc, data, size);
}
