"""Signals and timelines: awaiting completion, polling, cancellation of waits, sticky device errors.

Also home of the kernels and helpers the other test modules share: a *gate* kernel that holds its
device queue until the test opens it (so "work is still pending" is a fact, not a timing guess),
a time-based spin kernel, a clock-stamp kernel, and the checkpoint-rule assertion.
"""

from __future__ import annotations

import time

import anyio
import numpy as np
import pytest

import aiotinyrt as rt
from aiotinyrt import Buffer, Device, DeviceError, dtypes
from tests.helpers import INC, SPIN, STAMP, assert_cancelled_at_entry, fail_command, gate_on, int_buffer

pytestmark = pytest.mark.anyio

# ---- shared kernels and helpers ------------------------------------------------------------------


# ---- awaiting and polling ----------------------------------------------------------------------


async def test_await_signal_returns_device_seconds_as_float() -> None:
    prog = await Device["CPU"].program("spin", SPIN)
    out = await int_buffer("CPU")
    sig = prog(out, vals=(20,))
    secs = await sig
    assert type(secs) is float
    assert 0.019 <= secs < 10
    assert sig.result() == secs
    assert await sig == secs  # awaiting a finished signal again returns the same time
    await out.free()


async def test_signal_done_polls_without_waiting() -> None:
    async with gate_on("CPU") as gate:
        out = await int_buffer("CPU")
        sig = gate.launch(out)
        assert not sig.done()
        assert not sig.failed()
        with pytest.raises(RuntimeError, match="has not completed"):
            sig.result()
        gate.open()
        await sig
        assert sig.done()
        assert not sig.failed()
        await out.free()


async def test_many_tasks_awaiting_one_signal_all_wake_with_its_time() -> None:
    results: list[float] = []
    async with gate_on("CPU") as gate:
        out = await int_buffer("CPU")
        sig = gate.launch(out)

        async def waiter() -> None:
            results.append(await sig)

        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            assert sig.timeline.pending_waiters() == 50
            assert results == []
            gate.open()
        await out.free()
    assert len(results) == 50
    assert len(set(results)) == 1
    assert type(results[0]) is float


async def test_2000_back_to_back_launches_complete_in_order_with_one_await() -> None:
    prog = await Device["CPU"].program("inc", INC)
    out = await int_buffer("CPU")
    sigs = [prog(out) for _ in range(2000)]
    assert [s.value for s in sigs] == list(range(sigs[0].value, sigs[0].value + 2000))
    await sigs[-1]
    assert all(s.done() for s in sigs)
    assert (await out.numpy()).tolist() == [2000]
    await out.free()


async def test_2000_back_to_back_launches_on_null_need_one_await() -> None:
    prog = await Device["NULL"].program("anything", "not even C")
    buf = await Buffer("NULL", 16, dtypes.float32).allocate()
    sigs = [prog(buf) for _ in range(2000)]
    await sigs[-1]
    assert all(s.done() and not s.failed() for s in sigs)
    await buf.free()


@pytest.mark.slow
async def test_event_loop_never_stalls_while_a_300ms_kernel_runs() -> None:
    dev = Device["CPU"]
    prog = await dev.program("spin", SPIN)
    out = await int_buffer("CPU")
    lags: list[float] = []
    stop = anyio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            await anyio.sleep(0.005)
            lags.append(time.perf_counter() - start - 0.005)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        secs = await dev.run(prog, out, vals=(300,))
        stop.set()
    assert secs >= 0.299
    assert len(lags) >= 20, f"the ticker ran only {len(lags)} times in 300 ms"
    assert max(lags) < 0.1, f"the event loop stalled for {max(lags) * 1e3:.1f} ms"
    await out.free()


# ---- cancellation ---------------------------------------------------------------------------------


async def test_cancelled_wait_leaves_the_kernel_running_and_its_buffers_valid() -> None:
    dev = Device["CPU"]
    async with gate_on("CPU") as gate:
        out = await int_buffer("CPU", 7)
        sig = gate.launch(out, 42)
        with anyio.move_on_after(0.02) as scope:
            await sig
        assert scope.cancelled_caught
        assert not sig.done()
        assert sig.timeline.pending_waiters() == 0  # the abandoned wait left nothing behind
        gate.open()
        await dev.synchronize()
    assert sig.done()
    assert type(sig.result()) is float
    assert (await out.numpy()).tolist() == [42]
    await out.free()


async def test_wait_timeout_raises_timeout_error_and_the_work_keeps_running() -> None:
    async with gate_on("CPU") as gate:
        out = await int_buffer("CPU")
        sig = gate.launch(out, 5)
        with pytest.raises(TimeoutError, match=r"CPU.*keeps running"):
            await sig.wait(timeout=0.01)
        assert not sig.done()
        gate.open()
        assert type(await sig) is float
    assert (await out.numpy()).tolist() == [5]
    await out.free()


async def test_signal_wait_is_a_checkpoint_when_already_done() -> None:
    prog = await Device["NULL"].program("k", "k")
    sig = prog()
    await sig
    await assert_cancelled_at_entry(sig.wait)
    await assert_cancelled_at_entry(lambda: sig)


