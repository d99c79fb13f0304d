/* The poll of a CL queue's awaiting thread in C, with its report (aiotinyrt/backends/cl_queue.py;
   the ring's side is clq_poll.c): cl_poll() is CLQueue.poll in one call, and reports a round
   trip's repeat launch in the common case (report_direct); cl_claim() and cl_poll_for() are
   the timeline's claim and poll for a repeat launch, one C call each, the poll returning the
   launch's device time when it reported it. The repeat launch itself, and cl_done() for the
   waiter's reports, are clfast.c's. */
#include "pyext.h"

#include "clq.h"

/* 1 unless the timeline's waiters (`heap`: Timeline._heap, a heap of (value, seq, waiter)) are
   all for values after `last`; 1 too for anything not so read. */
static int waiter_due(PyObject *heap, long long last) {
    if (!heap || !PyList_CheckExact(heap)) return 1;
    if (PyList_GET_SIZE(heap) == 0) return 0;
    PyObject *top = PyList_GET_ITEM(heap, 0);
    if (!PyTuple_CheckExact(top) || PyTuple_GET_SIZE(top) < 1 || !PyLong_CheckExact(PyTuple_GET_ITEM(top, 0)))
        return 1;
    long long value = PyLong_AsLongLong(PyTuple_GET_ITEM(top, 0));
    if (value == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 1;
    }
    return value <= last;
}

/* 0 if DEBUG is unset, empty or "0" in os.environ as Python reads it (helpers.environ_get: the
   mapping's own dict of encoded names), 1 otherwise, or when os.environ is not an os._Environ
   (a test replaced it with another mapping) or cannot be read so: Python's path decides. (The
   mapping of the moment, by its class: one replaced when this module was configured and put
   back since must not turn the C report off for good.) `os.environ` is read from the module's
   dict at each call; its `_data` is kept for as long as it is the same mapping (an _Environ
   never rebinds it): per report, a dict lookup and a comparison, not two attribute lookups
   (a fifth of the report's time). */
static PyObject *seen_environ, *seen_data; /* (strong references) */

/* 1 with `*raw` the encoded value of `name` in os.environ (borrowed; NULL: unset), 0 when it
   cannot be read so (not an os._Environ, or an error, cleared). */
