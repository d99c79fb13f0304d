/* Lock: a reentrant lock that C code can take and give back without calling Python.

   Python uses it as threading.RLock (acquire, release, the with statement, _is_owned). The
   repeat launch of a CL program (clfast.c) takes its DriverQueue's submit lock and its
   program's argument lock with lock_try() and gives them back with lock_release(): two plain
   function calls, where RLock's Python methods cost a method call, an argument tuple and a
   keyword parse each (a sixth of a launch, measured).

   A blocking acquire() lets the GIL go while it waits and cannot be interrupted by a signal;
   the locks it serves are held for the length of one hand-over to a driver. */
#include "pyext.h"

#include <pythread.h>

typedef struct {
    PyObject_HEAD PyThread_type_lock lock;
    unsigned long owner; /* the holder's thread ident while count > 0 */
    unsigned long count;
} Lock;

static int lock_init(PyObject *self, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Lock() takes no arguments");
        return -1;
    }
    Lock *l = (Lock *)self;
    if (!l->lock && !(l->lock = PyThread_allocate_lock())) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void lock_dealloc(PyObject *self) {
    Lock *l = (Lock *)self;
    if (l->lock) {
        if (l->count) PyThread_release_lock(l->lock);
        PyThread_free_lock(l->lock);
    }
    Py_TYPE(self)->tp_free(self);
}

/* 1: taken by this thread (again, or anew), 0: another thread holds it. */
static int lock_take(Lock *l, int blocking, PY_TIMEOUT_T timeout_us) {
    unsigned long me = PyThread_get_thread_ident();
    if (l->count && l->owner == me) {
        l->count++;
        return 1;
    }
    int got = PyThread_acquire_lock(l->lock, NOWAIT_LOCK);
    if (!got && blocking) {
        PyLockStatus r;
        Py_BEGIN_ALLOW_THREADS
        r = PyThread_acquire_lock_timed(l->lock, timeout_us, 0);
        Py_END_ALLOW_THREADS
        got = r == PY_LOCK_ACQUIRED;
    }
    if (got) {
        l->owner = me;
        l->count = 1;
    }
    return got;
}

/* Take `lock` if nobody holds it, this thread included: 1 taken, 0 held, -1 not a Lock. */
int lock_try(PyObject *lock) {
    if (Py_TYPE(lock) != &LockType || !((Lock *)lock)->lock) return -1;
    return ((Lock *)lock)->count == 0 && lock_take((Lock *)lock, 0, 0);
}

/* Give back a Lock this thread holds (once). */
void lock_release(PyObject *lock) {
    Lock *l = (Lock *)lock;
    if (--l->count == 0) {
        l->owner = 0;
        PyThread_release_lock(l->lock);
    }
}

static PyObject *py_acquire(PyObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"blocking", "timeout", NULL};
    int blocking = 1;
    double timeout = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|pd:acquire", names, &blocking, &timeout)) return NULL;
    if (!blocking && timeout != -1) {
        PyErr_SetString(PyExc_ValueError, "can't specify a timeout for a non-blocking call");
        return NULL;
    }
    if (timeout < 0 && timeout != -1) {
        PyErr_SetString(PyExc_ValueError, "timeout value must be a non-negative number");
        return NULL;
    }
    PY_TIMEOUT_T us = timeout < 0 ? -1 : (PY_TIMEOUT_T)(timeout * 1e6);
    return PyBool_FromLong(lock_take((Lock *)self, blocking, us));
}

static PyObject *py_enter(PyObject *self, PyObject *unused) {
    (void)unused;
    lock_take((Lock *)self, 1, -1);
    Py_RETURN_TRUE;
}

static PyObject *py_release(PyObject *self, PyObject *unused) {
    (void)unused;
    Lock *l = (Lock *)self;
    if (!l->count || l->owner != PyThread_get_thread_ident()) {
        PyErr_SetString(PyExc_RuntimeError, "cannot release un-acquired lock");
        return NULL;
    }
    lock_release(self);
    Py_RETURN_NONE;
}

static PyObject *py_exit(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    (void)args;
    (void)n;
    return py_release(self, NULL);
}

static PyObject *py_is_owned(PyObject *self, PyObject *unused) {
    (void)unused;
    Lock *l = (Lock *)self;
    return PyBool_FromLong(l->count && l->owner == PyThread_get_thread_ident());
}

static PyObject *py_repr(PyObject *self) {
    Lock *l = (Lock *)self;
    return PyUnicode_FromFormat("<Lock %s owner=%lu count=%lu>", l->count ? "locked" : "unlocked", l->owner,
                                l->count);
}

static PyMethodDef lock_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))py_acquire, METH_VARARGS | METH_KEYWORDS,
     "acquire(blocking=True, timeout=-1): as threading.RLock's"},
    {"release", py_release, METH_NOARGS, "release(): as threading.RLock's"},
    {"__enter__", py_enter, METH_NOARGS, "acquire()"},
    {"__exit__", (PyCFunction)(void (*)(void))py_exit, METH_FASTCALL, "release()"},
    {"_is_owned", py_is_owned, METH_NOARGS, "whether this thread holds it"},
    {NULL, NULL, 0, NULL},
};

PyTypeObject LockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "_hostq.Lock",
    .tp_basicsize = sizeof(Lock),
    .tp_dealloc = lock_dealloc,
    .tp_repr = py_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A reentrant lock that C code takes without calling Python (see lock.c).",
    .tp_methods = lock_methods,
    .tp_init = lock_init,
    .tp_new = PyType_GenericNew,
};
