/* The repeat launch of a CL program (aiotinyrt/backends/ops_cl.py) and the report of those
   launches' completion, in C.

   A launch of a CL program with the buffers of a launch remembered by Program._remember, each
   holding the same memory and last touched by the program's queue only, while the kernel's
   arguments are still set to them, needs no hazard, no wait list and no clSetKernelArg: it is
   one clEnqueueNDRangeKernel (waiting for the ring's gate when it opens a batch), its event
   and its Signal handed to the queue's completion ring (clq.c) under the tag -value, and the
   Signal's access records. Nothing else is made per launch: the DriverQueue keeps no record of
   such a command (no Completion, no entry in its tables, no event object; DriverQueue._event
   finds a pending one's event in the ring), and the GIL is held throughout. cl_launch_impl()
   does that; Python's path (DriverQueue.submit, CLQueue.enqueue, CLProgram._enqueue) costs
   ~12 us per launch, this one about PoCL's enqueue and a few hundred nanoseconds.

   It declines (returns None, having changed nothing: Python launches it) whenever those would
   do anything else: the queue stopping or holding commands back, the device holding its sticky
   error, a hand-over or an argument change under way (their locks, lock.c, are taken without
   waiting), the kernel's arguments set to other buffers or vals, or an enqueue that failed
   (Python's then meets the same error and reports it).

   cl_done() is the other half: the queue's waiter (or a poll) took a batch from the ring, and
   for a run of such launches that completed, with consecutive values, it stores each one's
   device time in its Signal, drops what the Signal held for the command and hands the Signals
   to Python in one list (CLQueue._report_taken: DriverQueue._report_run). cl_poll() is the
   awaiting thread's poll (CLQueue.poll) in one call, with the report of a round trip's
   launch in C in the common case (report_direct): the rest of a round trip is this much
   Python less. */
#include "pyext.h"

#include "clq.h"

typedef int32_t cl_int;
typedef cl_int (*enqueue_fn)(void *, void *, uint32_t, const size_t *, const size_t *, const size_t *, uint32_t,
                             void *const *, void **);
typedef cl_int (*release_fn)(void *);
typedef cl_int (*wait_fn)(uint32_t, void *const *);

static enqueue_fn cl_enqueue;
static release_fn cl_release;
static wait_fn cl_wait;
static PyObject *completion_type;
static Py_ssize_t off_fn, off_args, off_deps, off_keep, off_t_heap;
static PyObject *float_zero, *empty_tuple;
static PyObject *os_module, *environ_type, *s_environ, *s_data, *b_debug; /* (environ_value) */
static PyObject *s_error, *s_submitted, *s_commands, *s_bufs, *s_vals, *s_name, *s_closed, *s_completed, *s_heap;

/* The DriverQueue class and the offsets of the __slots__ members C reads and writes (a queue
   of another class is left to Python). */
static PyTypeObject *dq_type;
static Py_ssize_t off_dq_advancing, off_dq_enqueuing, off_dq_held, off_dq_next, off_dq_results, off_dq_runs,
    off_dq_stopping, off_dq_taken;

/* A DriverQueue's member at `off` (borrowed; NULL if never assigned). */
#define DQ(dq, off) SLOT(dq, off)

/* The offsets of two object members of a class with __slots__ (the CLQueue's `_ring` and
   `_poll_ns`, the timeline counters' `completed` and `submitted`), found at the first object
   of that class seen; 1 if `obj` is of that class, 0 if its class has no such members (the
   caller reads them by name). */
typedef struct {
    PyTypeObject *type; /* (a strong reference) */
    Py_ssize_t off[2];
} members_t;

static int members_of(members_t *m, PyObject *obj, const char *first, const char *second) {
    PyTypeObject *type = Py_TYPE(obj);
    if (type == m->type) return 1;
    Py_ssize_t a = slot_offset(type, first), b = a < 0 ? -1 : slot_offset(type, second);
    if (b < 0) {
        PyErr_Clear();
        return 0;
    }
    Py_INCREF(type);
    Py_XSETREF(m->type, type);
    m->off[0] = a, m->off[1] = b;
    return 1;
}

