/* The completion half of a CL queue's driver (aiotinyrt/backends/cl_queue.py), in C.

   The submitting thread hands every command's event to clq_push(); the queue's waiter thread
   sits in clq_wait() with the GIL released: it waits for the oldest event handed over, then
   takes every later one that has completed too (the queue is in order, so they form a prefix),
   reads each one's execution status and profiling times, releases its reference, and returns
   the whole batch to Python in one call. Done in Python, those are three or four calls per event
   that each release and retake the GIL, which the submitting thread needs at the same moment.

   Gates (clq_gating, clq_gate). PoCL's enqueue costs ~1 us while its workers have work, and
   4-8 us when they sleep: each enqueue then wakes them. A queue fed one command at a time
   slower than the device runs them has its workers asleep at nearly every enqueue. With gating
   on, a command enqueued while nobody waits for the queue joins a batch: the batch's first
   command waits for a user event of the ring's (its gate), the later ones follow it in the
   in-order queue, and the gate is set (one wake-up of the workers for the batch) when a
   caller starts waiting for any command of the queue (clq_set_wake), a command of another
   queue waits for one of the batch (clq_open), the batch is `gate_ns` old (the waiter thread
   times it; the next enqueue does too), or the queue closes. A command enqueued while
   somebody waits, or while the waiter is inside the driver's wait for an older command (it
   could not time a gate then; the device has work), goes to the device at once; so does one
   enqueued while the newest command has not completed (the device has work: its workers are
   awake). So does the command after a launch round trip's: once an await claimed or polled
   for the newest command handed over and that was a repeat launch (clq_newest_launch: the
   caller awaits each launch as it makes it), the next command skips the gate (`direct`, for
   one command). It gets a claim of its own instead (`direct_claim`, for gate_ns, as long as
   a gate would have held it back; claims share one time, the latest of those counted): the
   waiter leaves its completion to the await's poll, and the await's clq_claim of it takes
   that claim over. (A longer claim would hold back a Python command behind it, and a gate
   opened while the waiter waits for the claim's end, that long.) It ends, as a gate is set,
   when somebody waits for the queue (clq_set_wake), and also with a claim of another
   command, a poll without a claim of the newest launch, the next direct command or a new
   gating setting (clq_end_direct). One whose time passed counts until the next claim is
   counted, as any claim, but no longer ends the waiter's holds (clq_claimed). Measured with
   the waiter napping (below), pairs alternating in one process: 34-41 us per round trip against 38-54 with a batch of one per command
   whose gate the await sets (asyncio), 44-50 against 49-56 (trio); the claim's set of the
   gate wakes PoCL's workers as the direct enqueue does, after a user event and a gated
   enqueue that cost more. Without naps the direct enqueue measured slower.

   Nobody waits. While nobody waits for any command of the queue and no Python command is in
   the ring, the waiter does not wait for the oldest event in the driver at first: it looks at
   it every CLQ_POLL_NS, CLQ_LOOKS times (a timed wait that pushes do not end; clq_set_wake
   does). A round trip's command is taken by its awaiting thread's poll (below) long before:
   the waiter, which the driver's wait would wake at its completion and the token's return
   would wake again, on 2 cores shared with the driver's worker, wakes once per CLQ_POLL_NS at
   most instead. An event still pending after that is waited for in the driver (a long kernel
   costs no wake-ups), and so is every event once somebody waits: reported at once.

   Naps. A waiter that finds the ring empty does not wait for the next push at once: for
   CLQ_NAPS times CLQ_POLL_NS after the last push it naps (a timed wait, `polling` set, so
   clq_set_wake wakes it), and only a push it must act on at once wakes it: a Python command,
   or any push while somebody waits for the queue. (Any other signal of `more` ends a nap
   early too, and counts as one.) Otherwise it finds what was pushed when its nap ends, as it
   finds completions while nobody waits. A round trip's command is taken
   by its awaiting thread's poll, so a waiter woken at each push only looked at a pending
   event and slept again, on 2 cores shared with the driver's worker and the loop; napping,
   it wakes once per CLQ_POLL_NS at most while round trips go on, and waits untimed (a push
   wakes it) once CLQ_NAPS naps passed without one. A new gate still wakes it when its nap
   would end after the gate's time (clq_gate); a launch round trip's command opens none.

   Two takers (clq_poll, in clq_poll.c). A caller about to wait for a command it just
   submitted (the loop thread's `await` of a launch on an idle queue) may wait for it itself,
   briefly: it spins on
   the command's event in clq_poll() and takes the completed prefix, as clq_wait() does, so
   the result reaches it without the two hand-overs between threads (driver to waiter, waiter
   to loop) that cost more than the kernel. Whoever takes events holds the ring's token
   (`taking`) until its caller has reported them (clq_reported), so the takers' reports and
   the caller's per-command records stay in ring order; a waiting poller has priority (the
   waiter ends a hold for it and leaves the events it woke for to it), and clq_poll takes no
   urgent event (a Python command runs on the waiter). A caller that must do something else
   first (the loop thread's checkpoint, which every await makes) claims the command
   (clq_claim): its batch goes to the device, and until the caller's clq_poll (or clq_unclaim)
   ends the claim, or its claim_due passes, the waiter leaves completed events to it as to a
   waiting poller, so the checkpoint runs while the device runs the command. It waits for a
   claim's end as it naps (clq_wait_token), and the end of a poll or a report wakes it only
   while the ring holds events (clq_wake_takers): a round trip's poll leaves the ring empty,
   and the waiter sleeps on to the end of its nap. Claims are
   numbered, so that ending one that ran out of time (a poll that came late) is a no-op.

   The OpenCL entry points come from the caller (the ICD loader Python opened), so this file
   needs neither OpenCL's headers nor its library at build time. */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>