static int environ_value(PyObject *name, PyObject **raw) {
    PyObject *environ = PyDict_GetItemWithError(PyModule_GetDict(os_module), s_environ); /* borrowed */
    if (!environ || (PyObject *)Py_TYPE(environ) != environ_type) {
        PyErr_Clear();
        return 0;
    }
    if (environ != seen_environ) {
        PyObject *data = PyObject_GetAttr(environ, s_data);
        if (!data || !PyDict_CheckExact(data)) {
            Py_XDECREF(data);
            PyErr_Clear();
            return 0;
        }
        Py_INCREF(environ);
        Py_XSETREF(seen_environ, environ);
        Py_XSETREF(seen_data, data);
    }
    *raw = PyDict_GetItemWithError(seen_data, name);
    if (!*raw && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return 1;
}

static int debug_may_log(void) {
    PyObject *raw;
    if (!environ_value(b_debug, &raw)) return 1;
    return raw && (!PyBytes_CheckExact(raw) ||
                   (PyBytes_GET_SIZE(raw) != 0 && strcmp(PyBytes_AS_STRING(raw), "0") != 0));
}

/* The report of DriverQueue._report_run's common case in C, for the `n` entries a poll took:
   a run of repeat launches, each completed without error, next in line on a queue with
   nothing else to complete, no waiter of its timeline due by the last of them, no sticky
   error and DEBUG unset or 0 (debug_may_log).
   Returns 1 once they are complete (their Signals' device times stored, what they held
   dropped, `_taken` and the timeline's `completed` moved; `*elapsed`, when given, is set to a
   new reference to the device time of the one tagged `want`, if any), 0 if any of that does
   not hold: nothing was changed, and the caller reports them as any batch (Python's path).

   No Python code runs and the GIL is never let go between the first check and the store of
   `completed`: no other thread can act on the queue or the timeline meanwhile (the checks'
   attributes are plain ones, the timeline's waiters a __slots__ member; nothing allocated
   there is tracked by the cyclic collector). A thread inside a section of the queue's done
   lock, preempted there, holds the lock: the call declines then. A thread preempted inside
   Timeline.add_waiter has pushed its waiter (seen here) or reads `completed` after this store
   (and fires itself), as with Timeline.advance. What the Signals held is released last (that may run Python code). */
static int report_direct(PyObject *settle, PyObject **objs, const int64_t *tags, const int32_t *status,
                         const double *seconds, int n, int64_t want, PyObject **elapsed) {
    PyObject *dq = PyTuple_GET_ITEM(settle, 5), *done_lock = PyTuple_GET_ITEM(settle, 6);
    PyObject *timeline = PyTuple_GET_ITEM(settle, 7), *counters = PyTuple_GET_ITEM(settle, 8);
    PyObject *device = PyTuple_GET_ITEM(settle, 9);
    if (n < 1 || n > 256 || !dq_type || !PyObject_TypeCheck(dq, dq_type)) return 0;
    for (int k = 0; k < n; k++)
        if (tags[k] >= 0 || status[k] != 0 || (k > 0 && tags[k] != tags[k - 1] - 1)) return 0;
    if (debug_may_log()) return 0; /* (DEBUG >= 2 logs each completion: Python's path) */
    long long first = -tags[0], last = -tags[n - 1];
    PyObject *last_obj = PyLong_FromLongLong(last);
    if (!last_obj) {
        PyErr_Clear();
        return 0;
    }
    if (lock_try(done_lock) != 1) { /* (0: held, by another thread or inside a section of this one) */
        Py_DECREF(last_obj);
        return 0;
    }
    PyObject *results = DQ(dq, off_dq_results), *runs = DQ(dq, off_dq_runs), *enqueuing = DQ(dq, off_dq_enqueuing);
    int ok = DQ(dq, off_dq_advancing) == Py_False && results && PyDict_CheckExact(results) &&
             PyDict_GET_SIZE(results) == 0 && runs && PyDict_CheckExact(runs) && PyDict_GET_SIZE(runs) == 0 &&
             enqueuing && PyLong_CheckExact(enqueuing) &&
             PyLong_AsUnsignedLongMask(enqueuing) != PyThread_get_thread_ident() &&
             device_is(device, 0, Py_None) == 1;
    PyObject *completed = NULL;
    if (ok && members_of(&counters_members, counters, "completed", "submitted")) {
        completed = SLOT(counters, counters_members.off[0]);
        Py_XINCREF(completed);
    } else if (ok) {
        completed = PyObject_GetAttr(counters, s_completed);
    }
    ok = completed && PyLong_CheckExact(completed) && PyLong_AsLongLong(completed) + 1 == first;
    Py_XDECREF(completed);
    ok = ok && !waiter_due(SLOT(timeline, off_t_heap), last);
    if (ok) {
        Py_INCREF(last_obj);
        set_slot(dq, off_dq_taken, last_obj); /* (the old value: an int, no code runs) */
    }
    if (!ok) {
        PyErr_Clear();
        lock_release(done_lock);
        Py_DECREF(last_obj);
        return 0;
    }
    PyObject *dropped[256 * DROPPED];
    for (int k = 0; k < n; k++) {
        signal_done(objs[k], seconds[k], &dropped[k * DROPPED]);
        if (tags[k] == want && elapsed) {
            *elapsed = SLOT(objs[k], off_elapsed);
            Py_INCREF(*elapsed);
        }
    }
    counters_set(counters, 0, last_obj);
    lock_release(done_lock);
    Py_DECREF(last_obj);
    for (int k = 0; k < n * DROPPED; k++) Py_XDECREF(dropped[k]);
    for (int k = 0; k < n; k++) Py_DECREF(objs[k]); /* (the ring's references) */
    return 1;
}

/* The arrays a poll reads a batch into (settle's addresses: objects, tags, statuses, times). */
typedef struct {
    PyObject **objs;
    int64_t *tags;
    int32_t *status;
    double *seconds;
} taken_t;

/* The arrays of `settle` into `t`; -1 with an error set (`who` names the caller). */
static int settle_arrays(PyObject *settle, taken_t *t, const char *who) {
    t->objs = PyLong_AsVoidPtr(PyTuple_GET_ITEM(settle, 1));
    t->tags = PyLong_AsVoidPtr(PyTuple_GET_ITEM(settle, 2));
    t->status = PyLong_AsVoidPtr(PyTuple_GET_ITEM(settle, 3));
    t->seconds = PyLong_AsVoidPtr(PyTuple_GET_ITEM(settle, 4));
    if (PyErr_Occurred()) return -1;
    if (!t->objs || !t->tags || !t->status || !t->seconds) {
        PyErr_Format(PyExc_ValueError, "%s: NULL array", who);
        return -1;
    }
    return 0;
}

/* clq_poll() into `t` with the GIL let go while it waits: the number of events taken. */
static int poll_taken(clq_t *ring, uintptr_t event, int64_t tag, long ns, int64_t claim, taken_t *t) {
    int taken;
    Py_BEGIN_ALLOW_THREADS
    taken = clq_poll(ring, event, tag, ns, claim, 256, t->status, t->seconds, t->tags, (void **)t->objs);
    Py_END_ALLOW_THREADS
    return taken;
}

/* cl_poll(settle, event, tag, ns, claim): CLQueue.poll in one call. clq_poll() (the GIL let go
   while it waits) with the queue's arrays, then, when what it took is the common case of a
   round trip (report_direct), its report. settle: (ring, objs, tags, status, seconds (the
   addresses), DriverQueue, its done lock, Timeline, the timeline's counters, device). Returns
   (n, first, last): n the events the poll took that the caller reports itself, then calls
   clq_reported() (0: none, or reported here); first..last the values reported here (0, 0:
   none). */
PyObject *py_cl_poll(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 5 || !PyTuple_CheckExact(args[0]) || PyTuple_GET_SIZE(args[0]) != 10) {
        PyErr_SetString(PyExc_TypeError, "cl_poll(settle, event, tag, ns, claim)");
        return NULL;
    }
    PyObject *settle = args[0];
    clq_t *ring = PyLong_AsVoidPtr(PyTuple_GET_ITEM(settle, 0));
    uintptr_t event = (uintptr_t)PyLong_AsVoidPtr(args[1]);
    long long tag = PyLong_AsLongLong(args[2]), claim = PyLong_AsLongLong(args[4]);
    long ns = PyLong_AsLong(args[3]);
    taken_t t;
    if (PyErr_Occurred() || settle_arrays(settle, &t, "cl_poll") < 0) return NULL;
    if (!ring) {
        PyErr_SetString(PyExc_ValueError, "cl_poll: NULL ring");
        return NULL;
    }
    long long first = 0, last = 0;
    int taken = poll_taken(ring, event, tag, ns, claim, &t);
    if (taken > 0) {
        first = -t.tags[0], last = -t.tags[taken - 1];
        if (report_direct(settle, t.objs, t.tags, t.status, t.seconds, taken, 0, NULL)) {
            clq_reported(ring);
            taken = 0;
        } else {
            first = last = 0;
        }
    }
    return Py_BuildValue("(iLL)", taken, first, last);
}