static members_t counters_members, driver_members;

/* Set the timeline counters' `completed` (which 0) or `submitted` (1) to `value`. */
static void counters_set(PyObject *counters, int which, PyObject *value) {
    if (members_of(&counters_members, counters, "completed", "submitted")) {
        Py_INCREF(value);
        set_slot(counters, counters_members.off[which], value); /* (the old value: an int) */
    } else if (PyObject_SetAttr(counters, which ? s_submitted : s_completed, value) < 0) {
        PyErr_WriteUnraisable(counters);
    }
}

/* cl_configure(Completion, DriverQueue, enqueue, release, wait) after configure(): the
   DriverQueue's Completion class, the DriverQueue class, and the ICD loader's
   clEnqueueNDRangeKernel, clReleaseEvent and clWaitForEvents (addresses). */
PyObject *py_cl_configure(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 5 || !PyType_Check(args[0]) || !PyType_Check(args[1]) || !sig_type) {
        PyErr_SetString(PyExc_TypeError,
                        "cl_configure(Completion, DriverQueue, enqueue, release, wait) after configure()");
        return NULL;
    }
    PyTypeObject *qt = (PyTypeObject *)args[1];
    const struct {
        Py_ssize_t *off;
        const char *name;
    } members[] = {
        {&off_dq_advancing, "_advancing"}, {&off_dq_enqueuing, "_enqueuing"}, {&off_dq_held, "_held"},
        {&off_dq_next, "_next"},           {&off_dq_results, "_results"},     {&off_dq_runs, "_runs"},
        {&off_dq_stopping, "_stopping"},   {&off_dq_taken, "_taken"},
    };
    for (size_t i = 0; i < sizeof members / sizeof members[0]; i++)
        if ((*members[i].off = slot_offset(qt, members[i].name)) < 0) return NULL;
    void *enqueue = PyLong_AsVoidPtr(args[2]), *release = PyLong_AsVoidPtr(args[3]);
    void *wait = PyLong_AsVoidPtr(args[4]);
    if (PyErr_Occurred()) return NULL;
    if (!enqueue || !release || !wait) {
        PyErr_SetString(PyExc_ValueError, "cl_configure: NULL entry point");
        return NULL;
    }
    if ((off_fn = slot_offset(sig_type, "_fn")) < 0 || (off_args = slot_offset(sig_type, "_args")) < 0 ||
        (off_deps = slot_offset(sig_type, "_deps")) < 0 || (off_keep = slot_offset(sig_type, "_keep")) < 0 ||
        (off_t_heap = slot_offset(timeline_type, "_heap")) < 0)
        return NULL;
    if (!empty_tuple) { /* (the last of these made: a failure part way is tried again) */
        PyObject **names[] = {&s_error, &s_submitted, &s_commands, &s_bufs, &s_vals,
                              &s_name,  &s_closed,    &s_completed, &s_heap};
        const char *text[] = {"_error", "submitted", "_commands", "_bufs", "_vals",
                              "name",   "_closed",   "completed", "_heap"};
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
            if (!*names[i] && !(*names[i] = PyUnicode_InternFromString(text[i]))) return NULL;
        if ((!os_module && !(os_module = PyImport_ImportModule("os"))) ||
            (!environ_type && !(environ_type = PyObject_GetAttrString(os_module, "_Environ"))) ||
            (!s_environ && !(s_environ = PyUnicode_InternFromString("environ"))) ||
            (!s_data && !(s_data = PyUnicode_InternFromString("_data"))) ||
            (!b_debug && !(b_debug = PyBytes_FromString("DEBUG"))))
            return NULL;
        if ((!float_zero && !(float_zero = PyFloat_FromDouble(0.0))) || !(empty_tuple = PyTuple_New(0)))
            return NULL;
    }
    Py_INCREF(args[0]);
    Py_XSETREF(completion_type, args[0]);
    Py_INCREF(args[1]);
    Py_XSETREF(dq_type, qt);
    cl_enqueue = (enqueue_fn)enqueue;
    cl_release = (release_fn)release;
    cl_wait = (wait_fn)wait;
    Py_RETURN_NONE;
}

