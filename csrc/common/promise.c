/* The outcome of work another thread finishes.  See promise.h.
 *
 * One mutex and condition for every promise: settling is rare next to the
 * work it ends (one per deferred call), and a waiter, woken by any of them,
 * checks its own. */
/* clock_gettime and the pthread_cond_timedwait its deadline is for. */
#define _POSIX_C_SOURCE 200809L
#include "promise.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define KV_PROMISE_MESSAGE 256

struct kv_promise {
    atomic_int holders;
    atomic_int settled;
    char failure[KV_PROMISE_MESSAGE]; /* "" unless it failed; written before `settled` */
};

static pthread_mutex_t settling = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t settled_one;
static pthread_once_t settled_one_made = PTHREAD_ONCE_INIT;

/* Deadlines on the monotonic clock, which a change of the wall clock does
 * not move. */
static void make_settled_one(void)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&settled_one, &attr);
    pthread_condattr_destroy(&attr);
}

kv_promise *kv_promise_new(void)
{
    pthread_once(&settled_one_made, make_settled_one);
    kv_promise *o = calloc(1, sizeof *o);
    if (o != NULL)
        atomic_init(&o->holders, 2);
    return o;
}

void kv_promise_settle(kv_promise *o, const char *failure)
{
    if (failure != NULL)
        snprintf(o->failure, sizeof o->failure, "%s", failure);
    pthread_mutex_lock(&settling);
    atomic_store_explicit(&o->settled, 1, memory_order_release);
    pthread_cond_broadcast(&settled_one);
    pthread_mutex_unlock(&settling);
}

int kv_promise_settled(const kv_promise *o)
{
    return atomic_load_explicit((atomic_int *)&o->settled, memory_order_acquire);
}

int kv_promise_wait(kv_promise *o, double timeout)
{
    if (kv_promise_settled(o))
        return 1;
    if (timeout > 1e9) /* beyond any wait (and time_t): unbounded */
        timeout = -1;
    struct timespec until = {0, 0};
    if (timeout >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &until);
        const double whole = (double)(time_t)timeout;
        until.tv_sec += (time_t)whole;
        until.tv_nsec += (long)((timeout - whole) * 1e9);
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&settling);
    int waited = 0;
    while (!kv_promise_settled(o) && waited != ETIMEDOUT)
        waited = timeout < 0 ? pthread_cond_wait(&settled_one, &settling)
                             : pthread_cond_timedwait(&settled_one, &settling, &until);
    pthread_mutex_unlock(&settling);
    return kv_promise_settled(o);
}

const char *kv_promise_failure(const kv_promise *o)
{
    return kv_promise_settled(o) && o->failure[0] != '\0' ? o->failure : NULL;
}

void kv_promise_release(kv_promise *o)
{
    if (o != NULL && atomic_fetch_sub(&o->holders, 1) == 1)
        free(o);
}
