/* The poller's side of a CL queue's completion ring (clq.c tells the whole ring, "Two
   takers"): a caller about to wait for a command it submitted waits for it itself, briefly
   (clq_poll), or claims it first and polls after its checkpoint (clq_claim, clq_unclaim), and
   reports what it took before giving the ring's token back (clq_polled, clq_reported). */
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#include "clq_internal.h"

/* How many commands may be ahead of one clq_poll() waits for on the device (fewer than this). */
#define CLQ_POLL_AHEAD 4

/* The index from the ring's head of the command `event` (or with NULL: pushed under `tag`) that
   a poll may wait for: fewer than CLQ_POLL_AHEAD commands and no urgent one ahead of it; -1 if
   none (caller holds the lock). */
static long clq_pollable(clq_t *q, cl_event event, int64_t tag) {
    size_t ahead = 0;
    for (; ahead < q->count && ahead < CLQ_POLL_AHEAD; ahead++) {
        struct slot *s = &q->ring[(q->head + ahead) % q->cap];
        if (event ? s->event == event : s->tag == tag) return (long)ahead;
        if (s->urgent) return -1;
    }
    return -1;
}

static int clq_end_claim(clq_t *q, int64_t claim);

/* Whether the command `ahead` commands from the ring's head is the newest one handed over
   and a repeat launch (handed over with its Signal, clq_hand): a launch awaited as soon as it
   was made, whose queue's next command goes to the device at once (see "Gates" in clq.c). */
static int clq_newest_launch(clq_t *q, long ahead) {
    return (size_t)ahead + 1 == q->count && q->ring[(q->head + (size_t)ahead) % q->cap].obj != NULL;
}

/* A caller about to poll for a command (as clq_poll: its event at `event_address`, or with 0
   the one pushed under `tag`) after something else first (the loop thread's checkpoint): the
   command's batch goes to the device now, and the waiter leaves completed events to the
   caller's clq_poll for `ns` at most. Returns the claim's number (positive: the caller hands it
   to the clq_poll or the clq_unclaim that ends it, once), or 0 (nothing done: no such command
   the poll could wait for). Claims are counted; once the latest one's time passed, the next
   claim counts none of them any more (one whose caller raised before its poll ends there), and
   ending one of those is a no-op, so a late poll never ends a newer claim. A claim of the
   newest command handed over, a repeat launch, takes over the claim of its direct launch if
   that one still counts (its number is returned), and sets `direct` (see "Gates" in clq.c);
   a claim of another command ends that claim. */
int64_t clq_claim(clq_t *q, uintptr_t event_address, int64_t tag, long ns) {
    if (clq_forked(q)) return 0;
    struct timespec due;
    clq_after(&due, ns);
    int64_t out = 0;
    pthread_mutex_lock(&q->lock);
    long ahead = clq_pollable(q, (cl_event)event_address, tag);
    if (ahead >= 0) {
        int newest = clq_newest_launch(q, ahead);
        int64_t adopt = newest ? q->direct_claim : 0;
        if (!adopt) clq_end_direct(q); /* (this claim keeps the waiter off instead) */
        out = clq_count_claim(q, &due, adopt);
        q->direct_claim = 0; /* (taken over, or ended above) */
        atomic_store(&q->directed, 0);
        q->direct = newest;
        clq_open_locked(q); /* (the waiter needs no wake-up: it leaves the command to the caller) */
    }
    pthread_mutex_unlock(&q->lock);
    return out;
}

/* Count a claim lasting until `due` at least (caller holds the lock) and return its number; or
   with `adopt`, the number of a claim counted before (a direct launch's, see clq_gate), which
   counts on with that time if it still counts. Once the latest claim's time passed, the next
   one counts none of the earlier ones any more. */
CLQ_HIDDEN int64_t clq_count_claim(clq_t *q, const struct timespec *due, int64_t adopt) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    if (q->claims && !clq_before(&now, &q->claim_due)) {
        q->claims = 0;
        q->claim_floor = q->claim_last;
    }
    if (!q->claims || clq_before(&q->claim_due, due)) q->claim_due = *due;
    if (adopt > q->claim_floor) return adopt;
    q->claims++;
    return ++q->claim_last;
}

/* End claim `claim` (caller holds the lock): 1 if it still counted. */
static int clq_end_claim(clq_t *q, int64_t claim) {
    if (claim <= q->claim_floor || q->claims <= 0) return 0;
    q->claims--;
    return 1;
}

/* Wake the threads waiting for the token itself (the waiter or a poller that must take
   events), and the waiter waiting for claims to end (clq_wait_token) only while the ring holds
   events: after a round trip's poll took its own command the ring is empty, and a waiter woken
   then would only find the event it looked at gone and nap again (caller holds the lock); it
   finds that at the end of its nap instead. Woken at every poll and report, it cost a wake-up
   across cores and the lock's contention, ~4 us of the awaits it met, in runs of a few dozen
   round trips until it once found the ring empty. */
CLQ_HIDDEN void clq_wake_takers(clq_t *q) {
    if (q->token_waits) pthread_cond_broadcast(&q->token);
    if (q->claim_wait && q->count > 0) pthread_cond_signal(&q->more);
}

/* End the claim of the direct launch whose await's claim has not taken it over, if any
   (caller holds the lock; see clq_gate). */
CLQ_HIDDEN void clq_end_direct(clq_t *q) {
    if (q->direct_claim && clq_end_claim(q, q->direct_claim))
        clq_wake_takers(q); /* (a waiter waiting for the claim's end looks again) */
    q->direct_claim = 0;
    atomic_store(&q->directed, 0);
}

