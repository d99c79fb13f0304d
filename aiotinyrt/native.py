"""The native half of the host worker queue: a command ring and its run loop, in C.

Why it exists
=============
A launch of a tiny kernel is about a microsecond of work. Run by a Python worker thread, each
command also costs several microseconds of Python *and* the GIL, which the event loop thread
needs to submit the next launch: the two threads take turns instead of running side by side.
Here the worker's inner loop is C. Python only writes a command into the ring (one cffi call,
which also wakes a sleeping worker) and the worker runs every native command without the GIL:
a kernel call through a function pointer, with its pointer and int arguments from an argument
block the program prepared once. The Python worker thread sits in :func:`hq_run` (GIL
released) and comes back to Python only when it must:

* ``R_PY``: the next command is a Python one (copies, transfers, split kernels, graph replays,
  anything with cross-queue dependencies); it runs exactly as before;
* ``R_WAKE``: the command just run reached the smallest value a waiter registered on the
  timeline (``wake_at``); Python advances the timeline itself, so internal callbacks (deferred
  frees) run before ``completed`` moves, then wakes the waiting tasks;
* ``R_HALTED``: the device holds a sticky error (or is closing); Python fails the command.

Memory ordering: the worker's "check ``wake_at``, then store ``completed``" and a waiter's "store
``wake_at``, then read ``completed``" (:func:`hq_set_wake`) run under one tiny spinlock, so a
waiter registered concurrently is either seen before ``completed`` moves (and its callback runs
first) or sees the new value and fires itself: a poller never sees a value whose deferred frees
have not run, and a wake-up cannot be lost. The worker's sleep (``sleeping`` vs. the slot's
sequence number) is a store-then-load handshake with sequentially consistent atomics.

The ring is a linked list of fixed-size chunks, allocated on demand and recycled once the worker
passed them, so any number of commands may be in flight without blocking the submitter.

Calling convention: every argument travels as a 64-bit integer. On x86-64 and AArch64 (SysV /
AAPCS64, Linux) a pointer or a 32-bit int passed in a 64-bit slot lands where the callee reads
it, so ``fn(a0, ..., an)`` with ``uint64_t`` parameters calls a kernel declared with pointers
and ``int`` vals correctly. Other platforms use the Python worker (:func:`load` returns None).

The library is built once per machine with the C compiler the CPU backend uses and kept next to
the compile cache (``CACHEDB``'s directory, else ``$XDG_CACHE_HOME/aiotinyrt``); without a
compiler, or with ``NATIVE_QUEUE=0``, every queue runs on the pure-Python worker, which has the
same semantics. Built with Python's headers (when present) the library is also a CPython extension
module with two hot paths: ``push()`` and ``launch()``, the repeat launch of ``Program.__call__``.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread
import cffi

from aiotinyrt.helpers import debug_level, getenv, getenv_str

#: Most arguments a native command may take; longer calls run on the Python path.
MAX_ARGS = 24
#: Slots per ring chunk.
CHUNK = 4096
#: Device times are kept for this many latest commands of each queue (a power of two).
ELAPSED_SLOTS = 1 << 14

K_PY, K_NATIVE = 0, 1
R_PY, R_WAKE, R_HALTED, R_DEPS = 1, 2, 4, 8
NO_WAKE = (1 << 63) - 1

CDEF = """
typedef struct {
    int64_t completed;
    int64_t expected;
    double *elapsed;
    char _consumer[40];
    int64_t submitted;
    char _producer[56];
    int64_t wake_at;
    int32_t halted;
    int32_t sleeping;
    int64_t fail_max;
    int32_t remote;
    int32_t deps_ok;
} hq_t;
hq_t *hq_new(void);
void hq_free(hq_t *q);
int64_t hq_push_deps(hq_t *q, int32_t kind, uintptr_t fn, int32_t nargs, uintptr_t args,
                     int32_t ndeps, uintptr_t deps);
int hq_run(hq_t *q);
void hq_next(hq_t *q);
int64_t hq_set_wake(hq_t *q, int64_t value);
void hq_complete(hq_t *q, int64_t value);
void hq_note_failure(hq_t *q, int64_t value);
"""


def _call_cases() -> str:
    cases = []
    for n in range(MAX_ARGS + 1):
        params = ", ".join(["u64"] * n) or "void"
        args = ", ".join(f"a[{i}]" for i in range(n))
        cases.append(f"    case {n}: ((void (*)({params}))fn)({args}); break;")
    return "\n".join(cases)


SOURCE = (
    r"""
#define _GNU_SOURCE  /* sched_getcpu, sched_setaffinity */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <sched.h>
#include <time.h>
#include <unistd.h>
#include <sys/syscall.h>

typedef uint64_t u64;
#define CHUNK @CHUNK@
#define ELAPSED_MASK @ELAPSED_MASK@
enum { K_PY = 0, K_NATIVE = 1 };
enum { R_PY = 1, R_WAKE = 2, R_HALTED = 4, R_DEPS = 8 };
#define LOAD(p) __atomic_load_n((p), __ATOMIC_SEQ_CST)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_SEQ_CST)

/* deps: ndeps pairs (hq_t address, value): run only once each of those queues completed that value */
typedef struct {
    int64_t seq; void *fn; u64 *args; int32_t kind; int32_t nargs; int64_t *deps; int64_t ndeps;
} hq_slot;
typedef struct hq_chunk { hq_slot slots[CHUNK]; struct hq_chunk *next; } hq_chunk;

/* One cache line per writer, so the producer (the event loop) and the consumer (the worker)
   do not bounce a line between cores on every command. The cdef declares the prefix up to
   `sleeping`, with the same padding. */
typedef struct {
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
} hq_t;
_Static_assert(__builtin_offsetof(hq_t, submitted) == 64, "hq_t layout");
_Static_assert(__builtin_offsetof(hq_t, wake_at) == 128, "hq_t layout");
_Static_assert(__builtin_offsetof(hq_t, fail_max) == 144, "hq_t layout");

static hq_chunk *chunk_new(void) {
    hq_chunk *c = calloc(1, sizeof(hq_chunk));
    return c;
}

hq_t *hq_new(void) {
    hq_t *q = aligned_alloc(64, (sizeof(hq_t) + 63) / 64 * 64);
    if (!q) return NULL;
    memset(q, 0, sizeof(hq_t));
    q->elapsed = calloc(ELAPSED_MASK + 1, sizeof(double));
    q->rchunk = q->wchunk = chunk_new();
    if (!q->elapsed || !q->rchunk) { free(q->elapsed); free(q->rchunk); free(q); return NULL; }
    q->wake_at = INT64_MAX;
    q->expected = 1;
    pthread_mutex_init(&q->pmu, NULL);
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->cv, NULL);
    return q;
}

void hq_free(hq_t *q) {
    hq_chunk *c = q->rchunk;
    while (c) { hq_chunk *n = c->next; free(c); c = n; }
    c = q->spare;
    while (c) { hq_chunk *n = c->next; free(c); c = n; }
    free(q->elapsed);
    free(q);
}

/* Spreading long commands over CPUs. Two workers woken together (a kernel and a copy on one
   device's two queues, or two devices' stages) are often placed on one CPU by the kernel's
   wake-up heuristics while the other CPU goes idle, and a thread that ran within the last half
   millisecond counts as cache-hot, so the load balancer leaves them sharing for milliseconds
   (sampled from /proc: both runnable on one CPU in every slow try). bench/pipeline.py's kernel
   overlapped with a 32 MiB copy took 1.5-1.7x the longer of the two on a 2-core VM. So:
   - every worker counts itself on its CPU (cpu_busy) while it runs a command;
   - a producer waking a sleeping worker whose last command was long first narrows that
     worker's mask to the CPUs where no worker runs (steer), and the worker, once awake, puts
     its own mask back (unsteer): it is placed on a free CPU, then free to move again;
   - before a long command, a worker that finds another worker's command on its CPU anyway
     moves itself to a CPU where none runs, for that command only (spread_enter/_leave).
   "Long": the queue's previous command took >= SPREAD_MIN_S; streams of tiny launches never
   pay these system calls. Masks only ever narrow within the worker's mask as read just before
   (a user's taskset, even one set after start, is what is put back). Figures in BENCHMARKS.md;
   the pipeline is not changed by it (its stages share a core with the event loop thread, which
   this does not count). */
