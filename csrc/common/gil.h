/* Whether a CPU copy releases the GIL (on free-threaded CPython: detaches
 * from the interpreter) while it runs: from KV_RELEASE_GIL_BYTES up.  A
 * shorter copy takes less time than giving the GIL up and taking it back,
 * which, with other threads calling in, is where small calls from several
 * threads would spend their time. */
#ifndef KVBM_GIL_H
#define KVBM_GIL_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>

#define KV_RELEASE_GIL_BYTES ((int64_t)64 << 10)

/* Before a copy of `bytes`: the thread state to give kv_retake_gil, or
 * NULL when the GIL stays held. */
static inline PyThreadState *kv_release_gil_for(int64_t bytes)
{
    return bytes >= KV_RELEASE_GIL_BYTES ? PyEval_SaveThread() : NULL;
}

static inline void kv_retake_gil(PyThreadState *released)
{
    if (released != NULL)
        PyEval_RestoreThread(released);
}

#endif /* KVBM_GIL_H */