/* 1 if `obj.name` is `want` (0 if not, -1 on error). */
static int attr_is(PyObject *obj, PyObject *name, PyObject *want) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    int out = v == want;
    Py_DECREF(v);
    return out;
}

/* 1 if DriverQueue `dq` of `device` would hand a command to its driver at once: not stopping,
   holding nothing back, its device open and without a sticky error; 0 if not (or not a
   DriverQueue with its members set); -1 on error. */
static int queue_ready(PyObject *dq, PyObject *device) {
    if (!dq_type || !PyObject_TypeCheck(dq, dq_type)) return 0;
    PyObject *held = DQ(dq, off_dq_held);
    Py_ssize_t len = held ? PyObject_Length(held) : 1;
    int ok = DQ(dq, off_dq_stopping) != Py_False ? 0 : len < 0 ? -1 : len == 0;
    if (ok == 1) ok = attr_is(device, s_error, Py_None);
    if (ok == 1) ok = attr_is(device, s_closed, Py_False);
    return ok;
}

/* 1 if the program's kernel arguments are still `args`' buffers and vals ((gsz, lsz, vals,
   *handles)); 0 if not; -1 on error. */
static int arguments_set(PyObject *prog, PyObject *args) {
    PyObject *bufs = PyObject_GetAttr(prog, s_bufs);
    if (!bufs) return -1;
    Py_ssize_t nb = PyTuple_GET_SIZE(args) - 3;
    int ok = PyTuple_CheckExact(bufs) && PyTuple_GET_SIZE(bufs) == nb;
    for (Py_ssize_t i = 0; ok && i < nb; i++) ok = PyTuple_GET_ITEM(bufs, i) == PyTuple_GET_ITEM(args, 3 + i);
    Py_DECREF(bufs);
    if (!ok) return 0;
    PyObject *vals = PyObject_GetAttr(prog, s_vals);
    if (!vals) return -1;
    PyObject *want = PyTuple_GET_ITEM(args, 2);
    ok = vals == want ? 1 : PyTuple_CheckExact(vals) ? PyObject_RichCompareBool(vals, want, Py_EQ) : 0;
    Py_DECREF(vals);
    return ok;
}

/* The command of `sig` (value `value` of DriverQueue `dq`) is enqueued but its event never
   reached the ring: it fails with MemoryError, reported as Python's path reports a command
   (DriverQueue._commands, a Completion). Errors are written as unraisable. */
static void fail_refused(PyObject *dq, PyObject *driver, PyObject *sig, PyObject *value) {
    PyObject *commands = PyObject_GetAttr(dq, s_commands);
    int ok = commands && PyDict_SetItem(commands, value, sig) == 0;
    Py_XDECREF(commands);
    PyObject *done = ok ? PyObject_CallFunction(completion_type, "OOO", dq, value, float_zero) : NULL;
    PyObject *name = done ? PyObject_GetAttr(driver, s_name) : NULL;
    PyObject *text =
        name ? PyUnicode_FromFormat("%S: no memory for the completion ring (or the queue is closed)", name) : NULL;
    PyObject *exc = text ? PyObject_CallOneArg(PyExc_MemoryError, text) : NULL;
    PyObject *called = exc ? PyObject_CallFunction(done, "OO", float_zero, exc) : NULL;
    if (!called) PyErr_WriteUnraisable(dq);
    Py_XDECREF(called);
    Py_XDECREF(exc);
    Py_XDECREF(text);
    Py_XDECREF(name);
    Py_XDECREF(done);
}

/* The repeat launch: `fast` is CLProgram._fast, (DriverQueue, Timeline, by_bufs, ring address,
   cl_command_queue address, cl_kernel address, CLQueue, the queue's submit Lock, the program's
   argument Lock, the timeline's counters, the device); the entry of `key` in by_bufs is (fn,
   args, None, handles, global size address, local size address or 0), fn(queue, 0, NULL, *args)
   being the launch Python would make. Returns its Signal, None (Python launches it), or NULL
   with an error (nothing enqueued, or: enqueued and tracked, its access records not all
   updated, as launch_impl). */