#include "clq_internal.h"

/* This process's id, kept by a fork handler: getpid() is a system call (glibc keeps no cache),
   and every enqueue asks (clq_gate) whether its ring is this process's. */
static _Atomic pid_t self_pid;
static pthread_once_t self_pid_once = PTHREAD_ONCE_INIT;

static void self_pid_update(void) { atomic_store(&self_pid, getpid()); }

static void self_pid_init(void) {
    self_pid_update();
    pthread_atfork(NULL, NULL, self_pid_update);
}

/* 1 in a child forked after `q` was made (its waiter and the driver's threads are gone). */
CLQ_HIDDEN int clq_forked(const clq_t *q) { return q->pid != atomic_load(&self_pid); }

clq_t *clq_new(uintptr_t wait, uintptr_t event_info, uintptr_t profiling_info, uintptr_t retain,
               uintptr_t release) {
    clq_t *q = calloc(1, sizeof *q);
    if (!q) return NULL;
    q->cap = 1024;
    q->ring = malloc(q->cap * sizeof *q->ring);
    pthread_condattr_t attr;
    int ok = q->ring && pthread_condattr_init(&attr) == 0;
    if (ok) { /* (clq_wait's timed waits count on the monotonic clock) */
        ok = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC) == 0 && pthread_cond_init(&q->more, &attr) == 0 &&
             pthread_cond_init(&q->token, &attr) == 0;
        pthread_condattr_destroy(&attr);
    }
    if (!ok || pthread_mutex_init(&q->lock, NULL) != 0) {
        free(q->ring);
        free(q);
        return NULL;
    }
    atomic_init(&q->wake, CLQ_NO_WAKE);
    atomic_init(&q->polling, 0);
    q->wait = (wait_fn)wait;
    q->event_info = (info_fn)event_info;
    q->profiling_info = (info_fn)profiling_info;
    q->retain = (ref_fn)retain;
    q->release = (ref_fn)release;
    pthread_once(&self_pid_once, self_pid_init);
    q->pid = atomic_load(&self_pid);
    return q;
}

/* Set the open batch's gate, if there is one (caller holds the lock). */
CLQ_HIDDEN void clq_open_locked(clq_t *q) {
    cl_event g = q->gate;
    if (!g) return;
    q->gate = NULL;
    atomic_store(&q->gated, 0);
    q->set_status(g, 0 /* CL_COMPLETE */);
    q->release(g);
}

/* Gate batches of commands enqueued while nobody waits (see the top of the file): `context`
   the queue's cl_context, `create_user` and `set_status` clCreateUserEvent and
   clSetUserEventStatus, a batch held `ns` nanoseconds at most (0: gating off). */
