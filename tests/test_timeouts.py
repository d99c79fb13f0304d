"""Timeouts: giving up on a wait raises ``TimeoutError`` naming what was awaited, and never stops
the work or frees the memory it uses.

Every test holds a device queue with the gate kernel (see ``tests/test_signals.py``), so "the
work is still pending when the wait expires" is a fact, not a timing guess.
"""

from __future__ import annotations

import anyio
import numpy as np
import pytest

import aiotinyrt as rt
from aiotinyrt import Buffer, DeviceError, dtypes
from tests.helpers import INC, gate_on, int_buffer

pytestmark = pytest.mark.anyio

DEV = "CPU:4"  # a device of its own, so timeline values and memory figures are exact


async def test_fail_after_around_await_raises_timeout_and_the_launch_still_completes() -> None:
    async with rt.open_device(DEV), gate_on(DEV) as gate:
        out = await int_buffer(DEV, 7)
        sig = gate.launch(out, 42)
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.02):
                await sig
        assert not sig.done()
        assert sig.timeline.pending_waiters() == 0
        gate.open()
        assert type(await sig) is float
        assert (await out.numpy()).tolist() == [42]
        await out.free()


async def test_wait_timeout_message_names_device_timeline_and_both_values() -> None:
    async with rt.open_device(DEV), gate_on(DEV) as gate:
        out = await int_buffer(DEV)
        sig = gate.launch(out)
        assert (sig.value, sig.timeline.completed) == (1, 0)  # the device's first launch
        with pytest.raises(TimeoutError) as info:
            await sig.wait(timeout=0.01)
        assert str(info.value).startswith(f"{DEV}: timeline compute not set to 1, but 0 after 0.01 s")
        gate.open()
        await sig
        await out.free()


async def test_memory_freed_after_a_timeout_stays_in_use_until_the_work_completes() -> None:
    async with rt.open_device(DEV) as dev, gate_on(DEV) as gate:
        out = await Buffer(DEV, 1024, dtypes.int32).allocate()
        in_use = dev.allocator.statistics().bytes_in_use
        sig = gate.launch(out, 9)
        with pytest.raises(TimeoutError):
            await sig.wait(timeout=0.01)
        await out.free()
        assert dev.allocator.statistics().bytes_in_use == in_use  # deferred: the kernel still runs
        gate.open()
        await dev.synchronize()
        assert not sig.failed()
        assert dev.allocator.statistics().bytes_in_use == in_use - 4096


async def test_copyin_that_times_out_still_lands_after_the_write_it_waits_for() -> None:
    async with rt.open_device(DEV), gate_on(DEV) as gate:
        out = await int_buffer(DEV, 0, size=4)
        gate.launch(out, 5)  # writes out[0] = 5 once opened
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.02):
                await out.copyin(np.array([1, 2, 3, 4], np.int32))  # ordered after the gate (WAW)
        gate.open()
        assert (await out.numpy()).tolist() == [1, 2, 3, 4]
        await out.free()


async def test_wait_timeout_ms_env_bounds_every_kind_of_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    async with rt.open_device(DEV) as dev, gate_on(DEV) as gate:
        inc = await dev.program("inc", INC)
        out = await int_buffer(DEV)
        other = await int_buffer(DEV)
        monkeypatch.setenv("WAIT_TIMEOUT_MS", "20")
        sig = gate.launch(out, 3)
        with pytest.raises(TimeoutError, match=rf"^{DEV}: timeline compute not set to {sig.value}, but "):
            await sig
        with pytest.raises(TimeoutError, match="not set to"):
            await dev.synchronize()
        with pytest.raises(TimeoutError, match="not set to"):
            await dev.run(inc, other)  # queued behind the gate on the compute queue
        assert sig.timeline.pending_waiters() == 0  # the timed-out tasks left no waiter behind
        with pytest.raises(TimeoutError, match="not set to"):
            await out.numpy()  # a read queued after the gate's pending write
        with pytest.raises(TimeoutError, match="not set to"):
            await dev.reset()  # draining is a wait too; the device stays usable
        assert not sig.done()
        gate.open()
        assert type(await sig.wait(timeout=30)) is float  # an explicit timeout wins over the env
        monkeypatch.delenv("WAIT_TIMEOUT_MS")
        await dev.synchronize()
        assert (await out.numpy()).tolist() == [3]
        assert (await other.numpy()).tolist() == [1]  # the timed-out run still ran
        assert all(tl.pending_waiters() == 0 for tl in dev.timelines)
        await out.free()
        await other.free()