#define SPREAD_MIN_S 100e-6
#ifdef __linux__
static int32_t cpu_busy[CPU_SETSIZE];

/* Count this worker on its CPU (moving first when it shares it, see above); returns the CPU
   counted (-1: none) and sets *moved when the mask must be put back. */
static int spread_enter(hq_t *q, int long_command, int *moved) {
    int cpu = sched_getcpu();
    *moved = 0;
    if (cpu < 0 || cpu >= CPU_SETSIZE) return -1;
    if (long_command && LOAD(&cpu_busy[cpu]) > 0
        && sched_getaffinity(0, sizeof q->home, &q->home) == 0) {  /* its mask now, to put back */
        for (int c = 0; c < CPU_SETSIZE; c++) {
            if (c == cpu || !CPU_ISSET(c, &q->home) || LOAD(&cpu_busy[c]) > 0) continue;
            cpu_set_t one;
            CPU_ZERO(&one);
            CPU_SET(c, &one);
            if (sched_setaffinity(0, sizeof one, &one) == 0) {
                *moved = 1;
                cpu = sched_getcpu();
                if (cpu < 0 || cpu >= CPU_SETSIZE) cpu = c;
            }
            break;
        }
    }
    __atomic_add_fetch(&cpu_busy[cpu], 1, __ATOMIC_SEQ_CST);
    return cpu;
}

static void spread_leave(hq_t *q, int cpu, int moved) {
    if (cpu >= 0) __atomic_sub_fetch(&cpu_busy[cpu], 1, __ATOMIC_SEQ_CST);
    if (moved) sched_setaffinity(0, sizeof q->home, &q->home);
}

/* The worker, awake: its own mask back (placed already, it is not moved by a wider mask). */
static void unsteer(hq_t *q) {
    if (LOAD(&q->steered)) {
        STORE(&q->steered, 0);
        sched_setaffinity(0, sizeof q->home, &q->home);
    }
}

/* A producer waking a sleeping worker whose last command was long, while other workers run
   commands: narrow the worker's mask to the CPUs where none runs first, so the kernel places it
   on one of them. Without this the wake-up put it behind a running kernel on that kernel's CPU
   (its previous CPU, and the waker's was busy too), where it waited for the kernel's time
   slice while the other CPU went idle: the load balancer leaves a thread that ran within the
   last half millisecond where it is. Called under the worker's sleep mutex while it sleeps
   (so it sees `steered` when it wakes); the worker restores its mask as soon as it is awake. */
static void steer(hq_t *q) {
    int32_t tid = LOAD(&q->tid);
    if (tid <= 0 || q->elapsed[LOAD(&q->completed) & ELAPSED_MASK] < SPREAD_MIN_S) return;
    if (q->pid != (int32_t)getpid()) return;  /* a forked child: that thread is the parent's */
    /* Narrowed already by an earlier push it has not woken up for: `home` holds its own mask,
       and reading the narrowed one into `home` would leave it narrowed for good. */
    if (LOAD(&q->steered)) return;
    if (sched_getaffinity(tid, sizeof q->home, &q->home) != 0) return;  /* its mask now */
    cpu_set_t mask = q->home;
    int busy = 0, left = 0;
    for (int c = 0; c < CPU_SETSIZE; c++) {
        if (!CPU_ISSET(c, &mask)) continue;
        if (LOAD(&cpu_busy[c]) > 0) { CPU_CLR(c, &mask); busy = 1; } else left = 1;
    }
    if (busy && left && sched_setaffinity(tid, sizeof mask, &mask) == 0) STORE(&q->steered, 1);
}
#else
static int spread_enter(hq_t *q, int long_command, int *moved) {
    (void)q; (void)long_command; *moved = 0; return -1;
}
static void spread_leave(hq_t *q, int cpu, int moved) { (void)q; (void)cpu; (void)moved; }
static void steer(hq_t *q) { (void)q; }
static void unsteer(hq_t *q) { (void)q; }
#endif

static void wake(hq_t *q) {
    if (LOAD(&q->sleeping)) {
        pthread_mutex_lock(&q->mu);
        if (LOAD(&q->sleeping)) steer(q);
        pthread_cond_signal(&q->cv);
        pthread_mutex_unlock(&q->mu);
    }
}

/* Append one command; returns its timeline value, or -1 when out of memory. */
int64_t hq_push_deps(hq_t *q, int32_t kind, uintptr_t fn, int32_t nargs, uintptr_t args,
                     int32_t ndeps, uintptr_t deps) {
    pthread_mutex_lock(&q->pmu);
    if (q->wpos == CHUNK) {
        hq_chunk *c = q->spare;
        if (c) q->spare = c->next; else c = chunk_new();
        if (!c) { pthread_mutex_unlock(&q->pmu); return -1; }
        c->next = NULL;
        STORE(&q->wchunk->next, c);
        q->wchunk = c; q->wpos = 0;
    }
    hq_slot *s = &q->wchunk->slots[q->wpos++];
    int64_t value = q->submitted + 1;
    s->fn = (void *)fn; s->args = (u64 *)args; s->kind = kind; s->nargs = nargs;
    s->deps = (int64_t *)deps; s->ndeps = ndeps;
    STORE(&s->seq, value);
    STORE(&q->submitted, value);
    pthread_mutex_unlock(&q->pmu);
    wake(q);
    return value;
}

int64_t hq_push(hq_t *q, int32_t kind, uintptr_t fn, int32_t nargs, uintptr_t args) {
    return hq_push_deps(q, kind, fn, nargs, args, 0, 0);
}

/* Cross-queue waits. A worker whose next command depends on another queue's value sleeps on one
   process-wide condition variable after announcing itself in that queue's `remote` count; every
   store of `completed` (here, or Python's through hq_complete) is followed by a look at `remote`.
   Both sides store then load with sequentially consistent atomics, so either the waiter sees the
   value or the completing side sees the waiter (and broadcasts under the mutex the waiter holds
   until it sleeps): a wake-up cannot be lost. */
static pthread_mutex_t remote_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t remote_cv = PTHREAD_COND_INITIALIZER;

static void notify_remote(hq_t *q) {
    if (LOAD(&q->remote)) {
        pthread_mutex_lock(&remote_mu);
        pthread_cond_broadcast(&remote_cv);
        pthread_mutex_unlock(&remote_mu);
    }
}

/* `completed` from Python (commands run by the Python worker, waiters' advances). */
void hq_complete(hq_t *q, int64_t value) {
    int64_t old = LOAD(&q->completed);
    while (old < value && !__atomic_compare_exchange_n(&q->completed, &old, value, 0, __ATOMIC_SEQ_CST,
                                                        __ATOMIC_SEQ_CST)) {
    }
    notify_remote(q);
}

/* Command `value` failed: dependents on it (and, conservatively, on anything before it) go back
   to Python to be checked. Called before `completed` passes `value`. */
void hq_note_failure(hq_t *q, int64_t value) {
    int64_t old = LOAD(&q->fail_max);
    while (old < value && !__atomic_compare_exchange_n(&q->fail_max, &old, value, 0, __ATOMIC_SEQ_CST,
                                                        __ATOMIC_SEQ_CST)) {
    }
}

