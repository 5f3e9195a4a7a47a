/* A promise: the outcome of work that another thread finishes after the
 * call that started it returned (a deferred staged call: gpu.h, kv_gpu_move): pending
 * until that thread settles it, done or failed with a message, once.  Both
 * sides hold it; the last release frees it.  Nothing here needs the GIL. */
#ifndef KVBM_PROMISE_H
#define KVBM_PROMISE_H

typedef struct kv_promise kv_promise;

/* A pending promise with two holders, the thread that settles it and the
 * one that waits for it; NULL when out of memory. */
kv_promise *kv_promise_new(void);

/* Settles it: done when `failure` is NULL, else failed with a copy of it.
 * Wakes its waiters. */
void kv_promise_settle(kv_promise *o, const char *failure);

/* Waits until it is settled or `timeout` seconds passed (< 0: no bound).
 * Returns 1 once settled, 0 on the timeout; 1 at once for a settled one. */
int kv_promise_wait(kv_promise *o, double timeout);

/* Whether it is settled, without waiting. */
int kv_promise_settled(const kv_promise *o);

/* The failure's message once settled, or NULL: it did not fail. */
const char *kv_promise_failure(const kv_promise *o);

void kv_promise_release(kv_promise *o);

#endif /* KVBM_PROMISE_H */
