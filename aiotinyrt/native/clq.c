/* The completion half of a CL queue's driver (aiotinyrt/backends/cl_queue.py), in C.

   The submitting thread hands every command's event to clq_push(); the queue's waiter thread
   sits in clq_wait() with the GIL released: it waits for the oldest event handed over, then
   takes every later one that has completed too (the queue is in order, so they form a prefix),
   reads each one's execution status and profiling times, releases its reference, and returns
   the whole batch to Python in one call. Done in Python, those are three or four calls per event
   that each release and retake the GIL, which the submitting thread needs at the same moment.

   The OpenCL entry points come from the caller (the ICD loader Python opened), so this file
   needs neither OpenCL's headers nor its library at build time. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "clq.h"

typedef int32_t cl_int;
typedef uint32_t cl_uint;
typedef uint64_t cl_ulong;
typedef void *cl_event;

#define CL_EVENT_COMMAND_EXECUTION_STATUS 0x11D3
#define CL_PROFILING_COMMAND_START 0x1282
#define CL_PROFILING_COMMAND_END 0x1283

typedef cl_int (*wait_fn)(cl_uint, const cl_event *);
typedef cl_int (*info_fn)(cl_event, cl_uint, size_t, void *, size_t *);
typedef cl_int (*ref_fn)(cl_event);

struct slot {
    cl_event event;
    int64_t tag; /* the caller's name for the command (its deque entry) */
};

struct clq {
    pthread_mutex_t lock;
    pthread_cond_t more;
    struct slot *ring; /* a circular buffer of cap slots: count events from head */
    size_t cap, head, count;
    int closed;
    pid_t pid; /* the process that made it */
    wait_fn wait;
    info_fn event_info, profiling_info;
    ref_fn retain, release;
};

clq_t *clq_new(uintptr_t wait, uintptr_t event_info, uintptr_t profiling_info, uintptr_t retain,
               uintptr_t release) {
    clq_t *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    q->cap = 1024;
    q->ring = malloc(q->cap * sizeof *q->ring);
    if (!q->ring || pthread_mutex_init(&q->lock, NULL) != 0) {
        free(q->ring);
        free(q);
        return NULL;
    }
    pthread_cond_init(&q->more, NULL);
    q->wait = (wait_fn)wait;
    q->event_info = (info_fn)event_info;
    q->profiling_info = (info_fn)profiling_info;
    q->retain = (ref_fn)retain;
    q->release = (ref_fn)release;
    q->pid = getpid();
    return q;
}

/* Free the ring and release the events it still holds. In a forked child (the parent's waiter
   thread and the driver's threads are gone) nothing is released: only the memory is freed, and
   the mutex and condition variable are never destroyed (a condition variable whose waiter was
   the parent's thread would make pthread_cond_destroy wait forever; on Linux they hold no other
   resource). */
void clq_free(clq_t *q) {
    if (!q) return;
    if (q->pid == getpid())
        for (size_t i = 0; i < q->count; i++) q->release(q->ring[(q->head + i) % q->cap].event);
    free(q->ring);
    free(q);
}

/* Keep a reference to `event` until clq_wait() reported it, under `tag`. 0, or -1 (out of
   memory, or the queue is closed: nothing was kept). */
int clq_push(clq_t *q, void *event, int64_t tag) {
    int out = 0;
    pthread_mutex_lock(&q->lock);
    if (q->closed) {
        out = -1;
    } else if (q->count == q->cap) {
        struct slot *bigger = malloc(2 * q->cap * sizeof *bigger);
        if (!bigger) {
            out = -1;
        } else {
            for (size_t i = 0; i < q->count; i++) bigger[i] = q->ring[(q->head + i) % q->cap];
            free(q->ring);
            q->ring = bigger;
            q->head = 0;
            q->cap *= 2;
        }
    }
    if (out == 0) {
        q->retain(event);
        q->ring[(q->head + q->count) % q->cap] = (struct slot){event, tag};
        if (q->count++ == 0) pthread_cond_signal(&q->more);
    }
    pthread_mutex_unlock(&q->lock);
    return out;
}

/* Wait (blocking) for the oldest event handed over, then report it and every later completed
   one, at most `max`: tags[i] is its tag, status[i] its execution status (0: complete;
   negative: its error) or the error of reading it, seconds[i] its profiling time (0 without
   one). Returns the number reported, or -1 once the queue is closed and every event was
   reported. 0 only after a wait that failed while its event had not completed: that event is
   not reported until it has (its command may still use its memory); the call sleeps 1 ms
   first, so a caller calling again does not spin. */
int clq_wait(clq_t *q, int max, int32_t *status, double *seconds, int64_t *tags) {
    struct slot taken[256];
    if (max > 256) max = 256;
    if (max < 1) max = 1;
    pthread_mutex_lock(&q->lock);
    while (q->count == 0 && !q->closed) pthread_cond_wait(&q->more, &q->lock);
    if (q->count == 0) {
        pthread_mutex_unlock(&q->lock);
        return -1;
    }
    cl_event first = q->ring[q->head].event;
    pthread_mutex_unlock(&q->lock);
    q->wait(1, &first); /* (a failure: the statuses below tell) */
    pthread_mutex_lock(&q->lock); /* only this thread takes events: the prefix stays */
    int n = (int)(q->count < (size_t)max ? q->count : (size_t)max);
    for (int i = 0; i < n; i++) taken[i] = q->ring[(q->head + (size_t)i) % q->cap];
    pthread_mutex_unlock(&q->lock);
    int done = 0;
    for (; done < n; done++) {
        cl_int st = 0;
        cl_event ev = taken[done].event;
        cl_int code = q->event_info(ev, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL);
        if (code == 0 && st > 0) break; /* not completed yet: the next batch starts with it */
        status[done] = code ? code : st;
        tags[done] = taken[done].tag;
        seconds[done] = 0.0;
        cl_ulong t[2];
        if (status[done] == 0 &&
            q->profiling_info(ev, CL_PROFILING_COMMAND_START, sizeof t[0], &t[0], NULL) == 0 &&
            q->profiling_info(ev, CL_PROFILING_COMMAND_END, sizeof t[1], &t[1], NULL) == 0)
            seconds[done] = t[1] > t[0] ? (double)(t[1] - t[0]) * 1e-9 : 0.0;
        q->release(ev);
    }
    if (done == 0) { /* the wait failed (`waited`) and its event is still queued or running */
        struct timespec nap = {0, 1000000};
        nanosleep(&nap, NULL);
    }
    pthread_mutex_lock(&q->lock);
    q->head = (q->head + (size_t)done) % q->cap;
    q->count -= (size_t)done;
    pthread_mutex_unlock(&q->lock);
    return done;
}

/* No more events: clq_wait() returns -1 once it reported every event handed over. */
void clq_close(clq_t *q) {
    pthread_mutex_lock(&q->lock);
    q->closed = 1;
    pthread_cond_broadcast(&q->more);
    pthread_mutex_unlock(&q->lock);
}
