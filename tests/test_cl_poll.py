"""An await of a CL command with few ahead of it waits for it in the awaiting thread, briefly,
and reports it there (aiotinyrt/native/clq.c, "Two takers"; ``CLQueue.poll``): the waiter
thread and the pollers take turns on the ring's token, no completion is lost or reported twice,
a Python command is left to the waiter, and a poll returns after its budget whatever the
command does."""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anyio
import pytest
import trio

from aiotinyrt import Device, DeviceError
from aiotinyrt.backends import cl_queue
from aiotinyrt.backends import opencl as ocl
from aiotinyrt.backends.cl_queue import CLQueue
from aiotinyrt.backends.ops_cl import CLDevice, cl_command, ffi
from aiotinyrt.driverqueue import Done, DriverQueue
from aiotinyrt.signal import Signal
from tests.helpers import cl_ring, direct_launch, int_buffer, seen_done

pytestmark = pytest.mark.anyio

INC = "__kernel void inc(__global int* out) { out[0] += 1; }"
MINUTE_US = 60_000_000


@pytest.fixture(autouse=True)
def _claims_last_a_minute(monkeypatch: pytest.MonkeyPatch) -> None:
    """An await's claim holds for a minute here (a test that times it sets its own): the
    checkpoint between the claim and the poll may take longer than the 1 ms default on a busy
    machine, and the waiter would then report what these tests expect the awaiting thread to."""
    monkeypatch.setattr(cl_queue, "_CLAIM_NS", MINUTE_US * 1000)


@pytest.fixture
async def ring() -> AsyncIterator[tuple[CLDevice, DriverQueue, CLQueue]]:
    """CL, its compute queue and that queue's driver (skipped without the native ring); the
    poll's budget and the gate's hold come back afterwards, and a sticky error is reset."""
    dev, queue, driver = cl_ring("poll")
    await dev.synchronize()
    budget = driver._poll_ns
    try:
        yield dev, queue, driver
    finally:
        driver._poll_ns = budget
        driver.gate(50)
        if dev._error is not None:  # (a test that failed before its own reset)
            await dev.reset()


async def _inc_held_a_minute(dev: CLDevice, driver: CLQueue) -> tuple[Any, Any]:
    """The inc program and a zeroed int on ``dev``, the queue idle, its gate held a minute (so
    the waiter cannot take a launch before a poll opens it) and its poll's budget a minute."""
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    driver.gate(MINUTE_US)
    driver._poll_ns = MINUTE_US * 1000
    return prog, out


class _Reports:
    """The threads that report each CL batch and the values reported, in order: commands
    handed over (``cl_queue.report``) and repeat launches made in C (``_report_run`` and
    ``_report_failed`` of the DriverQueue), which both takers call, and the repeat launches
    ``driver``'s poll reported in C (``cl_poll``, and the timeline's ``cl_poll_for``:
    clpoll.c)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, driver: CLQueue) -> None:
        self.threads: list[int] = []
        self.values: list[int] = []
        report, run, failed = cl_queue.report, DriverQueue._report_run, DriverQueue._report_failed

        def spy(batch: list[tuple[Done, float, BaseException | None]]) -> None:
            self._saw(done.value for done, _, _ in batch)  # type: ignore[attr-defined]
            report(batch)

        def spy_run(queue: DriverQueue, sigs: list[Any]) -> None:
            self._saw(s.value for s in sigs)
            run(queue, sigs)

        def spy_failed(queue: DriverQueue, sig: Any, seconds: float, error: BaseException) -> None:
            self._saw([sig.value])
            failed(queue, sig, seconds, error)

        monkeypatch.setattr(cl_queue, "report", spy)
        monkeypatch.setattr(DriverQueue, "_report_run", spy_run)
        monkeypatch.setattr(DriverQueue, "_report_failed", spy_failed)
        assert driver._poll_out is not None
        if driver._settle is None:
            driver._settle_args(driver._poll_out)
        c_poll = driver._c_poll

        def spy_c_poll(*args: Any) -> tuple[int, int, int]:
            n, first, last = c_poll(*args)
            if last:
                self._saw(range(first, last + 1))
            return n, first, last

        monkeypatch.setattr(driver, "_c_poll", spy_c_poll)
        poll = None if driver.owner is None else driver.owner.timeline.poll
        if isinstance(poll, functools.partial):  # (cl_poll_for, bound to the queue's hooks)

            def saw_in_c(first: int, last: int) -> None:
                self._saw(range(first, last + 1))

            hooks = (*poll.args[0][:4], saw_in_c)  # (a fifth item: called at each report in C)
            monkeypatch.setattr(driver.owner.timeline, "poll", functools.partial(poll.func, hooks))

    def _saw(self, values: Any) -> None:
        self.threads.append(threading.get_ident())
        self.values.extend(values)


async def test_an_await_of_a_launch_on_an_idle_queue_is_reported_by_the_awaiting_thread(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate holds each launch until the poll opens it (so the waiter cannot take it first)
    and the budget is a minute: every completion is the loop thread's."""
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    reports = _Reports(monkeypatch, queue.driver)
    first = queue.timeline.completed + 1
    with anyio.fail_after(30):
        for _ in range(20):
            await prog(out)
    assert reports.threads == [threading.get_ident()] * 20
    assert reports.values == list(range(first, first + 20))
    assert (await out.numpy())[0] == 20
    await out.free()