PyObject *cl_launch_impl(PyObject *prog, PyObject *key, PyObject *bufs, PyObject *fast) {
    if (!cl_enqueue || !PyTuple_CheckExact(fast) || PyTuple_GET_SIZE(fast) != CL_FAST_LEN) Py_RETURN_NONE;
    PyObject *dq = PyTuple_GET_ITEM(fast, 0), *timeline = PyTuple_GET_ITEM(fast, 1);
    PyObject *by_bufs = PyTuple_GET_ITEM(fast, 2), *driver = PyTuple_GET_ITEM(fast, 6);
    PyObject *submit_lock = PyTuple_GET_ITEM(fast, 7), *prog_lock = PyTuple_GET_ITEM(fast, 8);
    PyObject *counters = PyTuple_GET_ITEM(fast, 9), *device = PyTuple_GET_ITEM(fast, 10);
    clq_t *ring = PyLong_AsVoidPtr(PyTuple_GET_ITEM(fast, 3));
    void *cq = PyLong_AsVoidPtr(PyTuple_GET_ITEM(fast, 4)), *kernel = PyLong_AsVoidPtr(PyTuple_GET_ITEM(fast, 5));
    if (PyErr_Occurred()) return NULL;
    if (!ring || !cq || !kernel || !PyDict_CheckExact(by_bufs)) Py_RETURN_NONE;
    PyObject *entry = PyDict_GetItemWithError(by_bufs, key); /* borrowed */
    if (!entry) {
        PyErr_Clear(); /* not cached, or unhashable arguments: Python decides */
        Py_RETURN_NONE;
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 6) Py_RETURN_NONE;
    PyObject *args = PyTuple_GET_ITEM(entry, 1);
    if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != 3 + PyTuple_GET_SIZE(bufs)) Py_RETURN_NONE;
    if (!same_buffers(bufs, PyTuple_GET_ITEM(entry, 3), timeline)) Py_RETURN_NONE;
    const size_t *gsz = PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 4));
    const size_t *lsz = PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry, 5));
    if (PyErr_Occurred()) return NULL;
    if (!gsz) Py_RETURN_NONE;

    /* The Signal is made first, before any lock is taken or any state is read (a collection
       could run Python code). It is never looked at by the cyclic collector while its command
       is pending (thousands at once in a pipeline: each collection of the older generations
       would walk them all); cl_done() or DriverQueue tracks it again once it completed. Nor is
       its keep, the tuple of the launch's buffers, once handed to the ring: tracked, each one
       outlived the young generation's collections while pending and reached the oldest, whose
       collections (a walk of every object of the process) then came every few thousand
       launches, a fifth of a launch's cost; cl_done() tracks it again. */
    Py_INCREF(entry); /* (it holds the global size) */
    PyObject *value = NULL, *next = NULL, *out = NULL;
    PyObject *sig = sig_type->tp_alloc(sig_type, 0);
    int locked = 0, prog_locked = 0, advanced = 0, r = 0;
    if (!sig) goto fail;
    PyObject_GC_UnTrack(sig);
    /* (lock_try: 1 taken now; 0 held, by this thread too: a launch from inside a hand-over) */
    if (lock_try(submit_lock) != 1) goto decline_or_fail;
    locked = 1;
    if ((r = queue_ready(dq, device)) <= 0) goto decline_or_fail;
    if (lock_try(prog_lock) != 1) goto decline_or_fail;
    prog_locked = 1;
    if ((r = arguments_set(prog, args)) <= 0) goto decline_or_fail;
    value = DQ(dq, off_dq_next); /* (a DriverQueue: queue_ready) */
    Py_XINCREF(value);
    if (!value || !PyLong_CheckExact(value)) goto decline_or_fail;
    long long v = PyLong_AsLongLong(value);
    if (v == -1 && PyErr_Occurred()) goto fail;
    if (v < 1 || v == LLONG_MAX) goto decline_or_fail;
    if (!(next = PyLong_FromLongLong(v + 1))) goto fail;

    /* The Signal as DriverQueue.submit makes it (its keep: the buffers). */
    const struct {
        Py_ssize_t off;
        PyObject *value;
    } fields[] = {
        {off_timeline, timeline},
        {off_value, value},
        {off_error, Py_None},
        {off_elapsed, float_zero},
        {off_fn, PyTuple_GET_ITEM(entry, 0)},
        {off_args, args},
        {off_deps, empty_tuple},
        {off_keep, bufs},
    };
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        Py_INCREF(fields[i].value);
        set_slot(sig, fields[i].off, fields[i].value);
    }
    Py_INCREF(next);
    set_slot(dq, off_dq_next, next); /* (the old value: an int, no code runs) */
    advanced = 1;
    void *ev = NULL, *gate = clq_gate(ring); /* (a batch's first command waits for its gate) */
    cl_int code = cl_enqueue(cq, kernel, 3, NULL, gsz, lsz, gate ? 1 : 0, gate ? &gate : NULL, &ev);
    if (gate) cl_release(gate);
    if (code != 0) goto decline_or_fail;

    /* Enqueued: the command is the queue's from here on. The ring takes the event (our
       reference) and a reference to the Signal (cl_done() hands it to Python). */
    counters_set(counters, 1, value);
    Py_INCREF(sig);
    int refused = ev == NULL || clq_hand(ring, ev, -(int64_t)v, sig) != 0;
    if (refused) {
        Py_DECREF(sig);
        if (ev) { /* it fails, but only once the device is done with its memory; the GIL goes
                     meanwhile, and its batch goes to the device */
            Py_BEGIN_ALLOW_THREADS
            clq_open(ring);
            cl_wait(1, &ev);
            Py_END_ALLOW_THREADS
            cl_release(ev);
        }
    } else if (PyObject_GC_IsTracked(bufs)) {
        PyObject_GC_UnTrack(bufs); /* (as the Signal: see keep_tracked) */
    }
    lock_release(prog_lock);
    lock_release(submit_lock);
    locked = prog_locked = 0;
    if (refused) fail_refused(dq, driver, sig, value);
    if (record_writes(bufs, sig) == 0) out = sig;
    goto end;

