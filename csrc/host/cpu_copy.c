/* Raw copies on the CPU.  See cpu_copy.h. */
#include "cpu_copy.h"

#include <string.h>

void kv_cpu_copy_pairs(const kv_pairs *pairs)
{
    for (int64_t i = 0; i < pairs->count; i++)
        memcpy((void *)(uintptr_t)pairs->dst[i], (const void *)(uintptr_t)pairs->src[i],
               (size_t)(pairs->sizes ? pairs->sizes[i] : pairs->uniform_size));
}