/* End claim `claim` without polling (its caller gave up): the waiter goes on at once. */
void clq_unclaim(clq_t *q, int64_t claim) {
    if (clq_forked(q)) return;
    pthread_mutex_lock(&q->lock);
    clq_end_claim(q, claim);
    clq_wake_takers(q);
    pthread_cond_signal(&q->more); /* (it may be timing a gate the claim set: it looks again) */
    pthread_mutex_unlock(&q->lock);
}

/* The poller's side of two takers (see the top of the file): wait in the calling thread, at
   most `ns`, for the event at `event_address` (a command's, handed over with clq_push, which
   the caller keeps alive), or with `event_address` 0 for the event pushed under `tag`, with
   fewer than CLQ_POLL_AHEAD commands ahead of it in the ring (any other returns 0 at once),
   to complete, opening the gate of its batch first; then take the completed prefix of the
   ring, at most `max` events, up to the first urgent one, as clq_wait() reports them. Returns
   the number taken (the caller reports them, then calls clq_reported), or 0 (nothing taken:
   the event did not complete in time, the waiter took it, or the prefix starts with an
   urgent event; nothing to report). `claim`: the number of the caller's clq_claim() that ends
   here, or 0. A poll for the newest command handed over, a repeat launch, sets `direct`, and
   without a claim that still counts also ends that command's direct claim (clq.c, "Gates"). */
int clq_poll(clq_t *q, uintptr_t event_address, int64_t tag, long ns, int64_t claim, int max, int32_t *status,
             double *seconds, int64_t *tags, void **objs) {
    cl_event event = (cl_event)event_address;
    if (clq_forked(q)) return 0;
    struct timespec due, now;
    clq_after(&due, ns);
    pthread_mutex_lock(&q->lock);
    int claimed = claim && clq_end_claim(q, claim); /* (the token wait below decides meanwhile) */
    long ahead = max < 1 ? -1 : clq_pollable(q, event, tag);
    if (ahead < 0) {
        if (claimed) clq_wake_takers(q);
        pthread_mutex_unlock(&q->lock);
        return 0;
    }
    int retained = !event;
    if (retained) { /* (found by its tag: this call keeps it alive while it spins) */
        event = q->ring[(q->head + (size_t)ahead) % q->cap].event;
        q->retain(event);
    }
    q->direct = clq_newest_launch(q, ahead);
    if (!claimed && q->direct) clq_end_direct(q); /* (this poll takes it) */
    q->poller++; /* (the waiter leaves the event it woke for to this call) */
    clq_open_locked(q);
    pthread_mutex_unlock(&q->lock);
    cl_int st = 1;
    int completed = 0;
    for (;;) {
        if (q->event_info(event, CL_EVENT_COMMAND_EXECUTION_STATUS, sizeof st, &st, NULL) != 0 || st <= 0) {
            completed = 1;
            break;
        }
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (!clq_before(&now, &due)) break;
        sched_yield(); /* (the driver's worker may need this core: on 2 cores it often does) */
    }
    int done = 0;
    pthread_mutex_lock(&q->lock);
    if (completed) {
        clq_after(&due, ns); /* (the waiter gives the token back once it reported its batch) */
        while (q->taking) {
            pthread_cond_signal(&q->more); /* (a waiter holding results ends its hold) */
            clock_gettime(CLOCK_MONOTONIC, &now);
            if (!clq_before(&now, &due)) break;
            q->token_waits++;
            int late = pthread_cond_timedwait(&q->token, &q->lock, &due) != 0;
            q->token_waits--;
            if (late) break;
        }
        if (!q->taking) {
            q->taking = CLQ_POLLER;
            cl_event taken = NULL; /* (released once its slot is gone, as in clq_wait) */
            while (done < max && q->count > 0 && !q->ring[q->head].urgent) {
                struct slot s = q->ring[q->head];
                pthread_mutex_unlock(&q->lock);
                if (taken) q->release(taken);
                taken = NULL;
                int completed_too = clq_read(q, s.event, &status[done], &seconds[done]);
                pthread_mutex_lock(&q->lock);
                if (!completed_too) break;
                q->head = (q->head + 1) % q->cap;
                q->count--;
                taken = s.event;
                if (s.event == q->looked_at) q->looked_at = NULL;
                tags[done] = s.tag;
                objs[done++] = s.obj;
            }
            if (taken) {
                pthread_mutex_unlock(&q->lock);
                q->release(taken);
                pthread_mutex_lock(&q->lock);
            }
            if (done == 0) {
                q->taking = 0;
            } else {
                q->polled = done;
                q->poll_owner = pthread_self();
            }
        }
    }
    q->poller--;
    clq_wake_takers(q);
    pthread_mutex_unlock(&q->lock);
    if (retained) q->release(event);
    return done;
}

/* How many events the calling thread's last clq_poll() took that it has not reported yet
   (clq_reported), 0 if none: its caller reports them even when an exception (a signal
   handler's) came between the call and its own reading of the result. */
int clq_polled(clq_t *q) {
    if (clq_forked(q)) return 0; /* a forked child: the parent's waiter may have held the lock */
    pthread_mutex_lock(&q->lock);
    int n = q->polled && pthread_equal(q->poll_owner, pthread_self()) ? q->polled : 0;
    pthread_mutex_unlock(&q->lock);
    return n;
}

/* The events a clq_wait() or clq_poll() call took are reported: the token goes back. */
void clq_reported(clq_t *q) {
    pthread_mutex_lock(&q->lock);
    q->polled = 0;
    q->taking = 0;
    clq_wake_takers(q);
    pthread_mutex_unlock(&q->lock);
}

/* The claims no poll or clq_unclaim ended yet (tests). */
int clq_claims(clq_t *q) {
    if (clq_forked(q)) return 0;
    pthread_mutex_lock(&q->lock);
    int n = q->claims;
    pthread_mutex_unlock(&q->lock);
    return n;
}

