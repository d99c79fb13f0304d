/* The repeat launch of a CL program (aiotinyrt/backends/ops_cl.py), in C.

   A launch of a CL program with the buffers of a launch remembered by Program._remember, each
   holding the same memory and last touched by the program's queue only, while the kernel's
   arguments are still set to them, needs no hazard, no wait list and no clSetKernelArg: it is
   one clEnqueueNDRangeKernel (waiting for the ring's gate when it opens a batch), the event
   handed to the queue's completion ring (clq.c), and the DriverQueue's record of one command.
   cl_launch_impl() does exactly what DriverQueue.submit, CLQueue.enqueue and
   CLProgram._enqueue do for such a launch, on the same Python state, with the GIL held
   throughout (the Python path costs ~12 us per launch, and each of its cffi calls
   lets go of the GIL the queue's waiter thread is asking for).

   It declines (returns None, having changed nothing: Python launches it) whenever those would
   do anything else: the queue stopping or holding commands back, the device holding its sticky
   error, tracing on, a hand-over or an argument change under way (their locks are taken without
   waiting), the kernel's arguments set to other buffers or vals, or an enqueue that failed
   (Python's then meets the same error and reports it). */
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
static PyTypeObject *completion_type;
static Py_ssize_t off_fn, off_args, off_deps, off_keep, off_c_queue, off_c_value, off_c_start;
static PyObject *float_zero, *empty_tuple, *one;
static PyObject *s_stopping, *s_held, *s_profile, *s_device, *s_error, *s_submit_lock, *s_enqueuing, *s_next,
    *s_c, *s_submitted, *s_commands, *s_events, *s_taken, *s_lock, *s_bufs, *s_vals, *s_tag, *s_items,
    *s_acquire, *s_release, *s_append, *s_name, *s_closed;

/* A cl_event reference of a launch made here: the DriverQueue keeps it as the command's event
   (other queues' wait lists read int() of it) and releasing this object releases the event. */
typedef struct {
    PyObject_HEAD void *event;
} ClEvent;

static void clevent_dealloc(PyObject *self) {
    void *event = ((ClEvent *)self)->event;
    if (event) cl_release(event);
    Py_TYPE(self)->tp_free(self);
}

static PyObject *clevent_int(PyObject *self) { return PyLong_FromVoidPtr(((ClEvent *)self)->event); }

static PyNumberMethods clevent_number = {.nb_int = clevent_int};

static PyTypeObject ClEventType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_hostq.ClEvent",
    .tp_basicsize = sizeof(ClEvent),
    .tp_dealloc = clevent_dealloc,
    .tp_as_number = &clevent_number,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A launch's cl_event, released with this object; int() is its address.",
};

/* cl_configure(Completion, enqueue, release, wait) after configure(): the DriverQueue's
   Completion class and the ICD loader's clEnqueueNDRangeKernel, clReleaseEvent and
   clWaitForEvents (addresses). Returns the ClEvent type. */
PyObject *py_cl_configure(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 4 || !PyType_Check(args[0]) || !sig_type) {
        PyErr_SetString(PyExc_TypeError, "cl_configure(Completion, enqueue, release, wait) after configure()");
        return NULL;
    }
    void *enqueue = PyLong_AsVoidPtr(args[1]), *release = PyLong_AsVoidPtr(args[2]);
    void *wait = PyLong_AsVoidPtr(args[3]);
    if (PyErr_Occurred()) return NULL;
    if (!enqueue || !release || !wait) {
        PyErr_SetString(PyExc_ValueError, "cl_configure: NULL entry point");
        return NULL;
    }
    PyTypeObject *ct = (PyTypeObject *)args[0];
    if ((off_c_queue = slot_offset(ct, "queue")) < 0 || (off_c_value = slot_offset(ct, "value")) < 0 ||
        (off_c_start = slot_offset(ct, "start")) < 0 || (off_fn = slot_offset(sig_type, "_fn")) < 0 ||
        (off_args = slot_offset(sig_type, "_args")) < 0 || (off_deps = slot_offset(sig_type, "_deps")) < 0 ||
        (off_keep = slot_offset(sig_type, "_keep")) < 0)
        return NULL;
    if (!one) { /* (the last of these made: a failure part way is tried again) */
        if (PyType_Ready(&ClEventType) < 0) return NULL;
        PyObject **names[] = {&s_stopping, &s_held,  &s_profile, &s_device,    &s_error,  &s_submit_lock,
                              &s_enqueuing, &s_next, &s_c,       &s_submitted, &s_commands, &s_events,
                              &s_taken,    &s_lock,  &s_bufs,    &s_vals,      &s_tag,    &s_items,
                              &s_acquire,  &s_release, &s_append, &s_name, &s_closed};
        const char *text[] = {"_stopping", "_held",  "profile", "device",    "_error",  "_submit_lock",
                              "_enqueuing", "_next", "_c",      "submitted", "_commands", "_events",
                              "_taken",    "_lock",  "_bufs",   "_vals",     "_tag",    "_items",
                              "acquire",   "release", "append", "name", "_closed"};
        for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
            if (!*names[i] && !(*names[i] = PyUnicode_InternFromString(text[i]))) return NULL;
        if ((!float_zero && !(float_zero = PyFloat_FromDouble(0.0))) ||
            (!empty_tuple && !(empty_tuple = PyTuple_New(0))) || !(one = PyLong_FromLong(1)))
            return NULL;
    }
    Py_INCREF(ct);
    Py_XSETREF(completion_type, ct);
    cl_enqueue = (enqueue_fn)enqueue;
    cl_release = (release_fn)release;
    cl_wait = (wait_fn)wait;
    Py_INCREF(&ClEventType);
    return (PyObject *)&ClEventType;
}

