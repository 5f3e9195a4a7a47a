/* A lock for the little state that several threads may reach with an
 * attached thread state (the type-facts cache, the stub build's staging
 * settings): a PyMutex on free-threaded CPython, where nothing else
 * serializes them, and nothing with the GIL, which already does.
 *
 * Held only around plain reads, writes and increfs: never around Python
 * code, a Py_DECREF or anything that blocks, so that a thread waiting for it
 * never waits for the interpreter.  State used with the GIL released (the
 * GPU rings and staging) has its own PyThread lock (gpu_internal.h). */
#ifndef KVBM_LOCK_H
#define KVBM_LOCK_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#ifdef Py_GIL_DISABLED

/* ThreadSanitizer sees the inline fast path of PyMutex but not its slow
 * path inside the interpreter: tell it about every acquire and release. */
#if defined(__SANITIZE_THREAD__)
#define KV_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define KV_TSAN 1
#endif
#endif
#ifdef KV_TSAN
#include <sanitizer/tsan_interface.h>
#define KV_LOCK_ACQUIRED(lock) __tsan_acquire(lock)
#define KV_LOCK_RELEASING(lock) __tsan_release(lock)
#else
#define KV_LOCK_ACQUIRED(lock) ((void)(lock))
#define KV_LOCK_RELEASING(lock) ((void)(lock))
#endif

typedef PyMutex kv_lock; /* zero-initialized: unlocked */

static inline void kv_lock_acquire(kv_lock *lock)
{
    PyMutex_Lock(lock);
    KV_LOCK_ACQUIRED(lock);
}

static inline void kv_lock_release(kv_lock *lock)
{
    KV_LOCK_RELEASING(lock);
    PyMutex_Unlock(lock);
}

#else

typedef struct {
    char unused; /* the GIL serializes every user */
} kv_lock;

static inline void kv_lock_acquire(kv_lock *lock) { (void)lock; }
static inline void kv_lock_release(kv_lock *lock) { (void)lock; }

#endif /* Py_GIL_DISABLED */

#endif /* KVBM_LOCK_H */
