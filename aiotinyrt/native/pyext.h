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
HIDDEN PyObject *py_cl_poll(PyObject *self, PyObject *const *args, Py_ssize_t n);
HIDDEN PyObject *py_cl_claim(PyObject *self, PyObject *const *args, Py_ssize_t n);
HIDDEN PyObject *py_cl_poll_for(PyObject *self, PyObject *const *args, Py_ssize_t n);
#endif
