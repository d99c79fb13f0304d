"""The CL waiter's naps (aiotinyrt/native/clq.c, "Naps"): for a while after each push, a waiter
that found its ring empty waits with a time limit, and a push wakes it only when it must act
at once (a Python command, or any push while somebody waits for the queue); otherwise it
looks at the ring when its nap ends. Nothing handed over in a nap is lost."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator

import anyio
import pytest

from aiotinyrt.backends.cl_queue import CLQueue
from aiotinyrt.backends.ops_cl import CLDevice
from aiotinyrt.driverqueue import DriverQueue
from tests.helpers import cl_ring, int_buffer, seen_done

pytestmark = pytest.mark.anyio

INC = "__kernel void inc(__global int* out) { out[0] += 1; }"
ROUND_TRIPS = 200


@pytest.fixture
async def ungated() -> AsyncIterator[tuple[CLDevice, DriverQueue, CLQueue]]:
    """CL, its compute queue and that queue's driver, batches off (a gate opening would wake the
    waiter to time it, which these tests do not count); the default hold comes back afterwards."""
    dev, queue, driver = cl_ring("naps")
    await dev.synchronize()
    driver.gate(0)
    try:
        yield dev, queue, driver
    finally:
        driver.gate(50)


def _push_wakes(driver: CLQueue) -> int:
    return int(driver._native.clq_push_wakes(driver._ring))


async def test_round_trips_do_not_wake_the_waiter_at_each_push(
    ungated: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    """Each await takes its launch itself (a poll), so the waiter finds the ring empty and
    naps; the next launch's push leaves it napping. It wakes for a push only after a millisecond
    without one (4 naps, or fewer when other signals cut them short), which a loaded machine's
    pause between two round trips may make."""
    dev, _, driver = ungated
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    before = _push_wakes(driver)
    with anyio.fail_after(60):
        for _ in range(ROUND_TRIPS):
            await prog(out)
    assert _push_wakes(driver) - before < ROUND_TRIPS // 4
    assert (await out.numpy())[0] == ROUND_TRIPS
    await out.free()


async def test_a_launch_nobody_waits_for_is_reported_after_a_nap(
    ungated: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    """Launches pushed while the waiter naps, with no waiter registered on the timeline (which
    would wake it): the waiter reports them once its nap ends. ``done()`` is polled from a
    thread, as a caller without an await does."""
    dev = ungated[0]
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await prog(out)  # (a push: the waiter naps)
    sigs = [prog(out) for _ in range(3)]

    assert await seen_done(sigs[-1])
    assert all(s.done() for s in sigs)
    assert (await out.numpy())[0] == 4
    await out.free()


async def test_a_python_command_pushed_while_the_waiter_naps_wakes_it(
    ungated: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    """Only the waiter runs a Python command: its push wakes a napping waiter, counted. The
    push is made while the waiter naps (a launch's await, then the test spins until the waiter
    rests and tries again if it found it waiting untimed: a millisecond without a push)."""
    dev, queue, driver = ungated
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    deadline = time.monotonic() + 20
    for _ in range(100):
        await prog(out)  # (a push: the waiter naps again)
        while not driver._native.clq_resting(driver._ring) and time.monotonic() < deadline:
            pass
        if driver._native.clq_resting(driver._ring) == 1:
            break
    else:
        pytest.fail("the waiter was never found napping")
    before = _push_wakes(driver)
    ran: list[int] = []
    sig = queue.submit(lambda: ran.append(threading.get_ident()), ())
    with anyio.fail_after(20):
        await sig
    assert ran and ran[0] != threading.get_ident()
    assert _push_wakes(driver) > before
    await out.free()


async def test_round_trips_do_not_wake_the_waiter_at_each_poll(
    ungated: tuple[CLDevice, DriverQueue, CLQueue],
) -> None:
    """The waiter that looked at a round trip's launch and found it claimed waits for the
    claim to end as in a nap; the await's poll takes the launch, and with the ring empty
    nothing cuts that wait short: the waiter finds the launch gone when its nap ends. (Woken at
    the end of each poll and of each report, it stayed in step with the round trips, two
    wake-ups across cores each, until it once found the ring empty.)"""
    dev, _, driver = ungated
    prog = await dev.program("inc", INC)
    out = await int_buffer(dev.name)
    await dev.synchronize()
    before = driver._native.clq_claim_wakes(driver._ring)
    with anyio.fail_after(60):
        for _ in range(ROUND_TRIPS):
            await prog(out)
    assert driver._native.clq_claim_wakes(driver._ring) - before < ROUND_TRIPS // 20
    assert (await out.numpy())[0] == ROUND_TRIPS
    await out.free()