decline_or_fail:
    if (r < 0) goto fail;
    if (advanced) {
        Py_INCREF(value);
        set_slot(dq, off_dq_next, value);
    }
    out = Py_None;
    goto end;
fail:
    if (advanced) {
        Py_INCREF(value);
        set_slot(dq, off_dq_next, value);
    }
end:
    if (prog_locked) lock_release(prog_lock);
    if (locked) lock_release(submit_lock);
    Py_XINCREF(out);
    Py_XDECREF(value);
    Py_XDECREF(next);
    Py_XDECREF(sig);
    Py_DECREF(entry);
    return out;
}

/* A Signal's keep made untracked by cl_launch_impl goes back to the cyclic collector (before
   the Signal itself does, and whoever drops it) once its command completed. */
static void keep_tracked(PyObject *sig) {
    PyObject *keep = SLOT(sig, off_keep);
    if (keep && PyTuple_CheckExact(keep) && !PyObject_GC_IsTracked(keep)) PyObject_GC_Track(keep);
}

/* The fields of a Signal whose command completed that it no longer holds (fn, args, deps, keep). */
#define DROPPED 4

/* The Signal of a repeat launch that completed without error, as its report leaves it: its
   device time (`seconds`) stored, its keep tracked again, its DROPPED fields None (what they
   held is handed to the caller in `dropped`, to release: that may run Python code), and the
   Signal itself tracked again. Nothing here runs Python code. */