void clq_gating(clq_t *q, void *context, uintptr_t create_user, uintptr_t set_status, long ns) {
    if (clq_forked(q)) return; /* a forked child: the parent's waiter may have held the lock */
    pthread_mutex_lock(&q->lock);
    clq_open_locked(q);
    clq_end_direct(q); /* (and no round trip's rule carries over: see clq_gate) */
    q->direct = 0;
    pthread_cond_signal(&q->more); /* (a waiter timing the gate looks at the new one) */
    q->context = context;
    q->create_user = (user_fn)create_user;
    q->set_status = (status_fn)set_status;
    q->gate_ns = create_user && set_status && ns > 0 ? ns : 0;
    pthread_mutex_unlock(&q->lock);
}

/* Free the ring and release the events it still holds. In a forked child (the parent's waiter
   thread and the driver's threads are gone) nothing is released: only the memory is freed, and
   the mutex and condition variable are never destroyed (a condition variable whose waiter was
   the parent's thread would make pthread_cond_destroy wait forever; on Linux they hold no other
   resource). */
void clq_free(clq_t *q) {
    if (!q) return;
    if (!clq_forked(q)) {
        clq_open_locked(q);
        for (size_t i = 0; i < q->count; i++) q->release(q->ring[(q->head + i) % q->cap].event);
    }
    free(q->ring);
    free(q);
}

static int clq_add(clq_t *q, void *event, int64_t tag, int urgent, void *obj, int retain) {
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
        if (retain) q->retain(event);
        q->ring[(q->head + q->count) % q->cap] = (struct slot){event, tag, urgent, obj};
        q->count++;
        if (urgent) q->urgent_count++;
        q->naps = 0;
        if (q->idle || (q->napping && (urgent || atomic_load(&q->wake) != CLQ_NO_WAKE))) {
            q->push_wakes++;
            pthread_cond_signal(&q->more); /* (a napping or other timed wait looks by itself) */
        }
    }
    pthread_mutex_unlock(&q->lock);
    return out;
}

/* Keep a reference to `event` until clq_wait() reported it, under `tag` (urgent: reported as
   soon as it completed). 0, or -1 (out of memory, or the queue is closed: nothing was kept). */
int clq_push(clq_t *q, void *event, int64_t tag, int urgent) { return clq_add(q, event, tag, urgent, NULL, 1); }

/* As clq_push (not urgent), taking over the caller's reference to `event` (it stays the
   caller's when the call fails), with `obj`: the caller's, handed back untouched with the tag. */
int clq_hand(clq_t *q, void *event, int64_t tag, void *obj) { return clq_add(q, event, tag, 0, obj, 0); }

/* How long results taken by clq_wait() may wait for more to join them while nobody waits for
   any command of the queue (a caller polling Signal.done() sees completions this late), and
   how often the oldest pending event is looked at meanwhile. */
#define CLQ_HOLD_NS 1000000L
#define CLQ_POLL_NS 250000L
/* How many times the waiter looks at one oldest event while nobody waits, before it waits for
   it in the driver (see "Nobody waits" at the top). */
#define CLQ_LOOKS 4
/* How many naps of CLQ_POLL_NS the waiter takes with the ring empty after the last push, before
   it waits untimed (see "Naps" at the top). */
#define CLQ_NAPS 4

CLQ_HIDDEN void clq_after(struct timespec *t, long ns) {
    clock_gettime(CLOCK_MONOTONIC, t);
    t->tv_sec += ns / 1000000000L;
    t->tv_nsec += ns % 1000000000L;
    if (t->tv_nsec >= 1000000000L) {
        t->tv_sec += 1;
        t->tv_nsec -= 1000000000L;
    }
}

CLQ_HIDDEN int clq_before(const struct timespec *a, const struct timespec *b) {
    return a->tv_sec < b->tv_sec || (a->tv_sec == b->tv_sec && a->tv_nsec < b->tv_nsec);
}

/* Call before enqueuing a command: the gate it must wait for (put it in its wait list, then
   release it: the ring keeps its own reference), when it opens a batch; NULL when it joins the
   open batch (the in-order queue puts it behind the batch's first command), or goes to the
   device at once (somebody waits for the queue, gating is off or failed, the queue closed, a
   launch round trip's command: then with a claim of its own, see "Gates" at the top).
   The caller serializes its calls with its pushes (its submit lock). */
