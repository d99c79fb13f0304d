/* The extension module: push(), the repeat launch and Program.__call__ in C. */
#include "pyext.h"

/* The same library is also a CPython extension module: push() from Python without libffi and
   without releasing the GIL (it takes a few dozen nanoseconds), the submit path of every launch. */

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
PyTypeObject *sig_type, *buf_type, *queue_type, *timeline_type;
Py_ssize_t off_timeline, off_value, off_error, off_elapsed, off_handle, off_accesses, off_nbytes;
Py_ssize_t off_q_stopping, off_q_last_held, off_q_held, off_q_dep_sigs, off_q_caddr, off_t_caddr, off_p_fast;
PyObject *s_hold, *zero;

int set_slot(PyObject *obj, Py_ssize_t off, PyObject *value) {  /* steals value */
    PyObject *old = SLOT(obj, off);
    SLOT(obj, off) = value;
    Py_XDECREF(old);
    return 0;
}

Py_ssize_t slot_offset(PyTypeObject *type, const char *name) {
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

/* configure(Signal, Buffer, HostQueue, Timeline, Program): the classes whose __slots__ C reads
   and writes, and the members' offsets (found once, from the member descriptors). */
static PyObject *py_configure(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 5) {
        PyErr_SetString(PyExc_TypeError, "configure(Signal, Buffer, HostQueue, Timeline, Program)");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyType_Check(args[i])) {
            PyErr_SetString(PyExc_TypeError, "configure() takes five classes");
            return NULL;
        }
    }
    PyTypeObject *st = (PyTypeObject *)args[0], *bt = (PyTypeObject *)args[1], *qt = (PyTypeObject *)args[2];
    PyTypeObject *tt = (PyTypeObject *)args[3], *pt = (PyTypeObject *)args[4];
    if ((off_timeline = slot_offset(st, "timeline")) < 0 || (off_value = slot_offset(st, "value")) < 0 ||
        (off_error = slot_offset(st, "_error")) < 0 || (off_elapsed = slot_offset(st, "_elapsed")) < 0 ||
        (off_handle = slot_offset(bt, "_handle")) < 0 || (off_accesses = slot_offset(bt, "_accesses")) < 0 ||
        (off_nbytes = slot_offset(bt, "nbytes")) < 0 || (off_q_stopping = slot_offset(qt, "_stopping")) < 0 ||
        (off_q_last_held = slot_offset(qt, "_last_held")) < 0 || (off_q_held = slot_offset(qt, "_held")) < 0 ||
        (off_q_dep_sigs = slot_offset(qt, "_dep_sigs")) < 0 || (off_q_caddr = slot_offset(qt, "_caddr")) < 0 ||
        (off_t_caddr = slot_offset(tt, "_caddr")) < 0 || (off_p_fast = slot_offset(pt, "_fast")) < 0)
        return NULL;
    PyTypeObject **types[] = {&sig_type, &buf_type, &queue_type, &timeline_type};
    for (int i = 0; i < 4; i++) {
        Py_INCREF(args[i]);
        Py_XDECREF(*types[i]);
        *types[i] = (PyTypeObject *)args[i];
    }
    if (!s_hold) {
        s_hold = PyUnicode_InternFromString("_hold");
        zero = PyLong_FromLong(0);
        if (!s_hold || !zero) return NULL;
    }
    Py_RETURN_NONE;
}

/* A HostQueue slot (borrowed; NULL with AttributeError set when it was never assigned). */
PyObject *queue_slot(PyObject *queue, Py_ssize_t off) {
    if (!PyObject_TypeCheck(queue, queue_type)) {
        PyErr_Format(PyExc_TypeError, "expected a HostQueue, got %.100s", Py_TYPE(queue)->tp_name);
        return NULL;
    }
    PyObject *value = SLOT(queue, off);
    if (!value) PyErr_SetString(PyExc_AttributeError, "HostQueue slot not set");
    return value;
}

/* Hold `hold` on `queue` until command `value` ran: extend the newest held entry when it is the
   same object, else queue._hold(); when that raises, append it to the hold list from C (the
   command runs anyway) and return -1 with the error set. */
