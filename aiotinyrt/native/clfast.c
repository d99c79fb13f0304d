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
   to Python in one list (CLQueue._report_taken: DriverQueue._report_run). The awaiting
   thread's poll and its report of a round trip's launch, and the timeline's claim and poll,
   are clpoll.c's. */
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
static Py_ssize_t off_fn, off_args, off_deps, off_keep;
Py_ssize_t off_t_heap;
static PyObject *float_zero, *empty_tuple;
PyObject *os_module, *environ_type, *s_environ, *s_data, *b_debug; /* (clpoll.c's environ_value) */
PyObject *s_completed;
static PyObject *s_error, *s_submitted, *s_commands, *s_bufs, *s_vals, *s_name, *s_closed, *s_heap;

PyTypeObject *dq_type;
Py_ssize_t off_dq_advancing, off_dq_enqueuing, off_dq_held, off_dq_next, off_dq_results, off_dq_runs, off_dq_stopping,
    off_dq_taken;

int members_of(members_t *m, PyObject *obj, const char *first, const char *second) {
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

members_t counters_members, driver_members;

/* Set the timeline counters' `completed` (which 0) or `submitted` (1) to `value`. */
void counters_set(PyObject *counters, int which, PyObject *value) {
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

/* The device's `_error` and `_closed` (Compiled's __slots__), the program's `_bufs` and `_vals`
   (CLProgram's), read by offset: each generic attribute look-up cost ~50-100 ns of a launch.
   A type whose members are not slots (a subclass that shadows one) is read by name. */
static members_t device_members, program_members;

/* A new reference to `obj`'s member `which` of the pair `m` caches (first, second), read by
   offset where they are slots, else by `name`; NULL with an error if it has none. */
static PyObject *member_or_attr(members_t *m, PyObject *obj, const char *first, const char *second, int which,
                                PyObject *name) {
    if (!members_of(m, obj, first, second)) return PyObject_GetAttr(obj, name);
    PyObject *v = SLOT(obj, m->off[which]);
    if (!v) PyErr_SetObject(PyExc_AttributeError, name);
    Py_XINCREF(v);
    return v;
}

int device_is(PyObject *device, int which, PyObject *want) {
    PyObject *v = member_or_attr(&device_members, device, "_error", "_closed", which, which ? s_closed : s_error);
    int out = v ? v == want : -1;
    Py_XDECREF(v);
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
    if (ok == 1) ok = device_is(device, 0, Py_None);
    if (ok == 1) ok = device_is(device, 1, Py_False);
    return ok;
}

/* 1 if the program's kernel arguments are still `args`' buffers and vals ((gsz, lsz, vals,
   *handles)); 0 if not; -1 on error. */
static int arguments_set(PyObject *prog, PyObject *args) {
    PyObject *bufs = member_or_attr(&program_members, prog, "_bufs", "_vals", 0, s_bufs);
    if (!bufs) return -1;
    Py_ssize_t nb = PyTuple_GET_SIZE(args) - 3;
    int ok = PyTuple_CheckExact(bufs) && PyTuple_GET_SIZE(bufs) == nb;
    for (Py_ssize_t i = 0; ok && i < nb; i++) ok = PyTuple_GET_ITEM(bufs, i) == PyTuple_GET_ITEM(args, 3 + i);
    Py_DECREF(bufs);
    if (!ok) return 0;
    PyObject *vals = member_or_attr(&program_members, prog, "_bufs", "_vals", 1, s_vals);
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


/* The Signal of a repeat launch that completed without error, as its report leaves it: its
   device time (`seconds`) stored, its keep tracked again, its DROPPED fields None (what they
   held is handed to the caller in `dropped`, to release: that may run Python code), and the
   Signal itself tracked again. Nothing here runs Python code. */
void signal_done(PyObject *sig, double seconds, PyObject **dropped) {
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