void *clq_gate(clq_t *q) {
    if (!q->gate_ns || clq_forked(q)) return NULL;
    struct timespec now;
    cl_event out = NULL;
    pthread_mutex_lock(&q->lock);
    if (q->gate) { /* (the clock is read only when a batch is open or opens: a busy queue needs none) */
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (clq_before(&now, &q->gate_due) && !q->closed) {
            pthread_mutex_unlock(&q->lock); /* it joins the open batch */
            return NULL;
        }
        clq_open_locked(q);
    }
    cl_int err = 0;
    int now_please = q->closed || q->blocked || atomic_load(&q->wake) != CLQ_NO_WAKE;
    if (q->direct && !now_please) { /* a launch round trip's (see "Gates" at the top) */
        clq_after(&now, q->gate_ns);
        clq_end_direct(q);
        q->direct_claim = clq_count_claim(q, &now, 0);
        atomic_store(&q->directed, 1);
        /* (stored, then `wake` loaded, as for a gate below: a caller that started waiting
           meanwhile either ends the claim in clq_set_wake or is seen here) */
        if (atomic_load(&q->wake) != CLQ_NO_WAKE) clq_end_direct(q);
        now_please = 1;
    }
    q->direct = 0;
    if (!now_please && q->count > 0) { /* the newest command not done: the device has work */
        cl_int st = 0;
        cl_event newest = q->ring[(q->head + q->count - 1) % q->cap].event;
        now_please = q->event_info(newest, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL) == 0 && st > 0;
    }
    cl_event g = now_please ? NULL : q->create_user(q->context, &err);
    if (g && err != 0) g = NULL;
    if (g) {
        clock_gettime(CLOCK_MONOTONIC, &now);
        q->gate = g;
        q->gate_due = now;
        q->gate_due.tv_nsec += q->gate_ns;
        while (q->gate_due.tv_nsec >= 1000000000L) {
            q->gate_due.tv_sec += 1;
            q->gate_due.tv_nsec -= 1000000000L;
        }
        /* (stored, then `wake` loaded: a caller that started waiting meanwhile either sees
           the gate in clq_set_wake or is seen here) */
        atomic_store(&q->gated, 1);
        if (atomic_load(&q->wake) != CLQ_NO_WAKE) {
            clq_open_locked(q);
        } else {
            q->retain(g); /* (the caller's, until its enqueue read the wait list) */
            out = g;
            if (q->idle || (atomic_load(&q->polling) && clq_before(&q->gate_due, &q->until)))
                pthread_cond_signal(&q->more); /* (the waiter times the gate) */
        }
    }
    pthread_mutex_unlock(&q->lock);
    return out;
}

/* Read `ev`'s outcome into *status and *seconds: 1 if it completed (or reading it failed),
   0 if it has not completed yet. */
CLQ_HIDDEN int clq_read(clq_t *q, cl_event ev, int32_t *status, double *seconds) {
    cl_int st = 0;
    cl_int code = q->event_info(ev, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL);
    if (code == 0 && st > 0) return 0;
    *status = code ? code : st;
    *seconds = 0.0;
    cl_ulong t[2];
    if (*status == 0 && q->profiling_info(ev, CL_PROFILING_COMMAND_START, sizeof t[0], &t[0], NULL) == 0 &&
        q->profiling_info(ev, CL_PROFILING_COMMAND_END, sizeof t[1], &t[1], NULL) == 0)
        *seconds = t[1] > t[0] ? (double)(t[1] - t[0]) * 1e-9 : 0.0;
    return 1;
}

/* Whether a claim counts at `now` (caller holds the lock): one whose time passed still counts
   until the next claim is counted (clq_count_claim), but it no longer ends a hold. */
static int clq_claimed(const clq_t *q, const struct timespec *now) {
    return q->claims > 0 && clq_before(now, &q->claim_due);
}

/* The waiter's wait for the token after its wait for the oldest event, `first` (caller holds
   the lock): while somebody takes events, or a poller waits for the token or its event, or a
   caller is about to poll (clq_claim, until its claim_due), unless `first` is urgent (no
   poller takes it). It returns once `first` is gone from the ring (a poller took it: nothing
   to wait for; it looks before each wait). The wait for claims to end is a nap, CLQ_POLL_NS at
   most (on `more`, `napping` and `polling` set: what wakes a nap wakes it), which the end of a
   claim, a poll or a report cuts short only while the ring holds events (clq_wake_takers;
   clq_unclaim always does). */