int hold_until(PyObject *queue, PyObject *value, PyObject *hold, int extend) {
    PyObject *held = queue_slot(queue, off_q_last_held);  /* borrowed */
    if (held && extend && PyList_CheckExact(held) && PyList_GET_SIZE(held) == 2 &&
        PyList_GET_ITEM(held, 1) == hold) {
        Py_INCREF(value);
        PyList_SetItem(held, 0, value);
        return 0;
    }
    PyObject *r = held ? PyObject_CallMethodObjArgs(queue, s_hold, value, hold, NULL) : NULL;
    if (r) { Py_DECREF(r); return 0; }
    PyObject *type, *exc, *tb;
    PyErr_Fetch(&type, &exc, &tb);
    PyObject *pair = PyList_New(2);
    if (pair) {
        Py_INCREF(value); PyList_SET_ITEM(pair, 0, value);
        Py_INCREF(hold); PyList_SET_ITEM(pair, 1, hold);
        PyObject *list = queue_slot(queue, off_q_held);  /* borrowed */
        PyObject *ok = list ? PyObject_CallMethod(list, "append", "O", pair) : NULL;
        if (!ok) Py_INCREF(hold);  /* (not even that: what the command reads is never released) */
        Py_XDECREF(ok);
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
void fill_signal(PyObject *sig, PyObject *timeline, PyObject *value) {
    Py_INCREF(timeline);
    set_slot(sig, off_timeline, timeline);
    set_slot(sig, off_value, value);
    Py_INCREF(Py_None);
    set_slot(sig, off_error, Py_None);
    Py_INCREF(Py_None);
    set_slot(sig, off_elapsed, Py_None);
}

/* A repeat launch's buffers: `bufs` (a tuple) are Buffers holding `handles` (the remembered
   launch's), in order, each last touched by `timeline` only (or never). */
int same_buffers(PyObject *bufs, PyObject *handles, PyObject *timeline) {
    Py_ssize_t nb = PyTuple_GET_SIZE(bufs);
    if (!PyTuple_CheckExact(handles) || PyTuple_GET_SIZE(handles) != nb) return 0;
    for (Py_ssize_t i = 0; i < nb; i++) {
        PyObject *b = PyTuple_GET_ITEM(bufs, i);
        if (Py_TYPE(b) != buf_type || SLOT(b, off_handle) != PyTuple_GET_ITEM(handles, i)) return 0;
        PyObject *acc = SLOT(b, off_accesses);
        if (!acc || !PyList_CheckExact(acc) || PyList_GET_SIZE(acc) > 1) return 0;
        if (PyList_GET_SIZE(acc) == 1) {
            PyObject *a = PyList_GET_ITEM(acc, 0);
            if (!PyTuple_CheckExact(a) || PyTuple_GET_SIZE(a) != 4) return 0;
            PyObject *prev = PyTuple_GET_ITEM(a, 2);
            if (Py_TYPE(prev) != sig_type || SLOT(prev, off_timeline) != timeline) return 0;
        }
    }
    return 1;
}

/* The access records of a launch of `sig` that writes every buffer of `bufs` (whole base
   buffers): [(0, nbytes, sig, True)] each. 0, or -1 with the error set (some are not updated). */
int record_writes(PyObject *bufs, PyObject *sig) {
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(bufs); i++) {
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
        if (!list) {
            Py_XDECREF(a);
            return -1;
        }
        PyList_SET_ITEM(list, 0, a);
        set_slot(b, off_accesses, list);
    }
    return 0;
}

static PyObject *launch_impl(PyObject *key, PyObject *bufs, PyObject *by_bufs, PyObject *timeline,
                             PyObject *queue, hq_t *q) {
    PyObject *entry = PyDict_GetItemWithError(by_bufs, key);  /* borrowed */
    if (!entry) {
        PyErr_Clear();  /* not cached, or unhashable arguments: Python decides */
        Py_RETURN_NONE;
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) < 4) Py_RETURN_NONE;
    if (!same_buffers(bufs, PyTuple_GET_ITEM(entry, 3), timeline)) Py_RETURN_NONE;
    PyObject *stopping = queue_slot(queue, off_q_stopping);  /* borrowed */
    if (!stopping) return NULL;
    if (stopping != Py_False) Py_RETURN_NONE;
    if (!q) {
        PyObject *caddr = queue_slot(queue, off_q_caddr);
        if (!caddr) return NULL;
        q = (hq_t *)PyLong_AsVoidPtr(caddr);
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
    int failed = record_writes(bufs, sig) < 0;
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
   a program whose `_fast` is set goes straight to launch_impl ((queue, timeline, by_bufs, queue
   address): a host-run native queue) or cl_launch_impl (a CL program's 7-tuple, clfast.c);
   anything else (and a launch they decline) calls `call_py(self, *args, **kwargs)`, the Python
   implementation, unchanged. This saves the Python frame of __call__ on every repeat launch. */
static PyObject *call_py, *capturing_var, *vals_key, *s_vals;

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
        PyObject *fast = idle ? SLOT(self, off_p_fast) : NULL;  /* (self: a Program, by the descriptor) */
        Py_XINCREF(fast);
        /* a host-run native queue's (queue, timeline, by_bufs, address), or a CL program's tuple */
        Py_ssize_t kind = fast && PyTuple_CheckExact(fast) ? PyTuple_GET_SIZE(fast) : 0;
        hq_t *q = NULL;
        if (kind == 4 && PyDict_CheckExact(PyTuple_GET_ITEM(fast, 2)))
            q = (hq_t *)PyLong_AsVoidPtr(PyTuple_GET_ITEM(fast, 3));
        if (q || kind == CL_FAST_LEN) {
            PyObject *bufs = PyTuple_New(nargs), *sig = NULL, *key = NULL;
            if (bufs) {
                for (Py_ssize_t i = 0; i < nargs; i++) {
                    Py_INCREF(args[i]);
                    PyTuple_SET_ITEM(bufs, i, args[i]);
                }
                key = nkw ? PyTuple_Pack(3, vals_key, bufs, args[nargs]) : (Py_INCREF(bufs), bufs);
            }
            if (key && q) {
                sig = launch_impl(key, bufs, PyTuple_GET_ITEM(fast, 2), PyTuple_GET_ITEM(fast, 1),
                                  PyTuple_GET_ITEM(fast, 0), q);
            } else if (key) {
                sig = cl_launch_impl(self, key, bufs, fast);
            }
            Py_XDECREF(key);
            Py_XDECREF(bufs);
            if (sig == NULL) {
                if (PyErr_Occurred()) { Py_DECREF(fast); return NULL; }
            } else if (sig != Py_None) {
                Py_DECREF(fast);
                return sig;
            } else {
                Py_DECREF(sig);
            }
        }
        Py_XDECREF(fast);
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

/* track(signals): hand the objects of a list that the repeat launch made untracked (clfast.c)
   back to the cyclic collector; nothing for those it tracks already. */
static PyObject *py_track(PyObject *self, PyObject *objs) {
    (void)self;
    if (!PyList_Check(objs)) {
        PyErr_SetString(PyExc_TypeError, "track() takes a list");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(objs); i++) {
        PyObject *obj = PyList_GET_ITEM(objs, i);
        if (PyObject_IS_GC(obj) && !PyObject_GC_IsTracked(obj)) PyObject_GC_Track(obj);
    }
    Py_RETURN_NONE;
}

static PyMethodDef hq_methods[] = {
    {"track", py_track, METH_O, "track(list)"},
    {"push", (PyCFunction)(void (*)(void))py_push, METH_FASTCALL, "push(q, kind, fn, n, args[, nd, deps])"},
    {"complete", (PyCFunction)(void (*)(void))py_complete, METH_FASTCALL, "complete(queue, value)"},
    {"install", (PyCFunction)(void (*)(void))py_install, METH_FASTCALL, "install(Program, call, var, key)"},
    {"configure", (PyCFunction)(void (*)(void))py_configure, METH_FASTCALL, "configure(Signal, Buffer, HostQueue, Timeline, Program)"},
    {"launch", (PyCFunction)(void (*)(void))py_launch, METH_FASTCALL, "launch(bufs, by_bufs, timeline, q)"},
    {"replay", (PyCFunction)(void (*)(void))py_replay, METH_FASTCALL, "replay(runs)"},
    {"cl_configure", (PyCFunction)(void (*)(void))py_cl_configure, METH_FASTCALL,
     "cl_configure(Completion, enqueue, release, wait)"},
    {"cl_done", (PyCFunction)(void (*)(void))py_cl_done, METH_FASTCALL,
     "cl_done(objs, tags, status, seconds, i, n)"},
    {"cl_poll", (PyCFunction)(void (*)(void))py_cl_poll, METH_FASTCALL, "cl_poll(settle, event, tag, ns, claim)"},
    {"cl_claim", (PyCFunction)(void (*)(void))py_cl_claim, METH_FASTCALL, "cl_claim(hooks, value)"},
    {"cl_poll_for", (PyCFunction)(void (*)(void))py_cl_poll_for, METH_FASTCALL, "cl_poll_for(hooks, value, claim=0)"},
    {NULL, NULL, 0, NULL},
};
static struct PyModuleDef hq_module = {
    PyModuleDef_HEAD_INIT, "_hostq", NULL, -1, hq_methods, NULL, NULL, NULL, NULL,
};
#ifndef HQ_SOURCE_DIGEST
#define HQ_SOURCE_DIGEST "unknown"
#endif
PyMODINIT_FUNC PyInit__hostq(void) {
    PyObject *m = PyModule_Create(&hq_module);
    if (m && PyModule_AddStringConstant(m, "SOURCE_DIGEST", HQ_SOURCE_DIGEST) < 0) Py_CLEAR(m);
    if (m && (PyType_Ready(&LockType) < 0 || PyModule_AddObjectRef(m, "Lock", (PyObject *)&LockType) < 0))
        Py_CLEAR(m);
    return m;
}
