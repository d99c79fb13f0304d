"""Batches of CL commands nobody waits for (aiotinyrt/native/clq.c, "Gates"): a command enqueued
while nobody waits for its queue waits for the batch's gate; a task awaiting the queue, a
command of another queue depending on one of the batch, or the batch's deadline hands it to
the device; a command enqueued while somebody waits goes at once."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator

import anyio
import pytest

from aiotinyrt.backends import opencl as ocl
from aiotinyrt.backends.cl_queue import CLQueue
from aiotinyrt.backends.ops_cl import CLDevice, ffi
from aiotinyrt.driverqueue import DriverQueue
from tests.helpers import cl_ring, direct_launch, int_buffer, seen_done

pytestmark = pytest.mark.anyio

INC = "__kernel void inc(__global int* out) { out[0] += 1; }"
LONG_US = 60_000_000  # (a gate held this long: only what the test checks opens it)


@pytest.fixture
async def ring() -> AsyncIterator[tuple[CLDevice, DriverQueue, CLQueue]]:
    """CL, its compute queue and that queue's driver, with batches held up to a minute (skipped
    without the native ring); the default hold comes back afterwards."""
    dev, queue, driver = cl_ring("gates")
    await dev.synchronize()
    driver.gate(LONG_US)
    try:
        yield dev, queue, driver
    finally:
        driver.gate(50)


async def test_a_launch_nobody_waits_for_waits_for_its_gate_and_an_await_opens_it(
    ring: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    dev, _, driver = ring
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    sig = prog(out)
    assert driver.gated()  # (held: nobody waits for the queue)
    with anyio.fail_after(20):  # (the gate holds a minute: only the await can open it)
        await sig
    assert not driver.gated()
    assert (await out.numpy())[0] == 1
    await out.free()


async def test_a_command_of_another_queue_waiting_for_a_held_launch_opens_its_gate(
    ring: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    """The read runs on the copy queue, with the launch's event in its wait list; awaiting it
    sets nothing on the compute queue."""
    dev, _, driver = ring
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    prog(out)
    assert driver.gated()
    with anyio.fail_after(20):
        assert (await out.numpy())[0] == 1
    await out.free()


async def test_a_command_of_another_queue_opens_a_gate_the_waiter_is_timing(
    ring: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    """The batch starts with a Python command, which only the waiter thread can run: the read
    waiting for the launch behind it must wake the waiter, which times the minute's gate."""
    dev, queue, driver = ring
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    ahead = queue.submit(lambda: None, ())
    prog(out)
    assert driver.gated()
    with anyio.fail_after(20):
        assert (await out.numpy())[0] == 1
    assert ahead.done()
    await out.free()


async def test_a_batch_nobody_waits_for_goes_to_the_device_at_its_deadline(
    ring: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    """A thread waits for the launch's event through OpenCL alone (no waiter on the timeline):
    the waiter thread sets the gate once the batch is as old as the hold."""
    dev, queue, driver = ring
    driver.gate(20_000)
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    sig = prog(out)
    assert driver.gated()
    event = queue._event(sig.value)
    events = ffi.new("cl_event[1]", [event])
    ocl.lib().clRetainEvent(event)
    try:
        with anyio.fail_after(20):
            await anyio.to_thread.run_sync(ocl.lib().clWaitForEvents, 1, events, abandon_on_cancel=True)
    finally:
        ocl.lib().clReleaseEvent(event)
    assert queue.timeline.pending_waiters() == 0 and not driver.gated()
    await sig
    await out.free()


async def test_a_launch_while_somebody_waits_for_the_queue_goes_to_the_device_at_once(
    ring: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    dev, queue, driver = ring
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    go = threading.Event()
    ahead = queue.submit(lambda: go.wait(60), ())
    async with anyio.create_task_group() as tg:
        waiting = anyio.Event()

        async def wait_ahead() -> None:
            waiting.set()
            await ahead

        tg.start_soon(wait_ahead)
        await waiting.wait()
        assert queue.timeline.pending_waiters() == 1
        sig = prog(out)
        assert not driver.gated()  # (somebody waits: no batch is held)
        go.set()
    with anyio.fail_after(20):
        await sig
    await out.free()


async def test_a_launch_behind_a_command_not_done_yet_opens_no_batch(
    ring: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    """The device has work (the newest command handed over has not completed): a launch goes
    to it at once, without a gate (whose user event costs more than the enqueue); behind a
    completed one, the next launch opens a batch again."""
    dev, queue, driver = ring
    cl, err = ocl.lib(), ffi.new("cl_int*")
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    user = cl.clCreateUserEvent(dev.context, err)
    driver.gate(0)
    marker = queue.submit(_after_the_user_event(user), ())  # (no gate: pending until the test sets it)
    driver.gate(LONG_US)
    try:
        sig = prog(out)
        assert not driver.gated()
    finally:
        cl.clSetUserEventStatus(user, ocl.COMPLETE)
    with anyio.fail_after(20):
        await sig
    assert marker.done() and not driver.gated()
    again = prog(out)
    assert driver.gated()  # (nothing pending: a batch, held until the await)
    with anyio.fail_after(20):
        await again
    cl.clReleaseEvent(user)
    assert (await out.numpy())[0] == 2
    await out.free()


def _after_the_user_event(user: object) -> object:
    """A marker over the user event ``user`` (and its wait list): pending until it is set."""
    from aiotinyrt.backends.ops_cl import cl_command

    @cl_command
    def marker(cq: object, n: int, wl: object) -> object:
        waits = ffi.new("cl_event[]", [*(wl[i] for i in range(n)), user])  # type: ignore[index]
        event = ffi.new("cl_event*")
        assert ocl.lib().clEnqueueMarkerWithWaitList(cq, n + 1, waits, event) == 0
        return event[0]

    return marker


async def test_a_launch_right_after_an_await_of_the_newest_launch_goes_to_the_device_at_once(
    ring: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    """A launch round trip: the await claimed the newest command handed over, a repeat launch,
    so the next launch skips the gate (its claim of its own keeps the waiter off it as the gate
    would: a thread's wait ends that claim as it would set a gate). Once: the launch after one
    waited for without a claim opens a batch again."""
    dev, _, driver = ring
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await prog(out)  # (the program's repeat launch made)
    driver.gate(LONG_US)  # (and no round trip's rule carried over)
    sig = prog(out)
    assert driver.gated()
    with anyio.fail_after(20):
        await sig
    direct = prog(out)
    assert not driver.gated()
    with anyio.fail_after(20):
        await anyio.to_thread.run_sync(direct.wait_blocking, 20)
    again = prog(out)
    assert driver.gated()
    with anyio.fail_after(20):
        await again
    assert (await out.numpy())[0] == 4
    await out.free()


async def test_a_direct_launch_nobody_awaits_is_reported_at_the_gates_time(
    ring: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    """The direct launch's own claim lasts the gate's time (20 ms here), then the waiter
    reports it; nobody waits for it (a waiter registered would end the claim):
    ``done()`` is polled from a thread."""
    dev, _, driver = ring
    _, out, direct = await direct_launch(dev, driver, 20_000)
    assert await seen_done(direct)
    await out.free()