static void call(void *fn, int32_t n, const u64 *a) {
    switch (n) {
@CASES@
    }
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline void relax(void) {
#if defined(__x86_64__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Spin this long for the next command before sleeping: a burst of launches (one every 1-2
   microseconds) then needs no wake-up per command, and an idle worker gives its core back after
   ~5 us. Kept short on purpose: on a 2-core machine four spinning workers (two devices, compute
   and copy) took the cores the kernels and the event loop needed (50 us was tried first). The spin
   yields the core every 256 rounds, so a kernel thread waiting for it runs. */
#define SPIN_NS 5000

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Wait until `ready(q, arg)` holds (spin, then sleep on the condition variable). */
static void await_ready(hq_t *q, int (*ready)(hq_t *, void *), void *arg) {
    int64_t deadline = 0;
    for (uint32_t spins = 1;; spins++) {
        if (ready(q, arg)) return;
        if (spins & 255) { relax(); continue; }
        if (!deadline) deadline = now_ns() + SPIN_NS;
        else if (now_ns() > deadline) break;
        sched_yield();
    }
    pthread_mutex_lock(&q->mu);
    STORE(&q->sleeping, 1);
    while (!ready(q, arg)) pthread_cond_wait(&q->cv, &q->mu);
    STORE(&q->sleeping, 0);
    pthread_mutex_unlock(&q->mu);
}

/* Wait until queue `o` completed `value`: a very short spin (a couple of microseconds: the
   dependency may be just finishing; longer spins took the core its kernel needed on 2 cores),
   then sleep until a completion on `o` broadcasts. */
static void wait_remote(hq_t *o, int64_t value) {
    for (int i = 0; i < 64; i++) {
        if (LOAD(&o->completed) >= value) return;
        relax();
    }
    pthread_mutex_lock(&remote_mu);
    __atomic_add_fetch(&o->remote, 1, __ATOMIC_SEQ_CST);
    while (LOAD(&o->completed) < value) pthread_cond_wait(&remote_cv, &remote_mu);
    __atomic_sub_fetch(&o->remote, 1, __ATOMIC_SEQ_CST);
    pthread_mutex_unlock(&remote_mu);
}

static int next_chunk_ready(hq_t *q, void *arg) { (void)arg; return LOAD(&q->rchunk->next) != NULL; }
static int slot_ready(hq_t *q, void *arg) { return LOAD(&((hq_slot *)arg)->seq) == q->expected; }

/* The slot holding `expected`, once published. */
static hq_slot *next_slot(hq_t *q) {
    if (q->rpos == CHUNK) {
        await_ready(q, next_chunk_ready, NULL);
        hq_chunk *old = q->rchunk;
        q->rchunk = LOAD(&old->next); q->rpos = 0;
        pthread_mutex_lock(&q->pmu);  /* recycle: the producer moved past it long ago */
        old->next = q->spare; q->spare = old;
        pthread_mutex_unlock(&q->pmu);
    }
    hq_slot *s = &q->rchunk->slots[q->rpos];
    await_ready(q, slot_ready, s);
    return s;
}

/* Move past the current command (its completion is recorded separately). */
void hq_next(hq_t *q) {
    q->rpos++;
    q->expected++;
    q->deps_ok = 0;  /* the check Python made was for the command just passed */
}


static inline void wlock(hq_t *q) { while (__atomic_exchange_n(&q->wlock, 1, __ATOMIC_ACQUIRE)) relax(); }
static inline void wunlock(hq_t *q) { __atomic_store_n(&q->wlock, 0, __ATOMIC_RELEASE); }

/* Set wake_at (a waiter registered: the smallest waiting value); returns `completed` as seen
   then. Under wlock, like hq_run's check-then-store: either hq_run sees the new wake_at before
   it stores `completed` (and returns R_WAKE, so Python runs the waiter first), or the caller
   sees the stored `completed` and fires the waiter itself. */
int64_t hq_set_wake(hq_t *q, int64_t value) {
    wlock(q);
    STORE(&q->wake_at, value);
    int64_t completed = LOAD(&q->completed);
    wunlock(q);
    return completed;
}

/* Run native commands in order until Python is needed; returns R_*. */
int hq_run(hq_t *q) {
#ifdef __linux__
    if (!q->tid) {
        q->pid = (int32_t)getpid();
        STORE(&q->tid, (int32_t)syscall(SYS_gettid));
    }
#endif
    for (;;) {
        hq_slot *s = next_slot(q);
        unsteer(q);
        if (s->kind != K_NATIVE) return R_PY;
        /* The dependencies first, even on a halted queue: a command completes (failed or not)
           only after the commands it is ordered after, as on the Python path. Its access
           records replaced theirs (a write supersedes what it waits for), so completing early
           would let a later access of that memory (another device's, for a folded transfer)
           proceed while they still ran. */
        if (s->ndeps) {
            if (q->deps_ok) q->deps_ok = 0;
            else {
                int suspect = 0;
                for (int64_t i = 0; i < s->ndeps; i++) {
                    hq_t *o = (hq_t *)(uintptr_t)s->deps[2 * i];
                    int64_t dv = s->deps[2 * i + 1];
                    wait_remote(o, dv);
                    if (LOAD(&o->fail_max) >= dv) suspect = 1;
                }
                if (suspect) return R_DEPS;  /* Python looks at the dependencies' outcomes */
            }
        }
        if (LOAD(&q->halted)) return R_HALTED;
        int64_t v = q->expected;
        int moved = 0, cpu = -1;
        if (s->fn) cpu = spread_enter(q, q->elapsed[(v - 1) & ELAPSED_MASK] >= SPREAD_MIN_S, &moved);
        double t0 = now();
        if (s->fn) call(s->fn, s->nargs, s->args);
        q->elapsed[v & ELAPSED_MASK] = now() - t0;
        if (s->fn) spread_leave(q, cpu, moved);
        wlock(q);
        if (v >= LOAD(&q->wake_at)) { wunlock(q); return R_WAKE; }
        /* never backwards: a worker abandoned by stop() may finish after stop advanced past it */
        if (v > LOAD(&q->completed)) STORE(&q->completed, v);
        wunlock(q);
        notify_remote(q);
        hq_next(q);
    }
}

#ifdef HQ_PYTHON
/* The same library is also a CPython extension module: push() from Python without libffi and
   without releasing the GIL (it takes a few dozen nanoseconds), the submit path of every launch. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

static PyObject *py_push(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 5 && n != 7) {
        PyErr_SetString(PyExc_TypeError, "push(queue, kind, fn, nargs, args[, ndeps, deps]): 5 or 7 ints");
        return NULL;
    }
    hq_t *q = (hq_t *)PyLong_AsVoidPtr(args[0]);
    long kind = PyLong_AsLong(args[1]);
    void *fn = PyLong_AsVoidPtr(args[2]);
    long nargs = PyLong_AsLong(args[3]);
    void *block = PyLong_AsVoidPtr(args[4]);
    if (PyErr_Occurred()) return NULL;
    long ndeps = n == 7 ? PyLong_AsLong(args[5]) : 0;
    void *deps = n == 7 ? PyLong_AsVoidPtr(args[6]) : NULL;
    if (PyErr_Occurred()) return NULL;
    if (!q) { PyErr_SetString(PyExc_ValueError, "push: NULL queue"); return NULL; }
    int64_t value = hq_push_deps(q, (int32_t)kind, (uintptr_t)fn, (int32_t)nargs, (uintptr_t)block,
                                 (int32_t)ndeps, (uintptr_t)deps);
    if (value < 0) return PyErr_NoMemory();
    return PyLong_FromLongLong(value);
}

/* launch(bufs, by_bufs, timeline, queue): the repeat launch of Program.__call__, in C.
   Handles exactly the case the Python fast path handles (same base buffers as an earlier native
   launch, each holding the same memory, each last touched by this queue only) and returns its
   Signal, having extended the queue's newest held entry or, when that is another one (launches
   alternating between slots or vals), held this one through queue._hold(); returns None for
   anything else, having changed nothing, and Python takes over. Slots are read and written through the
   offsets of the classes' member descriptors (configure() finds them). */
static PyTypeObject *sig_type, *buf_type;
static Py_ssize_t off_timeline, off_value, off_error, off_elapsed, off_handle, off_accesses, off_nbytes;
static PyObject *s_stopping, *s_last_held, *s_caddr, *s_hold, *zero;

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

static int set_slot(PyObject *obj, Py_ssize_t off, PyObject *value) {  /* steals value */
    PyObject *old = SLOT(obj, off);
    SLOT(obj, off) = value;
    Py_XDECREF(old);
    return 0;
}

static Py_ssize_t slot_offset(PyTypeObject *type, const char *name) {
    PyObject *d = PyObject_GetAttrString((PyObject *)type, name);
    if (!d) return -1;
    if (!PyObject_TypeCheck(d, &PyMemberDescr_Type)) {
        Py_DECREF(d);
        PyErr_Format(PyExc_TypeError, "%s.%s is not a __slots__ member", type->tp_name, name);
        return -1;
    }
    PyMemberDef *m = ((PyMemberDescrObject *)d)->d_member;
    Py_ssize_t off = m->type == T_OBJECT_EX ? m->offset : -1;
    Py_DECREF(d);
    if (off < 0) PyErr_Format(PyExc_TypeError, "%s.%s is not an object slot", type->tp_name, name);
    return off;
}

static PyObject *py_configure(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 2 || !PyType_Check(args[0]) || !PyType_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "configure(Signal, Buffer)");
        return NULL;
    }
    PyTypeObject *st = (PyTypeObject *)args[0], *bt = (PyTypeObject *)args[1];
    if ((off_timeline = slot_offset(st, "timeline")) < 0 || (off_value = slot_offset(st, "value")) < 0 ||
        (off_error = slot_offset(st, "_error")) < 0 || (off_elapsed = slot_offset(st, "_elapsed")) < 0 ||
        (off_handle = slot_offset(bt, "_handle")) < 0 || (off_accesses = slot_offset(bt, "_accesses")) < 0 ||
        (off_nbytes = slot_offset(bt, "nbytes")) < 0)
        return NULL;
    Py_INCREF(st); Py_XDECREF(sig_type); sig_type = st;
    Py_INCREF(bt); Py_XDECREF(buf_type); buf_type = bt;
    if (!s_stopping) {
        s_stopping = PyUnicode_InternFromString("_stopping");
        s_last_held = PyUnicode_InternFromString("_last_held");
        s_caddr = PyUnicode_InternFromString("_caddr");
        s_hold = PyUnicode_InternFromString("_hold");
        zero = PyLong_FromLong(0);
        if (!s_stopping || !s_last_held || !s_caddr || !s_hold || !zero) return NULL;
    }
    Py_RETURN_NONE;
}