/* 1: `lock` taken without waiting; 0: someone holds it; -1: error. */
static int try_acquire(PyObject *lock) {
    PyObject *got = PyObject_CallMethodOneArg(lock, s_acquire, Py_False);
    if (!got) return -1;
    int out = got == Py_True;
    Py_DECREF(got);
    return out;
}

static void release_lock(PyObject *lock) {
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_release);
    if (r) Py_DECREF(r);
    else PyErr_WriteUnraisable(lock);
    PyErr_Restore(type, exc, tb);
}

/* 1 if `obj.name` is `want` (0 if not, -1 on error). */
static int attr_is(PyObject *obj, PyObject *name, PyObject *want) {
    PyObject *v = PyObject_GetAttr(obj, name);
    if (!v) return -1;
    int out = v == want;
    Py_DECREF(v);
    return out;
}

/* 1 if DriverQueue `dq` would hand a command to its driver at once and untraced: not stopping,
   holding nothing back, no hand-over under way on this thread, its device open and without a
   sticky error, no trace; 0 if not; -1 on error. */
static int queue_ready(PyObject *dq) {
    int ok = attr_is(dq, s_stopping, Py_False);
    if (ok == 1) ok = attr_is(dq, s_profile, Py_None);
    if (ok == 1) {
        PyObject *held = PyObject_GetAttr(dq, s_held);
        Py_ssize_t len = held ? PyObject_Length(held) : -1;
        Py_XDECREF(held);
        ok = len < 0 ? -1 : len == 0;
    }
    if (ok == 1) {
        PyObject *inside = PyObject_GetAttr(dq, s_enqueuing);
        ok = inside ? PyObject_RichCompareBool(inside, zero, Py_EQ) : -1;
        Py_XDECREF(inside);
    }
    if (ok == 1) {
        PyObject *device = PyObject_GetAttr(dq, s_device);
        ok = device ? attr_is(device, s_error, Py_None) : -1;
        if (ok == 1) ok = attr_is(device, s_closed, Py_False);
        Py_XDECREF(device);
    }
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

/* The repeat launch: `fast` is CLProgram._fast, (DriverQueue, Timeline, by_bufs, ring address,
   cl_command_queue address, cl_kernel address, CLQueue); the entry of `key` in by_bufs is
   (fn, args, None, handles, global size address, local size address or 0), fn(queue, 0, NULL,
   *args) being the launch Python would make. Returns its Signal, None (Python launches it), or
   NULL with an error (nothing enqueued, or: enqueued and tracked, its access records not all
   updated, as launch_impl). */
PyObject *cl_launch_impl(PyObject *prog, PyObject *key, PyObject *bufs, PyObject *fast) {
    if (!cl_enqueue || !PyTuple_CheckExact(fast) || PyTuple_GET_SIZE(fast) != 7) Py_RETURN_NONE;
    PyObject *dq = PyTuple_GET_ITEM(fast, 0), *timeline = PyTuple_GET_ITEM(fast, 1);
    PyObject *by_bufs = PyTuple_GET_ITEM(fast, 2), *driver = PyTuple_GET_ITEM(fast, 6);
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

    /* Everything the command needs that a collection could run Python code for is made first,
       before any lock is taken or any state is read. */
    Py_INCREF(entry); /* (it holds the global size) */
    PyObject *submit_lock = NULL, *prog_lock = NULL, *value = NULL, *next = NULL, *tag = NULL;
    PyObject *commands = NULL, *items = NULL, *events = NULL, *counters = NULL, *out = NULL;
    PyObject *keep = PyTuple_Pack(2, bufs, prog);
    PyObject *sig = sig_type->tp_alloc(sig_type, 0);
    PyObject *done = completion_type->tp_alloc(completion_type, 0);
    PyObject *item = PyTuple_New(3);
    ClEvent *event = PyObject_New(ClEvent, &ClEventType);
    if (event) event->event = NULL;
    int locked = 0, prog_locked = 0, inserted = 0, advanced = 0, r;
    if (!keep || !sig || !done || !item || !event) goto fail;
    /* None of them is ever looked at by the cyclic collector: they live while their command is
       pending, thousands at once in a pipeline, and each collection of the older generations
       would walk them all (that was a third of a launch). The only cycles through them (the
       Signal's buffers recording it as their writer, the waiter's item and the queue) are
       broken when the command completes (DriverQueue clears the Signal's command and tracks
       it again: its error's traceback, or a frame holding it, may lead back to it; the waiter
       drops the items it did not report when the queue closes). */
    PyObject_GC_UnTrack(keep);
    PyObject_GC_UnTrack(sig);
    PyObject_GC_UnTrack(done);
    PyObject_GC_UnTrack(item);
    if (!(submit_lock = PyObject_GetAttr(dq, s_submit_lock)) || !(prog_lock = PyObject_GetAttr(prog, s_lock)))
        goto fail;
    if ((r = try_acquire(submit_lock)) <= 0) goto decline_or_fail;
    locked = 1;
    if ((r = queue_ready(dq)) <= 0) goto decline_or_fail;
    if ((r = try_acquire(prog_lock)) <= 0) goto decline_or_fail;
    prog_locked = 1;
    if ((r = arguments_set(prog, args)) <= 0) goto decline_or_fail;
    if (!(value = PyObject_GetAttr(dq, s_next)) || !(tag = PyObject_GetAttr(driver, s_tag)) ||
        !(commands = PyObject_GetAttr(dq, s_commands)) || !(items = PyObject_GetAttr(driver, s_items)) ||
        !(events = PyObject_GetAttr(dq, s_events)) || !(counters = PyObject_GetAttr(timeline, s_c)))
        goto fail;
    r = 0;
    if (!PyLong_CheckExact(value) || !PyLong_CheckExact(tag) || !PyDict_CheckExact(commands) ||
        !PyDict_CheckExact(events))
        goto decline_or_fail;
    if (!(next = PyNumber_Add(value, one))) goto fail;
    PyObject *next_tag = PyNumber_Add(tag, one);
    if (!next_tag) goto fail;
    Py_SETREF(tag, next_tag);
    int64_t tag_c = PyLong_AsLongLong(tag);
    if (tag_c == -1 && PyErr_Occurred()) goto fail;

    /* The Signal and the Completion as DriverQueue.submit and _hand_over make them. */
    const struct {
        PyObject *obj;
        Py_ssize_t off;
        PyObject *value;
    } fields[] = {
        {sig, off_timeline, timeline},   {sig, off_value, value},       {sig, off_error, Py_None},
        {sig, off_elapsed, float_zero},  {sig, off_fn, PyTuple_GET_ITEM(entry, 0)},
        {sig, off_args, args},           {sig, off_deps, empty_tuple},  {sig, off_keep, keep},
        {done, off_c_queue, dq},         {done, off_c_value, value},    {done, off_c_start, float_zero},
    };
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        Py_INCREF(fields[i].value);
        set_slot(fields[i].obj, fields[i].off, fields[i].value);
    }
    Py_INCREF(tag);
    PyTuple_SET_ITEM(item, 0, tag);
    Py_INCREF(done);
    PyTuple_SET_ITEM(item, 1, done);
    Py_INCREF(Py_None);
    PyTuple_SET_ITEM(item, 2, Py_None);

    /* Before the enqueue, what can fail: the command's record, the waiter's item (an item whose
       event never reaches the ring is dropped by the waiter), the counters. */
    if (PyDict_SetItem(commands, value, sig) < 0) goto fail;
    inserted = 1;
    PyObject *appended = PyObject_CallMethodOneArg(items, s_append, item);
    if (!appended) goto fail;
    Py_DECREF(appended);
    if (PyObject_SetAttr(driver, s_tag, tag) < 0 || PyObject_SetAttr(dq, s_next, next) < 0) goto fail;
    advanced = 1;
    void *ev = NULL, *gate = clq_gate(ring); /* (a batch's first command waits for its gate) */
    cl_int code = cl_enqueue(cq, kernel, 3, NULL, gsz, lsz, gate ? 1 : 0, gate ? &gate : NULL, &ev);
    if (gate) cl_release(gate);
    if (code != 0) goto decline_or_fail;

    /* Enqueued: the command is the queue's from here on. */
    event->event = ev;
    if (PyObject_SetAttr(counters, s_submitted, value) < 0) PyErr_WriteUnraisable(counters);
    int refused = ev == NULL || clq_push(ring, ev, tag_c, 0) != 0;
    if (refused) {
        if (ev) { /* it fails, but only once the device is done with its memory; the GIL goes
                     meanwhile (the kernel may wait for a Python command the waiter runs), and
                     its batch goes to the device */
            Py_BEGIN_ALLOW_THREADS
            clq_open(ring);
            cl_wait(1, &ev);
            Py_END_ALLOW_THREADS
        }
    } else if (PyDict_SetItem(events, value, (PyObject *)event) < 0) {
        PyErr_Clear(); /* (no event: other queues hold their commands back until it completed) */
    } else {
        PyObject *taken = PyObject_GetAttr(dq, s_taken);
        int gone = taken ? PyObject_RichCompareBool(taken, value, Py_GE) : -1;
        Py_XDECREF(taken);
        if (gone != 0 && PyDict_DelItem(events, value) < 0) PyErr_Clear();
        if (gone < 0) PyErr_Clear();
    }
    release_lock(prog_lock);
    release_lock(submit_lock);
    locked = prog_locked = 0;
    if (refused) { /* as CLQueue._hand's refusal: the command fails with MemoryError */
        PyObject *name = PyObject_GetAttr(driver, s_name);
        PyObject *text =
            name ? PyUnicode_FromFormat("%S: no memory for the completion ring (or the queue is closed)", name) : NULL;
        PyObject *exc = text ? PyObject_CallOneArg(PyExc_MemoryError, text) : NULL;
        Py_XDECREF(text);
        PyObject *called = exc ? PyObject_CallFunction(done, "OO", float_zero, exc) : NULL;
        if (!called) PyErr_WriteUnraisable(done);
        Py_XDECREF(called);
        Py_XDECREF(exc);
        Py_XDECREF(name);
    }
    if (record_writes(bufs, sig) == 0) out = sig;
    goto end;

decline_or_fail:
    if (r < 0) goto fail;
    if (advanced && PyObject_SetAttr(dq, s_next, value) < 0) PyErr_WriteUnraisable(dq);
    if (inserted && PyDict_DelItem(commands, value) < 0) PyErr_WriteUnraisable(commands);
    out = Py_None;
    goto end;
fail:
    if (advanced || inserted) {
        PyObject *type, *exc, *tb;
        PyErr_Fetch(&type, &exc, &tb);
        if (advanced && PyObject_SetAttr(dq, s_next, value) < 0) PyErr_WriteUnraisable(dq);
        if (inserted && PyDict_DelItem(commands, value) < 0) PyErr_WriteUnraisable(commands);
        PyErr_Restore(type, exc, tb);
    }
end:
    if (prog_locked) release_lock(prog_lock);
    if (locked) release_lock(submit_lock);
    Py_XINCREF(out);
    Py_XDECREF(submit_lock);
    Py_XDECREF(prog_lock);
    Py_XDECREF(value);
    Py_XDECREF(next);
    Py_XDECREF(tag);
    Py_XDECREF(commands);
    Py_XDECREF(items);
    Py_XDECREF(events);
    Py_XDECREF(counters);
    Py_XDECREF(keep);
    Py_XDECREF(sig);
    Py_XDECREF(done);
    Py_XDECREF(item);
    Py_XDECREF((PyObject *)event);
    Py_DECREF(entry);
    return out;
}
