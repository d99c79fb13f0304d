/* What the extension module's files share (pyext.c, replay.c). Python.h comes first, as CPython
   asks of every file that includes it. */
#ifndef AIOTINYRT_PYEXT_H
#define AIOTINYRT_PYEXT_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include "hostq_internal.h"

#define HIDDEN __attribute__((visibility("hidden")))

/* The Signal and Buffer classes and the offsets of the __slots__ members C reads and writes,
   found by configure() from the classes' member descriptors. */
HIDDEN extern PyTypeObject *sig_type, *buf_type;
HIDDEN extern Py_ssize_t off_timeline, off_value, off_error, off_elapsed, off_handle, off_accesses, off_nbytes;
HIDDEN extern PyObject *s_stopping, *s_last_held, *s_caddr, *s_hold, *zero;

#define SLOT(obj, off) (*(PyObject **)((char *)(obj) + (off)))

HIDDEN int set_slot(PyObject *obj, Py_ssize_t off, PyObject *value);
HIDDEN int hold_until(PyObject *queue, PyObject *value, PyObject *hold, int extend);
HIDDEN void fill_signal(PyObject *sig, PyObject *timeline, PyObject *value);
HIDDEN PyObject *py_replay(PyObject *self, PyObject *const *args, Py_ssize_t n);
#endif