/* Hold `hold` on `queue` until command `value` ran: extend the newest held entry when it is the
   same object, else queue._hold(); when that raises, append it to the hold list from C (the
   command runs anyway) and return -1 with the error set. */
static int hold_until(PyObject *queue, PyObject *value, PyObject *hold, int extend) {
    PyObject *held = PyObject_GetAttr(queue, s_last_held);
    if (held && extend && PyList_CheckExact(held) && PyList_GET_SIZE(held) == 2 &&
        PyList_GET_ITEM(held, 1) == hold) {
        Py_INCREF(value);
        PyList_SetItem(held, 0, value);
        Py_DECREF(held);
        return 0;
    }
    PyObject *r = held ? PyObject_CallMethodObjArgs(queue, s_hold, value, hold, NULL) : NULL;
    Py_XDECREF(held);
    if (r) { Py_DECREF(r); return 0; }
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyObject *pair = PyList_New(2);
    if (pair) {
        Py_INCREF(value); PyList_SET_ITEM(pair, 0, value);
        Py_INCREF(hold); PyList_SET_ITEM(pair, 1, hold);
        PyObject *list = PyObject_GetAttrString(queue, "_held");
        PyObject *ok = list ? PyObject_CallMethod(list, "append", "O", pair) : NULL;
        if (!ok) Py_INCREF(hold);  /* (not even that: what the command reads is never released) */
        Py_XDECREF(ok);
        Py_XDECREF(list);
        Py_DECREF(pair);
    } else {
        Py_INCREF(hold);
    }
    PyErr_Clear();
    PyErr_Restore(type, exc, tb);
    if (!PyErr_Occurred()) PyErr_NoMemory();
    return -1;
}

/* Fill in the Signal of pushed command `value` on `timeline` (steals `value`). */
static void fill_signal(PyObject *sig, PyObject *timeline, PyObject *value) {
    Py_INCREF(timeline);
    set_slot(sig, off_timeline, timeline);
    set_slot(sig, off_value, value);
    Py_INCREF(Py_None);
    set_slot(sig, off_error, Py_None);
    Py_INCREF(Py_None);
    set_slot(sig, off_elapsed, Py_None);
}

static PyObject *launch_impl(PyObject *key, PyObject *bufs, PyObject *by_bufs, PyObject *timeline,
                             PyObject *queue, hq_t *q) {
    PyObject *entry = PyDict_GetItemWithError(by_bufs, key);  /* borrowed */
    if (!entry) {
        PyErr_Clear();  /* not cached, or unhashable arguments: Python decides */
        Py_RETURN_NONE;
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) < 4) Py_RETURN_NONE;
    PyObject *handles = PyTuple_GET_ITEM(entry, 3);
    Py_ssize_t nb = PyTuple_GET_SIZE(bufs);
    if (!PyTuple_CheckExact(handles) || PyTuple_GET_SIZE(handles) != nb) Py_RETURN_NONE;
    for (Py_ssize_t i = 0; i < nb; i++) {
        PyObject *b = PyTuple_GET_ITEM(bufs, i);
        if (Py_TYPE(b) != buf_type || SLOT(b, off_handle) != PyTuple_GET_ITEM(handles, i)) Py_RETURN_NONE;
        PyObject *acc = SLOT(b, off_accesses);
        if (!acc || !PyList_CheckExact(acc) || PyList_GET_SIZE(acc) > 1) Py_RETURN_NONE;
        if (PyList_GET_SIZE(acc) == 1) {
            PyObject *a = PyList_GET_ITEM(acc, 0);
            if (!PyTuple_CheckExact(a) || PyTuple_GET_SIZE(a) != 4) Py_RETURN_NONE;
            PyObject *prev = PyTuple_GET_ITEM(a, 2);
            if (Py_TYPE(prev) != sig_type || SLOT(prev, off_timeline) != timeline) Py_RETURN_NONE;
        }
    }
    PyObject *stopping = PyObject_GetAttr(queue, s_stopping);
    if (!stopping) return NULL;
    int stop = stopping != Py_False;
    Py_DECREF(stopping);
    if (stop) Py_RETURN_NONE;
    if (!q) {
        PyObject *caddr = PyObject_GetAttr(queue, s_caddr);
        if (!caddr) return NULL;
        q = (hq_t *)PyLong_AsVoidPtr(caddr);
        Py_DECREF(caddr);
    }
    void *fn = PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 0));
    long nargs = PyLong_AsLong(PyTuple_GET_ITEM(entry, 1));
    void *block = PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 2));
    if (PyErr_Occurred() || !q) return NULL;
    /* From here on Python code may run (a collection during an allocation, queue._hold()):
       own the entry (it holds the argument block). */
    Py_INCREF(entry);
    PyObject *sig = sig_type->tp_alloc(sig_type, 0);
    if (!sig) { Py_DECREF(entry); return NULL; }
    int64_t v = hq_push(q, K_NATIVE, (uintptr_t)fn, (int32_t)nargs, (uintptr_t)block);
    if (v < 0) { Py_DECREF(sig); Py_DECREF(entry); return PyErr_NoMemory(); }
    /* The command is queued: fill in the signal and the access records first (so a failure
       below still leaves later work ordered after it), then hold the entry until it ran. */
    PyObject *value = PyLong_FromLongLong(v);
    if (!value) {  /* (out of memory: the entry, what the command reads, is never released) */
        Py_DECREF(sig);
        return NULL;
    }
    fill_signal(sig, timeline, value);
    int failed = 0;
    for (Py_ssize_t i = 0; !failed && i < nb; i++) {
        PyObject *b = PyTuple_GET_ITEM(bufs, i);
        PyObject *nbytes = SLOT(b, off_nbytes);
#if PY_VERSION_HEX < 0x030E0000 && !defined(Py_GIL_DISABLED)
        /* (3.14 caches tuple hashes; free-threaded builds cannot prove a reference is unique) */
        PyObject *acc = SLOT(b, off_accesses);
        if (acc && PyList_CheckExact(acc) && Py_REFCNT(acc) == 1 && PyList_GET_SIZE(acc) == 1) {
            /* the record of the previous launch, [(0, nbytes, sig, True)], referenced only by
               the buffer: put the new signal in place instead of building a new list and tuple
               (a tuple nobody else sees may be filled in; tuples do not cache their hash) */
            PyObject *old = PyList_GET_ITEM(acc, 0);
            if (PyTuple_CheckExact(old) && Py_REFCNT(old) == 1 && PyTuple_GET_SIZE(old) == 4 &&
                PyTuple_GET_ITEM(old, 0) == zero && PyTuple_GET_ITEM(old, 1) == nbytes &&
                PyTuple_GET_ITEM(old, 3) == Py_True) {
                PyObject *prev = PyTuple_GET_ITEM(old, 2);
                Py_INCREF(sig);
                PyTuple_SET_ITEM(old, 2, sig);
                Py_DECREF(prev);
                continue;
            }
        }
#endif
        PyObject *a = PyTuple_Pack(4, zero, nbytes ? nbytes : zero, sig, Py_True);
        PyObject *list = a ? PyList_New(1) : NULL;
        if (!list) { Py_XDECREF(a); failed = 1; break; }
        PyList_SET_ITEM(list, 0, a);
        set_slot(b, off_accesses, list);
    }
    PyObject *type = NULL, *exc = NULL, *tb = NULL;
    if (failed) PyErr_Fetch(&type, &exc, &tb);
    if (hold_until(queue, SLOT(sig, off_value), entry, 1) < 0) {  /* (the entry stays held) */
        if (failed) PyErr_Clear(); else { failed = 1; PyErr_Fetch(&type, &exc, &tb); }
    }
    if (failed) PyErr_Restore(type, exc, tb);
    Py_DECREF(entry);
    if (failed) { Py_DECREF(sig); return NULL; }
    return sig;
}

