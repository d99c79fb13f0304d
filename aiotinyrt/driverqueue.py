"""Driver-run queues: the backend's driver runs the commands and reports their completion.

A driver-run queue never runs a command itself. Submitting hands the command to the backend's
:class:`Driver` from the submitting thread (usually the event loop's) and returns its Signal at
once; the driver calls back once the command completed, from whatever thread it completes on (an
OpenCL event callback, one waiter thread per queue), and the queue then advances its timeline and
fires the waiters there, as a host worker does after running a command. There is no thread per
command and nothing polls the loop.

Dependencies. Commands of one queue are ordered by the driver (its queue is in order). A pending
dependency on a queue of the same driver context becomes part of the command's wait list (the
driver's events, as OpenCL's ``event_wait_list``). Any other pending dependency (a host-run queue,
another driver) is waited for on the device side: the command, and every later command of this
queue, is held back until it completes and then handed to the driver from the thread that
completed it. The loop never waits.

A command completes only once its driver reported it *and* every command in its wait list
completed on its own queue (a driver's callbacks may report a dependent first); if one of those
failed, or an earlier command of this queue it waits for did, it fails with "not run because a
command it depends on failed", as on a host-run queue. (The driver has had it by then: a driver
that skips commands after a failed wait, as OpenCL does, has not run it.)

Completion, failure, closing follow the host-run queue's rules (:mod:`aiotinyrt.queue`):
values complete in order (a driver reporting out of order is put back in order here); a command
that raised fails its Signal with a ``DeviceError`` that becomes the device's sticky error, and
every command completing after it fails with that error until ``reset()``; a command whose
dependency failed is not run; commands submitted while the device holds its error are not handed
to the driver. Closing fails the held-back commands; those the driver has complete normally.

Batches. A driver that learns of several completions at once (one wait that covers many events
of its in-order queue) reports them with one :func:`report`: their results are stored under one
lock and the timeline advanced once. Completing takes every result that is in, in value order,
in one pass, and each command's outcome is decided in order, as one at a time would: a failed
command in the middle of a batch fails its own Signal, those before it stay successful, and those
after it fail with the device's sticky error.

Commands a driver launches itself. A driver may also submit commands without :meth:`submit`
(the CL repeat launch does, in C: aiotinyrt/native/clfast.c): holding ``_submit_lock``, with
nothing held back, it takes the next value, enqueues, and keeps the command's event and Signal
itself; the queue keeps no record of it. It reports such commands in runs of consecutive values
(:meth:`DriverQueue._report_run`), or one that failed like any other
(:meth:`DriverQueue._report_failed`), and finds a pending one's event for other queues' wait
lists (``find``).

Locks: ``_submit_lock`` orders value assignment and hand-over (so the driver sees commands in
value order); completions take only ``_done_lock``, never while calling out, and one thread at a
time advances the timeline with no lock held, so callbacks that submit to other queues cannot
deadlock against this one. A command's event is stored without a lock: completion marks the
command taken before it drops the event, and the hand-over drops an event whose command was
taken meanwhile, so none outlives its command.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from aiotinyrt import native, recorder
from aiotinyrt.helpers import debug_level, fmt_time, get_logger
from aiotinyrt.queue import QueueOwner, describe
from aiotinyrt.signal import DeviceError, Signal, Timeline, dependency_failed, when_all_done

_log = get_logger("queue")


#: ``done(seconds, error)``: the driver's report that a command completed (error None: it ran).
Done = Callable[[float, BaseException | None], None]


class Completion:
    """The ``done`` a :class:`DriverQueue` hands its driver with each command: call it as
    ``done(seconds, error)`` exactly once, from any thread, or hand it to :func:`report` with
    others."""

    __slots__ = ("queue", "start", "value")

    def __init__(self, queue: DriverQueue, value: int, start: float) -> None:
        self.queue, self.value, self.start = queue, value, start

    def __repr__(self) -> str:
        return f"<Completion {self.queue.timeline.label}@{self.value}>"

    def __call__(self, seconds: float, error: BaseException | None) -> None:
        self.queue._report(((self, seconds, error),))


def report(batch: Sequence[tuple[Done, float, BaseException | None]]) -> None:
    """Report several completions at once, each ``(done, seconds, error)`` exactly as calling
    ``done(seconds, error)``: the results of one queue are stored under one lock and its timeline
    advanced once for them all (one wait for many events of an in-order queue costs one pass).
    A ``done`` that is not a queue's :class:`Completion` (a driver's wrapper) is just called."""
    start, n = 0, len(batch)
    while start < n:
        done = batch[start][0]
        if not isinstance(done, Completion):
            done(batch[start][1], batch[start][2])
            start += 1
            continue
        queue, end = done.queue, start + 1
        while end < n and isinstance(nxt := batch[end][0], Completion) and nxt.queue is queue:
            end += 1
        queue._report(batch[start:end] if start or end < n else batch)  # type: ignore[arg-type]
        start = end


class Driver(Protocol):
    """What a backend's driver offers a :class:`DriverQueue`."""

    def enqueue(
        self, fn: Callable[..., object], args: tuple[Any, ...], waits: Sequence[object], done: Done
    ) -> object:
        """Hand ``fn(*args)`` to the driver, to run after the events ``waits`` (of earlier
        commands of this driver) and after every command enqueued before it on this queue.
        Returns the command's event (what later commands' ``waits`` hold). Must call ``done``
        (or hand it to :func:`report`) exactly once, from any thread, when the command completed
        or failed; may raise (the command then fails at once). Must not block on the completion
        of other work.

        A driver may also offer ``counters``: the queue's timeline then keeps its counters
        there (the fields of ``signal._PyState``), so the driver sees ``wake_at``, the smallest
        value anyone waits for, change. A driver that holds completions back to report them in
        larger batches must report at once while ``wake_at`` is set.

        A driver that holds commands back from its device (to hand them over in batches) must
        offer ``expedite()``, called when a command of another queue is handed over with one of
        its events in the wait list: the held commands go to the device then, as they do when
        ``wake_at`` is set.

        A driver may offer ``poll(value, event)``: a brief wait, in the thread about to await a
        command, for that command's event (None: a command the driver launched itself, whose
        event it finds; or one it no longer has), reporting it (and what completed before it)
        from that thread if it completes meanwhile; the queue's timeline then calls it before a
        task registers a waiter (``Timeline.poll``). It must return promptly whatever happens:
        the thread is an event loop's.

        A driver with ``poll`` may offer ``claim(value, event) -> int`` and ``unclaim(claim)``
        too: a caller about to poll after doing something else first (the awaiting task's
        checkpoint) claims the command: it goes to the device now (its batch, if held back,
        too) and the driver leaves its completion for that caller's ``poll(value, event,
        claim)`` for a short while, so it is reported from the awaiting thread. The claim's
        number (positive), or 0: nothing claimed (poll as usual, with two arguments). Each
        claim ends with one such poll, or ``unclaim(claim)`` when the caller gives up (its wait
        was cancelled); the queue's timeline offers them as ``Timeline.claim`` and
        ``Timeline.unclaim``.

        A driver that launches commands itself (see "Commands a driver launches itself" in the
        module docstring) offers ``find(value)``: the event of such a pending command, a
        reference the caller may keep, or None once it is no longer the driver's."""
        ...


