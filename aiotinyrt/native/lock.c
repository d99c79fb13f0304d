/* Lock: a reentrant lock that C code can take and give back without calling Python.

   Python uses it as threading.RLock (acquire, release, the with statement, _is_owned). The
   repeat launch of a CL program (clfast.c) takes its DriverQueue's submit lock and its
   program's argument lock with lock_try() and gives them back with lock_release(): two plain
   function calls, where RLock's Python methods cost a method call, an argument tuple and a
   keyword parse each (a sixth of a launch, measured).

   A blocking acquire() lets the GIL go while it waits and cannot be interrupted by a signal;
   the locks it serves are held for the length of one hand-over to a driver. */
#include "pyext.h"

#include <errno.h>
#include <pthread.h>
#include <pythread.h>
#include <time.h>

/* (a pthread mutex, not a PyThread lock: CPython's non-blocking acquire of its lock reads the
   monotonic clock first, a tenth of a repeat launch for its two locks, measured) */
typedef struct {
    PyObject_HEAD pthread_mutex_t mutex;
    int ready;           /* the mutex is initialized */
    unsigned long owner; /* the holder's thread ident while count > 0 */
    unsigned long count;
} Lock;

static int lock_init(PyObject *self, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Lock() takes no arguments");
        return -1;
    }
    Lock *l = (Lock *)self;
    if (!l->ready) {
        int err = pthread_mutex_init(&l->mutex, NULL);
        if (err) {
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        l->ready = 1;
    }
    return 0;
}

static void lock_dealloc(PyObject *self) {
    Lock *l = (Lock *)self;
    if (l->ready) {
        if (l->count) pthread_mutex_unlock(&l->mutex);
        pthread_mutex_destroy(&l->mutex);
    }
    Py_TYPE(self)->tp_free(self);
}

/* Wait for the mutex, at most `timeout_us` (negative: no limit): 1 taken, 0 timed out. */
static int lock_wait(Lock *l, long long timeout_us) {
    if (timeout_us < 0) return pthread_mutex_lock(&l->mutex) == 0;
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
    const clockid_t clock = CLOCK_MONOTONIC; /* (a change of the wall clock does not move it) */
#else
    const clockid_t clock = CLOCK_REALTIME;
#endif
    struct timespec due;
    clock_gettime(clock, &due);
    due.tv_sec += (time_t)(timeout_us / 1000000);
    due.tv_nsec += (long)(timeout_us % 1000000) * 1000;
    if (due.tv_nsec >= 1000000000L) {
        due.tv_sec += 1;
        due.tv_nsec -= 1000000000L;
    }
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 30))
    return pthread_mutex_clocklock(&l->mutex, clock, &due) == 0;
#else
    return pthread_mutex_timedlock(&l->mutex, &due) == 0;
#endif
}

/* 1: taken by this thread (again, or anew), 0: another thread holds it. */
static int lock_take(Lock *l, int blocking, long long timeout_us) {
    unsigned long me = PyThread_get_thread_ident();
    if (l->count && l->owner == me) {
        l->count++;
        return 1;
    }
    int got = pthread_mutex_trylock(&l->mutex) == 0;
    if (!got && blocking && timeout_us != 0) {
        Py_BEGIN_ALLOW_THREADS
        got = lock_wait(l, timeout_us);
        Py_END_ALLOW_THREADS
    }
    if (got) {
        l->owner = me;
        l->count = 1;
    }
    return got;
}

/* Take `lock` if nobody holds it, this thread included: 1 taken, 0 held, -1 not a Lock. */
int lock_try(PyObject *lock) {
    if (Py_TYPE(lock) != &LockType || !((Lock *)lock)->ready) return -1;
    return ((Lock *)lock)->count == 0 && lock_take((Lock *)lock, 0, 0);
}

/* Give back a Lock this thread holds (once). */
void lock_release(PyObject *lock) {
    Lock *l = (Lock *)lock;
    if (--l->count == 0) {
        l->owner = 0;
        pthread_mutex_unlock(&l->mutex);
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
    if (timeout != timeout) { /* (as RLock's) */
        PyErr_SetString(PyExc_ValueError, "Invalid value NaN (not a number)");
        return NULL;
    }
    if (timeout > (double)PY_TIMEOUT_MAX / 1e6) {
        PyErr_SetString(PyExc_OverflowError, "timeout value is too large");
        return NULL;
    }
    long long us = timeout < 0 ? -1 : (long long)(timeout * 1e6);
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