static void clq_wait_token(clq_t *q, int urgent, cl_event first) {
    for (;;) {
        if (!urgent && (q->count == 0 || q->ring[q->head].event != first)) return;
        if (q->taking || (q->poller && !urgent)) {
            q->token_waits++;
            pthread_cond_wait(&q->token, &q->lock);
            q->token_waits--;
            continue;
        }
        if (!q->claims || urgent) return;
        struct timespec now, due = q->claim_due, nap; /* (a copy: clq_claim may move it meanwhile) */
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (!clq_before(&now, &due)) return;
        clq_after(&nap, CLQ_POLL_NS);
        if (clq_before(&nap, &due)) due = nap; /* (the claim may end unseen: `first` gone, ring empty) */
        atomic_store(&q->polling, 1);
        q->until = due;
        q->napping = q->claim_wait = 1;
        if (pthread_cond_timedwait(&q->more, &q->lock, &due) == 0) q->claim_wakes++;
        q->napping = q->claim_wait = 0;
        atomic_store(&q->polling, 0);
    }
}

/* Report completed events, at most `max`, oldest first: tags[i] is its tag, status[i] its
   execution status (0: complete; negative: its error) or the error of reading it, seconds[i]
   its profiling time (0 without one).

   With nothing taken yet the call waits (blocking) for the oldest event handed over, then takes
   it and every later completed one (the queue is in order: a prefix). It returns them at once
   when a caller waits for any command of the queue (clq_set_wake), one of them failed or is
   urgent, the oldest pending event is urgent, `max` are taken, or the queue is closed;
   otherwise it keeps looking at the oldest pending event every CLQ_POLL_NS and takes what
   completed, for at most CLQ_HOLD_NS after the first: a queue nobody waits for returns one
   batch per CLQ_HOLD_NS instead of one per event, and the caller's thread (which needs the
   GIL the submitting thread holds) runs that much less often. A caller that starts waiting
   meanwhile ends the hold at once.

   A call that takes events holds the token (see the top of the file): call clq_reported()
   once they are reported (the next clq_wait call gives it back too). It waits for the token after its wait for the oldest event (a
   poller may have taken that event: it then waits for the next), and ends a hold at once
   when a poller wants the token.

   Returns the number reported, or -1 once the queue is closed and every event was reported. 0
   only after a wait that failed while its event had not completed: that event is not reported
   until it has (its command may still use its memory); the call sleeps 1 ms first, so a
   caller calling again does not spin. */
