/* What the extension module's files share (pyext.c, replay.c). Python.h comes first, as CPython
   asks of every file that includes it. */
#ifndef AIOTINYRT_PYEXT_H
#define AIOTINYRT_PYEXT_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include "hostq_internal.h"

#define HIDDEN __attribute__((visibility("hidden")))

/* The classes whose state C reads and writes (Signal, Buffer, HostQueue, Timeline, Program) and the
   offsets of those __slots__ members, found once by configure() from the member descriptors: the
   layout is the classes' __slots__, nothing is looked up by name per call. */
HIDDEN extern PyTypeObject *sig_type, *buf_type, *queue_type, *timeline_type;
HIDDEN extern Py_ssize_t off_timeline, off_value, off_error, off_elapsed, off_handle, off_accesses, off_nbytes;
HIDDEN extern Py_ssize_t off_q_stopping, off_q_last_held, off_q_held, off_q_dep_sigs, off_q_caddr, off_t_caddr,
    off_p_fast;
HIDDEN extern PyObject *s_hold, *zero;

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

HIDDEN PyObject *queue_slot(PyObject *queue, Py_ssize_t off);
HIDDEN int set_slot(PyObject *obj, Py_ssize_t off, PyObject *value);
HIDDEN int hold_until(PyObject *queue, PyObject *value, PyObject *hold, int extend);
HIDDEN void fill_signal(PyObject *sig, PyObject *timeline, PyObject *value);
HIDDEN Py_ssize_t slot_offset(PyTypeObject *type, const char *name);
HIDDEN int same_buffers(PyObject *bufs, PyObject *handles, PyObject *timeline);
HIDDEN int record_writes(PyObject *bufs, PyObject *sig);
HIDDEN PyObject *py_replay(PyObject *self, PyObject *const *args, Py_ssize_t n);
/* lock.c: a reentrant lock C takes without Python (1: taken, 0: held elsewhere, -1: not a Lock) */
HIDDEN extern PyTypeObject LockType;
HIDDEN int lock_try(PyObject *lock);
HIDDEN void lock_release(PyObject *lock);
/* clfast.c: the repeat launch of a CL program, and the report of those launches' completion */
#define CL_FAST_LEN 11
HIDDEN PyObject *cl_launch_impl(PyObject *prog, PyObject *key, PyObject *bufs, PyObject *fast);
HIDDEN PyObject *py_cl_configure(PyObject *self, PyObject *const *args, Py_ssize_t n);
HIDDEN PyObject *py_cl_done(PyObject *self, PyObject *const *args, Py_ssize_t n);
/* What clfast.c shares with clpoll.c (the poll's report, the timeline's claim and poll): the
   DriverQueue class and its __slots__ members' offsets (cl_configure), the members of the
   CLQueue and of the ring counters found at the first object of each class (members_of: 1 if
   `obj` is of the class cached in `m`, 0 if its class has no such members), the interned
   names and os.environ's parts the report reads, and the report of one Signal. */
HIDDEN extern PyTypeObject *dq_type;
HIDDEN extern Py_ssize_t off_dq_advancing, off_dq_enqueuing, off_dq_held, off_dq_next, off_dq_results, off_dq_runs,
    off_dq_stopping, off_dq_taken, off_t_heap;
#define DQ(dq, off) SLOT(dq, off) /* a DriverQueue's member (borrowed; NULL if never assigned) */
typedef struct {
    PyTypeObject *type; /* (a strong reference) */
    Py_ssize_t off[2];
} members_t;
HIDDEN extern members_t counters_members, driver_members;
HIDDEN int members_of(members_t *m, PyObject *obj, const char *first, const char *second);
HIDDEN void counters_set(PyObject *counters, int which, PyObject *value);
/* 1 if the device's `_error` (which 0) or `_closed` (1) is `want`, 0 if not, -1 on error */
HIDDEN int device_is(PyObject *device, int which, PyObject *want);
HIDDEN extern PyObject *os_module, *environ_type, *s_environ, *s_data, *b_debug, *s_completed;
#define DROPPED 4 /* the fields of a Signal whose command completed that it drops: fn, args, deps, keep */
HIDDEN void signal_done(PyObject *sig, double seconds, PyObject **dropped);
HIDDEN PyObject *py_cl_poll(PyObject *self, PyObject *const *args, Py_ssize_t n);
HIDDEN PyObject *py_cl_claim(PyObject *self, PyObject *const *args, Py_ssize_t n);
HIDDEN PyObject *py_cl_poll_for(PyObject *self, PyObject *const *args, Py_ssize_t n);
#endif
