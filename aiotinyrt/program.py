"""Timelines, Signals, the host worker queue, and the Program base class.

How completion travels from a device back to an awaiting task
=============================================================

Every device queue owns one :class:`Timeline`: a monotonic count of the commands that queue has
finished. Submitting a command gives it the next value on that timeline and returns a
:class:`Signal` for it, a plain ``(timeline, value)`` pair; the signal is done when
``timeline.completed >= value``. Polling (``sig.done()``) is one integer comparison, so it is
safe from any thread and costs nothing.

The host-run backends (CPU, NULL) execute commands on one worker thread per queue
(:class:`HostQueue`). The worker pops commands in order, waits for the command's cross-queue
dependencies (signals of *other* timelines; commands on its own timeline are already ordered),
runs it, stores the elapsed time and any error on the command's signal, and then advances the
timeline. Advancing fires the *waiters* registered for values now reached.

A waiter is one of two things:

* an internal callback (deferred frees, dependency wake-ups of other workers); these run right
  there in the worker thread and must be short and must not raise. They run before any task is
  woken, so a task that wakes from ``synchronize()`` already sees memory released;
* a task's wake-up: a non-blocking, thread-safe call into the event loop the task runs on
  (``loop.call_soon_threadsafe`` on asyncio/uvloop, ``TrioToken.run_sync_soon`` on trio) that
  sets an ``anyio.Event`` the task sleeps on. The worker never waits for the loop to run it.

The only lock is the timeline's small waiter lock. Registering a waiter pushes it on a heap under
that lock and then re-reads ``completed``; the worker stores ``completed`` before it looks at the
heap. Whichever side comes second sees the other's write, so a wake-up cannot be lost; firing is
idempotent, so a wake-up may harmlessly happen twice.

Cancellation: a task that stops waiting (timeout, cancel scope, task-group failure) marks its
heap entry dead and leaves. The command itself is not touched: it runs to completion, and every
buffer it uses stays referenced by the queued command until then. Cancellation cancels the wait,
never the work.

Failure: an exception raised by a command is stored on its signal as a :class:`DeviceError`
and made sticky on the device; later commands of that device are not run (their signals fail
with the same error) until ``await dev.reset()``. Commands are never dropped silently: closing or
finalizing a device fails what it did not run.
"""

from __future__ import annotations

import array
import asyncio
import contextvars
import functools
import heapq
import itertools
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, NoReturn

import anyio
import anyio.lowlevel

from aiotinyrt import native
from aiotinyrt.helpers import debug_level, getenv, getenv_str

if TYPE_CHECKING:
    from aiotinyrt.buffer import Buffer
    from aiotinyrt.device import Compiled
    from aiotinyrt.graph import Graph
    from aiotinyrt.renderer import Kernel


