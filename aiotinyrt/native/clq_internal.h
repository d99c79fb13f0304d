/* The completion ring of a CL queue, inside: its structure and the helpers clq.c (the waiter's
   side, gates, pushes) and clq_poll.c (the poller's side: polls and claims) share. Not for
   cffi (clq.h is its view). */
#ifndef CLQ_INTERNAL_H
#define CLQ_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/types.h>
#include <time.h>

#include "clq.h"

#define CLQ_HIDDEN __attribute__((visibility("hidden")))

#define CLQ_NO_WAKE INT64_MAX /* clq_set_wake: nobody waits (aiotinyrt.native.NO_WAKE) */
#define CLQ_WAITER 1          /* the token's holder: clq_wait's caller ... */
#define CLQ_POLLER 2          /* ... or a clq_poll caller */

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
typedef cl_event (*user_fn)(void *, cl_int *);
typedef cl_int (*status_fn)(cl_event, cl_int);

struct slot {
    cl_event event;
    int64_t tag; /* the caller's name for the command (its deque entry) */
    int urgent;  /* the caller acts on its completion (a Python command): report it at once */
    void *obj;   /* the caller's, handed back with the tag (clfast.c: a repeat launch's Signal) */
};

struct clq {
    pthread_mutex_t lock;
    pthread_cond_t more;
    pthread_cond_t token; /* `taking` and `poller` went to 0 */
    int taking;           /* who holds the token (see the top of the file): 0, CLQ_WAITER, CLQ_POLLER */
    int poller;           /* a clq_poll() caller waits for the token or its event */
    int token_waits;      /* threads in a wait for the token itself: clq_wake_takers wakes them */
    int claim_wait;       /* the waiter waits for claims to end (on `more`, as a nap: see clq.c) */
    int polled;           /* the events the token's poller took (its thread: poll_owner) */
    int claims;           /* callers about to poll (clq_claim): the waiter leaves events to them ... */
    struct timespec claim_due; /* ... until then at the latest */
    int64_t claim_last;   /* the newest claim's number (clq_claim returns it) ... */
    int64_t claim_floor;  /* ... and the newest one no longer counted (it ran out of time) */
    pthread_t poll_owner;
    struct slot *ring; /* a circular buffer of cap slots: count events from head */
    size_t cap, head, count;
    int closed;
    /* clq_wait() holds taken results, looks at a pending event or naps in a timed wait
       (clq_set_wake wakes it), and the smallest
       value a caller waits for (CLQ_NO_WAKE: none). Stored and then the other loaded, both
       sequentially consistent: either the waiter sees the wake before it sleeps, or the setter
       sees it polling and signals under the lock (which the waiter holds until it sleeps). */
    _Atomic int polling;
    _Atomic int64_t wake;
    int idle;    /* the waiter waits (untimed) for an event to be handed over: a push wakes it */
    int napping; /* the waiter naps (a timed wait, see "Naps" in clq.c): only an urgent push, or any
                    push while somebody waits for the queue, wakes it */
    int naps;    /* its naps since the last push */
    long push_wakes; /* the pushes that woke it (tests, statistics) */
    long claim_wakes; /* its waits for claims to end that a signal cut short (tests, statistics) */
    int direct;  /* the newest command handed over, a repeat launch, was claimed or polled for:
                    the next command goes to the device at once (see "Gates" in clq.c) ... */
    int64_t direct_claim; /* ... with a claim of its own, which its await's clq_claim takes over;
                             `directed` tells clq_set_wake without the lock that there is one */
    _Atomic int directed;
    size_t urgent_count; /* urgent slots in the ring */
    cl_event looked_at;  /* the oldest event the waiter looked at while nobody waited ... */
    int looks;           /* ... and how many times (see "Nobody waits" at the top) */
    int blocked; /* the waiter is inside the driver's wait: it cannot time a gate */
    struct timespec until; /* the end of the waiter's timed wait, while `polling` */
    /* The open batch's gate (NULL: none; see the top of the file), set at gate_due at the
       latest; `gated` tells clq_set_wake without the lock that there is one. */
    cl_event gate;
    struct timespec gate_due;
    _Atomic int gated;
    long gate_ns; /* 0: no gating */
    void *context;
    user_fn create_user;
    status_fn set_status;
    pid_t pid; /* the process that made it */
    wait_fn wait;
    info_fn event_info, profiling_info;
    ref_fn retain, release;
};


/* 1 in a child forked after `q` was made (its waiter and the driver's threads are gone). */
CLQ_HIDDEN int clq_forked(const clq_t *q);
/* Set the open batch's gate, if there is one (caller holds the lock). */
CLQ_HIDDEN void clq_open_locked(clq_t *q);
/* *t = now + ns on the monotonic clock; whether a is before b. */
CLQ_HIDDEN void clq_after(struct timespec *t, long ns);
CLQ_HIDDEN int clq_before(const struct timespec *a, const struct timespec *b);
/* Count a claim until `due` (or take over claim `adopt`), caller holds the lock (clq_poll.c). */
CLQ_HIDDEN int64_t clq_count_claim(clq_t *q, const struct timespec *due, int64_t adopt);
/* End a direct launch's claim not taken over yet, if any; caller holds the lock (clq_poll.c). */
CLQ_HIDDEN void clq_end_direct(clq_t *q);
/* A claim ended or the token went back (caller holds the lock): see clq_poll.c. */
CLQ_HIDDEN void clq_wake_takers(clq_t *q);
/* Read an event's outcome: 1 completed (or reading failed), 0 not yet (see clq.c). */
CLQ_HIDDEN int clq_read(clq_t *q, cl_event ev, int32_t *status, double *seconds);

#endif
