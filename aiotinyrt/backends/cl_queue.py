"""The driver of the CL backend's queues: one in-order ``cl_command_queue`` and its waiter.

:class:`CLQueue` is the :class:`~aiotinyrt.driverqueue.Driver` of one
:class:`~aiotinyrt.driverqueue.DriverQueue` of a CL device (:mod:`aiotinyrt.backends.ops_cl`).

- **Enqueue** (the submitting thread): a command marked :func:`cl_command` is called as
  ``fn(queue, n_waits, wait_list, *args)`` and returns its event; a graph run
  (``graph._run_calls``) enqueues its commands one after the other, the first with the wait
  list; ``graph._join`` is a marker. Any other (Python) command gets a marker over its wait list
  and a barrier on a user event, so the queue's later commands wait until it ran.
- **Completion** (one waiter thread per queue): it waits for the oldest event handed to it
  (``clWaitForEvents``, GIL released), then takes every later event that has completed too
  (the queue is in order, so they form a prefix) and reports them in one
  :func:`~aiotinyrt.driverqueue.report`: one lock round trip and one timeline advance for the
  batch. Each event's execution status is read, so a failed one fails exactly its command (and
  the queue's sticky error the later ones). A Python command ends a batch: the waiter runs it
  once its marker completed, then sets its user event. With the native library the wait and
  the reading of a batch are one C call (``clq_wait`` of :mod:`aiotinyrt.native`'s
  ``clq.c``, which keeps a reference of its own to each event handed over with ``clq_push``,
  and waits in the driver only once somebody waits or an event stays pending; see clq.c);
  without it (``NATIVE_QUEUE=0``) the waiter makes those calls in Python. The repeat launches
  made in C (clfast.c) hand their events and Signals to the ring themselves and come back in
  runs (:meth:`CLQueue._report_taken`).
- **Batches** (the native ring only): a CL command enqueued while nobody waits for the queue
  joins a batch held back by a gate of the ring's, set when somebody starts waiting for the
  queue or ``CL_GATE_US`` (default 50) microseconds after the batch opened (none opens while
  the newest command handed over has not completed: the device has work); PoCL's enqueue
  costs several times more when it has to wake its workers for each command (clq.c tells the
  whole rule). The command after a launch that was awaited as soon as it was made (a round
  trip) goes to the device at once, its report left to its await's poll for ``CL_GATE_US`` at
  most, as long as a gate would have held the command back.
  ``CL_GATE_US=0`` hands every command to the device at once.
- **Await** (the native ring only): the awaiting thread may take a command's completion
  itself (``poll``, clq.c's "Two takers"). ``await sig`` first claims the command (``claim``:
  its batch goes to the device), makes the checkpoint every await makes while the device runs
  it, then polls; meanwhile the waiter leaves completions to that poll, for ``_CLAIM_NS`` at
  most. With the extension module the poll is one C call (clpoll.c's ``cl_poll``), which also
  reports a round trip's repeat launch in the common case (:meth:`_settle_args`); for a
  repeat launch the timeline's claim and poll are each one C call from the await
  (``cl_claim``, ``cl_poll_for``: :meth:`attach`), and that poll returns the launch's device
  time when it reported it.
- Events are released when their last reference goes (``ffi.gc``): the waiter drops its own
  before it reports, the DriverQueue its own when the command completed.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

from aiotinyrt import native
from aiotinyrt.backends import opencl as ocl
from aiotinyrt.backends.opencl import CLError, check, ffi
from aiotinyrt.driverqueue import Completion, Done, DriverQueue, report
from aiotinyrt.graph import _join, _run_calls
from aiotinyrt.helpers import getenv

NULL = ffi.NULL
Command = Callable[..., Any]


def cl_command(fn: Command) -> Command:
    """Mark ``fn(queue, n_waits, wait_list, *args) -> cl_event`` as an OpenCL command: the driver
    calls it with the wait list instead of running it on the host."""
    fn.cl_command = True  # type: ignore[attr-defined]
    return fn


#: How the waiter thread runs a Python command once its marker completed.
Run = Callable[[float, BaseException | None], tuple[float, BaseException | None]]
#: What the waiter thread is handed per command: its event, its ``done``, and for a Python
#: command the function that runs it (None for an OpenCL command).
Item = tuple[Any, Done, Run | None]


def _ring(lib: Any, cl: Any) -> Any:
    """A native completion ring (aiotinyrt/native/clq.c, in the native library ``lib``) over the
    loader ``cl``'s entry points, freed with its owner."""
    entry = [int(ffi.cast("uintptr_t", ffi.addressof(cl, name))) for name in _ENTRY_POINTS]
    ring = lib.clq_new(*entry)
    if ring == native.ffi.NULL:
        raise MemoryError("CL: no memory for a queue's completion ring")
    return native.ffi.gc(ring, lib.clq_free)