/* A CL queue's Timeline.claim and Timeline.poll in one C call each: what DriverQueue._claim
   and CLQueue.claim, or DriverQueue._poll and CLQueue.poll (with cl_poll), do for a command
   the DriverQueue keeps no event of (a repeat launch: the ring finds it by its tag), without
   their Python frames. CLQueue.attach binds them to `hooks` with functools.partial: (settle as
   cl_poll's, the CLQueue, the DriverQueue's events, cl_queue's module dict), and for tests a
   fifth item, called as f(first, last) after each report cl_poll_for makes in C. A command
   whose event the DriverQueue keeps goes to CLQueue.claim and CLQueue.poll with it. */
static PyObject *s_ring, *s_poll_ns, *s_claim_ns, *s_claim, *s_poll, *s_report_polled;

/* How many calls of CLQueue._report_polled a report left to Python gets (see cl_poll_for). */
#define REPORT_TRIES 4

/* The parts of `hooks` (borrowed) and the command `value`'s event the DriverQueue keeps (a new
   reference, NULL: none); -1 with an error set. */
static int hooks_parts(PyObject *hooks, PyObject *value, PyObject **settle, PyObject **driver, PyObject **event) {
    if (!PyTuple_CheckExact(hooks) || PyTuple_GET_SIZE(hooks) < 4 || PyTuple_GET_SIZE(hooks) > 5 ||
        !PyTuple_CheckExact(PyTuple_GET_ITEM(hooks, 0)) ||
        PyTuple_GET_SIZE(PyTuple_GET_ITEM(hooks, 0)) != 10 || !PyDict_CheckExact(PyTuple_GET_ITEM(hooks, 2)) ||
        !PyDict_CheckExact(PyTuple_GET_ITEM(hooks, 3)) || !PyLong_CheckExact(value)) {
        PyErr_SetString(PyExc_TypeError, "cl_claim/cl_poll_for((settle, CLQueue, events, globals), value, ...)");
        return -1;
    }
    if (!s_report_polled) {
        PyObject **names[] = {&s_ring, &s_poll_ns, &s_claim_ns, &s_claim, &s_poll, &s_report_polled};
        const char *text[] = {"_ring", "_poll_ns", "_CLAIM_NS", "claim", "poll", "_report_polled"};
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
            if (!*names[i] && !(*names[i] = PyUnicode_InternFromString(text[i]))) return -1;
    }
    *settle = PyTuple_GET_ITEM(hooks, 0);
    *driver = PyTuple_GET_ITEM(hooks, 1);
    *event = PyDict_GetItemWithError(PyTuple_GET_ITEM(hooks, 2), value);
    if (!*event && PyErr_Occurred()) return -1;
    Py_XINCREF(*event);
    return 0;
}

