"""Device queues: the host-run kind, a worker thread running commands in order.

A queue owns one :class:`~aiotinyrt.signal.Timeline`. Submitting a command hands it the next
value and returns its :class:`~aiotinyrt.signal.Signal` at once; the queue's executor runs the
commands in value order, stores each one's outcome and advances the timeline (see
:mod:`aiotinyrt.signal` for how completion then reaches waiting tasks).
"""

from __future__ import annotations

import array
import contextvars
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, NoReturn, Protocol

from aiotinyrt import native, recorder
from aiotinyrt.helpers import debug_level, fmt_time, get_logger
from aiotinyrt.lifetime import keep_forever, warn_abandoned
from aiotinyrt.signal import DeviceError, Signal, Timeline, dependency_failed, wait_in_thread


class QueueOwner(Protocol):
    """What a queue needs of its device: a name, the sticky error, and the hook that turns an
    exception raised by a command into that error."""

    name: str
    _error: DeviceError | None

    def _fail(self, exc: BaseException, sig: Signal) -> DeviceError: ...
    def _refusal(self) -> DeviceError: ...


class Queue(Protocol):
    """What every kind of queue offers: :class:`HostQueue` (a worker thread runs the commands)
    and :class:`~aiotinyrt.driverqueue.DriverQueue` (the backend's driver runs them). A device
    picks the kind per queue (``Compiled._make_queue``)."""

    device: QueueOwner
    name: str
    timeline: Timeline
    #: True where commands may take the native ring (``submit_native``, ``_caddr``): a
    #: HostQueue whose worker is the C one.
    native: bool
    _caddr: int
    profile: recorder.QueueTrace | None
    _thread: threading.Thread | None
    _stopping: bool

    def submit(
        self,
        fn: Callable[..., object],
        args: tuple[Any, ...],
        deps: tuple[Signal, ...] = (),
        keep: object = None,
    ) -> Signal: ...
    def submit_either(
        self,
        call: tuple[int, int, int, object] | None,
        fn: Callable[..., object],
        args: tuple[Any, ...],
        deps: tuple[Signal, ...],
        keep: object,
    ) -> Signal: ...
    def native_deps(self, deps: Sequence[Signal]) -> list[Signal] | None: ...
    def submit_native(
        self, fn: int, nargs: int, block: int, keep: object, deps: Sequence[Signal] = ()
    ) -> Signal: ...
    def queued(self) -> int: ...
    def _halt(self, halted: bool) -> None: ...
    def stop(self, *, drop_queued: bool, join_timeout: float | None) -> None: ...


class Recorder(Protocol):
    """Where submissions go instead of a queue while a task captures a graph
    (:class:`~aiotinyrt.graph.Graph`): ``fn(*args)`` on ``queue``, touching ``bufs`` (written
    where ``writes`` says), after ``wait_for``; returns a placeholder Signal."""

    def _record(
        self,
        queue: Queue,
        fn: Callable[..., object],
        args: tuple[Any, ...],
        bufs: tuple[Any, ...],
        writes: list[bool],
        wait_for: tuple[Signal, ...] = (),
        program: Any = None,
    ) -> Signal: ...


#: The graph the current task is capturing into, if any (see :mod:`aiotinyrt.graph`).
capturing: contextvars.ContextVar[Recorder | None] = contextvars.ContextVar("aiotinyrt_capture", default=None)


