"""``Signal.wait_blocking``: the blocking wait for synchronous callers (tinygrad's runtime calls).

Called in a thread that runs no event loop it blocks until the command completes and returns its
device seconds (or raises its ``DeviceError``, or ``TimeoutError``); on an event-loop thread
(asyncio, uvloop, trio) it raises ``RuntimeError`` instead of blocking the loop. Pending work is
held by the gate kernel (tests/helpers.py), so "still running when the timeout expires" is
a fact, not a timing guess.
"""

from __future__ import annotations

import threading

import anyio
import anyio.to_thread
import pytest

import aiotinyrt as rt
from aiotinyrt import DeviceError, Signal
from tests.helpers import INC, fail_command, gate_on, int_buffer

pytestmark = pytest.mark.anyio

DEV = "CPU:6"


async def test_wait_blocking_on_the_event_loop_thread_raises_instead_of_blocking() -> None:
    async with rt.open_device(DEV), gate_on(DEV) as gate:
        out = await int_buffer(DEV)
        sig = gate.launch(out, 3)
        with pytest.raises(RuntimeError, match="event-loop thread"):
            sig.wait_blocking(timeout=10)
        assert not sig.done()  # it returned at once: the gate is still closed
        gate.open()
        await sig
        with pytest.raises(RuntimeError, match="event-loop thread"):
            sig.wait_blocking()  # even when already done: the rule does not depend on timing
        await out.free()


async def test_wait_blocking_in_a_worker_thread_returns_the_device_seconds() -> None:
    async with rt.open_device(DEV) as dev, gate_on(DEV) as gate:
        out = await int_buffer(DEV)
        sig = gate.launch(out, 5)
        started = threading.Event()

        def blocking() -> float:
            started.set()
            return sig.wait_blocking(timeout=30)

        async with anyio.create_task_group() as tg:
            result: list[float] = []

            async def run() -> None:
                result.append(await anyio.to_thread.run_sync(blocking))

            tg.start_soon(run)
            await anyio.to_thread.run_sync(started.wait)
            assert not sig.done()
            gate.open()
        assert type(result[0]) is float and result[0] >= 0
        assert sig.done()
        assert (await out.numpy()).tolist() == [5]
        assert sig.timeline.pending_waiters() == 0
        inc = await dev.program("inc", INC)
        done = inc(out)
        await done
        assert await anyio.to_thread.run_sync(done.wait_blocking) >= 0  # already done: at once
        await out.free()


async def test_wait_blocking_timeout_raises_and_the_work_keeps_running() -> None:
    async with rt.open_device(DEV), gate_on(DEV) as gate:
        out = await int_buffer(DEV)
        sig = gate.launch(out, 8)
        with pytest.raises(TimeoutError, match=f"{DEV}: timeline compute"):
            await anyio.to_thread.run_sync(lambda: sig.wait_blocking(timeout=0.01))
        assert not sig.done()
        gate.open()
        await sig
        assert (await out.numpy()).tolist() == [8]
        await out.free()


async def test_wait_blocking_raises_the_device_error_of_a_failed_command() -> None:
    async with rt.open_device(DEV) as dev:
        sig = fail_command(dev)
        with pytest.raises(DeviceError, match="boom from the test"):
            await anyio.to_thread.run_sync(sig.wait_blocking, 30.0)
        await dev.reset()


def test_wait_blocking_outside_any_event_loop_blocks_until_done() -> None:
    async def launch() -> tuple[Signal, rt.Buffer]:
        dev = rt.Device[DEV]
        prog = await dev.program("inc", INC)
        out = await int_buffer(DEV)
        return prog(out), out

    sig, out = anyio.run(launch)
    assert type(sig.wait_blocking(timeout=30)) is float
    assert sig.done()
    with pytest.raises(ValueError, match="timeout"):
        sig.wait_blocking(timeout=-1)
    anyio.run(out.free)