def _pending(sig: Signal) -> bool:
    return sig.timeline.completed < sig.value


#: Driver-run queues by their timeline's id, so a dependency can find the queue (and the event)
#: behind a Signal. An entry lives as long as its queue is open.
_BY_TIMELINE: dict[int, DriverQueue] = {}


class DriverQueue:
    """One in-order device queue whose commands a backend's driver runs (see the module
    docstring). Offers the same submission interface as :class:`~aiotinyrt.queue.HostQueue`."""

    #: Never the native ring: every command goes through the driver.
    native = False

    # The state the CL repeat launch and the poll's report read and write from C, by the
    # members' offsets (clfast.c); any other attribute lives in the instance's dict.
    __slots__ = (
        "__dict__",
        "__weakref__",
        "_advancing",
        "_enqueuing",
        "_held",
        "_next",
        "_results",
        "_runs",
        "_stopping",
        "_taken",
    )

    def __init__(self, device: QueueOwner, name: str, driver: Driver, context: object = None) -> None:
        self.device = device
        self.name = name
        self.driver = driver
        #: Queues with the same context may put each other's events in their wait lists (an
        #: OpenCL context; default: the driver object itself).
        self.context = driver if context is None else context
        #: every command completed, when env PROFILE is set (see :mod:`aiotinyrt.recorder`)
        self.profile = recorder.QueueTrace(f"{device.name}/{name}") if recorder.start() else None
        self.timeline = Timeline(device.name, name, state=getattr(driver, "counters", None))
        self._thread: threading.Thread | None = None  # (no worker: the driver runs commands)
        self._stopping = False
        self._closed_error: DeviceError | None = None
        self._submit_lock = native.rlock()  # (the CL repeat launch takes it from C: lock.c)
        #: (a lock.c Lock where the extension module is there: the CL poll's report in C tries
        #: it without calling Python; see clpoll.c, report_direct)
        self._done_lock = native.rlock()
        self._next = 1
        self._commands: dict[int, Signal] = {}  # submitted, not completed yet
        self._events: dict[int, object] = {}  # the driver's event of each command it has
        self._held: deque[Signal] = deque()  # waiting for a dependency elsewhere, in value order
        self._results: dict[int, tuple[float, BaseException | None]] = {}
        #: completed runs of commands the driver launched itself (see :meth:`_report_run`),
        #: by their first value
        self._runs: dict[int, list[Signal]] = {}
        self._advancing = False
        self._again = False
        self._unrun: set[int] = set()  # results of commands never handed to the driver
        self._taken = 0  # the last value whose result completion took
        self._enqueuing = 0  # the thread inside driver.enqueue (its ident), 0: none
        self._inline = False  # a hand-over completed a command: the submitter advances
        _BY_TIMELINE[id(self.timeline)] = self
        #: the driver's ``find``, if it offers one (see :meth:`_event`)
        self._find: Callable[[int], object] | None = getattr(driver, "find", None)
        #: the driver's ``poll``, if it offers one (see ``Driver.poll``)
        self._driver_poll: Callable[..., None] | None = getattr(driver, "poll", None)
        #: the driver's ``claim``, if it offers one with ``poll`` (see ``Driver.poll``)
        self._driver_claim: Callable[[int, object], int] | None = getattr(driver, "claim", None)
        unclaim: Callable[[int], None] | None = getattr(driver, "unclaim", None)
        if self._driver_poll is not None:
            self.timeline.poll = self._poll
            if self._driver_claim is not None and unclaim is not None:
                self.timeline.claim, self.timeline.unclaim = self._claim, unclaim

    def __repr__(self) -> str:
        return f"<DriverQueue {self.timeline.label} queued={self.queued()}>"

    # ---- submission -------------------------------------------------------------------------------
    def submit(
        self,
        fn: Callable[..., object],
        args: tuple[Any, ...],
        deps: tuple[Signal, ...] = (),
        keep: object = None,
    ) -> Signal:
        """Hand ``fn(*args)`` to the driver after ``deps``; return its Signal at once."""
        pending: Sequence[Signal] = ()
        with self._submit_lock:
            if self._stopping:  # (checked under the lock: stop() empties what is held)
                raise DeviceError(f"{self.device.name} is closed", device=self.device.name)
            value = self._next
            self._next += 1
            self.timeline.submitted = value
            sig = Signal(self.timeline, value, fn, args, deps, keep)
            self._commands[value] = sig
            if self._held:
                self._held.append(sig)  # behind a held-back command: the driver's order is ours
            else:
                pending = self._hand_over(sig)
                if pending:
                    self._held.append(sig)
        if pending:
            when_all_done(pending, self._flush, after=True)
        elif self._inline:  # completed here (not run, or reported inside enqueue)
            self._inline = False
            self._advance()
        return sig

    def submit_either(
        self,
        call: tuple[int, int, int, object] | None,
        fn: Callable[..., object],
        args: tuple[Any, ...],
        deps: tuple[Signal, ...],
        keep: object,
    ) -> Signal:
        """As ``HostQueue.submit_either``: a driver-run queue has no native form."""
        return self.submit(fn, args, deps, keep)

    def native_deps(self, deps: Sequence[Signal]) -> list[Signal] | None:
        """No native ring here: None (the caller takes the ordinary path)."""
        return None

    _caddr = 0  # (no native ring)

    def submit_native(
        self, fn: int, nargs: int, block: int, keep: object, deps: Sequence[Signal] = ()
    ) -> Signal:
        """Never called: ``native`` is False."""
        raise TypeError(f"{self!r} has no native ring")

    def _hand_over(self, sig: Signal) -> Sequence[Signal]:
        """Give the command to the driver (or complete it unrun: a dependency failed, or the
        device holds its sticky error); or return the pending dependencies it must be held back
        for. Caller holds ``_submit_lock``."""
        device = self.device
        waits: Sequence[object] = ()
        if sig._deps:
            found: list[object] = []
            pending: list[Signal] = []
            for dep in sig._deps:
                timeline = dep.timeline
                if timeline.completed >= dep.value:
                    error = dep.error()
                    if error is not None:
                        self._finish(sig, dependency_failed(device.name, timeline.label, dep.value, error))
                        return ()
                    continue
                if timeline is self.timeline:
                    continue  # ordered by the driver's queue; its outcome is checked at completion
                other = _BY_TIMELINE.get(id(timeline))
                same_context = other is not None and other.context is self.context
                event = other._event(dep.value) if other is not None and same_context else None
                if event is None:
                    pending.append(dep)
                else:
                    found.append(event)
                    expedite = None if other is None else getattr(other.driver, "expedite", None)
                    if expedite is not None:  # (its batch goes to the device: this one waits)
                        expedite()
            if pending:
                return pending
            waits = found
        if device._error is not None:
            self._finish(sig, device._error)
            return ()
        value = sig.value
        fn = sig._fn
        assert fn is not None
        done = Completion(self, value, 0.0 if self.profile is None else time.perf_counter())
        outer, self._enqueuing = self._enqueuing, threading.get_ident()
        try:
            event = self.driver.enqueue(fn, sig._args, waits, done)
        except BaseException as exc:  # the command fails; the queue goes on
            # its traceback stays with the device's sticky error: not other commands' events
            waits, found = (), []
            if exc.__traceback__ is not None:
                traceback.clear_frames(exc.__traceback__.tb_next)
            self._report(((done, 0.0, exc),))
        else:
            self._events[value] = event
            if self._taken >= value:  # completed meanwhile: keep no event (completion sets
                self._events.pop(value, None)  # ``_taken`` before it drops the event)
        finally:
            self._enqueuing = outer
        return ()

    def _event(self, value: int) -> object:
        """The driver's event of pending command ``value``, or None (not handed over, or
        completed meanwhile): the one the hand-over kept, else the driver's ``find(value)`` for
        the commands it launched itself (:meth:`_report_run`)."""
        event = self._events.get(value)
        if event is None and self._find is not None:
            event = self._find(value)
        return event

    def _poll(self, value: int, claim: int = 0) -> None:
        """The timeline's ``poll``: the driver's brief wait for command ``value`` in this
        thread (see ``Driver.poll``), with its event if the hand-over kept one; ``claim``: the
        number of this thread's :meth:`_claim` of it, which the poll ends (0: none)."""
        poll = self._driver_poll
        if poll is None:
            return
        event = self._events.get(value)  # (held here: the wait reads it)
        if claim:
            poll(value, event, claim)
        else:  # (a driver without claims takes two arguments)
            poll(value, event)

    def _claim(self, value: int) -> int:
        """The timeline's ``claim``: the number of the driver's claim of command ``value`` for
        a poll of this thread to come, or 0 (see ``Driver.poll``)."""
        if self._driver_claim is None:
            return 0
        return self._driver_claim(value, self._events.get(value))

    def _flush(self) -> None:
        """Hand over held-back commands whose dependencies completed (any thread)."""
        pending: Sequence[Signal] = ()
        with self._submit_lock:
            while self._held and not pending:
                pending = self._hand_over(self._held[0])
                if not pending:
                    self._held.popleft()
        if pending:
            when_all_done(pending, self._flush, after=True)
        self._advance()

    def _finish(self, sig: Signal, error: BaseException) -> None:
        """Complete a command that is not run, in its turn (its dependencies do not matter)."""
        with self._done_lock:
            self._results[sig.value] = (0.0, error)
            self._unrun.add(sig.value)
        self._inline = True

    # ---- completion -------------------------------------------------------------------------------
    def _report(self, batch: Sequence[tuple[Completion, float, BaseException | None]]) -> None:
        """The driver's reports (``Done`` and :func:`report`) of commands of this queue: any
        thread, possibly inside ``enqueue`` itself (the submitter advances then)."""
        profile = self.profile
        if profile is not None:
            for done, seconds, _ in batch:
                sig = self._commands.get(done.value)
                if sig is not None:
                    profile.record(
                        sig._fn, sig._args, sig._keep, sig._deps or (), None, done.start, seconds, done.value
                    )
        with self._done_lock:
            results = self._results
            for done, seconds, error in batch:
                results[done.value] = (seconds, error)
        if self._enqueuing == threading.get_ident():
            self._inline = True
        else:
            self._advance()

    def _report_run(self, sigs: list[Signal]) -> None:
        """The driver's report that commands it launched itself completed: ``sigs``, Signals
        of this queue with consecutive values, that ran without error and without dependencies
        (the CL repeat launch, clfast.c). Such a command has no record here but its Signal: the
        driver submitted it under ``_submit_lock`` (value from ``_next``, ``timeline.submitted``),
        keeps its event (``find``), and has stored its device time and dropped what the Signal
        held for it. Any thread, as :meth:`_report`.

        The common case, the run next in line and nothing else to complete, advances the
        timeline here, without :meth:`_advance`'s pass over the tables (a round trip's report)."""
        first, last, me = sigs[0].value, sigs[-1].value, threading.get_ident()
        with self._done_lock:
            direct = (
                not self._advancing
                and not self._results
                and not self._runs
                and self._enqueuing != me
                and self.timeline.completed + 1 == first
            )
            if direct:
                self._advancing = True
            else:
                self._runs[first] = sigs
        if not direct:
            if self._enqueuing == me:
                self._inline = True
            else:
                self._advance()
            return
        try:
            self._taken = last
            self._complete_run(sigs)
            self.timeline.advance(last)
        finally:
            with self._done_lock:
                again, self._again, self._advancing = self._again, False, False
        if again:  # (another thread reported meanwhile and left it to this one)
            self._advance()

    def _report_failed(self, sig: Signal, seconds: float, error: BaseException) -> None:
        """The driver's report that a command it launched itself (see :meth:`_report_run`)
        failed: from here on it is reported as the commands handed over are."""
        self._commands[sig.value] = sig
        self._report(((Completion(self, sig.value, 0.0), seconds, error),))

    def _advance(self) -> None:
        """Complete, in value order, every command whose result is in and whose dependencies
        completed. One thread at a time: a call while another thread advances makes that thread
        look again before it stops, so no result is left behind; a callback that raises never
        leaves the queue wedged."""
        with self._done_lock:
            if self._advancing:
                self._again = True
                return
            self._advancing = True
        again = True
        while again:
            error: BaseException | None = None
            try:
                self._advance_locked_out()
            except BaseException as exc:
                error = exc
            with self._done_lock:
                again, self._again = self._again and error is None, False
                if not again:
                    self._advancing = False
            if error is not None:
                raise error

    def _advance_locked_out(self) -> bool:
        """The body of :meth:`_advance`; True when it stopped at a command whose dependencies
        have not completed yet (a waiter calls ``_advance`` again then). Takes every result
        that is in, in value order, under one lock, and advances the timeline once for them."""
        timeline, device = self.timeline, self.device
        debug = debug_level()
        results, commands, events, unrun, runs = (
            self._results,
            self._commands,
            self._events,
            self._unrun,
            self._runs,
        )
        while True:
            # in value order: a command reported one by one, or a run (_report_run)
            taken: list[tuple[Signal, float, BaseException | None, bool] | list[Signal]] = []
            late: list[Signal] = []
            last = 0
            with self._done_lock:
                value = timeline.completed + 1
                while True:
                    if value in results:
                        sig = commands[value]
                        # a dependency in the wait list counts once its own queue completed it: a
                        # driver's callbacks may report a dependent before its dependency
                        ran = value not in unrun
                        if not ran:
                            unrun.discard(value)
                        elif sig._deps:
                            late = [d for d in sig._deps if d.timeline is not timeline and _pending(d)]
                            if late:
                                break
                        seconds, error = results.pop(value)
                        del commands[value]
                        self._taken = value  # (before the event goes: see _hand_over)
                        events.pop(value, None)
                        taken.append((sig, seconds, error, ran))
                        last = value
                        value += 1
                    elif value in runs:
                        run = runs.pop(value)
                        taken.append(run)
                        last = value = run[-1].value
                        self._taken = value
                        value += 1
                    else:
                        break
            for entry in taken:
                if isinstance(entry, list):  # (ran; fails with the sticky error of an earlier one)
                    self._complete_run(entry)
                    continue
                sig, seconds, error, ran = entry
                if ran:  # (a driver that skips a command after a failed wait reports its own
                    for dep in sig._deps:  # error for it: the dependency's failure is the cause)
                        dep_error = dep.error()
                        if dep_error is not None:  # (in the wait list, or earlier on this queue)
                            error = dependency_failed(device.name, dep.timeline.label, dep.value, dep_error)
                            break
                if error is not None and not isinstance(error, DeviceError):
                    error = device._fail(error, sig)
                elif error is None and device._error is not None:
                    error = device._error  # completed after the device's failure: failed with it
                sig._elapsed = seconds
                sig._error = error
                if error is not None:
                    timeline._record_failure(sig.value, sig.value, error)
                if debug >= 2:
                    _log.debug(
                        "%s@%d: %s %s",
                        timeline.label,
                        sig.value,
                        describe(sig._fn, sig._keep),
                        fmt_time(seconds),
                    )
                sig._fn = sig._args = sig._deps = sig._keep = None  # type: ignore[assignment]
            if taken:
                # (a repeat launch's Signal is untracked while pending, clfast.c: once it
                # completed, its error or a frame holding it may lead back to it)
                native.track([t[0] for t in taken if not isinstance(t, list)])
            if last:
                timeline.advance(last)
            if late:
                when_all_done(late, self._advance, after=True)
                return True
            if not last:
                return False

    def _complete_run(self, sigs: list[Signal]) -> None:
        """The outcome of commands of :meth:`_report_run` (they ran; their device times are
        stored): failed with the device's sticky error if it holds one by now."""
        error, timeline, debug = self.device._error, self.timeline, debug_level()
        if error is None and debug < 2:
            return
        for sig in sigs:
            if error is not None:
                sig._error = error
                timeline._record_failure(sig.value, sig.value, error)
            if debug >= 2:
                _log.debug("%s@%d: launch %s", timeline.label, sig.value, fmt_time(sig._elapsed or 0.0))

    # ---- state ------------------------------------------------------------------------------------
    def queued(self) -> int:
        """Commands submitted and not completed."""
        return self.timeline.submitted - self.timeline.completed

    def _halt(self, halted: bool) -> None:
        """The device's sticky error is read at each hand-over and completion: nothing to do."""

    def stop(self, *, drop_queued: bool, join_timeout: float | None) -> None:
        """Stop accepting commands; with ``drop_queued`` fail the held-back ones. Commands the
        driver has complete normally; ``join_timeout`` seconds are waited for them (None: not
        at all, the caller awaits the timeline)."""
        if self._stopping:
            return
        name = self.device.name
        self._closed_error = DeviceError(f"{name} was closed before this command ran", device=name)
        with self._submit_lock:
            self._stopping = True
            if drop_queued:
                while self._held:
                    self._finish(self._held.popleft(), self._closed_error)
        self._advance()
        _BY_TIMELINE.pop(id(self.timeline), None)
        if join_timeout is not None and self.queued():
            finished = threading.Event()
            self.timeline.add_waiter(self.timeline.submitted, finished.set, internal=True)
            finished.wait(join_timeout)
