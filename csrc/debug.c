/* The KVBM_EXT_DEBUG log.  See debug.h. */
#include "debug.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int kv_debug_enabled(void)
{
    const char *value = getenv("KVBM_EXT_DEBUG");
    return value != NULL && value[0] != '\0' && strcmp(value, "0") != 0;
}

void kv_debug(const char *format, ...)
{
    if (!kv_debug_enabled())
        return;
    char line[512];
    va_list args;
    va_start(args, format);
    vsnprintf(line, sizeof line, format, args);
    va_end(args);
    fprintf(stderr, "kvbm_ext: %s\n", line);
    fflush(stderr);
}