/* replay(runs): the submission of Graph.replay in C, for a plan whose every run is a native
   command (Graph._fast_plan builds `runs`). Each run is a tuple (queue, timeline, queue address,
   fn, nargs, block, hold, touched, after): addresses as ints, `hold` what the queue keeps alive
   until the command ran, `touched` a tuple of (buffer, base, start, end, write, whole) for every
   buffer the run uses, `after` the indices of earlier runs it waits for (wait_for). It does what
   the Python path does, in the same order: per run, the pending accesses of other queues to the
   same bytes become native dependencies, the command is pushed, its Signal made, its memory held
   and its accesses recorded. Returns the last run's Signal when that run waits, directly or
   through others, for every run on another queue; otherwise the tuple of every run's Signal
   (Python joins them). Returns None, having changed nothing, when a queue is stopping or an
   access cannot be waited for in C (a non-native queue, a signal carrying a Python error, a
   plan too large): the Python path then does all of it. */
#define REPLAY_MAX_RUNS 32
static PyObject *s_dep_sigs, *s_record, *s_prune;

static hq_t *timeline_queue(PyObject *timeline) {  /* NULL (no error set) for a Python queue */
    PyObject *caddr = PyObject_GetAttr(timeline, s_caddr);
    if (!caddr) { PyErr_Clear(); return NULL; }
    hq_t *q = PyLong_Check(caddr) ? (hq_t *)PyLong_AsVoidPtr(caddr) : NULL;
    Py_DECREF(caddr);
    if (PyErr_Occurred()) { PyErr_Clear(); return NULL; }
    return q;
}

static int64_t signal_value(PyObject *sig) {
    PyObject *value = SLOT(sig, off_value);
    return value && PyLong_Check(value) ? PyLong_AsLongLong(value) : -1;
}

/* Whether every access recorded on `base` names a Signal of a native queue without a Python
   error (so any of them can be waited for in C). */
static int accesses_waitable(PyObject *base) {
    if (Py_TYPE(base) != buf_type) return 0;
    PyObject *acc = SLOT(base, off_accesses);
    if (!acc || !PyList_CheckExact(acc)) return 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(acc); i++) {
        PyObject *a = PyList_GET_ITEM(acc, i);
        if (!PyTuple_CheckExact(a) || PyTuple_GET_SIZE(a) != 4) return 0;
        PyObject *sig = PyTuple_GET_ITEM(a, 2);
        if (Py_TYPE(sig) != sig_type || SLOT(sig, off_error) != Py_None) return 0;
        PyObject *tl = SLOT(sig, off_timeline);
        if (!tl || !timeline_queue(tl) || signal_value(sig) < 0) return 0;
    }
    return 1;
}

/* Record that `sig` (on `timeline`) reads or writes the bytes [start, end) of `buf`: as
   Buffer.record, in C for a whole buffer (a write replaces the list, a read supersedes the
   previous read of the same bytes on the same queue or is appended to a short list); the Python
   method otherwise. */
static int record_access(PyObject *buf, PyObject *base, PyObject *start, PyObject *end, int write, int whole,
                         PyObject *sig, PyObject *timeline) {
    PyObject *acc = SLOT(base, off_accesses);
    if (whole && acc && PyList_CheckExact(acc)) {
        Py_ssize_t n = PyList_GET_SIZE(acc);
        if (write) {
            PyObject *a = PyTuple_Pack(4, start, end, sig, Py_True);
            PyObject *list = a ? PyList_New(1) : NULL;
            if (!list) { Py_XDECREF(a); return -1; }
            PyList_SET_ITEM(list, 0, a);
            return set_slot(base, off_accesses, list);
        }
        if (n > 0) {
            PyObject *last = PyList_GET_ITEM(acc, n - 1);
            if (PyTuple_CheckExact(last) && PyTuple_GET_SIZE(last) == 4 &&
                PyTuple_GET_ITEM(last, 3) == Py_False && Py_TYPE(PyTuple_GET_ITEM(last, 2)) == sig_type &&
                SLOT(PyTuple_GET_ITEM(last, 2), off_timeline) == timeline) {
                int same = PyObject_RichCompareBool(PyTuple_GET_ITEM(last, 0), start, Py_EQ);
                if (same > 0) same = PyObject_RichCompareBool(PyTuple_GET_ITEM(last, 1), end, Py_EQ);
                if (same < 0) return -1;
                if (same) {
                    PyObject *a = PyTuple_Pack(4, start, end, sig, Py_False);
                    return a ? PyList_SetItem(acc, n - 1, a) : -1;
                }
            }
        }
        if (n < 8) {
            PyObject *a = PyTuple_Pack(4, start, end, sig, Py_False);
            if (!a) return -1;
            int rc = PyList_Append(acc, a);
            Py_DECREF(a);
            return rc;
        }
    }
    PyObject *r = PyObject_CallMethodObjArgs(buf, s_record, sig, write ? Py_True : Py_False, NULL);
    if (!r) return -1;
    Py_DECREF(r);
    return 0;
}


typedef struct { hq_t *q; int64_t value; PyObject *timeline, *value_obj; } dep_t;  /* (owned) */

static int add_dep(dep_t **deps, dep_t *small, Py_ssize_t *n, Py_ssize_t *cap, hq_t *q, int64_t value,
                   PyObject *timeline, PyObject *value_obj) {
    if (*n == *cap) {
        dep_t *grown = PyMem_Malloc(2 * *cap * sizeof(dep_t));
        if (!grown) { PyErr_NoMemory(); return -1; }
        memcpy(grown, *deps, *n * sizeof(dep_t));
        if (*deps != small) PyMem_Free(*deps);
        *deps = grown;
        *cap *= 2;
    }
    Py_INCREF(timeline);
    Py_INCREF(value_obj);
    (*deps)[(*n)++] = (dep_t){q, value, timeline, value_obj};
    return 0;
}

static void free_deps(dep_t *deps, dep_t *small, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_DECREF(deps[i].timeline);
        Py_DECREF(deps[i].value_obj);
    }
    if (deps != small) PyMem_Free(deps);
}

