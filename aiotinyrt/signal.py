"""Timelines and Signals: completion, waiting and failure of device commands.

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

import asyncio
import heapq
import itertools
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable, Generator, Sequence
from typing import Any

import anyio
import anyio.lowlevel

from aiotinyrt import native
from aiotinyrt.helpers import check_timeout, env_wait_timeout, getenv
from aiotinyrt.lifetime import fork_generation, forked_error_message


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

    __slots__ = (
        "_abandoned",
        "_c",
        "_caddr",
        "_complete",
        "_failures",
        "_generation",
        "_heap",
        "_lib",
        "_lock",
        "_seq",
        "claim",
        "device",
        "name",
        "poll",
        "unclaim",
    )

    def __init__(self, device: str, name: str, lib: Any = None, state: Any = None) -> None:
        self.device = device
        self.name = name
        self._lib = lib
        #: the counters: a C ``hq_t`` (``lib``), a driver's object with the fields of
        #: :class:`_PyState` (``state``: one that learns ``wake_at``), or a :class:`_PyState`
        self._c: Any = _PyState() if state is None else state
        if lib is not None:
            self._c = native.ffi.gc(lib.hq_new(), lib.hq_free)
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
        #: the first command an abandoned worker may still be running (see aiotinyrt.lifetime):
        #: memory used by commands from it on is never released
        self._abandoned = ABANDONED_NEVER
        self._generation = fork_generation()  # the process (by fork generation) that runs it
        #: a driver-run queue's brief wait for command ``value`` in the awaiting thread, which
        #: completes it there if it completes meanwhile (``Driver.poll``); it may return the
        #: command's device seconds when it completed it without error (else None); None: no
        #: such wait
        self.poll: Callable[..., float | None] | None = None
        #: a driver-run queue's claim of command ``value`` for a ``poll(value, claim)`` of this
        #: thread after a checkpoint (the claim's number, 0: none; ``unclaim(claim)`` gives it
        #: up), if it offers one
        self.claim: Callable[[int], int] | None = None
        self.unclaim: Callable[[int], None] | None = None

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
            try:
                callback()
            except BaseException as exc:  # as internal ones: never kill the completing thread
                _report_callback_error(exc)

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
        # ``await sig`` without a timeout. The round trip of a driver-run queue that claims its
        # commands (a CL launch awaited as soon as it was made) runs here, without the frames
        # of wait() and _settle() and anyio's dispatch: claim, checkpoint, poll. The checkpoint
        # is the one anyio's comes down to: on asyncio (uvloop too) a bare ``yield``, which is
        # what ``asyncio.sleep(0)`` makes (the task runs again after one pass of the loop, and
        # a cancellation is thrown in there); on trio ``trio.lowlevel.checkpoint()``. A poll
        # that completed the command returns its device seconds; anything else goes on as
        # wait() does, its checkpoint made. A command already done, on any queue, takes that
        # checkpoint alone (wait()'s frames and anyio's: ~7 of ~15 us of it on asyncio here).
        timeline = self.timeline
        claim = timeline.claim
        library = _async_library.name if "trio" in _MODULES and _async_library is not None else None
        if library not in (None, "asyncio", "trio"):
            return (yield from self.wait().__await__())
        number = 0 if claim is None else claim(self.value)  # (0: nothing claimed, or done)
        done = not number and timeline.completed >= self.value
        if claim is None and not done:
            return (yield from self.wait().__await__())
        poll = timeline.poll
        if number or done:
            try:
                if library == "trio":
                    yield from _MODULES["trio"].lowlevel.checkpoint().__await__()
                else:
                    yield
            except BaseException:
                if number:
                    assert timeline.unclaim is not None
                    timeline.unclaim(number)
                raise
            if done:
                return self.result()
            assert poll is not None
            elapsed = poll(self.value, number)
            if elapsed is not None:
                return elapsed
        elif timeline.completed < self.value:
            assert poll is not None
            poll(self.value)  # (nothing claimed: the poll an unclaimed wait makes)
        yield from self._settle(None, polled=True, checked=bool(number)).__await__()
        return self.result()

    async def wait(self, timeout: float | None = None) -> float:
        """Wait until the command completes; return its device execution time in seconds.

        ``timeout`` (seconds, any real number: negative has expired, ``inf`` is no limit;
        default: env ``WAIT_TIMEOUT_MS``, unset = no limit) raises :class:`TimeoutError` naming
        the device, the timeline and its completed and awaited values. A NaN timeout is a
        ``ValueError``, a non-number a ``TypeError``, raised before anything waits. Raises
        :class:`DeviceError` if the command failed.

        Cancellation: cancelling the wait (or a timeout) abandons only the wait; the command keeps
        running to completion and every buffer it uses stays alive until it does. Always a
        checkpoint, even when the signal is already done.
        """
        await self._settle(None if timeout is None else check_timeout(timeout))
        return self.result()

    def wait_blocking(self, timeout: float | None = None) -> float:
        """Block the calling thread until the command completes; return its device seconds.

        For synchronous callers outside any event loop (tinygrad's runtime calls, plain scripts,
        worker threads). ``timeout`` (seconds, None = no limit) raises :class:`TimeoutError`
        naming the device, the timeline and both values; the work keeps running. Raises the
        command's :class:`DeviceError` if it failed.

        On a thread running an event loop (asyncio, uvloop, trio) it raises ``RuntimeError``
        at once, done or not, instead of blocking the loop: ``await sig`` there. The wake-up is
        an internal waiter: it runs in the worker thread that completes the command (after
        ``completed`` moved) and sets a ``threading.Event``; no event loop is involved.
        """
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"timeout must be None or >= 0 seconds, got {timeout!r}")
        try:
            asyncio.get_running_loop()
            on_loop = True
        except RuntimeError:
            trio = sys.modules.get("trio")
            on_loop = trio is not None and trio.lowlevel.in_trio_run()
        if on_loop:
            raise RuntimeError(
                f"{self!r}: wait_blocking() called on an event-loop thread, where it would block "
                "the loop; use 'await sig' there, or call it from a worker thread"
            )
        timeline, value = self.timeline, self.value
        if timeline.completed < value and timeline._lib is not None and _POLL_S > 0:
            deadline = time.perf_counter() + _POLL_S  # a just-submitted native command (see _settle)
            while timeline.completed < value and time.perf_counter() < deadline:
                pass
        if timeline.completed < value:
            event = threading.Event()
            waiter = timeline.add_waiter(value, event.set, internal=True, after=True)
            try:
                if not event.wait(timeout):
                    raise TimeoutError(
                        f"{timeline.device}: timeline {timeline.name} not set to {value}, "
                        f"but {timeline.completed} after {timeout:g} s (the work keeps running)"
                    )
            finally:
                waiter.callback = None
        return self.result()

    async def _settle(
        self, timeout: float | None = None, polled: bool = False, checked: bool = False
    ) -> None:
        """Wait until done without raising the command's error (see :meth:`wait`); ``polled``:
        the caller made the claim and the poll (``__await__``), ``checked``: and its
        checkpoint."""
        timeline, value = self.timeline, self.value
        if not polled and timeline.completed < value and timeline.poll is not None:  # a driver-run queue
            claim = 0 if timeline.claim is None else timeline.claim(value)
            if claim:
                # The checkpoint first, while the device runs the command (the claim sent it),
                # then the poll that ends the claim: the waiter thread leaves it to this poll
                try:
                    await anyio.lowlevel.checkpoint()
                except BaseException:
                    assert timeline.unclaim is not None
                    timeline.unclaim(claim)
                    raise
                checked = True
                timeline.poll(value, claim)
            else:
                timeline.poll(value)  # (see Timeline.poll)
        if timeline.completed < value and timeline._lib is not None and _POLL_S > 0:
            # A native command just submitted to an awake worker is often done a few
            # microseconds later; polling that long (the worker needs no GIL) is far cheaper
            # than a waiter, a sleep and a wake-up of the loop (see _POLL_S).
            deadline = time.perf_counter() + _POLL_S
            while timeline.completed < value and time.perf_counter() < deadline:
                pass
        if timeline.completed >= value:
            if not checked:
                await anyio.lowlevel.checkpoint()
            return
        if timeline._generation != fork_generation():  # a device of the parent: nothing runs it
            raise DeviceError(forked_error_message(timeline.device), device=timeline.device)
        if timeout is None:  # (read only when there is something to wait for)
            timeout = env_wait_timeout()
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


#: sniffio's thread-local, whose ``name`` trio sets to ``"trio"`` for as long as it runs in
#: the thread (trio imports sniffio). ``Signal.__await__`` makes trio's checkpoint where trio
#: is imported and that name is ``"trio"``, a bare yield where trio is not imported or the
#: name is unset (or ``"asyncio"``): under asyncio and uvloop, as anyio decides without
#: sniffio; any other name goes through ``wait()``. Not
#: ``asyncio._get_running_loop()``: it asks the OS for the process id at each call (a fork
#: check), a system call that cost ~1-1.5 us of a ~25 us round trip here.
_MODULES = sys.modules
_async_library: Any
try:
    from sniffio import thread_local as _async_library
except ImportError:  # (no sniffio: no trio either)
    _async_library = None

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


#: ``Timeline._abandoned`` of a timeline whose worker was never abandoned
ABANDONED_NEVER = 1 << 62


def abandoned(signals: Sequence[Signal]) -> bool:
    """Whether any of ``signals`` is a command an abandoned worker may still be running (or one
    queued behind it): the memory it uses must never be released (see :mod:`aiotinyrt.lifetime`)."""
    return any(s.value >= s.timeline._abandoned for s in signals)


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


def dependency_failed(device: str, label: str, value: int, error: BaseException) -> DeviceError:
    return DeviceError(
        f"{device}: not run because a command it depends on failed ({label}@{value}): {error}",
        device=device,
        cause=error,
    )
