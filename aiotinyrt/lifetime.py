"""What happens to work that never finishes, and to devices inherited across ``fork()``.

Abandoned commands
==================
A command still running when its device closes (a kernel that never returns, a long copy) cannot
be stopped: a thread cannot be killed, and the command may be writing into device or host memory
at any moment. Closing gives such a worker a bounded time (``EXIT_JOIN_S`` at interpreter exit,
``CLOSE_TIMEOUT_S`` and ``EXIT_JOIN_S`` in ``aclose()``) and then *abandons* it:

* its timeline is completed so that nobody waits for it (the abandoned command and those queued
  behind it fail with a ``DeviceError``);
* but everything the abandoned command may still touch is leaked on purpose: memory freed with
  that command pending is never unmapped or reused (:func:`keep_forever` also keeps it alive
  through the interpreter's final teardown), and so are the queue, its C state, the program and
  any host buffer the command copies from or to;
* one warning names the command.

Unmapping memory a running thread writes to is a crash (SIGSEGV); a deliberate leak at close is
not, so the runtime leaks.

Fork
====
Worker threads do not survive ``fork()``: a device opened by the parent has no workers in a child,
so its queues would never run anything. In a child, every device the parent opened refuses use at
once with a ``DeviceError`` saying so (CUDA's rule); ``Device[name]`` in the child opens a fresh
device of its own.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import warnings
from collections.abc import Callable

#: incremented in a forked child (see :func:`fork_generation`)
_generation = 0
_kept: list[object] = []
_kept_lock = threading.Lock()


def keep_forever(obj: object) -> None:
    """Leak ``obj`` on purpose: it is never freed, not even when the interpreter tears down its
    modules at exit (an extra reference nobody drops). For memory an abandoned command may still
    use."""
    with _kept_lock:
        _kept.append(obj)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def kept_count() -> int:
    """How many objects :func:`keep_forever` holds (statistics, tests)."""
    return len(_kept)


def warn_abandoned(message: str, *, at_exit: bool) -> None:
    """The one warning of an abandoned command: a single line on stderr at interpreter exit (no
    traceback machinery is safe there), else a ``RuntimeWarning``."""
    if at_exit:
        try:
            sys.stderr.write(f"aiotinyrt: warning: {message}\n")
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):
            pass
        return
    warnings.warn(f"aiotinyrt: {message}", RuntimeWarning, stacklevel=4)


def exit_join_s() -> float:
    """Env ``EXIT_JOIN_S`` (seconds, default 2): how long closing waits for a running command."""
    return _seconds("EXIT_JOIN_S", 2.0)


def close_timeout() -> float:
    """Env ``CLOSE_TIMEOUT_S`` (seconds, default 30): how long ``aclose()`` waits for queued work."""
    return _seconds("CLOSE_TIMEOUT_S", 30.0)


def _seconds(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if 0 <= value < float("inf") else default


def fork_generation() -> int:
    """0 in the process that imported aiotinyrt; one more in each forked descendant. A device
    remembers the generation it was opened in and refuses use in any other."""
    return _generation


def forked_error_message(device: str) -> str:
    """The message of a device used in a forked child."""
    return (
        f"{device} was opened before this process ({os.getpid()}) was forked from it: worker "
        f"threads do not survive fork(); open the device again in the child (Device[{device!r}] "
        "opens a fresh one), or start children with multiprocessing's 'spawn' or 'forkserver'"
    )


def _after_fork_in_child() -> None:
    global _generation
    _generation += 1
    for callback in list(_fork_callbacks):
        try:  # (also runs in children that exec at once, e.g. uvloop's subprocesses: never fail)
            callback()
        except Exception:
            pass


_fork_callbacks: list[Callable[[], None]] = []


def on_fork_in_child(callback: Callable[[], None]) -> None:
    """Run ``callback()`` in a forked child, right after the fork (it must take no lock)."""
    _fork_callbacks.append(callback)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