static PyObject *py_replay(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 1 || !PyTuple_CheckExact(args[0]) || !sig_type) {
        PyErr_SetString(PyExc_TypeError, "replay(runs) after configure()");
        return NULL;
    }
    if (!s_dep_sigs) {
        s_dep_sigs = PyUnicode_InternFromString("_dep_sigs");
        s_record = PyUnicode_InternFromString("record");
        s_prune = PyUnicode_InternFromString("_prune_deps");
        if (!s_dep_sigs || !s_record || !s_prune) return NULL;
    }
    PyObject *runs = args[0];
    Py_ssize_t nr = PyTuple_GET_SIZE(runs);
    if (nr < 1 || nr > REPLAY_MAX_RUNS) Py_RETURN_NONE;
    /* 1. everything that could make the Python path necessary, before anything is pushed */
    for (Py_ssize_t k = 0; k < nr; k++) {
        PyObject *run = PyTuple_GET_ITEM(runs, k);
        if (!PyTuple_CheckExact(run) || PyTuple_GET_SIZE(run) != 9) Py_RETURN_NONE;
        PyObject *touched = PyTuple_GET_ITEM(run, 7), *after = PyTuple_GET_ITEM(run, 8);
        if (!PyTuple_CheckExact(touched) || !PyTuple_CheckExact(after)) Py_RETURN_NONE;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(after); j++) {
            Py_ssize_t r = PyLong_AsSsize_t(PyTuple_GET_ITEM(after, j));
            if (r < 0 || r >= k) { PyErr_Clear(); Py_RETURN_NONE; }
        }
        PyObject *stopping = PyObject_GetAttr(PyTuple_GET_ITEM(run, 0), s_stopping);
        if (!stopping) return NULL;
        int stop = stopping != Py_False;
        Py_DECREF(stopping);
        if (stop) Py_RETURN_NONE;
        for (Py_ssize_t t = 0; t < PyTuple_GET_SIZE(touched); t++) {
            PyObject *acc = PyTuple_GET_ITEM(touched, t);
            if (!PyTuple_CheckExact(acc) || PyTuple_GET_SIZE(acc) != 6) Py_RETURN_NONE;
            if (!accesses_waitable(PyTuple_GET_ITEM(acc, 1))) Py_RETURN_NONE;
        }
    }
    /* 2. push, run by run */
    PyObject *sigs[REPLAY_MAX_RUNS];
    hq_t *queues[REPLAY_MAX_RUNS];
    int64_t values[REPLAY_MAX_RUNS];
    uint64_t covered[REPLAY_MAX_RUNS];
    PyObject *timelines[REPLAY_MAX_RUNS];
    Py_ssize_t done = 0;
    PyObject *result = NULL;
    int failed = 0;
    for (Py_ssize_t k = 0; k < nr && !failed; k++) {
        PyObject *run = PyTuple_GET_ITEM(runs, k);
        PyObject *queue = PyTuple_GET_ITEM(run, 0), *timeline = PyTuple_GET_ITEM(run, 1);
        PyObject *hold = PyTuple_GET_ITEM(run, 6), *touched = PyTuple_GET_ITEM(run, 7);
        PyObject *after = PyTuple_GET_ITEM(run, 8);
        hq_t *q = (hq_t *)PyLong_AsVoidPtr(PyTuple_GET_ITEM(run, 2));
        void *fn = PyLong_AsVoidPtr(PyTuple_GET_ITEM(run, 3));
        long nargs = PyLong_AsLong(PyTuple_GET_ITEM(run, 4));
        void *block = PyLong_AsVoidPtr(PyTuple_GET_ITEM(run, 5));
        if (PyErr_Occurred()) { failed = 1; break; }
        if (!q) { PyErr_SetString(PyExc_ValueError, "replay: NULL queue"); failed = 1; break; }
        if (k > 0) {  /* (Python ran since the check above: a queue may have been stopped) */
            PyObject *stopping = PyObject_GetAttr(queue, s_stopping);
            int stop = !stopping || stopping != Py_False;
            Py_XDECREF(stopping);
            if (stop) {
                if (stopping) Py_XDECREF(PyObject_CallMethod(queue, "_refuse_closed", NULL));
                if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "replay: queue stopped");
                failed = 1;
                break;
            }
        }
        uint64_t cov = 0;
        /* the dependencies, looked at once (a pending one may complete meanwhile): pairs for C,
           (timeline, value) for Python's look-up of a failure (see R_DEPS) */
        dep_t small[16], *deps = small;
        Py_ssize_t nd = 0, cap = 16;
        for (Py_ssize_t j = 0; j < PyTuple_GET_SIZE(after) && !failed; j++) {
            Py_ssize_t r = PyLong_AsSsize_t(PyTuple_GET_ITEM(after, j));
            cov |= (1ull << r) | covered[r];
            PyObject *at = SLOT(sigs[r], off_value);
            if (add_dep(&deps, small, &nd, &cap, queues[r], values[r], timelines[r], at) < 0) failed = 1;
        }
        for (Py_ssize_t t = 0; t < PyTuple_GET_SIZE(touched) && !failed; t++) {
            PyObject *use = PyTuple_GET_ITEM(touched, t);
            PyObject *acc = SLOT(PyTuple_GET_ITEM(use, 1), off_accesses);
            Py_ssize_t start = PyLong_AsSsize_t(PyTuple_GET_ITEM(use, 2));
            Py_ssize_t end = PyLong_AsSsize_t(PyTuple_GET_ITEM(use, 3));
            int write = PyTuple_GET_ITEM(use, 4) == Py_True;
            if (!acc || !PyList_CheckExact(acc)) continue;  /* (nothing recorded) */
            for (Py_ssize_t e = 0; e < PyList_GET_SIZE(acc); e++) {
                PyObject *a = PyList_GET_ITEM(acc, e);
                if (!PyTuple_CheckExact(a) || PyTuple_GET_SIZE(a) != 4) continue;
                if (!(PyTuple_GET_ITEM(a, 3) == Py_True || write)) continue;
                Py_ssize_t a_start = PyLong_AsSsize_t(PyTuple_GET_ITEM(a, 0));
                Py_ssize_t a_end = PyLong_AsSsize_t(PyTuple_GET_ITEM(a, 1));
                if (!(a_start < end && start < a_end)) continue;
                PyObject *sig = PyTuple_GET_ITEM(a, 2);
                PyObject *tl = SLOT(sig, off_timeline);
                if (tl == timeline) continue;  /* this queue runs it first anyway */
                hq_t *o = timeline_queue(tl);
                int64_t v = signal_value(sig);
                if (!o || v < 0) { PyErr_Clear(); continue; }  /* (checked above) */
                /* done: not a dependency (as Buffer.dependencies). An earlier run of this
                   replay counts as waited for when it is pending (a dependency) or done without
                   failure; done and possibly failed, the join (Python's) reports it. */
                int done_now = LOAD(&o->completed) >= v;
                if (!done_now || LOAD(&o->fail_max) < v)
                    for (Py_ssize_t r = 0; r < k; r++)
                        if (sigs[r] == sig) cov |= (1ull << r) | covered[r];
                if (done_now) continue;
                if (add_dep(&deps, small, &nd, &cap, o, v, tl, SLOT(sig, off_value)) < 0) {
                    failed = 1;
                    break;
                }
            }
        }
        if (!failed && nd > 0) {
            /* push with dependencies; the R_DEPS look-up entry exists before the GIL can be
               released (nothing between allocates a tracked object or runs Python) */
            PyObject *pairs = PyBytes_FromStringAndSize(NULL, nd * 16);
            PyObject *on = pairs ? PyTuple_New(nd) : NULL;
            PyObject *waiting = on ? PyObject_GetAttr(queue, s_dep_sigs) : NULL;
            PyObject *sig = waiting ? sig_type->tp_alloc(sig_type, 0) : NULL;
            PyObject *keep = sig ? PyTuple_Pack(3, hold, pairs, on) : NULL;
            if (keep && !PyDict_CheckExact(waiting)) {
                PyErr_SetString(PyExc_TypeError, "replay: _dep_sigs is not a dict");
                Py_CLEAR(keep);
            }
            int64_t *p = keep ? (int64_t *)PyBytes_AS_STRING(pairs) : NULL;
            for (Py_ssize_t i = 0; p && i < nd; i++) {
                p[2 * i] = (int64_t)(uintptr_t)deps[i].q;
                p[2 * i + 1] = deps[i].value;
                PyObject *pair = PyTuple_Pack(2, deps[i].timeline, deps[i].value_obj);
                if (!pair) { Py_CLEAR(keep); p = NULL; break; }
                PyTuple_SET_ITEM(on, i, pair);
            }
            int64_t v = keep ? hq_push_deps(q, K_NATIVE, (uintptr_t)fn, (int32_t)nargs, (uintptr_t)block,
                                            (int32_t)nd, (uintptr_t)p) : -1;
            PyObject *value = v < 0 ? NULL : PyLong_FromLongLong(v);
            if (value && PyDict_SetItem(waiting, value, on) < 0) Py_CLEAR(value);
            if (!value) {
                /* out of memory (with the command queued when v >= 0: then `keep`, what it
                   reads, is never released, deliberately) */
                if (v < 0) Py_XDECREF(keep);
                Py_XDECREF(sig); Py_XDECREF(waiting); Py_XDECREF(pairs); Py_XDECREF(on);
                if (!PyErr_Occurred()) PyErr_NoMemory();
                failed = 1;
            } else {
                Py_DECREF(pairs); Py_DECREF(on);
                fill_signal(sig, timeline, value);
                sigs[k] = sig; values[k] = v; queues[k] = q; covered[k] = cov; timelines[k] = timeline;
                done = k + 1;
                if (hold_until(queue, value, keep, 0) < 0) failed = 1;
                Py_DECREF(keep);
                if (!failed && PyDict_GET_SIZE(waiting) > 64) {
                    PyObject *r = PyObject_CallMethodObjArgs(queue, s_prune, NULL);
                    if (r) Py_DECREF(r); else failed = 1;
                }
                Py_DECREF(waiting);
            }
        }
        free_deps(deps, small, nd);
        if (!failed && done == k) {  /* no dependencies: a plain push */
            PyObject *sig = sig_type->tp_alloc(sig_type, 0);
            if (!sig) { failed = 1; break; }
            int64_t v = hq_push(q, K_NATIVE, (uintptr_t)fn, (int32_t)nargs, (uintptr_t)block);
            PyObject *value = v < 0 ? NULL : PyLong_FromLongLong(v);
            if (!value) {
                Py_DECREF(sig);
                if (!PyErr_Occurred()) PyErr_NoMemory();
                failed = 1;
                break;
            }
            fill_signal(sig, timeline, value);
            sigs[k] = sig; values[k] = v; queues[k] = q; covered[k] = cov; timelines[k] = timeline;
            done = k + 1;
            if (hold_until(queue, value, hold, 1) < 0) failed = 1;
        }
        /* the accesses, even after a failure above: the command is queued, later work must be
           ordered after it */
        if (done != k + 1) break;  /* (nothing pushed for this run) */
        PyObject *type = NULL, *exc = NULL, *tb = NULL;
        if (failed) PyErr_Fetch(&type, &exc, &tb);
        for (Py_ssize_t t = 0; t < PyTuple_GET_SIZE(touched); t++) {
            PyObject *use = PyTuple_GET_ITEM(touched, t);
            if (record_access(PyTuple_GET_ITEM(use, 0), PyTuple_GET_ITEM(use, 1), PyTuple_GET_ITEM(use, 2),
                              PyTuple_GET_ITEM(use, 3), PyTuple_GET_ITEM(use, 4) == Py_True,
                              PyTuple_GET_ITEM(use, 5) == Py_True, sigs[k], timeline) < 0) {
                if (failed) PyErr_Clear(); else { failed = 1; PyErr_Fetch(&type, &exc, &tb); }
            }
        }
        if (failed) PyErr_Restore(type, exc, tb);
    }
    if (!failed) {
        /* the last run stands for the whole replay when it waits for every run on another queue */
        Py_ssize_t last = nr - 1;
        int whole = 1;
        for (Py_ssize_t r = 0; r < last; r++)
            if (timelines[r] != timelines[last] && !(covered[last] >> r & 1)) whole = 0;
        if (whole) {
            result = sigs[last];
            Py_INCREF(result);
        } else if ((result = PyTuple_New(nr))) {
            for (Py_ssize_t r = 0; r < nr; r++) { Py_INCREF(sigs[r]); PyTuple_SET_ITEM(result, r, sigs[r]); }
        }
    }
    for (Py_ssize_t r = 0; r < done; r++) Py_DECREF(sigs[r]);
    return result;
}

