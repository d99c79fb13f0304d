/* The host queue: a ring of commands and the worker's run loop (see aiotinyrt/native/__init__.py). */
#include "hostq_internal.h"

static hq_chunk *chunk_new(void) {
    hq_chunk *c = calloc(1, sizeof(hq_chunk));
    return c;
}

hq_t *hq_new(void) {
    hq_t *q = aligned_alloc(64, (sizeof(hq_t) + 63) / 64 * 64);
    if (!q) return NULL;
    memset(q, 0, sizeof(hq_t));
    q->elapsed = calloc((HQ_ELAPSED_SLOTS - 1) + 1, sizeof(double));
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
    if (tid <= 0 || q->elapsed[LOAD(&q->completed) & (HQ_ELAPSED_SLOTS - 1)] < SPREAD_MIN_S) return;
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
    if (q->wpos == HQ_CHUNK) {
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
    case 0: ((void (*)(void))fn)(); break;
    case 1: ((void (*)(u64))fn)(a[0]); break;
    case 2: ((void (*)(u64, u64))fn)(a[0], a[1]); break;
    case 3: ((void (*)(u64, u64, u64))fn)(a[0], a[1], a[2]); break;
    case 4: ((void (*)(u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3]); break;
    case 5: ((void (*)(u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4]); break;
    case 6: ((void (*)(u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5]); break;
    case 7: ((void (*)(u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6]); break;
    case 8: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]); break;
    case 9: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8]); break;
    case 10: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9]); break;
    case 11: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10]); break;
    case 12: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11]); break;
    case 13: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12]); break;
    case 14: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13]); break;
    case 15: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14]); break;
    case 16: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15]); break;
    case 17: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15], a[16]); break;
    case 18: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15], a[16], a[17]); break;
    case 19: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18]); break;
    case 20: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18], a[19]); break;
    case 21: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18], a[19], a[20]); break;
    case 22: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18], a[19], a[20], a[21]); break;
    case 23: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18], a[19], a[20], a[21], a[22]); break;
    case 24: ((void (*)(u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64, u64))fn)(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13], a[14], a[15], a[16], a[17], a[18], a[19], a[20], a[21], a[22], a[23]); break;
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
    if (q->rpos == HQ_CHUNK) {
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
        if (s->fn) cpu = spread_enter(q, q->elapsed[(v - 1) & (HQ_ELAPSED_SLOTS - 1)] >= SPREAD_MIN_S, &moved);
        double t0 = now();
        if (s->fn) call(s->fn, s->nargs, s->args);
        q->elapsed[v & (HQ_ELAPSED_SLOTS - 1)] = now() - t0;
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
