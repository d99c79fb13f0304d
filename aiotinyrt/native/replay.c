/* The extension module: Graph.replay's submission in C. */
#include "pyext.h"

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
static PyObject *s_record, *s_prune;

/* A HostQueue slot as a new reference (NULL with an error set), as PyObject_GetAttr gives it. */
static PyObject *queue_attr(PyObject *queue, Py_ssize_t off) {
    PyObject *value = queue_slot(queue, off);
    Py_XINCREF(value);
    return value;
}

static hq_t *timeline_queue(PyObject *timeline) {  /* NULL (no error set) for a Python queue */
    if (!PyObject_TypeCheck(timeline, timeline_type)) return NULL;
    PyObject *caddr = SLOT(timeline, off_t_caddr);
    hq_t *q = caddr && PyLong_Check(caddr) ? (hq_t *)PyLong_AsVoidPtr(caddr) : NULL;
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

PyObject *py_replay(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)self;
    if (n != 1 || !PyTuple_CheckExact(args[0]) || !sig_type) {
        PyErr_SetString(PyExc_TypeError, "replay(runs) after configure()");
        return NULL;
    }
    if (!s_record) {
        s_record = PyUnicode_InternFromString("record");
        s_prune = PyUnicode_InternFromString("_prune_deps");
        if (!s_record || !s_prune) return NULL;
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
        PyObject *stopping = queue_attr(PyTuple_GET_ITEM(run, 0), off_q_stopping);
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
            PyObject *stopping = queue_attr(queue, off_q_stopping);
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
            PyObject *waiting = on ? queue_attr(queue, off_q_dep_sigs) : NULL;
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