/* The CLQueue's ring (NULL: closed) and poll time (CLQueue._poll_ns, read at each call: tests
   change it); -1 with an error set. */
static int ring_and_poll(PyObject *settle, PyObject *driver, clq_t **ring, long *ns) {
    PyObject *ring_obj, *poll_ns;
    if (members_of(&driver_members, driver, "_ring", "_poll_ns")) {
        ring_obj = SLOT(driver, driver_members.off[0]), poll_ns = SLOT(driver, driver_members.off[1]);
        if (!ring_obj || !poll_ns) {
            PyErr_SetString(PyExc_AttributeError, "CLQueue._ring or _poll_ns not set");
            return -1;
        }
        Py_INCREF(ring_obj), Py_INCREF(poll_ns);
    } else {
        ring_obj = PyObject_GetAttr(driver, s_ring);
        poll_ns = ring_obj ? PyObject_GetAttr(driver, s_poll_ns) : NULL;
        if (!poll_ns) {
            Py_XDECREF(ring_obj);
            return -1;
        }
    }
    *ring = ring_obj == Py_None ? NULL : PyLong_AsVoidPtr(PyTuple_GET_ITEM(settle, 0));
    *ns = PyLong_AsLong(poll_ns);
    Py_DECREF(ring_obj), Py_DECREF(poll_ns);
    return PyErr_Occurred() ? -1 : 0;
}

/* cl_claim(hooks, value): Timeline.claim (CLQueue.claim: the claim's number, or 0). */
PyObject *py_cl_claim(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "cl_claim(hooks, value)");
        return NULL;
    }
    PyObject *settle, *driver, *event;
    if (hooks_parts(args[0], args[1], &settle, &driver, &event) < 0) return NULL;
    if (event) {
        PyObject *out = PyObject_CallMethodObjArgs(driver, s_claim, args[1], event, NULL);
        Py_DECREF(event);
        return out;
    }
    clq_t *ring;
    long ns;
    if (ring_and_poll(settle, driver, &ring, &ns) < 0) return NULL;
    if (!ring || ns <= 0) return PyLong_FromLong(0);
    PyObject *claim_ns = PyDict_GetItemWithError(PyTuple_GET_ITEM(args[0], 3), s_claim_ns); /* (tests set it) */
    long claim_for = claim_ns ? PyLong_AsLong(claim_ns) : -1;
    long long v = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (!claim_ns || claim_for < 0) {
        PyErr_SetString(PyExc_ValueError, "cl_claim: no _CLAIM_NS, or a negative one");
        return NULL;
    }
    if (v < 1) return PyLong_FromLong(0); /* (value 0: done before anything was submitted) */
    return PyLong_FromLongLong(clq_claim(ring, 0, -v, claim_for));
}

