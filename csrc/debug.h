/* The KVBM_EXT_DEBUG log: one line per GPU copy call on stderr, saying which
 * backend ran and why, so that no fallback goes unseen. */
#ifndef KVBM_DEBUG_H
#define KVBM_DEBUG_H

/* True when KVBM_EXT_DEBUG is set to anything but "" or "0" (read at every
 * call, so a test or a session can switch it on at run time). */
int kv_debug_enabled(void);

/* Writes "kvbm_ext: <message>\n" to stderr when the log is enabled. */
void kv_debug(const char *format, ...);

#endif /* KVBM_DEBUG_H */