async def test_rt_synchronize_under_wait_timeout_ms_raises_timeout_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``aiotinyrt.synchronize`` waits in a task group; its timeout must still surface as a plain
    ``TimeoutError`` (not an ``ExceptionGroup``) so ``except TimeoutError`` works everywhere."""
    async with rt.open_device(DEV) as dev, gate_on(DEV) as gate:
        out = await int_buffer(DEV)
        gate.launch(out)
        monkeypatch.setenv("WAIT_TIMEOUT_MS", "20")
        try:
            with pytest.raises(TimeoutError, match="not set to"):
                await rt.synchronize(dev, "NULL")
        finally:
            monkeypatch.delenv("WAIT_TIMEOUT_MS")
            gate.open()
        await dev.synchronize()
        await out.free()


async def test_timeout_zero_returns_a_done_signal_and_refuses_a_pending_one() -> None:
    async with rt.open_device(DEV) as dev, gate_on(DEV) as gate:
        inc = await dev.program("inc", INC)
        out = await int_buffer(DEV)
        done = inc(out)
        await done
        assert type(await done.wait(timeout=0)) is float
        pending = gate.launch(out)
        with pytest.raises(TimeoutError, match="after 0 s"):
            await pending.wait(timeout=0)
        gate.open()
        await pending
        await out.free()


async def test_outer_cancellation_during_a_wait_with_timeout_is_a_cancellation_not_a_timeout() -> None:
    async with rt.open_device(DEV), gate_on(DEV) as gate:
        out = await int_buffer(DEV)
        sig = gate.launch(out)
        with anyio.move_on_after(0.02) as scope:
            await sig.wait(timeout=30)
        assert scope.cancelled_caught
        assert sig.timeline.pending_waiters() == 0
        gate.open()
        await sig
        await out.free()


@pytest.mark.slow
async def test_many_timed_out_waiters_on_one_signal_all_raise_and_leave_nothing_behind() -> None:
    outcomes: list[str] = []
    async with rt.open_device(DEV), gate_on(DEV) as gate:
        out = await int_buffer(DEV)
        sig = gate.launch(out, 11)

        async def waiter(timeout: float) -> None:
            try:
                await sig.wait(timeout=timeout)
                outcomes.append("done")
            except TimeoutError:
                outcomes.append("timeout")

        async with anyio.create_task_group() as tg:
            for i in range(100):
                tg.start_soon(waiter, 0.001 * (i % 10 + 1))
        assert outcomes == ["timeout"] * 100
        assert sig.timeline.pending_waiters() == 0
        gate.open()
        await sig
        assert (await out.numpy()).tolist() == [11]
        await out.free()


async def test_a_timed_out_command_that_later_fails_raises_device_error_when_awaited_again() -> None:
    async with rt.open_device(DEV) as dev, gate_on(DEV) as gate:
        out = await int_buffer(DEV)
        first = gate.launch(out)

        def boom() -> None:
            raise OSError("injected after the timeout")

        failing = dev._compute_queue.submit(boom, ())
        with pytest.raises(TimeoutError):
            await failing.wait(timeout=0.01)
        gate.open()
        with pytest.raises(DeviceError, match="injected after the timeout"):
            await failing
        assert not first.failed()
        await dev.reset()
        await out.free()
