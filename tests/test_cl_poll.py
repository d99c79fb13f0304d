"""An await of a CL command with few ahead of it waits for it in the awaiting thread, briefly,
and reports it there (aiotinyrt/native/clq.c, "Two takers"; ``CLQueue.poll``): the waiter
thread and the pollers take turns on the ring's token, no completion is lost or reported twice,
a Python command is left to the waiter, and a poll returns after its budget whatever the
command does."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

from aiotinyrt import Device, DeviceError
from aiotinyrt.backends import cl_queue
from aiotinyrt.backends import opencl as ocl
from aiotinyrt.backends.cl_queue import CLQueue
from aiotinyrt.backends.ops_cl import CLDevice, cl_command, ffi
from aiotinyrt.driverqueue import Done, DriverQueue
from tests.helpers import int_buffer

pytestmark = pytest.mark.anyio

INC = "__kernel void inc(__global int* out) { out[0] += 1; }"
MINUTE_US = 60_000_000


@pytest.fixture
async def ring() -> AsyncIterator[tuple[CLDevice, DriverQueue, CLQueue]]:
    """CL, its compute queue and that queue's driver (skipped without the native ring); the
    poll's budget and the gate's hold come back afterwards, and a sticky error is reset."""
    dev = Device["CL"]
    assert isinstance(dev, CLDevice)
    queue = dev._compute_queue
    driver = queue.driver
    assert isinstance(driver, CLQueue)
    if driver._ring is None:
        pytest.skip("NATIVE_QUEUE=0: no completion ring, so no poll")
    await dev.synchronize()
    budget = driver._poll_ns
    try:
        yield dev, queue, driver
    finally:
        driver._poll_ns = budget
        driver.gate(50)
        if dev._error is not None:  # (a test that failed before its own reset)
            await dev.reset()


class _Reports:
    """The threads that report each CL batch (``cl_queue.report``, which both takers call)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.threads: list[int] = []
        self.values: list[int] = []
        real = cl_queue.report

        def spy(batch: list[tuple[Done, float, BaseException | None]]) -> None:
            self.threads.append(threading.get_ident())
            self.values.extend(done.value for done, _, _ in batch)
            real(batch)

        monkeypatch.setattr(cl_queue, "report", spy)


async def test_an_await_of_a_launch_on_an_idle_queue_is_reported_by_the_awaiting_thread(
    ring: tuple[CLDevice, DriverQueue, CLQueue], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The gate holds each launch until the poll opens it (so the waiter cannot take it first)
    and the budget is a minute: every completion is the loop thread's."""
    dev, queue, driver = ring
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    driver.gate(MINUTE_US)
    driver._poll_ns = MINUTE_US * 1000
    reports = _Reports(monkeypatch)
    first = queue.timeline.completed + 1
    with anyio.fail_after(30):
        for _ in range(20):
            await prog(out)
    assert reports.threads == [threading.get_ident()] * 20
    assert reports.values == list(range(first, first + 20))
    assert (await out.numpy())[0] == 20
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
    real_poll = driver.poll

    def poll(event: Any) -> None:
        real_poll(event)
        polls.append(go.is_set())  # (returned while the Python command still held the queue)

    monkeypatch.setattr(queue, "_driver_poll", poll)
    reports = _Reports(monkeypatch)
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
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    driver.gate(MINUTE_US)
    driver._poll_ns = MINUTE_US * 1000
    reports = _Reports(monkeypatch)
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
    reports = _Reports(monkeypatch)
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
    reports = _Reports(monkeypatch)
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