int clq_wait(clq_t *q, int max, int32_t *status, double *seconds, int64_t *tags, void **objs) {
    if (max < 1) max = 1;
    int done = 0, now_please = 0;
    struct timespec due = {0, 0}, next;
    pthread_mutex_lock(&q->lock);
    if (q->taking == CLQ_WAITER) { /* (its caller reported the last batch: calling again says so) */
        q->taking = 0;
        clq_wake_takers(q);
    }
    for (;;) {
        if (done == 0) {
            for (;;) { /* a batch's gate first (its commands cannot complete before it is set) */
                if (q->gate) {
                    clock_gettime(CLOCK_MONOTONIC, &next);
                    if (q->closed || !clq_before(&next, &q->gate_due)) {
                        clq_open_locked(q);
                        continue;
                    }
                    atomic_store(&q->polling, 1); /* (clq_set_wake sets the gate and wakes it) */
                    q->until = next = q->gate_due;
                    pthread_cond_timedwait(&q->more, &q->lock, &next);
                    atomic_store(&q->polling, 0);
                } else if (q->count == 0 && !q->closed && q->naps < CLQ_NAPS) {
                    q->naps++; /* (a nap: see "Naps" at the top) */
                    atomic_store(&q->polling, 1); /* (clq_set_wake wakes it) */
                    clq_after(&next, CLQ_POLL_NS);
                    q->until = next;
                    q->napping = 1;
                    pthread_cond_timedwait(&q->more, &q->lock, &next);
                    q->napping = 0;
                    atomic_store(&q->polling, 0);
                } else if (q->count == 0 && !q->closed) {
                    q->idle = 1;
                    pthread_cond_wait(&q->more, &q->lock);
                    q->idle = 0;
                } else {
                    break;
                }
            }
            if (q->count == 0) {
                if (q->taking || q->poller) { /* (closed: a poller may still report what it took) */
                    q->token_waits++;
                    pthread_cond_wait(&q->token, &q->lock);
                    q->token_waits--;
                    continue;
                }
                pthread_mutex_unlock(&q->lock);
                return -1;
            }
            cl_event first = q->ring[q->head].event;
            int urgent = q->ring[q->head].urgent; /* (a poller never takes it: no need to wait) */
            q->retain(first); /* (a poller may take it and release the ring's reference) */
            if (first != q->looked_at) {
                q->looked_at = first;
                q->looks = 0;
            }
            if (!q->urgent_count && !q->closed && atomic_load(&q->wake) == CLQ_NO_WAKE &&
                q->looks++ < CLQ_LOOKS) {
                /* Nobody waits for the queue: look at the oldest event every CLQ_POLL_NS instead
                   of waiting for it in the driver (see "Nobody waits" at the top) */
                pthread_mutex_unlock(&q->lock);
                cl_int st = 1;
                int ready = q->event_info(first, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL) != 0 ||
                            st <= 0;
                if (!ready) {
                    pthread_mutex_lock(&q->lock);
                    atomic_store(&q->polling, 1); /* (clq_set_wake wakes it) */
                    if (atomic_load(&q->wake) == CLQ_NO_WAKE && !q->closed) {
                        clq_after(&next, CLQ_POLL_NS);
                        if (q->gate && clq_before(&q->gate_due, &next)) next = q->gate_due;
                        q->until = next;
                        pthread_cond_timedwait(&q->more, &q->lock, &next);
                    }
                    atomic_store(&q->polling, 0);
                    pthread_mutex_unlock(&q->lock);
                    q->release(first);
                    pthread_mutex_lock(&q->lock);
                    continue;
                }
            } else {
                q->blocked = 1; /* (no gate opens while it waits: see clq_gate) */
                pthread_mutex_unlock(&q->lock);
                q->wait(1, &first); /* (a failure: the statuses below tell) */
            }
            pthread_mutex_lock(&q->lock);
            q->blocked = 0;
            clq_wait_token(q, urgent, first);
            int mine = q->count > 0 && q->ring[q->head].event == first;
            q->release(first);
            if (!mine) continue; /* a poller took it: wait for the next one */
            q->taking = CLQ_WAITER;
        }
        cl_event taken = NULL; /* (the ring's reference goes once its slot is gone: see clq_find) */
        while (done < max && q->count > 0) { /* only this thread takes events: the prefix stays */
            struct slot s = q->ring[q->head];
            pthread_mutex_unlock(&q->lock);
            if (taken) q->release(taken);
            taken = NULL;
            int completed = clq_read(q, s.event, &status[done], &seconds[done]);
            pthread_mutex_lock(&q->lock);
            if (!completed) break; /* not completed yet: the next batch starts with it */
            q->head = (q->head + 1) % q->cap;
            q->count--;
            taken = s.event;
            if (s.event == q->looked_at) q->looked_at = NULL; /* (its address may be reused at once) */
            if (s.urgent) q->urgent_count--;
            tags[done] = s.tag;
            objs[done] = s.obj;
            if (done++ == 0) clq_after(&due, CLQ_HOLD_NS);
            if (status[done - 1] != 0 || s.urgent) now_please = 1;
        }
        if (taken) {
            pthread_mutex_unlock(&q->lock);
            q->release(taken);
            pthread_mutex_lock(&q->lock);
        }
        if (done == 0) { /* the wait failed and its event is still queued or running */
            q->taking = 0;
            clq_wake_takers(q);
            pthread_mutex_unlock(&q->lock);
            struct timespec nap = {0, 1000000};
            nanosleep(&nap, NULL);
            return 0;
        }
        clock_gettime(CLOCK_MONOTONIC, &next);
        if (now_please || done == max || q->closed || q->poller || clq_claimed(q, &next) || !clq_before(&next, &due) ||
            (q->count > 0 && q->ring[q->head].urgent))
            break;
        atomic_store(&q->polling, 1);
        if (atomic_load(&q->wake) != CLQ_NO_WAKE) {
            atomic_store(&q->polling, 0);
            break;
        }
        if (q->gate && !clq_before(&next, &q->gate_due)) clq_open_locked(q);
        clq_after(&next, CLQ_POLL_NS);
        if (clq_before(&due, &next)) next = due;
        if (q->gate && clq_before(&q->gate_due, &next)) next = q->gate_due;
        q->until = next;
        pthread_cond_timedwait(&q->more, &q->lock, &next);
        atomic_store(&q->polling, 0);
        clock_gettime(CLOCK_MONOTONIC, &next);
        if (q->poller || clq_claimed(q, &next)) break; /* (what completed meanwhile is theirs) */
    }
    pthread_mutex_unlock(&q->lock);
    return done;
}

