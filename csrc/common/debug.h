/* The KVBM_EXT_DEBUG log: one line per GPU copy call, saying which backend ran
 * and why, so that no fallback goes unseen.  Lines are records of the Python
 * logger "kvbm_ext" (kvbm_ext/_debug.py says where they go). */
#ifndef KVBM_DEBUG_H
#define KVBM_DEBUG_H

/* True when KVBM_EXT_DEBUG is set to anything but "" or "0" (read at every
 * call, so a test or a session can switch it on at run time; no Python code
 * runs to find out). */
int kv_debug_enabled(void);

/* When the log is enabled, formats the message and hands it to
 * kvbm_ext._debug.emit.  Call with the GIL held.  An exception already set is
 * kept and restored; one raised by the logging code is reported through
 * sys.unraisablehook, so that logging never changes a call's outcome. */
void kv_debug(const char *format, ...);

#endif /* KVBM_DEBUG_H */