_SPINS = 64
_yield_gil = time.sleep
_new_object = object.__new__
_log = get_logger("queue")


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

    # The extension module (pyext.c, replay.c) reads _stopping, _last_held, _held, _dep_sigs and
    # _caddr at these slots' offsets; other attributes may live in ``__dict__``.
    __slots__ = (
        "__dict__",
        "_c",
        "_caddr",
        "_closed_error",
        "_commands",
        "_dep_lock",
        "_dep_sigs",
        "_dropping",
        "_held",
        "_last_held",
        "_lib",
        "_push",
        "_sleeping",
        "_start_lock",
        "_stopping",
        "_thread",
        "_values",
        "_wake",
        "device",
        "name",
        "native",
        "profile",
        "timeline",
    )

    def __init__(self, device: QueueOwner, name: str) -> None:
        self.device = device
        self.name = name
        #: every command run, when env PROFILE is set (see :mod:`aiotinyrt.recorder`)
        self.profile = recorder.QueueTrace(f"{device.name}/{name}") if recorder.start() else None
        # per-command timing output needs every command to pass through Python
        lib = native.load() if self.profile is None and debug_level() < 2 else None
        self._lib = lib
        self.native = lib is not None
        self.timeline = Timeline(device.name, name, lib)
        self._c = self.timeline._c
        self._caddr = 0
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
        self._running: Signal | None = None  # the latest Python command started
        self._stop_value = 0  # the stop marker's value, once stop() ran

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
            self._refuse_closed()
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
        raise self.device._refusal()

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
        waited_from = None
        if deps:
            if self.profile is not None:
                waited_from = perf()
            wait_in_thread(deps)
            for dep in deps:
                error = dep.error()
                if error is not None:
                    sig._error = dependency_failed(device.name, dep.timeline.label, dep.value, error)
                    break
        if self._dropping and sig._error is None:
            sig._error = self._closed_error
        if sig._error is None:
            if device._error is None:
                self._running = sig  # (named if the device is closed while it runs)
                start = perf()
                try:
                    fn(*args)  # type: ignore[misc]
                except BaseException as exc:
                    sig._error = device._fail(exc, sig)
                sig._elapsed = perf() - start
                if debug >= 2:
                    name = describe(fn, sig._keep)
                    _log.debug("%s@%d: %s %s", self.timeline.label, value, name, fmt_time(sig._elapsed))
                if self.profile is not None:
                    self.profile.record(fn, args, sig._keep, deps, waited_from, start, sig._elapsed, value)
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
                        failed = dependency_failed(device.name, other.label, at, error)
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
        self._stop_value = value
        if self._thread is None:
            self.timeline.advance(value)
            return
        if join_timeout is None:  # the caller joins and calls abandon_if_stuck() itself
            return
        self._thread.join(join_timeout)
        self.abandon_if_stuck(at_exit=True)

    def abandon_if_stuck(self, *, at_exit: bool) -> bool:
        """After :meth:`stop`: if the worker has not reached its stop marker, it is stuck in a
        command; abandon it (see :mod:`aiotinyrt.lifetime`). Its timeline is completed, the stuck
        command and those behind it failing, so nobody waits; but this queue, and every buffer
        whose free waited for one of those commands, is leaked on purpose, never unmapped, and
        one warning names the command. Returns whether it abandoned."""
        timeline = self.timeline
        value = self._stop_value
        if not value or timeline.completed >= value:
            return False
        stuck = timeline.completed + 1
        timeline._abandoned = stuck  # before anything completes: frees due now see it
        keep_forever(self)  # its C state, held blocks and host buffers stay valid
        name = self._describe_stuck(stuck)
        warn_abandoned(
            f"{timeline.label}@{stuck} ({name}) was still running when {self.device.name} closed; "
            "its worker is abandoned and the memory it uses stays allocated",
            at_exit=at_exit,
        )
        error = DeviceError(
            f"{self.device.name}: {timeline.label}@{stuck} ({name}) was abandoned, still running, "
            "when the device closed",
            device=self.device.name,
        )
        timeline._record_failure(stuck, stuck, error)
        timeline._record_failure(stuck + 1, value - 1, self._closed_error or error)
        timeline.advance(value)
        return True

    def _describe_stuck(self, value: int) -> str:
        """The name of command ``value`` (a kernel's name, else the function's)."""
        running = self._running
        if running is not None and running.value == value and running._fn is not None:
            return describe(running._fn, running._keep)
        for last, keep in list(self._held):  # native launches hold (fn, nargs, block, handles, keep, program)
            if last >= value:
                if isinstance(keep, tuple) and keep and hasattr(keep[-1], "lib"):
                    return str(keep[-1].name)
                return "a native command"
        return "a command"


def describe(fn: object, keep: object) -> str:
    """A name for a command in DEBUG output: the kernel's name, else the function's."""
    # a launch keeps (buffers, program): name the kernel
    if isinstance(keep, tuple) and len(keep) == 2 and hasattr(keep[1], "lib"):
        return str(keep[1].name)
    return getattr(fn, "__name__", type(fn).__name__)