/* cl_poll_for(hooks, value, claim=0): Timeline.poll (CLQueue.poll). Returns the device time of
   command `value` when this call reported it in C (it completed without error: the awaiting
   task returns it as it is), else None (whatever happened: reported by Python's path, by the
   waiter, or not completed yet; the caller looks at the timeline). */
PyObject *py_cl_poll_for(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 2 && n != 3) {
        PyErr_SetString(PyExc_TypeError, "cl_poll_for(hooks, value, claim=0)");
        return NULL;
    }
    PyObject *settle, *driver, *event;
    if (hooks_parts(args[0], args[1], &settle, &driver, &event) < 0) return NULL;
    PyObject *claim_obj = n == 3 ? args[2] : zero;
    if (event) {
        PyObject *out = PyObject_CallMethodObjArgs(driver, s_poll, args[1], event, claim_obj, NULL);
        Py_DECREF(event);
        if (!out) return NULL;
        Py_DECREF(out);
        Py_RETURN_NONE;
    }
    long long v = PyLong_AsLongLong(args[1]), claim = PyLong_AsLongLong(claim_obj);
    clq_t *ring;
    long ns;
    if (PyErr_Occurred() || ring_and_poll(settle, driver, &ring, &ns) < 0) return NULL;
    if (!ring || v < 1) Py_RETURN_NONE; /* (value 0: done before anything was submitted) */
    if (ns <= 0) {
        if (claim) clq_unclaim(ring, claim);
        Py_RETURN_NONE;
    }
    taken_t t;
    if (settle_arrays(settle, &t, "cl_poll_for") < 0) return NULL;
    int taken = poll_taken(ring, 0, -v, ns, claim, &t);
    if (taken <= 0) Py_RETURN_NONE;
    PyObject *elapsed = NULL;
    if (report_direct(settle, t.objs, t.tags, t.status, t.seconds, taken, -v, &elapsed)) {
        int spied = PyTuple_GET_SIZE(args[0]) == 5;
        PyObject *seen = NULL;
        if (spied) /* (a test's: before the token goes back, so in order) */
            seen = PyObject_CallFunction(PyTuple_GET_ITEM(args[0], 4), "LL", (long long)-t.tags[0],
                                         (long long)-t.tags[taken - 1]);
        clq_reported(ring);
        if (spied && !seen) {
            Py_XDECREF(elapsed);
            return NULL;
        }
        Py_XDECREF(seen);
        if (elapsed) return elapsed;
        Py_RETURN_NONE;
    }
    /* Python's path reports them and gives the ring's token back (CLQueue._report_polled). An
       exception raised before that report began (a signal handler's, as the frame starts)
       leaves them taken and the token held (clq_polled still counts them): they are
       reported again with that exception put aside (up to REPORT_TRIES calls in all; one that
       keeps failing so, written as unraisable, leaves the queue's completions stuck, as a
       report that raises in Python does anywhere), then it is raised. */
    PyObject *count = PyLong_FromLong(taken);
    PyObject *out = count ? PyObject_CallMethodObjArgs(driver, s_report_polled, count, NULL) : NULL;
    if (!out && count && clq_polled(ring) == taken) {
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        for (int tries = 1; tries < REPORT_TRIES && clq_polled(ring) == taken; tries++) {
            PyObject *again = PyObject_CallMethodObjArgs(driver, s_report_polled, count, NULL);
            if (!again) PyErr_WriteUnraisable(driver);
            Py_XDECREF(again);
        }
        PyErr_Restore(type, exc, tb);
    }
    Py_XDECREF(count);
    if (!out) {
        if (!count) clq_reported(ring); /* (no memory even for that: the token goes back, what was taken is lost) */
        return NULL;
    }
    Py_DECREF(out);
    Py_RETURN_NONE;
}
