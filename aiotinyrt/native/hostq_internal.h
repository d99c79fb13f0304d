/* The host queue's C side: the full hq_t and what hostq.c and the extension module share. */
#ifndef AIOTINYRT_HOSTQ_INTERNAL_H
#define AIOTINYRT_HOSTQ_INTERNAL_H
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  /* sched_getcpu, sched_setaffinity */
#endif
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

typedef uint64_t u64;
#define LOAD(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)

typedef struct hq hq_t;
#include "hostq.h"

/* deps: ndeps pairs (hq_t address, value): run only once each of those queues completed that value */
typedef struct {
    int64_t seq; void *fn; u64 *args; int32_t kind; int32_t nargs; int64_t *deps; int64_t ndeps;
} hq_slot;
typedef struct hq_chunk { hq_slot slots[HQ_CHUNK]; struct hq_chunk *next; } hq_chunk;

/* One cache line per writer, so the producer (the event loop) and the consumer (the worker)
   do not bounce a line between cores on every command. The cdef declares the prefix up to
   `sleeping`, with the same padding. */
struct hq {
    /* line 0: written by the consumer */
    int64_t completed, expected;
    double *elapsed;
    hq_chunk *rchunk; int64_t rpos;   /* where `expected` lives */
    int32_t wlock;                    /* orders `completed` against a registering waiter */
    char pad0[20];
    /* line 1: written by producers (under pmu) */
    int64_t submitted;
    hq_chunk *wchunk; int64_t wpos;   /* the next free slot */
    hq_chunk *spare;                  /* recycled chunks */
    char pad1[32];
    /* line 2: read on every command, written rarely */
    int64_t wake_at;
    int32_t halted, sleeping;
    int64_t fail_max;                 /* the largest value known to have failed (0: none) */
    int32_t remote;                   /* other queues' workers asleep waiting for `completed` */
    int32_t deps_ok;                  /* Python checked the current command's dependencies */
    char pad2[32];
    pthread_mutex_t pmu;              /* producers */
    pthread_mutex_t mu; pthread_cond_t cv;  /* the consumer's sleep */
    int32_t tid;                      /* the worker's thread id, once it ran (0 before) */
    int32_t steered;                  /* a producer narrowed its CPU mask to wake it (see steer) */
    int32_t pid;                      /* the process the worker runs in (tid is only valid there) */
#ifdef __linux__
    cpu_set_t home;                   /* the worker's mask before the latest narrowing */
#endif
};

#define HQ_SAME(field) \
    _Static_assert(offsetof(hq_t, field) == offsetof(struct hq_view, field), "hq_t." #field " vs hostq.h")
HQ_SAME(completed);
HQ_SAME(expected);
HQ_SAME(elapsed);
HQ_SAME(submitted);
HQ_SAME(wake_at);
HQ_SAME(halted);
HQ_SAME(sleeping);
HQ_SAME(fail_max);
HQ_SAME(remote);
HQ_SAME(deps_ok);
_Static_assert(offsetof(hq_t, submitted) == 64 && offsetof(hq_t, wake_at) == 128, "one cache line per writer");
#endif