/* complete(queue, value): hq_complete without releasing the GIL */
static PyObject *py_complete(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "complete(queue, value) takes 2 ints");
        return NULL;
    }
    hq_t *q = (hq_t *)PyLong_AsVoidPtr(args[0]);
    long long value = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (!q) { PyErr_SetString(PyExc_ValueError, "complete: NULL queue"); return NULL; }
    hq_complete(q, value);
    Py_RETURN_NONE;
}

static PyObject *py_launch(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 4 || !PyTuple_CheckExact(args[0]) || !PyDict_CheckExact(args[1]) || !sig_type) {
        PyErr_SetString(PyExc_TypeError, "launch(bufs, by_bufs, timeline, queue) after configure()");
        return NULL;
    }
    return launch_impl(args[0], args[0], args[1], args[2], args[3], NULL);
}

/* Program.__call__ in C: install(Program, call_py, capturing) puts a method descriptor for
   prog_call on the class. A call without keywords (or with `vals=` alone), outside a capture, of
   a program whose `_fast`
   is set ((queue, timeline, by_bufs, queue address)) goes straight to launch_impl; anything
   else (and a launch_impl that declines) calls `call_py(self, *args, **kwargs)`, the Python
   implementation, unchanged. This saves the Python frame of __call__ on every repeat launch. */
static PyObject *call_py, *capturing_var, *vals_key, *s_fast, *s_vals;

/* `vals=` alone, as a tuple of exact ints (bool and float never match a cached entry whose ints
   compare equal: the Python path refuses them), is part of the repeat launch's key:
   (vals_key, bufs, vals), vals_key being a private object no argument list can equal. */
static int plain_vals(PyObject *kwnames, PyObject *value) {
    PyObject *name = PyTuple_GET_ITEM(kwnames, 0);
    if (name != s_vals && PyUnicode_Compare(name, s_vals) != 0) return 0;
    if (!PyTuple_CheckExact(value)) return 0;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(value); i++)
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(value, i))) return 0;
    return 1;
}

static PyObject *prog_call(PyObject *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs > 0 && (nkw == 0 || (nkw == 1 && plain_vals(kwnames, args[nargs])))) {
        PyObject *capturing = NULL;
        if (PyContextVar_Get(capturing_var, NULL, &capturing) < 0) return NULL;
        int idle = capturing == NULL || capturing == Py_None;
        Py_XDECREF(capturing);
        PyObject *fast = idle ? PyObject_GetAttr(self, s_fast) : NULL;
        if (fast && PyTuple_CheckExact(fast) && PyTuple_GET_SIZE(fast) == 4 &&
            PyDict_CheckExact(PyTuple_GET_ITEM(fast, 2))) {
            hq_t *q = (hq_t *)PyLong_AsVoidPtr(PyTuple_GET_ITEM(fast, 3));
            PyObject *bufs = q ? PyTuple_New(nargs) : NULL;
            PyObject *sig = NULL;
            PyObject *key = NULL;
            if (bufs) {
                for (Py_ssize_t i = 0; i < nargs; i++) {
                    Py_INCREF(args[i]);
                    PyTuple_SET_ITEM(bufs, i, args[i]);
                }
                key = nkw ? PyTuple_Pack(3, vals_key, bufs, args[nargs]) : (Py_INCREF(bufs), bufs);
            }
            if (key) {
                sig = launch_impl(key, bufs, PyTuple_GET_ITEM(fast, 2), PyTuple_GET_ITEM(fast, 1),
                                  PyTuple_GET_ITEM(fast, 0), q);
            }
            Py_XDECREF(key);
            Py_XDECREF(bufs);
            Py_DECREF(fast);
            if (sig == NULL) {
                if (PyErr_Occurred()) return NULL;
            } else if (sig != Py_None) {
                return sig;
            } else {
                Py_DECREF(sig);
            }
        } else {
            Py_XDECREF(fast);
        }
        if (PyErr_Occurred()) return NULL;
    }
    /* the Python implementation: call_py(self, *args, **kwargs) */
    PyObject *small[16], **stack = small;
    Py_ssize_t total = 1 + nargs + nkw;
    if (total > 16 && !(stack = PyMem_Malloc(total * sizeof(PyObject *)))) return PyErr_NoMemory();
    stack[0] = self;
    memcpy(stack + 1, args, (nargs + nkw) * sizeof(PyObject *));
    PyObject *result = PyObject_Vectorcall(call_py, stack, 1 + nargs, kwnames);
    if (stack != small) PyMem_Free(stack);
    return result;
}

static PyMethodDef call_def = {
    "__call__", (PyCFunction)(void (*)(void))prog_call, METH_FASTCALL | METH_KEYWORDS,
    "Enqueue one launch of this kernel and return its Signal (see Program._call_py)."};

static PyObject *py_install(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 4 || !PyType_Check(args[0]) || !PyCallable_Check(args[1]) ||
        !PyContextVar_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "install(Program, call_py, capturing, vals_key)");
        return NULL;
    }
    if (!s_fast && !(s_fast = PyUnicode_InternFromString("_fast"))) return NULL;
    if (!s_vals && !(s_vals = PyUnicode_InternFromString("vals"))) return NULL;
    Py_INCREF(args[1]); Py_XDECREF(call_py); call_py = args[1];
    Py_INCREF(args[2]); Py_XDECREF(capturing_var); capturing_var = args[2];
    Py_INCREF(args[3]); Py_XDECREF(vals_key); vals_key = args[3];
    PyObject *descr = PyDescr_NewMethod((PyTypeObject *)args[0], &call_def);
    if (!descr) return NULL;
    int rc = PyObject_SetAttrString(args[0], "__call__", descr);
    Py_DECREF(descr);
    if (rc < 0) return NULL;
    Py_RETURN_NONE;
}