_ENTRY_POINTS = (
    "clWaitForEvents",
    "clGetEventInfo",
    "clGetEventProfilingInfo",
    "clRetainEvent",
    "clReleaseEvent",
)


_GATE_ENTRY_POINTS = ("clCreateUserEvent", "clSetUserEventStatus")

#: How long a claim (:meth:`CLQueue.claim`) keeps the waiter from reporting what completes: the
#: claiming task's checkpoint takes ~10-20 us; a loop that runs other tasks for longer delays
#: the reports of this queue's commands by this much at most (or by the gate's time, when that
#: is longer and the waiter was timing the gate the claim set), then the waiter reports them
#: and the poll that ends the claim finds them done.
_CLAIM_NS = 1_000_000


_c_launch: list[bool] = []  # [True] once the extension module's repeat launch is ready


def cdata_address(cdata: Any) -> int:
    """The address a cffi pointer holds, as an int."""
    return int(ffi.cast("uintptr_t", cdata))


def c_launch_ready() -> bool:
    """Whether the extension module's repeat launch of CL programs (clfast.c) is there; it is
    configured once with the loader's entry points. The launches it makes hand their events
    and Signals to the queue's completion ring themselves (see :meth:`CLQueue._report_taken`)."""
    if not _c_launch:  # (not ready: asked again next time, NATIVE_QUEUE may have changed)
        cl = ocl.lib()
        names = ("clEnqueueNDRangeKernel", "clReleaseEvent", "clWaitForEvents")
        entry = (cdata_address(ffi.addressof(cl, n)) for n in names)
        if native.cl_launcher(Completion, DriverQueue, *entry):
            _c_launch.append(True)
    return bool(_c_launch)


def _no_c_poll(*args: Any) -> tuple[int, int, int]:
    raise AssertionError("cl_poll called without the extension module")


class _RingCounters:
    """A CL queue's timeline counters (see ``Driver.counters`` in :mod:`aiotinyrt.driverqueue`):
    a change of ``wake_at`` reaches the completion ring, which holds completions back for larger
    batches only while nobody waits."""

    __slots__ = ("_lib", "_ring", "_wake", "completed", "halted", "submitted")

    def __init__(self, lib: Any, ring: Any) -> None:
        self._lib, self._ring = lib, ring
        self.completed = self.submitted = self.halted = 0
        self._wake = native.NO_WAKE

    @property
    def wake_at(self) -> int:
        """The smallest value anyone waits for (``native.NO_WAKE``: none)."""
        return self._wake

    @wake_at.setter
    def wake_at(self, value: int) -> None:
        if value != self._wake:
            self._wake = value
            self._lib.clq_set_wake(self._ring, value)


class _Taken:
    """The arrays one taker of a ring reads a batch into (statuses, times, tags, objects), their
    addresses, and the extension module's ``cl_done`` (None without it)."""

    __slots__ = ("addresses", "arrays", "done")

    def __init__(self) -> None:
        nffi = native.ffi
        objs, tags = nffi.new("void *[256]"), nffi.new("int64_t[256]")
        status, seconds = nffi.new("int32_t[256]"), nffi.new("double[256]")
        self.arrays = (status, seconds, tags, objs)
        self.addresses = tuple(int(nffi.cast("uintptr_t", a)) for a in (objs, tags, status, seconds))
        self.done = native.cl_reporter() if c_launch_ready() else None  # (None: no C launches)