class _QueueFrames:
    """The Python functions of the DriverQueue's and the CLQueue's modules that run in this
    thread while it is active (``sys.setprofile``)."""

    def __init__(self) -> None:
        self.ran: list[str] = []

    def _profile(self, frame: Any, event: str, arg: object) -> None:
        name = os.path.basename(frame.f_code.co_filename)
        if event == "call" and name in ("driverqueue.py", "cl_queue.py"):
            self.ran.append(f"{name}:{frame.f_code.co_name}")

    def __enter__(self) -> _QueueFrames:
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.setprofile(None)


async def test_a_round_trip_claims_and_polls_in_one_c_call_each_and_returns_the_device_time(
    ring: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    """The await of a repeat launch claims and polls through the timeline's C hooks (clpoll.c's
    ``cl_claim`` and ``cl_poll_for``): no Python function of the DriverQueue's or the CLQueue's
    runs in the awaiting thread (their claim, poll and report), and the await returns the
    device time the poll stored in the Signal."""
    dev, _, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    await _c_report(driver, prog, out)
    frames = _QueueFrames()
    elapsed: list[float] = []
    with anyio.fail_after(30):
        for _ in range(5):
            sig = prog(out)
            with frames:
                elapsed.append(await sig)
            assert sig.done() and elapsed[-1] == sig.result() and elapsed[-1] > 0
    assert frames.ran == []
    assert (await out.numpy())[0] == 6
    await out.free()


async def test_an_await_whose_claim_takes_nothing_claims_once_and_polls_without_it(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last of 12 pipelined launches is too far behind the ring's head to be polled for:
    its await's one claim takes nothing, and the await goes on without claiming again (one
    poll without a claim, then a waiter as any other)."""
    dev, queue, driver = ring
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    driver.gate(MINUTE_US)  # (the launches stay in the ring until the claim opens their batch)
    log = _ClaimLog(queue, monkeypatch)
    for _ in range(11):
        prog(out)
    last = prog(out)
    with anyio.fail_after(30):
        await last
    assert log.calls[:2] == ["claim False", "poll"] and log.calls.count("claim False") == 1
    assert (await out.numpy())[0] == 12
    await out.free()


async def test_a_report_left_to_python_that_raised_before_it_began_is_made_all_the_same(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``DEBUG`` set the poll leaves its report to Python (``CLQueue._report_polled``).
    Exceptions raised there before the report began (as signal handlers' may, twice here)
    must not leave the command taken and the ring's token held: the report is made again,
    then the first exception reaches the await (the second is written as unraisable), and
    the queue goes on."""
    dev, _, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    await _c_report(driver, prog, out)
    report, calls = driver._report_polled, []

    def raise_first(n: int) -> None:
        calls.append(n)
        if len(calls) <= 2:
            raise RuntimeError(f"before the report ({len(calls)})")
        report(n)

    unraisable: list[BaseException | None] = []
    monkeypatch.setattr(driver, "_report_polled", raise_first)
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(u.exc_value))
    monkeypatch.setenv("DEBUG", "1")
    sig = prog(out)
    with anyio.fail_after(30), pytest.raises(RuntimeError, match=r"before the report \(1\)"):
        await sig
    assert calls == [1, 1, 1] and sig.done() and sig.error() is None
    assert [str(e) for e in unraisable] == ["before the report (2)"]
    monkeypatch.delenv("DEBUG")
    with anyio.fail_after(30):
        await prog(out)
    assert (await out.numpy())[0] == 3
    await out.free()