static PyMethodDef hq_methods[] = {
    {"push", (PyCFunction)(void (*)(void))py_push, METH_FASTCALL, "push(q, kind, fn, n, args[, nd, deps])"},
    {"complete", (PyCFunction)(void (*)(void))py_complete, METH_FASTCALL, "complete(queue, value)"},
    {"install", (PyCFunction)(void (*)(void))py_install, METH_FASTCALL, "install(Program, call, var, key)"},
    {"configure", (PyCFunction)(void (*)(void))py_configure, METH_FASTCALL, "configure(Signal, Buffer)"},
    {"launch", (PyCFunction)(void (*)(void))py_launch, METH_FASTCALL, "launch(bufs, by_bufs, timeline, q)"},
    {"replay", (PyCFunction)(void (*)(void))py_replay, METH_FASTCALL, "replay(runs)"},
    {NULL, NULL, 0, NULL},
};
static struct PyModuleDef hq_module = {PyModuleDef_HEAD_INIT, "_hostq", NULL, -1, hq_methods};
PyMODINIT_FUNC PyInit__hostq(void) { return PyModule_Create(&hq_module); }
#endif
""".replace("@CHUNK@", str(CHUNK))
    .replace("@ELAPSED_MASK@", str(ELAPSED_SLOTS - 1))
    .replace("@CASES@", _call_cases())
)

ffi = cffi.FFI()
ffi.cdef(CDEF)

_lock = threading.Lock()
_loaded: list[Any] = []  # [lib or None] once load() ran


def _cache_dir() -> Path:
    """Next to the compile cache (``CACHEDB``, else ``$XDG_CACHE_HOME/aiotinyrt``)."""
    from aiotinyrt.compiler import cache_path

    return cache_path().parent


def _compiler() -> str | None:
    env = getenv_str("CC")
    if env and shutil.which(env.split()[0]):
        return env.split()[0]
    for name in ("clang", "gcc", "cc"):
        if shutil.which(name):
            return name
    return None


def supported() -> bool:
    """True where the uniform 64-bit argument convention holds (see the module docstring)."""
    return sys.platform.startswith("linux") and platform.machine() in ("x86_64", "AMD64", "aarch64", "arm64")


def _python_include() -> str | None:
    include = sysconfig.get_paths().get("include")
    return include if include and os.path.exists(os.path.join(include, "Python.h")) else None


def _compile(cc: str, flags: list[str], tag: str) -> Path | None:
    """Build SOURCE with ``flags`` into the cache directory (once per machine); None on failure."""
    digest = hashlib.sha256("\0".join([SOURCE, cc, platform.machine(), *flags]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"hostq-{tag}-{digest}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".hostq-", suffix=".so")
    os.close(fd)
    try:
        subprocess.run(
            [cc, "-O2", "-fPIC", "-shared", "-pthread", *flags, "-x", "c", "-", "-o", tmp],
            input=SOURCE.encode(),
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(tmp, target)  # atomic: concurrent processes each install a whole file
    except (OSError, subprocess.SubprocessError) as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if debug_level() >= 1:
            stderr = getattr(exc, "stderr", b"") or b""
            print(f"aiotinyrt: native queue ({tag}) not built: {exc}\n{stderr.decode(errors='replace')}")
        return None
    return target


def _build() -> tuple[Any, Any] | None:
    cc = _compiler()
    if cc is None:
        return None
    include = _python_include()
    if include is not None:  # the library doubles as an extension module with a fast push()
        tag = sys.implementation.cache_tag or "py"
        path = _compile(cc, ["-DHQ_PYTHON", f"-I{include}"], tag)
        if path is not None:
            spec = importlib.util.spec_from_file_location("_hostq", path)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
                return ffi.dlopen(str(path)), module
    path = _compile(cc, [], "c")
    if path is None:
        return None
    lib = ffi.dlopen(str(path))
    return lib, None


def load() -> Any:
    """The native queue library (built and cached on first use), or None where it is unavailable
    or disabled by ``NATIVE_QUEUE=0``."""
    built = _load()
    return None if built is None else built[0]


def _hot(name: str, cffi_form: Callable[[Any], Callable[..., Any]]) -> Any:
    """The extension module's function ``name`` (no libffi, no GIL release), or where the library
    was built without Python's headers ``cffi_form(lib)``. Call only after :func:`load` succeeded."""
    built = _load()
    assert built is not None
    lib, module = built
    return getattr(module, name) if module is not None else cffi_form(lib)


def _push_cffi(lib: Any) -> Callable[..., int]:
    cast = ffi.cast

    def push(q: int, kind: int, fn: int, nargs: int, args: int, ndeps: int = 0, deps: int = 0) -> int:
        value = int(lib.hq_push_deps(cast("hq_t *", q), kind, fn, nargs, args, ndeps, deps))
        if value < 0:
            raise MemoryError("out of memory for the command queue")
        return value

    return push


def pusher() -> Callable[..., int]:
    """``push(queue_address, kind, fn, nargs, args[, ndeps, deps]) -> value``. With ``ndeps``, the
    command runs once every ``(queue address, value)`` pair of the ``int64_t[2 * ndeps]`` at
    ``deps`` is complete (waited for by the worker, in C). Raises ``MemoryError`` when no ring
    chunk can be allocated."""
    return _hot("push", _push_cffi)  # type: ignore[no-any-return]


def completer() -> Callable[[int, int], None]:
    """``complete(queue_address, value)``: store ``completed`` from Python and wake workers of
    other queues waiting for it."""

    def complete_cffi(lib: Any) -> Callable[[int, int], None]:
        return lambda q, value: lib.hq_complete(ffi.cast("hq_t *", q), value)

    return _hot("complete", complete_cffi)  # type: ignore[no-any-return]


_configured: list[type] = []


def launcher(signal_type: type, buffer_type: type) -> Callable[..., Any] | None:
    """The C ``launch(bufs, by_bufs, timeline, queue)`` of the extension module (see SOURCE),
    configured for these classes, or None without the extension module."""
    built = _load()
    if built is None or built[1] is None:
        return None
    module = built[1]
    if _configured != [signal_type, buffer_type]:
        with _lock:
            module.configure(signal_type, buffer_type)
            _configured[:] = [signal_type, buffer_type]
    return module.launch  # type: ignore[no-any-return]


def replayer(signal_type: type, buffer_type: type) -> Callable[[tuple[Any, ...]], Any] | None:
    """The C ``replay(runs)`` of the extension module (Graph.replay's submission, see SOURCE),
    configured for these classes, or None without the extension module."""
    if launcher(signal_type, buffer_type) is None:
        return None
    built = _load()
    assert built is not None
    return built[1].replay  # type: ignore[no-any-return]


def install_call(program_type: type, call_py: Callable[..., Any], capturing: Any, vals_key: object) -> bool:
    """Make ``program_type.__call__`` the extension module's C function, which runs the repeat
    launch itself and hands every other call to ``call_py`` unchanged; False (nothing done)
    without the extension module. Idempotent."""
    built = _load()
    if built is None or built[1] is None:
        return False
    with _lock:
        if program_type.__dict__.get("__call__") is not call_py:
            return True  # installed already
        built[1].install(program_type, call_py, capturing, vals_key)
    return True


async def prepare() -> None:
    """Build (first use on this machine: ~0.7 s of compiler here) or load the library in a worker
    thread, so that opening a device afterwards does not do it on the event loop thread.
    ``open_device()`` and the demo call it; code that opens devices with ``Device[name]`` on a
    loop can await it first.

    Cancellation: cancels the wait; a build already running finishes in its thread and is used
    by the next device opened.
    """
    if _loaded:
        await anyio.lowlevel.checkpoint()
        return
    await anyio.to_thread.run_sync(load, abandon_on_cancel=True)


def _load() -> tuple[Any, Any] | None:
    if getenv("NATIVE_QUEUE", 1) == 0 or not supported():
        return None
    if not _loaded:
        with _lock:
            if not _loaded:
                _loaded.append(_build())
    return _loaded[0]  # type: ignore[no-any-return]