class DeviceError(RuntimeError):
    """A command failed on a device (the original exception is ``__cause__``), or the device is
    in a state where it cannot run work (closed, finalized).

    ``device`` names the device; ``cause`` is the exception raised by the failing command, if any.
    """

    def __init__(self, message: str, *, device: str = "", cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.device = device
        self.cause = cause
        if cause is not None:
            self.__cause__ = cause


def _loop_waker(fn: Callable[[], object]) -> Callable[[], None]:
    """Return a callable that, from any thread, schedules ``fn`` on the calling task's event loop
    without blocking. Must be called from inside a running event loop."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None:

        def wake_asyncio() -> None:
            try:
                loop.call_soon_threadsafe(fn)
            except RuntimeError:  # the loop was closed: nobody is waiting any more
                pass

        return wake_asyncio
    import trio

    token = trio.lowlevel.current_trio_token()

    def wake_trio() -> None:
        try:
            token.run_sync_soon(fn)
        except trio.RunFinishedError:
            pass

    return wake_trio


class _Waiter:
    """One registered interest in a timeline value. ``callback`` is None once it fired or was
    abandoned."""

    __slots__ = ("after", "callback", "internal")

    def __init__(self, callback: Callable[[], None], internal: bool, after: bool = False) -> None:
        self.callback: Callable[[], None] | None = callback
        self.internal = internal
        self.after = after


class _PyState:
    """The counters of a timeline run by the pure-Python worker (the native queue keeps them in
    C, in an ``hq_t`` with the same field names)."""

    __slots__ = ("completed", "halted", "submitted", "wake_at")

    def __init__(self) -> None:
        self.completed = 0
        self.submitted = 0
        self.wake_at = native.NO_WAKE
        self.halted = 0


class Timeline:
    """A monotonic counter of the commands one device queue has completed.

    ``completed`` is written only by the queue's executor; ``submitted`` by submitters. A
    :class:`Signal` ``(timeline, value)`` is done when ``completed >= value``. Both counters live
    in ``_c``: a C ``hq_t`` when the queue runs natively (see :mod:`aiotinyrt.native`), else a
    Python object with the same fields.
    """

    __slots__ = ("_c", "_caddr", "_complete", "_failures", "_heap", "_lib", "_lock", "_seq", "device", "name")

    def __init__(self, device: str, name: str, lib: Any = None) -> None:
        self.device = device
        self.name = name
        self._lib = lib
        self._c: Any = _PyState() if lib is None else native.ffi.gc(lib.hq_new(), lib.hq_free)
        if self._c == native.ffi.NULL:
            raise MemoryError(f"{device}: cannot allocate the native queue of {name}")
        #: the C struct's address, and the store of ``completed`` that also wakes other queues'
        #: workers waiting for it in C (native dependencies)
        self._caddr = 0 if lib is None else int(native.ffi.cast("uintptr_t", self._c))
        self._complete = None if lib is None else native.completer()
        self._lock = threading.Lock()
        self._heap: list[tuple[int, int, _Waiter]] = []
        self._seq = itertools.count()
        #: (first, last, error) of commands that failed (native ones have no Python signal to
        #: hold it; on a native queue Python commands' failures are here too)
        self._failures: list[tuple[int, int, BaseException]] = []

    def __repr__(self) -> str:
        return f"<Timeline {self.device}/{self.name} completed={self.completed} submitted={self.submitted}>"

    @property
    def completed(self) -> int:
        """The value of the last command this queue finished."""
        return int(self._c.completed)

    @completed.setter
    def completed(self, value: int) -> None:
        self._c.completed = value

    @property
    def submitted(self) -> int:
        """The value of the last command handed to this queue."""
        return int(self._c.submitted)

    @submitted.setter
    def submitted(self, value: int) -> None:
        self._c.submitted = value

    @property
    def label(self) -> str:
        """``"CPU/compute"``: the device and queue this timeline counts."""
        return f"{self.device}/{self.name}"

    def failure_at(self, value: int) -> BaseException | None:
        """The error of command ``value``, if it failed (or was not run): every command of a
        native queue, Python ones included, once completed; native commands only otherwise."""
        for first, last, error in reversed(self._failures):
            if first <= value <= last:
                return error
        return None

    def _record_failure(self, first: int, last: int, error: BaseException) -> None:
        """Commands ``first..last`` failed with ``error`` (extends the newest range). Called
        before ``completed`` reaches ``last``: on a native queue it also raises ``fail_max``, so
        native commands of other queues depending on them come back to Python to be failed."""
        if first > last:
            return
        if self._lib is not None:
            self._lib.hq_note_failure(self._c, last)
        failures = self._failures
        if failures and failures[-1][1] == first - 1 and failures[-1][2] is error:
            failures[-1] = (failures[-1][0], last, error)
        else:
            failures.append((first, last, error))

    def elapsed_at(self, value: int) -> float:
        """Device seconds of native command ``value``; NaN once it is too old to be kept."""
        c = self._c
        if self._lib is None or value <= c.completed - native.ELAPSED_SLOTS:
            return math.nan
        return float(c.elapsed[value & (native.ELAPSED_SLOTS - 1)])

    def _set_wake_locked(self) -> int:
        """Store the smallest waiting value as ``wake_at`` (caller holds ``_lock``); returns
        ``completed`` as read after the store."""
        wake = self._heap[0][0] if self._heap else native.NO_WAKE
        if self._lib is None:
            self._c.wake_at = wake
            return int(self._c.completed)
        return int(self._lib.hq_set_wake(self._c, wake))

    def add_waiter(
        self, value: int, callback: Callable[[], None], *, internal: bool = False, after: bool = False
    ) -> _Waiter:
        """Call ``callback`` once ``completed >= value`` (at once, in this thread, if it already is).

        Internal callbacks run in the thread that advances the timeline and must not raise or
        block (before ``completed`` moves, or just after it with ``after``); task wake-ups must be
        non-blocking thread-safe calls into a loop.
        """
        waiter = _Waiter(callback, internal, after)
        if self.completed >= value:
            waiter.callback = None
            callback()
            return waiter
        with self._lock:
            heapq.heappush(self._heap, (value, next(self._seq), waiter))
            completed = self._set_wake_locked()
        if completed >= value:  # the executor advanced while we registered
            self.fire_due()
        return waiter

    def advance(self, value: int) -> None:
        """Mark every command up to ``value`` complete and fire the waiters that reached it.

        Internal callbacks due at ``value`` (deferred frees) run *before* ``completed`` moves, so
        anyone who sees the new value, even by polling, also sees their effects; ``completed`` is
        stored under the waiter lock once no due waiter is left, so one registered meanwhile is
        either run here first or sees the new value and fires itself. Callbacks registered with
        ``after`` (other queues' dependency waits: a dependent must see this command done) and
        task wake-ups follow the store."""
        later: list[Callable[[], None]] = []
        while True:
            with self._lock:
                due = self._pop_due_locked(value)
                if not due:
                    complete = self._complete
                    if complete is None:
                        if value > self._c.completed:  # never backwards (see stop())
                            self._c.completed = value
                    else:  # also wakes other queues' workers waiting for it (no GIL release)
                        complete(self._caddr, value)
                    break
            later += self._fire(due)
        for callback in later:
            callback()

    def fire_due(self) -> None:
        """Fire every waiter whose value has been reached: internal callbacks first, then wake-ups."""
        for callback in self._run_due(self.completed):
            callback()

    def _run_due(self, upto: int) -> list[Callable[[], None]]:
        """Pop the waiters due at ``upto``, run the internal ones, return the rest (``after``
        callbacks, then task wake-ups) for the caller to run."""
        with self._lock:
            due = self._pop_due_locked(upto)
        return self._fire(due)

    def _pop_due_locked(self, upto: int) -> list[_Waiter]:
        """Pop the waiters due at ``upto`` and lower ``wake_at`` to the next (caller holds
        ``_lock``)."""
        due: list[_Waiter] = []
        heap = self._heap
        while heap and heap[0][0] <= upto:
            due.append(heapq.heappop(heap)[2])
        if due:
            self._set_wake_locked()
        return due

    @staticmethod
    def _fire(due: list[_Waiter]) -> list[Callable[[], None]]:
        """Run the internal callbacks of ``due`` now; return its ``after`` callbacks followed by
        its task wake-ups."""
        after: list[Callable[[], None]] = []
        wakeups: list[Callable[[], None]] = []
        for waiter in due:
            callback, waiter.callback = waiter.callback, None
            if callback is None:
                continue
            if waiter.internal:
                if waiter.after:
                    after.append(callback)
                    continue
                try:
                    callback()
                except BaseException as exc:  # never let a callback kill a worker thread
                    _report_callback_error(exc)
            else:
                wakeups.append(callback)
        return after + wakeups

    def pending_waiters(self) -> int:
        """Number of tasks waiting on this timeline (statistics, tests). Internal waiters (queued
        commands of other queues, deferred frees) are work, not waiting tasks, and not counted."""
        with self._lock:
            return sum(1 for _, _, w in self._heap if w.callback is not None and not w.internal)


def _report_callback_error(exc: BaseException) -> None:
    import sys
    import traceback

    print("aiotinyrt: internal completion callback failed:", file=sys.stderr)
    traceback.print_exception(exc, file=sys.stderr)


class Signal:
    """The completion of one command: ``(timeline, value)``.

    ``await sig`` waits for the command and returns its device execution time in seconds;
    ``sig.done()`` polls. Any number of tasks, on any event loop, may await one signal.
    """

    # The command itself travels in the signal until it has run (``_fn(*_args)`` after
    # ``_deps``; ``_keep`` holds what must outlive it); the worker clears these afterwards.
    __slots__ = ("_args", "_deps", "_elapsed", "_error", "_fn", "_keep", "timeline", "value")

    def __init__(
        self,
        timeline: Timeline,
        value: int,
        fn: Callable[..., object] | None = None,
        args: tuple[Any, ...] = (),
        deps: tuple[Signal, ...] = (),
        keep: object = None,
    ) -> None:
        self.timeline = timeline
        self.value = value
        self._elapsed: float | None = 0.0  # None: a native command's, kept by the timeline
        self._error: BaseException | None = None
        self._fn = fn
        self._args = args
        self._deps = deps
        self._keep = keep

    def __repr__(self) -> str:
        state = "failed" if self.failed() else ("done" if self.done() else "pending")
        return f"<Signal {self.timeline.label}@{self.value} {state}>"

    def done(self) -> bool:
        """True once the command finished (successfully or not). Never blocks; any thread."""
        return self.timeline.completed >= self.value

    def failed(self) -> bool:
        """True if the command finished with an error."""
        return self.done() and self.error() is not None

    def error(self) -> BaseException | None:
        """The error of a failed command (None while pending or when it succeeded)."""
        if self._error is not None:
            return self._error
        timeline = self.timeline
        if timeline._failures and timeline.completed >= self.value:
            return timeline.failure_at(self.value)
        return None

    def result(self) -> float:
        """The device seconds of a finished command; raises its ``DeviceError`` if it failed,
        ``RuntimeError`` if it has not finished yet. (A native command's time is kept for the
        latest 16,384 commands of its queue; older ones report NaN.)"""
        if not self.done():
            raise RuntimeError(f"{self!r} has not completed")
        error = self.error()
        if error is not None:
            raise error
        elapsed = self._elapsed
        return self.timeline.elapsed_at(self.value) if elapsed is None else elapsed

    def __await__(self) -> Generator[Any, None, float]:
        return self.wait().__await__()

    async def wait(self, timeout: float | None = None) -> float:
        """Wait until the command completes; return its device execution time in seconds.

        ``timeout`` (seconds; default: env ``WAIT_TIMEOUT_MS``, unset = no limit) raises
        :class:`TimeoutError` naming the device, the timeline and its completed and awaited
        values. Raises :class:`DeviceError` if the command failed.

        Cancellation: cancelling the wait (or a timeout) abandons only the wait; the command keeps
        running to completion and every buffer it uses stays alive until it does. Always a
        checkpoint, even when the signal is already done.
        """
        await self._settle(timeout)
        return self.result()

    async def _settle(self, timeout: float | None = None) -> None:
        """Wait until done without raising the command's error (see :meth:`wait`)."""
        timeline, value = self.timeline, self.value
        if timeline.completed < value and timeline._lib is not None and _POLL_S > 0:
            # A native command just submitted to an awake worker is often done a few
            # microseconds later; polling that long (the worker needs no GIL) is far cheaper
            # than a waiter, a sleep and a wake-up of the loop (see _POLL_S).
            deadline = time.perf_counter() + _POLL_S
            while timeline.completed < value and time.perf_counter() < deadline:
                pass
        if timeline.completed >= value:
            await anyio.lowlevel.checkpoint()
            return
        if timeout is None:  # (read only when there is something to wait for)
            ms = getenv("WAIT_TIMEOUT_MS")
            timeout = ms / 1000 if ms > 0 else None
        event = anyio.Event()
        waiter = timeline.add_waiter(value, _loop_waker(event.set))
        try:
            if timeout is None:
                await event.wait()
            else:
                with anyio.move_on_after(timeout):
                    await event.wait()
                if timeline.completed < value:
                    raise TimeoutError(
                        f"{timeline.device}: timeline {timeline.name} not set to {value}, "
                        f"but {timeline.completed} after {timeout:g} s (the work keeps running)"
                    )
        finally:
            waiter.callback = None


#: How long ``await sig`` polls a native queue before registering a waiter (seconds; env
#: ``WAIT_POLL_US``, default 10). Read once at import.
_POLL_S = getenv("WAIT_POLL_US", 10) / 1e6


def wait_in_thread(signals: Sequence[Signal]) -> None:
    """Block the calling (non-loop) thread until every signal is done. Used by workers to resolve
    cross-queue dependencies, never by the event loop thread."""
    if all(s.timeline.completed >= s.value for s in signals):
        return
    event = threading.Event()
    when_all_done(signals, event.set, after=True)
    event.wait()


def when_all_done(signals: Sequence[Signal], fn: Callable[[], None], *, after: bool = False) -> None:
    """Call ``fn`` once every signal is done: at once in this thread if they already are,
    otherwise in the worker thread that completes the last one. ``fn`` must not raise or block."""
    pending = [s for s in signals if s.timeline.completed < s.value]
    if not pending:
        fn()
        return
    remaining = [len(pending)]
    lock = threading.Lock()

    def one_done() -> None:
        with lock:
            remaining[0] -= 1
            last = remaining[0] == 0
        if last:
            fn()

    for sig in pending:
        sig.timeline.add_waiter(sig.value, one_done, internal=True, after=after)


_SPINS = 64
#: The first item of the repeat-launch cache keys of launches passing vals: no argument list
#: (``prog(*bufs)``'s key is the buffers themselves) can be equal to such a key.
_VALS_KEY = object()
_yield_gil = time.sleep
_new_object = object.__new__


class HostQueue:
    """One in-order device queue executed by a dedicated worker thread.

    Submission is synchronous, cheap and never waits for the worker. With the native queue (see
    :mod:`aiotinyrt.native`) every command takes a slot in a C ring: a *native* command (a kernel
    call with a prepared argument block, no cross-queue dependencies) is run by C without the
    GIL; a *Python* command (``fn(*args)``, with ``deps`` waited for by the worker) is handed
    back to the worker's Python loop when its turn comes. Without it, commands travel in a deque
    to a Python worker. Either way commands run in value order, one at a time.

    Two threads submitting at once may append Python commands out of value order; the worker
    puts such a command aside until the ones before it arrive.
    """

    def __init__(self, device: Compiled, name: str) -> None:
        self.device = device
        self.name = name
        #: (name, start, seconds) of every command run, when env PROFILE is set
        self.profile: list[tuple[str, float, float]] | None = [] if getenv_str("PROFILE") else None
        # per-command timing output needs every command to pass through Python
        lib = native.load() if self.profile is None and debug_level() < 2 else None
        self._lib = lib
        self.native = lib is not None
        self.timeline = Timeline(device.name, name, lib)
        self._c = self.timeline._c
        if lib is not None:
            self._push = native.pusher()
            self._caddr = self.timeline._caddr
        # the dependencies ``(timeline, value)`` of queued native commands that have some, by
        # value (see R_DEPS); no Signals, so nothing keeps them alive
        self._dep_sigs: dict[int, tuple[tuple[Timeline, int], ...]] = {}
        self._dep_lock = threading.Lock()  # a push with dependencies and its entry above, as one
        self._commands: deque[Signal] = deque()  # queued Python commands travel as their signals
        self._values = itertools.count(1)
        self._start_lock = threading.Lock()
        self._wake = threading.Event()
        self._sleeping = False
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dropping = False  # stop(drop_queued=True): fail what has not run, with _closed_error
        self._closed_error: DeviceError | None = None
        # what native commands need alive until they ran: [last value using it, object]
        self._held: deque[list[Any]] = deque()
        self._last_held: list[Any] | None = None

    def __repr__(self) -> str:
        return f"<HostQueue {self.timeline.label} queued={self.queued()}>"

    def submit(
        self,
        fn: Callable[..., object],
        args: tuple[Any, ...],
        deps: tuple[Signal, ...] = (),
        keep: object = None,
    ) -> Signal:
        """Enqueue ``fn(*args)`` after ``deps``; return its Signal. Never blocks on the worker."""
        if self._stopping:
            raise DeviceError(f"{self.device.name} is closed", device=self.device.name)
        timeline = self.timeline
        if self._lib is None:
            value = next(self._values)
            if value > timeline.submitted:
                timeline.submitted = value
        else:  # a Python slot in the ring: the worker takes the command from the deque
            value = self._push(self._caddr, native.K_PY, 0, 0, 0)
        sig = Signal(timeline, value, fn, args, deps, keep)
        self._commands.append(sig)
        if self._thread is None:
            self._start()
        if self._sleeping:
            self._wake.set()
        return sig

    def native_deps(self, deps: Sequence[Signal]) -> list[Signal] | None:
        """Of ``deps``, those a native command must wait for (not done yet, on another queue),
        or None when one cannot be waited for in C: it already failed, or its queue is not
        native. The Python path then runs the command (and names the failure)."""
        out: list[Signal] = []
        for dep in deps:
            timeline = dep.timeline
            # (one of this queue's own commands stays a dependency too: done by the time this one
            # runs, but the worker must still see whether it failed)
            if dep._error is not None or timeline._lib is None:
                return None
            if timeline.completed < dep.value:
                out.append(dep)
            elif timeline._failures and dep.error() is not None:
                return None
        return out

    def submit_native(
        self, fn: int, nargs: int, block: int, keep: object, deps: Sequence[Signal] = ()
    ) -> Signal:
        """Enqueue a native call ``fn(*block[:nargs])`` (addresses; ``fn`` 0 runs nothing) and
        return its Signal. ``keep`` (holding the block, the library and the memory the call
        touches) stays alive until the call ran. ``deps`` (from :meth:`native_deps`) are waited
        for by the worker, in C. Only where ``native`` is set. (The extension module's
        ``launch()`` does the same for repeat launches, in C.)"""
        if self._stopping:
            self._refuse_closed()
        if deps:
            # (an array.array: its buffer address without cffi's Python-level new() and cast())
            pairs = array.array("q", [x for dep in deps for x in (dep.timeline._caddr, dep.value)])
            address = pairs.buffer_info()[0]
            on = tuple((dep.timeline, dep.value) for dep in deps)
            waiting = self._dep_sigs
            with self._dep_lock:  # the worker's R_DEPS look-up must find the entry
                value = self._push(self._caddr, native.K_NATIVE, fn, nargs, block, len(deps), address)
                waiting[value] = on
            if len(waiting) > 64:
                self._prune_deps()
            self._hold(value, (keep, pairs, on))  # the timelines own the C queues it reads
        else:
            value = self._push(self._caddr, native.K_NATIVE, fn, nargs, block)
            held = self._last_held
            if held is not None and held[1] is keep:
                held[0] = value
            else:
                self._hold(value, keep)
        sig = _new_object(Signal)
        sig.timeline = self.timeline
        sig.value = value
        sig._error = None
        sig._elapsed = None
        return sig

    def _refuse_closed(self) -> NoReturn:
        """The error of a submission to a stopped queue (also raised by the C replay)."""
        raise DeviceError(f"{self.device.name} is closed", device=self.device.name)

    def _prune_deps(self) -> None:
        """Forget the dependencies of commands that ran (R_DEPS pops only suspects)."""
        waiting = self._dep_sigs
        completed = self._c.completed
        for done in [v for v in list(waiting) if v <= completed]:
            waiting.pop(done, None)

    def submit_either(
        self,
        call: tuple[int, int, int, object] | None,
        fn: Callable[..., object],
        args: tuple[Any, ...],
        deps: tuple[Signal, ...],
        keep: object,
    ) -> Signal:
        """Enqueue a command that has both forms: the native ``call`` (``(fn, nargs, block,
        keep)``, or None) when the worker can wait for ``deps`` in C, else ``fn(*args)``."""
        if call is not None and self.native:
            waits = self.native_deps(deps) if deps else ()
            if waits is not None:
                return self.submit_native(call[0], call[1], call[2], (call[3], keep), waits)
        return self.submit(fn, args, deps, keep)

    def _hold(self, value: int, keep: object) -> None:
        """Keep ``keep`` alive until command ``value`` ran (and later ones extend it while it is
        the newest). Also starts the worker: every first native submission comes through here."""
        if self._thread is None:
            self._start()
        held = self._last_held = [value, keep]
        queue = self._held
        queue.append(held)
        if len(queue) > 16:
            completed = self._c.completed
            while queue and queue[0][0] <= completed:
                if queue.popleft() is self._last_held:
                    self._last_held = None

    def queued(self) -> int:
        """Commands submitted and not completed (including the one running)."""
        return self.timeline.submitted - self.timeline.completed

    def _halt(self, halted: bool) -> None:
        """Stop (or resume) running native commands: the device holds a sticky error."""
        self._c.halted = 1 if halted or self._dropping else 0

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                target = self._worker if self._lib is None else self._native_worker
                thread = threading.Thread(target=target, name=f"aiotinyrt-{self.timeline.label}", daemon=True)
                thread.start()
                self._thread = thread

    def _next_command(self, expected: int, early: dict[int, Signal]) -> Signal:
        """Pop the Python command with value ``expected``, sleeping while the queue is empty."""
        commands = self._commands
        while True:
            command = early.pop(expected, None)
            if command is not None:
                return command
            try:
                command = commands.popleft()
            except IndexError:
                # Spin briefly (releasing the GIL) before sleeping: a burst of launches then needs
                # no wake-up per command, and an idle queue costs nothing after ~100 µs.
                for _ in range(_SPINS):
                    _yield_gil(0)
                    if commands:
                        break
                else:
                    self._sleeping = True
                    if not commands:
                        self._wake.wait()
                        self._wake.clear()
                    self._sleeping = False
                continue
            if command.value == expected:
                return command
            early[command.value] = command

    def _run_command(self, sig: Signal, value: int, perf: Callable[[], float], debug: int) -> None:
        """Run one Python command (after its dependencies) and store its outcome on its signal."""
        device = self.device
        fn, args, deps = sig._fn, sig._args, sig._deps
        if deps:
            wait_in_thread(deps)
            for dep in deps:
                error = dep.error()
                if error is not None:
                    sig._error = _dependency_failed(device.name, dep.timeline.label, dep.value, error)
                    break
        if self._dropping and sig._error is None:
            sig._error = self._closed_error
        if sig._error is None:
            if device._error is None:
                start = perf()
                try:
                    fn(*args)  # type: ignore[misc]
                except BaseException as exc:
                    sig._error = device._fail(exc, sig)
                sig._elapsed = perf() - start
                if debug >= 2:
                    name = _describe(fn, sig._keep)
                    print(f"{self.timeline.label}@{value}: {name} {fmt_time(sig._elapsed)}")
                if self.profile is not None:
                    self.profile.append((_describe(fn, sig._keep), start, sig._elapsed))
            else:
                sig._error = device._error
        sig._fn = sig._args = sig._deps = sig._keep = None  # type: ignore[assignment]

    def _worker(self) -> None:
        """The pure-Python worker: pops commands from the deque and runs them in value order."""
        commands, timeline, device = self._commands, self.timeline, self.device
        perf = time.perf_counter
        early: dict[int, Signal] = {}
        expected = timeline.completed + 1
        debug = debug_level()
        while True:
            try:
                sig = commands.popleft()
                if sig.value != expected:
                    commands.appendleft(sig)
                    raise IndexError
            except IndexError:
                sig = self._next_command(expected, early)
            if sig._fn is None:  # stop marker: args[0] is the last value this queue handed out
                for early_sig in early.values():
                    early_sig._error = DeviceError(f"{device.name} was closed", device=device.name)
                timeline.advance(sig._args[0])
                return
            self._run_command(sig, expected, perf, debug)
            timeline.advance(expected)
            expected += 1

    def _native_worker(self) -> None:
        """The worker of a native queue: sits in C running native commands, and comes back to
        Python for Python commands, waiters and failures (see :mod:`aiotinyrt.native`)."""
        lib: Any = self._lib
        c, timeline, device = self._c, self.timeline, self.device
        perf = time.perf_counter
        early: dict[int, Signal] = {}
        debug = debug_level()
        while True:
            code = lib.hq_run(c)
            value = c.expected
            if code == native.R_PY:
                sig = self._next_command(value, early)
                if sig._fn is None:  # stop marker
                    for early_sig in early.values():
                        early_sig._error = DeviceError(f"{device.name} was closed", device=device.name)
                    timeline.advance(value)
                    lib.hq_next(c)
                    return
                self._run_command(sig, value, perf, debug)
                if sig._error is not None:  # on the timeline too: native dependents look there
                    timeline._record_failure(value, value, sig._error)
            elif code == native.R_DEPS:  # a dependency's queue has failures: look at its outcome
                with self._dep_lock:
                    on = self._dep_sigs.pop(value, ())
                for other, at in on:
                    error = other.failure_at(at)
                    if error is not None:
                        failed = _dependency_failed(device.name, other.label, at, error)
                        timeline._record_failure(value, value, failed)
                        break
                else:
                    c.deps_ok = 1  # run it after all
                    continue
            elif code == native.R_HALTED:
                error = self._closed_error if self._dropping else device._error
                if error is None:  # reset meanwhile: run it after all
                    self._halt(False)
                    continue
                timeline._record_failure(value, value, error)
            timeline.advance(value)
            lib.hq_next(c)

    def stop(self, *, drop_queued: bool, join_timeout: float | None) -> None:
        """Stop the worker after what is queued (or fail what is queued when ``drop_queued``).

        Dropped commands complete with a ``DeviceError`` so nobody waits forever for them; a
        worker stuck in a command is abandoned after ``join_timeout`` seconds (it is a daemon
        thread, so it never holds up interpreter exit). ``join_timeout=None`` does not wait at
        all: the caller awaits the timeline reaching ``submitted`` instead.
        """
        if self._stopping:
            return
        self._stopping = True
        name = self.device.name
        closed = self._closed_error = DeviceError(f"{name} was closed before this command ran", device=name)
        if self._lib is not None:
            if drop_queued:
                self._dropping = True
                self._halt(True)
                for sig in list(self._commands):  # queued Python commands: failed, never run
                    if sig._error is None:
                        sig._error = closed
            value = self._push(self._caddr, native.K_PY, 0, 0, 0)
            self._commands.append(Signal(self.timeline, value, None, (value,)))
            if self._sleeping:
                self._wake.set()
        else:
            dropped: list[Signal] = []
            if drop_queued:
                while True:
                    try:
                        dropped.append(self._commands.popleft())
                    except IndexError:
                        break
            dropped.sort(key=lambda c: c.value)
            for sig in dropped:
                sig._error = closed
                sig._fn = sig._args = sig._deps = sig._keep = None  # type: ignore[assignment]
            value = next(self._values)
            self.timeline.submitted = value
            if self._thread is not None:
                # the marker takes the place of the dropped commands: the worker advances past them
                first = dropped[0].value if dropped else value
                self._commands.append(Signal(self.timeline, first, None, (value,)))
                self._wake.set()
        if self._thread is None:
            self.timeline.advance(value)
            return
        if join_timeout is None:  # the caller waits for the timeline itself (without blocking)
            return
        self._thread.join(join_timeout)
        timeline = self.timeline
        if timeline.completed < value:
            # the worker is stuck in a command: complete the rest so waiters return; native
            # commands among them (after the stuck one) never ran
            timeline._record_failure(timeline.completed + 2, value - 1, closed)
            timeline.advance(value)


def _dependency_failed(device: str, label: str, value: int, error: BaseException) -> DeviceError:
    return DeviceError(
        f"{device}: not run because a command it depends on failed ({label}@{value}): {error}",
        device=device,
        cause=error,
    )


def _describe(fn: object, keep: object) -> str:
    """A name for a command in DEBUG output: the kernel's name, else the function's."""
    if isinstance(keep, tuple) and len(keep) == 2 and isinstance(keep[1], Program):
        return keep[1].name
    return getattr(fn, "__name__", type(fn).__name__)


_UNIT_SIZE = (1, 1, 1)
_NO_VALS: tuple[int, ...] = ()

#: The graph the current task is capturing into, if any (see :mod:`aiotinyrt.graph`).
_capturing: contextvars.ContextVar[Graph | None] = contextvars.ContextVar("aiotinyrt_capture", default=None)


@functools.cache
def _buffer_type() -> type[Buffer]:
    from aiotinyrt.buffer import Buffer

    return Buffer


class Program:
    """One loaded kernel of a device. Calling it enqueues a launch and returns a :class:`Signal`.

    Backends subclass it and provide :meth:`_launcher`, which turns buffer handles, sizes and
    int values into a ``(function, args)`` pair the device queue runs. The base class owns the
    argument validation and the ordering of launches against other work on the same memory.
    """

    #: Most int vals one launch may pass.
    MAX_VALS: ClassVar[int] = 64

    def __init__(
        self, device: Compiled, name: str, lib: bytes, *, src: str | None = None, kernel: Kernel | None = None
    ) -> None:
        if not isinstance(name, str) or not name.isidentifier():
            raise ValueError(f"kernel name must be a C identifier, got {name!r}")
        if not isinstance(lib, (bytes, bytearray, memoryview)):
            raise TypeError(f"program binary must be bytes, got {type(lib).__name__}")
        if len(lib) == 0:
            raise ValueError(f"program binary for {name!r} is empty")
        self.device = device
        self.name = name
        self.lib = bytes(lib)
        #: Number of buffer and int arguments the kernel takes, when known (from its source).
        self.buf_count: int | None = None
        self.val_count: int | None = None
        #: The portable kernel this program was rendered from, if any: its launches take the
        #: kernel's vals and global size, check buffer dtypes and know which buffers are written.
        self.kernel = kernel
        if kernel is not None:
            self.buf_count, self.val_count = len(kernel.buffers), len(kernel.scalars)
            self._kernel_writes = frozenset(kernel.writes)
        elif src is not None:
            signature = parse_c_signature(src, name)
            if signature is not None:
                self.buf_count, self.val_count = signature
        self._entries: dict[tuple[Any, ...], Any] = {}  # native queue: see _native_entry
        # the fast path of __call__: buffers -> entry, and (_VALS_KEY, buffers, vals) -> entry
        self._by_bufs: dict[tuple[Any, ...], Any] = {}
        queue: HostQueue | None = getattr(device, "_compute_queue", None)
        native_raw = queue is not None and queue.native and kernel is None
        #: the repeat launch's state: (queue, timeline, _by_bufs, the queue's C address)
        self._fast: tuple[HostQueue, Timeline, dict[tuple[Any, ...], Any], int] | None = (
            (queue, queue.timeline, self._by_bufs, queue._caddr) if queue is not None and native_raw else None
        )
        self._c_launch = native.launcher(Signal, _buffer_type()) if native_raw else None
        if self._c_launch is not None and Program.__dict__["__call__"] is Program._call_py:
            # the repeat launch skips this method's Python frame: see native.install_call
            native.install_call(Program, Program._call_py, _capturing, _VALS_KEY)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name} on {self.device.name}>"

    def _launcher(
        self,
        handles: tuple[Any, ...],
        global_size: tuple[int, ...],
        local_size: tuple[int, ...] | None,
        vals: tuple[int, ...],
    ) -> tuple[Callable[..., object], tuple[Any, ...]]:
        """Return ``(fn, args)`` such that ``fn(*args)`` runs the kernel once, synchronously, on the
        device queue's worker. Must not run anything itself."""
        raise NotImplementedError

    def _native_call(self, handles: list[Any], global_size: tuple[int, ...], vals: tuple[int, ...]) -> Any:
        """Backend hook for native queues (:mod:`aiotinyrt.native`): ``(fn, nargs, block, keep)``
        where ``fn`` is the address of a C function (0: nothing to run), ``block`` the address of
        a ``uint64_t[]`` of its ``nargs`` arguments and ``keep`` what keeps that block alive; or
        None when this launch must run through :meth:`_launcher`. Called once per distinct
        argument list (the result is cached)."""
        return None

    def _native_entry(self, handles: list[Any], global_size: tuple[int, ...], vals: tuple[int, ...]) -> Any:
        """``(fn, nargs, block, handles, keep, self)`` for the native queue, or None. Cached per
        argument list; the tuple travels with the launch and keeps what it uses alive."""
        key = (*handles, vals)
        entry = self._entries.get(key)
        if entry is None:
            call = self._native_call(handles, global_size, vals)
            if call is None:
                return None
            if len(self._entries) >= 256:  # queued launches keep their own entries alive
                self._entries.clear()
                self._by_bufs.clear()
            fn, nargs, block, keep = call
            entry = self._entries[key] = (fn, nargs, block, tuple(handles), keep, self)
        return entry

    def _call_py(
        self,
        *bufs: Buffer,
        global_size: Sequence[int] = _UNIT_SIZE,
        local_size: Sequence[int] | None = None,
        vals: Sequence[int] = _NO_VALS,
        wait_for: Sequence[Signal] = (),
        writes: Sequence[int] | None = None,
    ) -> Signal:
        """Enqueue one launch of this kernel and return its Signal at once.

        ``bufs`` are allocated buffers of this program's device (views allowed); ``vals`` are
        32-bit ints passed after the buffers; ``wait_for`` adds explicit dependencies on signals
        of any device; ``writes`` lists the indices of the buffers the kernel writes (default:
        all of them), which orders it against other work on the same memory. Arguments are
        checked before anything is enqueued (``TypeError``/``ValueError``).
        """
        fast = self._fast
        plain = (  # what a repeat launch may be: buffers, and at most vals
            fast is not None
            and global_size is _UNIT_SIZE
            and local_size is None
            and not wait_for
            and writes is None
            and _capturing.get() is None
        )
        if plain and vals is _NO_VALS and self._c_launch is None:
            # The common launch, again, without the extension module (with it, the C __call__
            # did this before calling here): same buffers as an earlier native launch, each
            # still holding the memory it had then, each last touched by this queue only.
            assert fast is not None
            queue, timeline = fast[0], fast[1]
            try:
                entry = self._by_bufs.get(bufs)
            except TypeError:  # an unhashable argument: the full path says what is wrong
                entry = None
            if entry is not None:
                for b, handle in zip(bufs, entry[3], strict=True):  # the key is bufs: same length
                    if b._handle is not handle:
                        break
                    accesses = b._accesses
                    if accesses and (len(accesses) > 1 or accesses[0][2].timeline is not timeline):
                        break
                else:
                    sig = queue.submit_native(entry[0], entry[1], entry[2], entry)
                    for b in bufs:
                        b._accesses = [(0, b.nbytes, sig, True)]
                    return sig
        sig = self._call(bufs, global_size, local_size, vals, wait_for, writes)
        if plain:  # remember it for the repeat launch
            if vals is _NO_VALS:
                self._remember(bufs, (), bufs, sig)
            elif self._c_launch is not None and type(vals) is tuple and all(type(v) is int for v in vals):
                # (only the C __call__ repeats launches passing vals, exact ints as here)
                self._remember(bufs, vals, (_VALS_KEY, bufs, vals), sig)
        return sig

    def _remember(self, bufs: tuple[Buffer, ...], vals: tuple[int, ...], key: Any, sig: Signal) -> None:
        """Cache the native entry of a launch just made on the normal path under ``key``, for
        the repeat launch: only whole buffers, and only if it went to this program's queue."""
        fast = self._fast
        if (
            fast is not None
            and all(type(b) is _buffer_type() and b._base is None for b in bufs)
            and sig.timeline is fast[1]
        ):
            entry = self._native_entry([b._handle for b in bufs], _UNIT_SIZE, vals)
            if entry is not None:
                self._by_bufs[key] = entry

    #: With the extension module, replaced by a C function that runs the repeat launch (as the
    #: fast path above does) and calls ``_call_py`` for everything else.
    __call__ = _call_py

    def _call(
        self,
        bufs: tuple[Buffer, ...],
        global_size: Sequence[int],
        local_size: Sequence[int] | None,
        vals: Sequence[int],
        wait_for: Sequence[Signal],
        writes: Sequence[int] | None,
    ) -> Signal:
        device = self.device
        if self.kernel is not None:
            return self._call_kernel(bufs, global_size, local_size, vals, wait_for, writes)
        gsz = global_size if global_size is _UNIT_SIZE else _check_size("global_size", global_size)
        lsz = None if local_size is None else _check_size("local_size", local_size)
        if vals or type(vals) is not tuple:
            vals = self._check_vals(vals)
        if self.buf_count is not None and len(bufs) != self.buf_count:
            raise TypeError(f"{self.name} takes {self.buf_count} buffers, got {len(bufs)}")
        if self.val_count is not None and len(vals) != self.val_count:
            raise TypeError(f"{self.name} takes {self.val_count} int vals, got {len(vals)}")
        written = None if writes is None else self._check_writes(writes, len(bufs))
        handles = device._launch_handles(self.name, bufs)
        deps = _check_wait_for(wait_for) if wait_for else ()
        return device._submit_launch(self, handles, gsz, lsz, vals, bufs, deps, written)

    def _call_kernel(
        self,
        bufs: tuple[Buffer, ...],
        global_size: Sequence[int],
        local_size: Sequence[int] | None,
        vals: Sequence[int],
        wait_for: Sequence[Signal],
        writes: Sequence[int] | None,
    ) -> Signal:
        """A launch of a rendered Kernel: its dtypes, vals and global size are checked and its
        int arguments become ``vals + (gsz0, gsz1, gsz2)``."""
        kernel = self.kernel
        assert kernel is not None
        device = self.device
        handles = device._launch_handles(self.name, bufs)
        kernel.check_buffers([b.dtype for b in bufs])
        gsz = kernel.launch_size(None if global_size is _UNIT_SIZE else global_size)
        lsz = None if local_size is None else _check_size("local_size", local_size)
        all_vals = kernel.launch_vals(vals, gsz)
        written = self._kernel_writes if writes is None else self._check_writes(writes, len(bufs))
        deps = _check_wait_for(wait_for) if wait_for else ()
        return device._submit_launch(self, handles, gsz, lsz, all_vals, bufs, deps, written)

    def _check_vals(self, vals: Sequence[int]) -> tuple[int, ...]:
        if type(vals) is not tuple:
            if isinstance(vals, (str, bytes)) or not isinstance(vals, Sequence):
                raise TypeError(f"vals must be a sequence of ints, got {type(vals).__name__}")
            vals = tuple(vals)
        for v in vals:
            if type(v) is not int and (isinstance(v, bool) or not isinstance(v, int)):
                raise TypeError(f"{self.name}: vals must be ints, got {v!r} ({type(v).__name__})")
            if not -(2**31) <= v < 2**31:
                raise ValueError(f"{self.name}: val {v} does not fit in a 32-bit int")
        if len(vals) > self.MAX_VALS:
            raise ValueError(f"{self.name}: at most {self.MAX_VALS} vals, got {len(vals)}")
        return vals

    def _check_writes(self, writes: Sequence[int], nbufs: int) -> frozenset[int]:
        if isinstance(writes, (str, bytes)) or not isinstance(writes, (Sequence, set, frozenset)):
            raise TypeError(f"{self.name}: writes= must be a sequence of buffer indices, got {writes!r}")
        for i in writes:
            if type(i) is not int or not 0 <= i < nbufs:
                raise ValueError(f"{self.name}: writes= index {i!r} is not a buffer index (0..{nbufs - 1})")
        return frozenset(writes)


def _check_size(what: str, size: Sequence[int]) -> tuple[int, ...]:
    if type(size) is tuple and len(size) == 3 and all(type(s) is int and s > 0 for s in size):
        return size
    if isinstance(size, int) or not isinstance(size, Sequence):
        raise TypeError(f"{what} must be a sequence of 1 to 3 ints, got {size!r}")
    if not 1 <= len(size) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got {len(size)}")
    for s in size:
        if type(s) is not int:
            raise TypeError(f"{what} must hold ints, got {s!r}")
        if s <= 0:
            raise ValueError(f"{what} must be positive in every dimension, got {tuple(size)}")
    return tuple(size) + (1,) * (3 - len(size))


def _check_wait_for(wait_for: Sequence[Signal]) -> tuple[Signal, ...]:
    if not wait_for:
        return ()
    if isinstance(wait_for, Signal):
        return (wait_for,)
    deps = tuple(wait_for)
    for dep in deps:
        if not isinstance(dep, Signal):
            raise TypeError(f"wait_for must hold Signals, got {type(dep).__name__}")
    return deps


def fmt_time(seconds: float) -> str:
    """Format a duration for humans (``12.3 µs``)."""
    if math.isnan(seconds):
        return "n/a"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.2f} µs"
    if seconds < 1:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds:.2f} s"


_C_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)


def parse_c_signature(src: str, name: str) -> tuple[int, int] | None:
    """Count the pointer (buffer) and scalar (int) parameters of C function ``name`` in ``src``.

    Returns None when the definition cannot be found (the launch is then not checked).
    """
    code = _C_COMMENT.sub(" ", src)
    match = re.search(rf"\b{re.escape(name)}\s*\(([^)]*)\)\s*\{{", code)
    if match is None:
        return None
    params = [p.strip() for p in match.group(1).split(",") if p.strip() and p.strip() != "void"]
    bufs = sum(1 for p in params if "*" in p)
    return bufs, len(params) - bufs