async def test_an_await_makes_its_checkpoint_itself_a_bare_yield_on_asyncio_and_trios_on_trio(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A round trip's one checkpoint, made without anyio's dispatch to its backend (or the
    frames of ``wait()``): on an asyncio loop (uvloop too) a bare yield, what
    ``asyncio.sleep(0)`` makes; on trio ``trio.lowlevel.checkpoint()``, what anyio's calls."""
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    log = _ClaimLog(queue, monkeypatch)
    checkpoint, through_anyio = anyio.lowlevel.checkpoint, []

    async def counted() -> None:
        through_anyio.append(True)
        await checkpoint()

    monkeypatch.setattr(anyio.lowlevel, "checkpoint", counted)
    with anyio.fail_after(30):
        await prog(out)
    assert log.calls == ["claim True", "checkpoint", "poll claimed"]
    assert through_anyio == []
    await out.free()


async def test_a_poll_returns_after_its_budget_while_its_command_waits_for_a_python_command(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launch waits behind a Python command that waits for the test: the poll gives up,
    the task waits as any other, and the waiter thread reports both."""
    dev, queue, driver = ring
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    driver._poll_ns = 2_000_000  # (2 ms)
    go = threading.Event()
    ran_in: list[int] = []

    def hold() -> None:
        ran_in.append(threading.get_ident())
        go.wait(60)

    polls: list[bool] = []
    real_poll = queue.timeline.poll
    assert real_poll is not None

    def poll(value: int, claim: int = 0) -> float | None:
        out = real_poll(value, claim)
        polls.append(go.is_set())  # (returned while the Python command still held the queue)
        return out

    monkeypatch.setattr(queue.timeline, "poll", poll)
    reports = _Reports(monkeypatch, queue.driver)
    ahead = queue.submit(hold, ())
    sig = prog(out)
    async with anyio.create_task_group() as tg:
        tg.start_soon(sig.wait)
        with anyio.fail_after(30):
            while queue.timeline.pending_waiters() == 0:
                await anyio.lowlevel.checkpoint()
        go.set()
    assert polls == [False]
    assert ahead.done() and sig.done() and ran_in != [threading.get_ident()]
    assert threading.get_ident() not in reports.threads
    assert (await out.numpy())[0] == 1
    await out.free()


async def test_a_poll_leaves_a_python_command_after_its_launch_to_the_waiter_thread(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    reports = _Reports(monkeypatch, queue.driver)
    ran_in: list[int] = []
    sig = prog(out)
    after = queue.submit(lambda: ran_in.append(threading.get_ident()), ())
    with anyio.fail_after(30):
        await sig
        await after
    loop = threading.get_ident()
    assert len(ran_in) == 1 and ran_in[0] != loop
    assert reports.values == [sig.value, after.value]  # (the launch alone, then the command)
    assert reports.threads[0] == loop and reports.threads[1] == ran_in[0]
    await out.free()


async def test_a_failed_command_taken_by_a_poll_fails_its_signal_and_the_device(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    dev, queue, driver = ring
    cl, err = ocl.lib(), ffi.new("cl_int*")
    user = cl.clCreateUserEvent(dev.context, err)

    @cl_command
    def after_the_user_event(cq: object, n: int, wl: Any) -> object:
        """A marker waiting for the gate (in ``wl``) and the user event, which fails."""
        waits, event = ffi.new("cl_event[]", [*(wl[i] for i in range(n)), user]), ffi.new("cl_event*")
        assert cl.clEnqueueMarkerWithWaitList(cq, n + 1, waits, event) == 0
        return event[0]

    driver.gate(MINUTE_US)  # (the waiter cannot take the marker before the poll opens the gate)
    driver._poll_ns = MINUTE_US * 1000
    reports = _Reports(monkeypatch, queue.driver)
    sig = queue.submit(after_the_user_event, ())
    assert driver.gated()
    cl.clSetUserEventStatus(user, -5)
    with pytest.raises(DeviceError, match=r"execution status\) failed: CL_"), anyio.fail_after(30):
        await sig
    assert reports.threads == [threading.get_ident()]
    assert dev._error is not None and sig.error() is dev._error
    cl.clReleaseEvent(user)
    await dev.reset()


async def test_loop_threads_and_the_waiter_take_turns_without_losing_a_completion(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round trips from this loop and from a second thread's loop, with pipelined launches in
    between: every command is reported once, in order, and the count is right."""
    dev, queue, _ = ring
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    reports = _Reports(monkeypatch, queue.driver)
    first = queue.timeline.completed + 1

    async def round_trips(n: int) -> None:
        for i in range(n):
            sig = prog(out)
            if i % 7 == 0:
                for _ in range(10):
                    prog(out)
            await sig

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            tg.start_soon(round_trips, 200)
            tg.start_soon(round_trips, 200)
            tg.start_soon(anyio.to_thread.run_sync, anyio.run, round_trips, 200)
        await dev.synchronize()
    total = 3 * (200 + 10 * 29)
    assert reports.values == list(range(first, first + total))
    assert len(set(reports.threads)) >= 2  # (the waiter and at least one loop thread)
    assert (await out.numpy())[0] == total
    await out.free()


class _Owner:
    """The little a DriverQueue needs of its device (a queue of the tests' own)."""

    def __init__(self) -> None:
        self.name = "CLPOLL"
        self._error: DeviceError | None = None

    def _fail(self, exc: BaseException, sig: Any) -> DeviceError:
        self._error = self._error or DeviceError(f"{self.name}: {exc!r}", cause=exc)
        return self._error


@pytest.fixture
def private() -> Iterator[tuple[DriverQueue, CLQueue]]:
    """A CL queue of the test's own on CL's context (the tests close or wedge it on purpose),
    its gate held a minute and its poll's budget a minute."""
    dev = Device["CL"]
    assert isinstance(dev, CLDevice)
    driver = CLQueue("poll-test", dev.context, dev.device_id)
    if driver._ring is None:
        pytest.skip("NATIVE_QUEUE=0: no completion ring, so no poll")
    queue = DriverQueue(_Owner(), "poll-test", driver, context=dev.context)  # type: ignore[arg-type]
    driver.gate(MINUTE_US)
    driver._poll_ns = MINUTE_US * 1000
    try:
        yield queue, driver
    finally:
        driver.close()
        queue.stop(drop_queued=True, join_timeout=30)


@cl_command
def _marker(cq: object, n: int, wl: Any) -> object:
    """A marker over its wait list (the gate): it completes once the gate is set."""
    event = ffi.new("cl_event*")
    assert ocl.lib().clEnqueueMarkerWithWaitList(cq, n, wl, event) == 0
    return event[0]


class _Lib:
    """The native library as a CLQueue sees it, with ``after_poll(n)`` run as a poll returns."""

    def __init__(self, lib: Any, after_poll: Any) -> None:
        self._lib, self._after_poll = lib, after_poll

    def __getattr__(self, name: str) -> Any:
        return getattr(self._lib, name)

    def clq_poll(self, *args: Any) -> int:
        n = int(self._lib.clq_poll(*args))
        self._after_poll(n)
        return n


async def test_a_queue_closed_while_a_poll_holds_what_it_took_waits_for_its_report(
    private: tuple[DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The queue closes between the poll's take and its report: the waiter must not end (and
    drop the commands it did not report) before the poll reported."""
    queue, driver = private
    stayed: list[bool] = []

    def close(n: int) -> None:
        if n:
            closer = threading.Thread(target=driver.close)
            closer.start()
            closer.join()
            driver._waiter.join(0.5)  # (it may not end: the poll holds the ring's token)
            stayed.append(driver._waiter.is_alive())

    monkeypatch.setattr(driver, "_native", _Lib(driver._native, close))
    sig = queue.submit(_marker, ())
    with anyio.fail_after(30):
        await sig
    assert stayed == [True] and sig.done() and sig.error() is None
    driver._waiter.join(30)
    assert not driver._waiter.is_alive()


class _Interrupt(Exception):
    """Stands for a signal handler's exception (KeyboardInterrupt) raised as a poll returns."""


async def test_an_exception_as_a_poll_returns_still_reports_what_it_took(
    private: tuple[DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    queue, driver = private

    def interrupt(n: int) -> None:
        if n:
            raise _Interrupt

    monkeypatch.setattr(driver, "_native", _Lib(driver._native, interrupt))
    sig = queue.submit(_marker, ())
    with pytest.raises(_Interrupt):
        await sig
    assert sig.done() and sig.error() is None  # (reported, and the ring's token given back)
    monkeypatch.undo()
    with anyio.fail_after(30):
        await queue.submit(_marker, ())  # (the waiter takes turns again)


async def test_a_poll_waits_its_whole_budget_for_the_token_even_past_a_second(
    private: tuple[DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The waiter holds the token while it runs a Python command; the polled user event has
    completed: the poll, with a minute's budget, waits for the token and takes the event."""
    queue, driver = private
    driver.gate(0)  # (the Python command runs at once)
    cl, err = ocl.lib(), ffi.new("cl_int*")
    ctx = Device["CL"].context  # type: ignore[attr-defined]
    user = cl.clCreateUserEvent(ctx, err)
    running, go = threading.Event(), threading.Event()

    def hold() -> None:
        cl.clSetUserEventStatus(user, ocl.COMPLETE)
        running.set()
        go.wait(60)

    @cl_command
    def the_user_event(cq: object, n: int, wl: Any) -> object:
        cl.clRetainEvent(user)  # (the driver releases the command's event)
        return user

    ahead = queue.submit(hold, ())
    loop = threading.get_ident()

    def release_once_polling() -> None:
        """Set ``go`` once the poll registered: it opens the gate in the same locked section."""
        while driver.gated() and not go.is_set():
            time.sleep(0.001)
        go.set()

    reports = _Reports(monkeypatch, queue.driver)
    releaser = threading.Thread(target=release_once_polling)
    try:
        with anyio.fail_after(30):
            await anyio.to_thread.run_sync(running.wait)
            driver.gate(MINUTE_US)  # (the user event's command opens a batch only a poll opens)
            sig = queue.submit(the_user_event, ())
            assert driver.gated()
            releaser.start()
            await sig
    finally:
        go.set()  # (the releaser and the Python command end whatever happened)
        if releaser.is_alive():
            releaser.join()
    assert ahead.done() and sig.done()
    assert reports.values[-1] == sig.value and reports.threads[-1] == loop
    cl.clReleaseEvent(user)


async def test_a_command_behind_a_python_command_is_not_polled(
    ring: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    """A launch, a Python command, a launch, all held by the gate: the second launch cannot
    complete before the waiter runs the Python command, so an await of it must not poll (the
    waiter, its first event not urgent, would wait out the poll's minute for the poller)."""
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    ran: list[int] = []
    prog(out)
    between = queue.submit(lambda: ran.append(threading.get_ident()), ())
    last = prog(out)
    assert driver.gated()
    with anyio.fail_after(30):
        await last
    assert between.done() and ran and ran[0] != threading.get_ident()
    assert (await out.numpy())[0] == 2
    await out.free()


class _ClaimLog:
    """The claims, checkpoints and polls an await of the queue ``queue`` makes, in order."""

    def __init__(self, queue: DriverQueue, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[str] = []
        timeline = queue.timeline
        claim, unclaim, poll = timeline.claim, timeline.unclaim, timeline.poll
        assert claim is not None and unclaim is not None and poll is not None
        # On asyncio (uvloop too) the await's checkpoint is a bare yield: a callback scheduled
        # at the claim runs in the pass of the loop it gives way to, before the task again. On
        # trio it is trio's checkpoint (anyio's calls it too).
        loop = asyncio._get_running_loop()
        checkpoint = trio.lowlevel.checkpoint

        def logged_claim(value: int) -> int:
            got = claim(value)
            self.calls.append(f"claim {bool(got)}")
            if loop is not None:
                loop.call_soon(self.calls.append, "checkpoint")
            return got

        def logged_unclaim(number: int) -> None:
            self.calls.append("unclaim")
            unclaim(number)

        def logged_poll(value: int, number: int = 0) -> None:
            self.calls.append("poll claimed" if number else "poll")
            poll(value, number)

        async def logged_checkpoint() -> None:
            self.calls.append("checkpoint")
            await checkpoint()

        monkeypatch.setattr(timeline, "claim", logged_claim)
        monkeypatch.setattr(timeline, "unclaim", logged_unclaim)
        monkeypatch.setattr(timeline, "poll", logged_poll)
        if loop is None:
            monkeypatch.setattr(trio.lowlevel, "checkpoint", logged_checkpoint)


def _claimed_launch(prog: Any, out: Any, timeline: Any) -> tuple[Any, int]:
    """A launch of ``prog`` and the number of its claim (made at once)."""
    sig = prog(out)
    assert timeline.claim is not None
    claim = timeline.claim(sig.value)
    assert claim
    return sig, claim


def _until_completed(event: Any) -> None:
    """Spin until ``event`` completed on the device (None: the ring no longer holds it)."""
    status = ffi.new("cl_int*", 1)
    deadline = time.monotonic() + 30
    while event is not None and status[0] > 0 and time.monotonic() < deadline:
        assert ocl.lib().clGetEventInfo(event, ocl.EVENT_COMMAND_EXECUTION_STATUS, 4, status, ffi.NULL) == 0
    assert event is None or status[0] == 0


async def test_an_await_claims_its_launch_makes_its_checkpoint_while_it_runs_then_polls(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim sends the held-back launch to the device, the await's one checkpoint comes
    while it runs, and the poll that ends the claim reports it from the awaiting thread."""
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    reports = _Reports(monkeypatch, queue.driver)
    log = _ClaimLog(queue, monkeypatch)
    sig = prog(out)
    assert driver.gated()
    with anyio.fail_after(30):
        await sig
    assert log.calls == ["claim True", "checkpoint", "poll claimed"]
    assert reports.threads == [threading.get_ident()] and reports.values == [sig.value]
    assert (await out.numpy())[0] == 1
    await out.free()


async def test_the_waiter_leaves_a_claimed_command_to_the_poll_even_when_somebody_waits(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Claimed (for a minute here), a launch that completed stays the poll's: while another
    task waits for it (the waiter then waits in the driver and reports at once), the waiter
    reports nothing for 50 ms after its completion; the claimed poll reports it, here."""
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    reports = _Reports(monkeypatch, queue.driver)
    timeline = queue.timeline
    sig, claim = _claimed_launch(prog, out, timeline)
    woken = threading.Event()
    timeline.add_waiter(sig.value, woken.set, internal=True)  # (wake_at: somebody waits)
    event = queue._event(sig.value)
    assert event is not None
    _until_completed(event)
    assert not woken.wait(0.05)  # (the GIL is free meanwhile: the waiter could have reported)
    assert reports.values == [] and not sig.done()
    timeline.poll(sig.value, claim)
    assert sig.done() and woken.is_set()
    assert reports.threads == [threading.get_ident()] and reports.values == [sig.value]
    await out.free()


async def test_a_claim_nobody_polls_for_ends_after_its_time_and_the_waiter_reports(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim lasts ``_CLAIM_NS`` at most (1 us here): the waiter then reports the command
    itself; the poll that ends the claim later finds it done and takes nothing."""
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    monkeypatch.setattr(cl_queue, "_CLAIM_NS", 1000)
    reports = _Reports(monkeypatch, queue.driver)
    timeline = queue.timeline
    sig, claim = _claimed_launch(prog, out, timeline)
    done = threading.Event()
    timeline.add_waiter(sig.value, done.set, internal=True)
    assert await anyio.to_thread.run_sync(done.wait, 30)
    assert reports.threads != [threading.get_ident()] and reports.values == [sig.value]
    assert driver._native.clq_claims(driver._ring) == 1
    timeline.poll(sig.value, claim)
    assert reports.values == [sig.value] and driver._native.clq_claims(driver._ring) == 0
    await out.free()


async def test_an_await_cancelled_at_its_checkpoint_gives_its_claim_up(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled at the checkpoint that follows the claim, the await gives the claim up (no
    poll comes), and the waiter reports the command, which ran: the wait is cancelled, not
    the work."""
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    log = _ClaimLog(queue, monkeypatch)
    sig = prog(out)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await sig
    assert log.calls == ["claim True", "checkpoint", "unclaim"] and scope.cancelled_caught
    assert driver._native.clq_claims(driver._ring) == 0
    done = threading.Event()
    queue.timeline.add_waiter(sig.value, done.set, internal=True)
    assert await anyio.to_thread.run_sync(done.wait, 30)  # (a claim left would hold it a minute)
    assert (await out.numpy())[0] == 1
    await out.free()


async def test_a_claim_left_past_its_time_counts_no_more_at_the_next_claim(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim nobody ends in time (its caller raised before its poll, or polls late) stops
    counting once its time passed: the next claim finds it gone, and its late poll does not end
    the newer claim (the ring still counts it)."""
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    monkeypatch.setattr(cl_queue, "_CLAIM_NS", 1000)
    timeline = queue.timeline
    assert timeline.claim is not None
    left = prog(out)
    late = timeline.claim(left.value)  # (polled only after the next claim)
    assert late
    done = threading.Event()
    timeline.add_waiter(left.value, done.set, internal=True)
    assert await anyio.to_thread.run_sync(done.wait, 30)
    assert driver._native.clq_claims(driver._ring) == 1
    monkeypatch.setattr(cl_queue, "_CLAIM_NS", MINUTE_US * 1000)
    sig = prog(out)
    claim = timeline.claim(sig.value)
    assert claim and driver._native.clq_claims(driver._ring) == 1
    timeline.poll(left.value, late)
    assert driver._native.clq_claims(driver._ring) == 1  # (the late poll ended nothing)
    timeline.poll(sig.value, claim)
    assert driver._native.clq_claims(driver._ring) == 0
    with anyio.fail_after(30):
        await sig
    await out.free()


async def test_a_claim_given_up_sends_the_waiter_on_at_once(
    ring: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    """The waiter times the launch's gate (a minute); an await claims the launch (the gate is
    set: it runs) and is cancelled at its checkpoint: giving the claim up wakes the waiter,
    which reports the command at once, not when the gate's minute is up. Nobody waits for it
    (a waiter registered would wake the waiter itself): ``done()`` is polled."""
    dev, _, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    sig = prog(out)
    with anyio.CancelScope() as scope:
        scope.cancel()
        await sig

    assert await seen_done(sig)
    await out.free()


async def test_a_waiter_holding_a_batch_leaves_a_command_claimed_meanwhile_to_its_poll(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The waiter took a launch nobody waits for and holds it, looking for more every 250 us;
    a second launch is claimed meanwhile and completes before its claimant polls: the waiter
    returns what it holds without taking the claimed command, which the poll reports."""
    dev, queue, driver = ring
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    driver.gate(0)  # (launches go to the device at once)
    with anyio.fail_after(30):
        await prog(out)  # (the next launches are repeat launches, made in C)
    timeline = queue.timeline
    taken_by_the_waiter = []
    reports = _Reports(monkeypatch, queue.driver)
    for _ in range(100):  # (10 round trips that count)
        if len(taken_by_the_waiter) == 10:
            break
        held = prog(out)
        _until_completed(queue._event(held.value))  # (the waiter takes it and holds it)
        start = time.perf_counter()
        while time.perf_counter() - start < 0.0004:
            pass  # (past the waiter's first look: it is inside its hold)
        reports.values.clear()
        sig = prog(out)
        assert timeline.claim is not None
        claim = timeline.claim(sig.value)
        if not claim:  # (the waiter woke and took it first: it completed within microseconds)
            with anyio.fail_after(30):
                await sig
            continue
        _until_completed(queue._event(sig.value))  # (before the claimant polls)
        await anyio.to_thread.run_sync(time.sleep, 0.01)  # (the waiter's turn: it could take it now)
        taken_by_the_waiter.append(sig.value in reports.values)
        timeline.poll(sig.value, claim)
        with anyio.fail_after(30):
            await sig
    assert taken_by_the_waiter == [False] * 10
    await out.free()


async def test_a_claim_left_does_not_hold_back_a_python_command_that_no_poll_takes(
    ring: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    """Two claims of one launch (two awaits of it, the second at its checkpoint for a minute)
    and a Python command behind it: the first claimant's poll takes the launch; the waiter,
    which the second claim would keep waiting, sees a Python command at the ring's head (no
    poll takes one) and runs it at once."""
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    timeline = queue.timeline
    sig, first = _claimed_launch(prog, out, timeline)
    ran: list[int] = []
    after = queue.submit(lambda: ran.append(threading.get_ident()), ())
    assert timeline.claim is not None and timeline.unclaim is not None
    second = timeline.claim(sig.value)
    assert second
    timeline.poll(sig.value, first)
    assert sig.done() and driver._native.clq_claims(driver._ring) == 1
    with anyio.fail_after(20):  # (the second claim would hold the waiter a minute)
        await after
    assert ran and ran[0] != threading.get_ident()
    timeline.unclaim(second)
    await out.free()


async def _c_report(driver: CLQueue, prog: Any, out: Any) -> None:
    """Skip unless ``driver``'s poll reports round trips in C (the extension module's
    ``cl_poll``: without it, and so without repeat launches, every poll reports in Python);
    launch ``prog(out)`` once, so that the next launches are repeat launches (made in C)."""
    assert driver._poll_out is not None
    if driver._settle is None:
        driver._settle_args(driver._poll_out)
    if not driver._settle:
        pytest.skip("the extension module (aiotinyrt.native._hostq) is not built: no poll's report in C")
    with anyio.fail_after(30):
        await prog(out)


class _PythonRuns:
    """The runs of repeat launches reported by ``DriverQueue._report_run`` (Python's path)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.values: list[int] = []
        run = DriverQueue._report_run

        def spy(queue: DriverQueue, sigs: list[Any]) -> None:
            self.values.extend(s.value for s in sigs)
            run(queue, sigs)

        monkeypatch.setattr(DriverQueue, "_report_run", spy)


async def test_a_round_trip_is_reported_in_c_by_the_awaiting_thread(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With nothing else to complete and nobody waiting on the timeline, the poll reports a
    round trip's launch in the same C call: Python's report never runs, and the Signal ends
    as Python's report leaves it (device time stored, what it held dropped, tracked)."""
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    await _c_report(driver, prog, out)
    python_runs = _PythonRuns(monkeypatch)
    reports = _Reports(monkeypatch, driver)
    first = queue.timeline.completed + 1
    sigs, kept = [], []
    with anyio.fail_after(30):
        for _ in range(20):
            sig = prog(out)
            kept.append(sig._keep)  # (its tuple of buffers, untracked while pending)
            await sig
            sigs.append(sig)
    assert python_runs.values == []
    assert all(k == (out,) and gc.is_tracked(k) for k in kept)  # (the collector's again)
    assert reports.values == list(range(first, first + 20))
    assert reports.threads == [threading.get_ident()] * 20
    assert [s.value for s in sigs] == reports.values and queue._taken == first + 19
    assert queue.timeline.completed == first + 19 and not queue._advancing
    for sig in sigs:
        assert sig.done() and sig.error() is None and sig.result() > 0.0  # (PoCL's profiling time)
        assert sig._keep is None and sig._args is None and sig._fn is None and sig._deps is None
        assert gc.is_tracked(sig)
    assert (await out.numpy())[0] == 21
    await out.free()


async def test_a_round_trip_is_reported_in_python_when_a_waiter_of_the_timeline_is_due(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A waiter of the timeline (another task's await, a deferred free) must be fired by the
    report that reaches its value: the C report declines that one and Python's reports it,
    firing the waiter before ``completed`` moves. A waiter for a later value does not stop
    the C report. (Each waiter is registered once the await claimed its launch: the waiter
    thread then leaves the launch to the poll.)"""
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    await _c_report(driver, prog, out)
    python_runs = _PythonRuns(monkeypatch)
    timeline, claim = queue.timeline, queue.timeline.claim
    assert claim is not None
    first = timeline.completed + 1
    fired: list[int] = []

    def claim_then_wait(value: int) -> int:
        number = claim(value)
        timeline.add_waiter(first + 1, lambda: fired.append(timeline.completed), internal=True)
        return number

    monkeypatch.setattr(timeline, "claim", claim_then_wait)
    with anyio.fail_after(30):
        await prog(out)
        assert python_runs.values == [] and fired == []  # (its C report: nobody waits for it yet)
        await prog(out)
    assert python_runs.values == [first + 1]
    assert len(fired) == 2 and fired[0] == first  # (the first one fired before completed moved)
    assert timeline.completed == first + 1 and timeline.pending_waiters() == 0
    await out.free()


async def test_a_round_trip_is_reported_in_python_while_another_thread_holds_the_done_lock(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The C report only tries the queue's done lock: held by another thread, it declines,
    and Python's report waits for the lock (let go here once the poll handed the report to
    Python's path, ``CLQueue._report_polled``)."""
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    await _c_report(driver, prog, out)
    python_runs = _PythonRuns(monkeypatch)
    held, go = threading.Event(), threading.Event()
    report, handed = driver._report_polled, []

    def let_go_then_report(n: int) -> None:
        handed.append(n)
        go.set()
        report(n)

    def hold() -> None:
        with queue._done_lock:
            held.set()
            go.wait(60)

    monkeypatch.setattr(driver, "_report_polled", let_go_then_report)
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(30)
        sig = prog(out)
        with anyio.fail_after(30):
            await sig
    finally:
        go.set()
        holder.join(30)
    assert handed == [1]  # (it took the launch and left its report to Python)
    assert python_runs.values == [sig.value] and sig.done() and sig.error() is None
    await out.free()


async def test_a_round_trip_is_reported_in_python_while_a_later_command_waits_to_be_advanced(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command after the launch whose result is already in (held back for a dependency on
    another device that failed: it completes unrun) must be advanced with the launch's
    report: the C report declines (results pending) and Python's completes both."""
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    await _c_report(driver, prog, out)
    python_runs = _PythonRuns(monkeypatch)
    cpu, go = Device["CPU"], threading.Event()

    def fail() -> None:
        go.wait(60)
        raise RuntimeError("the dependency failed")

    dep = cpu._compute_queue.submit(fail, ())
    try:
        try:
            launch = prog(out)  # (its batch waits for the gate: held a minute)
            later = queue.submit(lambda: None, (), (dep,))
            assert list(queue._held) == [later]
        finally:
            go.set()
        with anyio.fail_after(30):
            while queue._held:  # (the CPU worker fails it once the dependency failed)
                await anyio.lowlevel.checkpoint()
            assert later.value in queue._results and not launch.done()
            await launch
            with pytest.raises(DeviceError, match="the dependency failed"):
                await later
        assert python_runs.values == [launch.value] and launch.error() is None
    finally:
        await cpu.reset()
    await out.free()


async def test_native_queue_0_set_after_the_queue_was_made_leaves_its_polls_as_they_are(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``NATIVE_QUEUE`` is read when a queue is made (its ring, its timeline's claim and poll in
    C): set to 0 (or to nothing) afterwards it changes nothing for the queue, whose round trips
    go on being claimed, polled and reported in C, and every await completes."""
    dev, _, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    await _c_report(driver, prog, out)  # (the launches below are repeat launches)
    python_runs, frames = _PythonRuns(monkeypatch), _QueueFrames()
    sigs = []
    with anyio.fail_after(30):
        for setting in ("0", "0", ""):
            monkeypatch.setenv("NATIVE_QUEUE", setting)
            sigs.append(prog(out))
            with frames:
                await sigs[-1]
    assert python_runs.values == [] and frames.ran == []
    assert all(s.done() and s.error() is None for s in sigs)
    monkeypatch.delenv("NATIVE_QUEUE")
    assert (await out.numpy())[0] == 4
    await out.free()


async def test_an_await_of_a_signal_of_value_0_returns_at_once(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Value 0 of a timeline is done before anything was submitted (``Signal(timeline,
    timeline.submitted)`` on a fresh queue): its await's claim takes nothing, no poll comes,
    and it returns 0.0 after its checkpoint."""
    _, queue, _ = ring
    log = _ClaimLog(queue, monkeypatch)
    with anyio.fail_after(30):
        assert await Signal(queue.timeline, 0) == 0.0
    assert log.calls == ["claim False", "checkpoint"]


async def test_a_round_trip_completed_after_the_device_failed_fails_with_its_error(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A launch that completes once the device holds its sticky error fails with it: the C
    report declines and Python's fails it."""
    dev, _, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    await _c_report(driver, prog, out)
    python_runs = _PythonRuns(monkeypatch)
    sig = prog(out)
    assert not sig.done()  # (its batch waits for the gate: held a minute)
    error = dev._fail(RuntimeError("elsewhere"), sig)
    with pytest.raises(DeviceError, match="elsewhere"), anyio.fail_after(30):
        await sig
    assert python_runs.values == [sig.value] and sig.error() is error
    await dev.reset()
    await out.free()


@pytest.mark.parametrize("how", ["set", "in a replaced os.environ"])
async def test_a_round_trip_is_reported_in_python_with_debug_logging(
    ring: tuple[CLDevice, DriverQueue, CLQueue],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    how: str,
) -> None:
    """DEBUG=2 logs every completed launch: the C report declines and Python's logs it. DEBUG
    is read from ``os.environ`` as Python reads it: with the mapping replaced (as a test may),
    the C report cannot read it and leaves the report to Python too."""
    dev, queue, driver = ring
    prog, out = await _inc_held_a_minute(dev, driver)
    await _c_report(driver, prog, out)
    python_runs = _PythonRuns(monkeypatch)
    if how == "set":
        monkeypatch.setenv("DEBUG", "2")
    else:
        monkeypatch.setattr(os, "environ", {**os.environ, "DEBUG": "2"})
    with caplog.at_level("DEBUG", logger="aiotinyrt"), anyio.fail_after(30):
        sig = prog(out)
        await sig
    assert python_runs.values == [sig.value]
    assert f"{queue.timeline.label}@{sig.value}: launch" in caplog.text
    monkeypatch.undo()
    await out.free()


def test_the_c_report_reads_debug_from_the_os_environ_of_the_moment() -> None:
    """A process whose CL device opens while ``os.environ`` is replaced (as a test may) and
    put back afterwards: its polls report round trips in C again (DEBUG is read from the
    mapping of the moment, not the one at the device's opening). A fresh process: the
    extension module is configured once, by the first CL device."""
    script = """
import functools, os, anyio
from aiotinyrt import Buffer, Device, dtypes
from aiotinyrt.backends import cl_queue
real = os.environ
os.environ = {**real}
dev = Device["CL"]
os.environ = real
driver = dev._compute_queue.driver
# (a minute's poll, claim and gate: only the report is under test, not who takes the command)
driver._poll_ns = 60_000_000_000
cl_queue._CLAIM_NS = 60_000_000_000
driver.gate(60_000_000)
async def main():
    prog = await dev.program("inc", "__kernel void inc(__global int* out) { out[0] += 1; }")
    out = await Buffer("CL", 1, dtypes.int32).allocate()
    await prog(out)
    timeline, reported = dev._compute_queue.timeline, []
    if not isinstance(timeline.poll, functools.partial):
        print("no C report")
        return
    saw = lambda first, last: reported.append((first, last))
    timeline.poll = functools.partial(timeline.poll.func, (*timeline.poll.args[0][:4], saw))
    for _ in range(5):
        await prog(out)
    print("reported in C:", len(reported), "polls:", reported)
anyio.run(main)
"""
    cl_ring("the poll's report in C")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("DEBUG", None)
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    if "no C report" in done.stdout:
        pytest.skip("the extension module (aiotinyrt.native._hostq) is not built: no poll's report in C")
    assert "reported in C: 5" in done.stdout, done.stdout + done.stderr


async def test_a_direct_launch_nobody_awaits_leaves_the_waiters_holds_alone_once_its_time_passed(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a round trip, a launch nobody awaits goes to the device at once with a claim of
    its own, which nobody ends (counted until the next claim). Once its time (the gate's, 50 us)
    passed, that claim no longer ends the waiter's holds: launches made 300 us apart, nobody
    waiting, come back a few per report (one hold lasts up to 1 ms), not one per report."""
    dev, queue, driver = ring
    prog, out, _ = await direct_launch(dev, driver, 50)
    reports = _Reports(monkeypatch, queue.driver)
    n = 40
    for _ in range(n):
        time.sleep(0.0003)  # (pacing: a producer slower than the device, nobody waiting)
        prog(out)
    with anyio.fail_after(30):
        await dev.synchronize()
    assert len(reports.threads) < n * 7 // 10
    assert (await out.numpy())[0] == n + 3
    await out.free()