static void signal_done(PyObject *sig, double seconds, PyObject **dropped) {
    PyObject *elapsed = seconds != 0.0 ? PyFloat_FromDouble(seconds) : NULL;
    if (!elapsed) {
        PyErr_Clear();
        Py_INCREF(float_zero);
        elapsed = float_zero;
    }
    PyObject *old = SLOT(sig, off_elapsed);
    SLOT(sig, off_elapsed) = elapsed;
    Py_XDECREF(old); /* (a float: nothing runs) */
    keep_tracked(sig);
    const Py_ssize_t offs[DROPPED] = {off_fn, off_args, off_deps, off_keep};
    for (int f = 0; f < DROPPED; f++) {
        dropped[f] = SLOT(sig, offs[f]);
        Py_INCREF(Py_None);
        SLOT(sig, offs[f]) = Py_None;
    }
    if (!PyObject_GC_IsTracked(sig)) PyObject_GC_Track(sig);
}

/* cl_done(objs, tags, status, seconds, i, n): the entries i.. of a batch a clq_wait() or
   clq_poll() took (the arrays' addresses) that are repeat launches' (tag -value, obj its
   Signal with the ring's reference): (j, signals, clean). Clean: entries i..j-1 completed, with
   consecutive values; each Signal's device time is stored, what it held for the command
   dropped, and it is tracked again; the list holds the ring's references. Not clean: entry i
   failed (status[i]); the list holds its Signal alone, untouched, and j is i + 1. j is i when
   entry i is not a repeat launch's. Raises (taking nothing) only when no list can be made. */
PyObject *py_cl_done(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 6) {
        PyErr_SetString(PyExc_TypeError, "cl_done(objs, tags, status, seconds, i, n)");
        return NULL;
    }
    PyObject **objs = PyLong_AsVoidPtr(args[0]);
    const int64_t *tags = PyLong_AsVoidPtr(args[1]);
    const int32_t *status = PyLong_AsVoidPtr(args[2]);
    const double *seconds = PyLong_AsVoidPtr(args[3]);
    Py_ssize_t i = PyLong_AsSsize_t(args[4]), end = PyLong_AsSsize_t(args[5]);
    if (PyErr_Occurred()) return NULL;
    if (!objs || !tags || !status || !seconds || i < 0 || end > 256) {
        PyErr_SetString(PyExc_ValueError, "cl_done: bad arrays or range");
        return NULL;
    }
    Py_ssize_t j = i;
    int clean = 1;
    if (j < end && tags[j] < 0 && status[j] != 0) {
        clean = 0;
        j++;
    } else {
        while (j < end && tags[j] < 0 && status[j] == 0 && (j == i || tags[j] == tags[j - 1] - 1)) j++;
    }
    PyObject *out = PyTuple_New(3), *list = out ? PyList_New(j - i) : NULL, *stop = list ? PyLong_FromSsize_t(j) : NULL;
    if (!stop) {
        Py_XDECREF(list);
        Py_XDECREF(out);
        return NULL;
    }
    for (Py_ssize_t k = i; k < j; k++) {
        PyList_SET_ITEM(list, k - i, objs[k]); /* (the ring's references) */
        keep_tracked(objs[k]);
    }
    for (Py_ssize_t k = i; clean && k < j; k++) { /* (dropping what a Signal held may run Python code) */
        PyObject *dropped[DROPPED];
        signal_done(objs[k], seconds[k], dropped);
        for (int f = 0; f < DROPPED; f++) Py_XDECREF(dropped[f]);
    }
    PyTuple_SET_ITEM(out, 0, stop);
    PyTuple_SET_ITEM(out, 1, list);
    PyTuple_SET_ITEM(out, 2, PyBool_FromLong(clean));
    return out;
}

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
             attr_is(device, s_error, Py_None) == 1;
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
static PyObject *s_ring, *s_poll_ns, *s_claim_ns, *s_claim, *s_poll, *s_unclaim, *s_report_polled;

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
        PyObject **names[] = {&s_ring, &s_poll_ns, &s_claim_ns, &s_claim, &s_poll, &s_unclaim, &s_report_polled};
        const char *text[] = {"_ring", "_poll_ns", "_CLAIM_NS", "claim", "poll", "unclaim", "_report_polled"};
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