/* The smallest value a caller waits for (CLQ_NO_WAKE: none): while there is one, clq_wait()
   returns what it took without holding it, and no batch's gate or direct command's claim
   holds anything back. Nothing in a forked child (no waiter runs there). */
void clq_set_wake(clq_t *q, int64_t wake) {
    atomic_store(&q->wake, wake); /* (no lock: the submitting thread sets it per wait) */
    if (wake == CLQ_NO_WAKE ||
        !(atomic_load(&q->polling) || atomic_load(&q->gated) || atomic_load(&q->directed)))
        return;
    if (clq_forked(q)) return; /* a forked child: the parent's waiter may have held the lock */
    pthread_mutex_lock(&q->lock);
    clq_open_locked(q); /* (the batch goes to the device: somebody waits) */
    clq_end_direct(q);  /* (as a gate: a direct launch's own claim ends when somebody waits) */
    pthread_cond_signal(&q->more);
    pthread_mutex_unlock(&q->lock);
}

/* Set the open batch's gate now (a command of another queue waits for one of its commands). */
void clq_open(clq_t *q) {
    if (!atomic_load(&q->gated) || clq_forked(q)) return;
    pthread_mutex_lock(&q->lock);
    clq_open_locked(q);
    pthread_cond_signal(&q->more); /* (a waiter timing the gate waits for the batch now) */
    pthread_mutex_unlock(&q->lock);
}

/* A new reference to the event pushed under `tag` that nobody took yet (the caller releases
   it), or NULL. Looked for from the newest: a dependency is usually a recent command. */
void *clq_find(clq_t *q, int64_t tag) {
    if (clq_forked(q)) return NULL;
    cl_event out = NULL;
    pthread_mutex_lock(&q->lock);
    for (size_t i = q->count; i-- > 0;) {
        struct slot *s = &q->ring[(q->head + i) % q->cap];
        if (s->tag == tag) {
            out = s->event;
            q->retain(out);
            break;
        }
    }
    pthread_mutex_unlock(&q->lock);
    return out;
}

/* A count of `q`'s read under its lock (tests, statistics); 0 in a forked child, where the
   parent's waiter may have held the lock. */
static long clq_count(clq_t *q, const long *count) {
    if (clq_forked(q)) return 0;
    pthread_mutex_lock(&q->lock);
    long n = *count;
    pthread_mutex_unlock(&q->lock);
    return n;
}

/* How many of the waiter's waits for claims to end a signal cut short (see clq_wake_takers). */
long clq_claim_wakes(clq_t *q) { return clq_count(q, &q->claim_wakes); }

/* How many pushes woke the waiter. */
long clq_push_wakes(clq_t *q) { return clq_count(q, &q->push_wakes); }

/* 1 while the waiter naps, 2 while it waits untimed for a push, else 0 (tests, statistics). */
int clq_resting(clq_t *q) {
    if (clq_forked(q)) return 0;
    pthread_mutex_lock(&q->lock);
    int n = q->napping ? 1 : q->idle ? 2 : 0;
    pthread_mutex_unlock(&q->lock);
    return n;
}

/* 1 while a batch waits for its gate (tests, statistics). */
int clq_gated(clq_t *q) { return atomic_load(&q->gated); }

/* No more events: clq_wait() returns -1 once it reported every event handed over. */
void clq_close(clq_t *q) {
    pthread_mutex_lock(&q->lock);
    q->closed = 1;
    clq_open_locked(q);
    pthread_cond_broadcast(&q->more);
    pthread_mutex_unlock(&q->lock);
}