async def test_signal_wait_is_a_checkpoint_when_pending() -> None:
    async with gate_on("CPU") as gate:
        out = await int_buffer("CPU")
        sig = gate.launch(out)
        await assert_cancelled_at_entry(sig.wait)
        assert not sig.done()
        assert sig.timeline.pending_waiters() == 0
        gate.open()
        await sig
        await out.free()


# ---- cross-device dependencies --------------------------------------------------------------------


async def test_wait_for_orders_a_launch_after_another_devices_signal() -> None:
    stamp = await Device["CPU"].program("stamp", STAMP)
    when = await Buffer("CPU", 1, dtypes.float64).allocate()
    async with gate_on("CPU:1") as gate:
        gated_out = await int_buffer("CPU:1")
        first = gate.launch(gated_out)
        second = stamp(when, wait_for=[first])
        assert not second.done()
        opened_at = time.monotonic()
        gate.open()
        await second
        assert first.done()
        await gated_out.free()
    assert (await when.numpy())[0] >= opened_at
    await when.free()


async def test_wait_for_accepts_signals_of_the_null_device() -> None:
    null_prog = await Device["NULL"].program("k", "k")
    inc = await Device["CPU"].program("inc", INC)
    out = await int_buffer("CPU")
    dep = null_prog()
    await inc(out, wait_for=[dep])
    assert dep.done()
    assert (await out.numpy()).tolist() == [1]
    await out.free()


async def test_launch_waiting_for_a_failed_signal_fails_without_running() -> None:
    inc = await Device["CPU"].program("inc", INC)
    out = await int_buffer("CPU")
    async with rt.open_device("CPU:3") as bad:
        failed = fail_command(bad)
        dependent = inc(out, wait_for=[failed])
        with pytest.raises(DeviceError, match="depends on failed") as info:
            await dependent
        assert info.value.device == "CPU"
        await bad.reset()
    assert (await out.numpy()).tolist() == [0]
    await Device["CPU"].run(inc, out)  # the dependent device is not poisoned
    assert (await out.numpy()).tolist() == [1]
    await out.free()


# ---- failures -------------------------------------------------------------------------------------


async def test_failed_command_raises_device_error_with_its_cause() -> None:
    async with rt.open_device("CPU:3") as dev:
        sig = fail_command(dev)
        with pytest.raises(DeviceError, match="boom from the test") as info:
            await sig
        assert info.value.device == "CPU:3"
        assert isinstance(info.value.cause, ValueError)
        assert info.value.__cause__ is info.value.cause
        assert sig.failed()
        await dev.reset()


async def test_device_error_is_sticky_until_reset_and_earlier_signals_stay_successful() -> None:
    async with rt.open_device("CPU:3") as dev:
        inc = await dev.program("inc", INC)
        out = await int_buffer("CPU:3")
        ok = inc(out)
        secs = await ok
        await dev.run(inc, out)  # count is now 2
        with pytest.raises(DeviceError):
            await fail_command(dev)
        later = inc(out)
        with pytest.raises(DeviceError, match="boom from the test"):
            await later
        with pytest.raises(DeviceError):
            await dev.synchronize()
        with pytest.raises(DeviceError):
            await out.copyin(np.zeros(1, np.int32))  # the copy queue is stopped too
        assert await ok == secs  # a signal that completed before the failure stays successful
        await dev.reset()
        await dev.synchronize()
        await dev.run(inc, out)
        assert (await out.numpy()).tolist() == [3]  # the launch after the failure never ran
        await out.free()


async def test_device_error_leaves_other_devices_unaffected() -> None:
    inc = await Device["CPU"].program("inc", INC)
    out = await int_buffer("CPU")
    async with rt.open_device("CPU:3") as bad:
        with pytest.raises(DeviceError):
            await fail_command(bad)
        await Device["CPU"].run(inc, out)
        await Device["CPU"].synchronize()
        await rt.synchronize("CPU", "NULL")
        await bad.reset()
    assert (await out.numpy()).tolist() == [1]
    await out.free()


async def test_rt_synchronize_waits_for_every_device_before_raising() -> None:
    async with rt.open_device("CPU:3") as bad:
        with pytest.raises(DeviceError):
            await fail_command(bad)
        async with gate_on("CPU:1") as gate:
            out = await int_buffer("CPU:1")
            pending = gate.launch(out)
            outcome: list[str] = []

            async def synchronize_all() -> None:
                try:
                    await rt.synchronize(bad, "CPU:1")
                except DeviceError:
                    outcome.append(f"raised, other device done={pending.done()}")

            async with anyio.create_task_group() as tg:
                tg.start_soon(synchronize_all)
                await anyio.wait_all_tasks_blocked()
                assert outcome == []
                gate.open()
            assert outcome == ["raised, other device done=True"]
            await out.free()
        await bad.reset()


async def test_reset_is_a_checkpoint_and_cancelled_reset_keeps_the_error() -> None:
    async with rt.open_device("CPU:3") as dev:
        with pytest.raises(DeviceError):
            await fail_command(dev)
        await assert_cancelled_at_entry(dev.reset)
        with pytest.raises(DeviceError):
            await dev.synchronize()
        await dev.reset()
        await dev.synchronize()