class CLQueue:
    """The Driver of one DriverQueue: an in-order ``cl_command_queue`` with profiling."""

    # What the timeline's claim and poll in C read at each call (clpoll.c, by the members'
    # offsets); any other attribute lives in the instance's dict.
    __slots__ = ("__dict__", "__weakref__", "_poll_ns", "_ring")

    def __init__(self, name: str, context: Any, device_id: Any) -> None:
        cl, err = ocl.lib(), ffi.new("cl_int*")
        self.name, self.context = name, context
        q = cl.clCreateCommandQueue(context, device_id, ocl.QUEUE_PROFILING_ENABLE, err)
        check(err[0], "clCreateCommandQueue")
        self.queue = ffi.gc(q, cl.clReleaseCommandQueue)
        self._events: queue.SimpleQueue[Item | None] = queue.SimpleQueue()
        self._native = native.load()  # (None: the waiter runs in Python)
        self._ring = None if self._native is None else _ring(self._native, cl)
        self.gate(getenv("CL_GATE_US", 50))
        self._items: deque[tuple[int, Done, Run | None]] = deque()  # (tag, done, run) per event
        self._tag = 0  # the last tag handed to the ring
        #: how long :meth:`poll` waits for a command (nanoseconds), and the arrays it reads into
        #: (one set: the loop threads that poll take turns on the ring's token)
        self._poll_ns = max(0, getenv("CL_POLL_US", 50)) * 1000
        self._poll_out = None if self._ring is None else _Taken()
        #: the extension module's ``cl_poll`` and its first argument (see :meth:`_settle_args`;
        #: None: not made yet, (): none)
        self._settle: tuple[Any, ...] | None = None
        self._c_poll: Callable[..., tuple[int, int, int]] = _no_c_poll
        #: the DriverQueue this drives (:meth:`attach`: the repeat launches' completions are
        #: reported to it directly)
        self.owner: Any = None
        #: the timeline's counters (the ring learns of waiters through them)
        self.counters = None if self._ring is None else _RingCounters(self._native, self._ring)
        wait = self._wait if self._ring is None else self._wait_ring
        self._waiter = threading.Thread(target=wait, name=f"cl-waiter-{name}", daemon=True)
        self._waiter.start()

    def _wait(self) -> None:
        """The waiter thread: waits for the oldest event handed to it (GIL released), then takes
        every later one that has completed too (in-order queue: a prefix) and reports them all at
        once. A Python command ends a batch: the commands after it wait for it to return."""
        cl, items, times, status = ocl.lib(), self._events, ffi.new("cl_ulong[2]"), ffi.new("cl_int*")
        pending: deque[Item | None] = deque()
        while True:
            if not pending:
                pending.append(items.get())
            pending.extend(items.get_nowait() for _ in range(items.qsize()))
            if (item := pending[0]) is None:
                return  # closed
            cl.clWaitForEvents(1, ffi.new("cl_event[1]", [item[0]]))  # (its status tells errors)
            pending.extend(items.get_nowait() for _ in range(items.qsize()))
            batch: list[tuple[Done, float, BaseException | None]] = []
            while (item := pending[0] if pending else None) is not None:
                event, done, run = item
                code = cl.clGetEventInfo(event, ocl.EVENT_COMMAND_EXECUTION_STATUS, 4, status, NULL)
                if code == 0 and status[0] > 0:
                    break  # not completed yet: the next batch starts with it
                pending.popleft()
                seconds, error = ocl.outcome(event, code or status[0], times)
                if run is not None:  # a Python command: the commands before it complete first
                    del item, event  # (it may wait for them), then it runs; later ones wait
                    if batch:
                        report(batch)
                    batch = [(done, *run(seconds, error))]
                    break
                batch.append((done, seconds, error))
            item = event = None  # (the events go before the commands complete)
            if batch:
                report(batch)
            else:  # the wait failed with its event still queued: look again in a while (its
                time.sleep(0.001)  # command is not reported before it completed)

    def _wait_ring(self) -> None:
        """The waiter thread on the native ring (:func:`_ring`): one C call per batch waits for
        the oldest event and reads the completed prefix's statuses and times (GIL released),
        and :meth:`_report_taken` reports them."""
        ring, lib, taken = self._ring, self._native, _Taken()
        while (n := lib.clq_wait(ring, 256, *taken.arrays)) >= 0:
            if n:
                self._report_taken(n, taken)
        self._items.clear()  # (commands whose events never reached the ring: already failed)

    def _report_taken(self, n: int, taken: _Taken) -> None:
        """Report the ``n`` events a ``clq_wait`` or ``clq_poll`` call took (their statuses,
        times, tags and objects), running the Python commands among them, then give the ring's
        token back (see clq.c, "Two takers").

        A command handed over by the DriverQueue has a positive tag: it is ``_items``' first
        one with that tag (an item whose event never reached the ring, its command failed by
        the exception that stopped the hand-over, is dropped). A repeat launch made in C has
        the tag ``-value`` and its Signal as object; ``cl_done`` (clfast.c) completes each run
        of them in one call, reported with ``DriverQueue._report_run``."""
        try:
            items, (status, seconds, tags, _) = self._items, taken.arrays
            batch: list[tuple[Done, float, BaseException | None]] = []
            i = 0
            while i < n:
                if tags[i] < 0:  # repeat launches (clfast.c)
                    if batch:
                        report(batch)
                        batch = []
                    if taken.done is None:  # (made while the extension module was off)
                        taken.done = native.cl_reporter()
                    assert taken.done is not None  # (only the extension module's launches)
                    i, sigs, clean = taken.done(*taken.addresses, i, n)
                    if clean:
                        self.owner._report_run(sigs)
                    else:
                        failure = CLError("a command's event (execution status)", status[i - 1])
                        self.owner._report_failed(sigs[0], seconds[i - 1], failure)
                    continue
                while items[0][0] != tags[i]:
                    items.popleft()
                _, done, run = items.popleft()
                code = status[i]
                error = None if code == 0 else CLError("a command's event (execution status)", code)
                if run is not None:  # a Python command: the commands before it complete first
                    if batch:
                        report(batch)
                    batch = [(done, *run(seconds[i], error))]
                    report(batch)
                    batch = []
                else:
                    batch.append((done, seconds[i], error))
                i += 1
            if batch:
                report(batch)
        finally:
            self._native.clq_reported(self._ring)

    def find(self, value: int) -> Any:
        """The event of the repeat launch of value ``value`` while the ring holds it (a
        reference of its own, released with the returned object), else None."""
        if self._ring is None:
            return None
        address = self._native.clq_find(self._ring, -value)
        if address == native.ffi.NULL:
            return None
        return ffi.gc(ffi.cast("cl_event", cdata_address(address)), ocl.lib().clReleaseEvent)

    def claim(self, value: int, event: Any) -> int:
        """Claim command ``value`` (``event`` as :meth:`poll`'s) for a poll of this thread to
        come, after its checkpoint (see ``Driver.poll``): its batch goes to the device now, and
        the waiter thread leaves what completes to that poll for ``_CLAIM_NS`` at most. The
        claim's number, or 0 (nothing claimed)."""
        if self._ring is None or self._poll_ns <= 0:
            return 0
        address = 0 if event is None else cdata_address(event)
        return int(self._native.clq_claim(self._ring, address, -value, _CLAIM_NS))

    def unclaim(self, claim: int) -> None:
        """End claim number ``claim``, which no poll ends (its awaiting task was cancelled at
        its checkpoint)."""
        if self._ring is not None:
            self._native.clq_unclaim(self._ring, claim)

    def poll(self, value: int, event: Any, claim: int = 0) -> None:
        """Wait briefly in the calling thread (``CL_POLL_US``, GIL released) for command
        ``value``: ``event``, a command's event of this queue that the caller keeps alive, or
        with None the repeat launch of that value (the ring finds its event by the tag); and
        report it and the completed commands before it from this thread if it completes
        meanwhile (clq.c, "Two takers"); nothing without the native ring or when the waiter
        thread reports it. ``claim``: the number of this thread's :meth:`claim` of the
        command, which the poll ends (0: none).

        What the poll took is reported even when an exception (a signal handler's, such as
        ``KeyboardInterrupt``) is raised as the call returns: it is read back from the ring."""
        if self._ring is None:
            return
        if self._poll_ns <= 0:
            if claim:
                self.unclaim(claim)
            return
        ring, lib, taken = self._ring, self._native, self._poll_out
        assert taken is not None  # (made with the ring)
        address = 0 if event is None else cdata_address(event)
        settle = self._settle if self._settle is not None else self._settle_args(taken)
        n = -1
        try:
            if settle:
                n = self._c_poll(settle, address, -value, self._poll_ns, claim)[0]
            else:
                n = lib.clq_poll(ring, address, -value, self._poll_ns, claim, 256, *taken.arrays)
        finally:
            if n < 0:  # (a signal handler raised before the result was stored: read it back)
                n = lib.clq_polled(ring)
            if n:
                self._report_taken(n, taken)

    def attach(self, owner: Any) -> None:
        """Drive DriverQueue ``owner`` (made with this driver). With the extension module, its
        timeline's ``claim`` and ``poll`` become clpoll.c's ``cl_claim`` and ``cl_poll_for``
        bound to this queue: for a repeat launch (no event kept by ``owner``) each is one C
        call, without the Python frames of ``DriverQueue._claim`` and :meth:`claim` (or
        ``DriverQueue._poll`` and :meth:`poll`), which serve any other command from there;
        the poll returns the launch's device time when it reported it itself."""
        self.owner = owner
        hooks = native.cl_hooks()
        if hooks is None or self._poll_out is None or not self._settle_args(self._poll_out):
            return
        assert self._settle is not None
        bound = (self._settle, self, owner._events, globals())
        owner.timeline.claim = partial(hooks[0], bound)
        owner.timeline.poll = partial(hooks[1], bound)

    def _report_polled(self, n: int) -> None:
        """Report the ``n`` events a ``cl_poll_for`` call took and did not report in C."""
        assert self._poll_out is not None
        self._report_taken(n, self._poll_out)

    def _settle_args(self, taken: _Taken) -> tuple[Any, ...]:
        """The extension module's ``cl_poll`` (clpoll.c), which polls and, in a round trip's
        common case, reports what it took in the same call, and its first argument; () without
        the extension module's repeat launch (its report needs no C then)."""
        c_poll = None if taken.done is None or self.owner is None else native.cl_poller()
        if c_poll is None:
            self._settle = ()
            return ()
        owner = self.owner
        ring = int(native.ffi.cast("uintptr_t", self._ring))
        self._c_poll = c_poll
        queue = (owner, owner._done_lock, owner.timeline, self.counters, owner.device)
        self._settle = (ring, *taken.addresses, *queue)
        return self._settle

    def gate(self, microseconds: int) -> None:
        """Hold batches of commands nobody waits for at most ``microseconds`` (0: hand every
        command to the device at once); see the module docstring. The open batch, if any, goes
        to the device now."""
        if self._ring is None:
            return
        cl = ocl.lib()
        user, status = (cdata_address(ffi.addressof(cl, n)) for n in _GATE_ENTRY_POINTS)
        context = native.ffi.cast("void *", cdata_address(self.context))
        self._native.clq_gating(self._ring, context, user, status, max(0, microseconds) * 1000)

    def gated(self) -> bool:
        """Whether a batch waits for its gate now."""
        return self._ring is not None and bool(self._native.clq_gated(self._ring))

    def expedite(self) -> None:
        """Hand the batch held back by its gate to the device now: a command of another queue
        waits for one of its commands (see ``Driver.expedite``)."""
        if self._ring is not None:
            self._native.clq_open(self._ring)

    def close(self) -> None:
        """Stop the waiter thread after the events handed to it."""
        if self._ring is not None:
            self._native.clq_close(self._ring)
        self._events.put(None)

    def _hand(self, event: Any, done: Done, run: Run | None) -> None:
        """Give the waiter thread a command's event (the ring keeps its own reference)."""
        if self._ring is None:
            self._events.put((event, done, run))
            return
        self._tag = tag = self._tag + 1
        self._items.append((tag, done, run))  # (before the ring has the event: the waiter pops it)
        if self._native.clq_push(self._ring, event, tag, run is not None) != 0:
            # the command is enqueued: it fails, but only once the device is done with its memory
            self._native.clq_open(self._ring)  # (its batch goes to the device)
            ocl.lib().clWaitForEvents(1, ffi.new("cl_event[1]", [event]))
            raise MemoryError(f"{self.name}: no memory for the completion ring (or the queue is closed)")

    def enqueue(self, fn: Command, args: tuple[Any, ...], waits: Sequence[Any], done: Done) -> Any:
        """Enqueue ``fn`` after ``waits``; the waiter thread calls ``done``."""
        cl = ocl.lib()
        gate = native.ffi.NULL if self._ring is None else self._native.clq_gate(self._ring)
        if gate != native.ffi.NULL:  # (it opens a batch: see the docstring)
            address = int(native.ffi.cast("uintptr_t", gate))
            waits = [*waits, ffi.gc(ffi.cast("cl_event", address), cl.clReleaseEvent)]
        n = len(waits)
        wl = ffi.new("cl_event[]", list(waits)) if n else NULL
        if getattr(fn, "cl_command", False):
            event = fn(self.queue, n, wl, *args)
        elif fn is _run_calls and all(getattr(f, "cl_command", False) for f, _ in args[0]):
            event = NULL  # a graph run: its commands in one submission, the first one waits
            for f, a in args[0]:
                if event != NULL:
                    cl.clReleaseEvent(event)
                event, n, wl = f(self.queue, n, wl, *a), 0, NULL
        elif fn is _join:
            ev = ffi.new("cl_event*")
            check(cl.clEnqueueMarkerWithWaitList(self.queue, n, wl, ev), "clEnqueueMarkerWithWaitList")
            event = ev[0]
        else:
            return self._host(fn, args, n, wl, done)
        event = ffi.gc(event, cl.clReleaseEvent)
        self._hand(event, done, None)
        return event

    def _host(self, fn: Command, args: tuple[Any, ...], n: int, wl: Any, done: Done) -> Any:
        """A Python command: the waiter thread runs it once a marker after its wait list
        completed, while a user event holds the queue's later commands back."""
        cl, err, marker = ocl.lib(), ffi.new("cl_int*"), ffi.new("cl_event*")
        user = cl.clCreateUserEvent(self.context, err)
        check(err[0], "clCreateUserEvent")
        user = ffi.gc(user, cl.clReleaseEvent)
        check(cl.clEnqueueMarkerWithWaitList(self.queue, n, wl, marker), "clEnqueueMarkerWithWaitList")
        marker_event = ffi.gc(marker[0], cl.clReleaseEvent)
        blocked = ffi.new("cl_event[1]", [user])
        check(cl.clEnqueueBarrierWithWaitList(self.queue, 1, blocked, NULL), "clEnqueueBarrierWithWaitList")

        def run(_: float, error: BaseException | None) -> tuple[float, BaseException | None]:
            start = time.perf_counter()
            if error is None:
                try:
                    fn(*args)
                except BaseException as exc:  # the command fails; the device becomes sticky
                    error = exc
            cl.clSetUserEventStatus(user, ocl.COMPLETE)
            return time.perf_counter() - start, error

        try:
            self._hand(marker_event, done, run)
        except BaseException:
            cl.clSetUserEventStatus(user, ocl.COMPLETE)  # (it fails unrun; the queue goes on)
            raise
        return user
