"""tinygrad on aiotinyrt: the AIO device (synchronous tinygrad) and the awaitable API.

Every async test runs on asyncio, trio and uvloop. Work is held back with the gate kernel on
the aiotinyrt device behind ``AIO:5`` (tests/helpers.py), so "the launch has not run yet"
is a fact, not a timing guess.
"""

from __future__ import annotations

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np
import pytest
from tinygrad import Device as TinyDevice
from tinygrad import Tensor, TinyJit, Variable

import aiotinyrt as rt
import aiotinyrt.tinygrad as aiotg
from aiotinyrt import DeviceError
from tests.helpers import fail_command, gate_on, int_buffer

pytestmark = pytest.mark.anyio

AIO = "AIO:5"
RT = "CPU:5"  # what AIO:5 runs on (AIO_BACKEND defaults to CPU)


def _mlp() -> tuple[TinyJit, Tensor, Tensor]:  # type: ignore[type-arg]
    w1 = Tensor(np.arange(32, dtype=np.float32).reshape(8, 4) / 10, device=AIO).realize()
    w2 = Tensor(np.ones((4, 3), np.float32), device=AIO).realize()

    @TinyJit
    def f(x: Tensor) -> Tensor:
        return ((x @ w1).relu() @ w2).softmax(axis=1).realize()

    return f, w1, w2


def _expected(x: np.ndarray, w1: Tensor, w2: Tensor) -> np.ndarray:
    h = np.maximum(x @ (np.arange(32, dtype=np.float32).reshape(8, 4) / 10), 0) @ np.ones((4, 3), np.float32)
    e = np.exp(h - h.max(axis=1, keepdims=True))
    return e / e.sum(axis=1, keepdims=True)


@pytest.mark.slow
def test_aio_is_a_tinygrad_device_run_by_aiotinyrt() -> None:
    dev = TinyDevice[AIO]
    assert isinstance(dev, aiotg.AIODevice)
    assert dev.rt is rt.Device[RT]
    assert aiotg.aiotinyrt_name("AIO") == "CPU" and aiotg.aiotinyrt_name("AIO:2") == "CPU:2"
    stats = dev.rt.allocator.statistics()
    a = Tensor(np.arange(6, dtype=np.float32), device=AIO)
    out = ((a * 2 + 1).reshape(2, 3).sum(axis=1)).numpy()
    assert out.tolist() == [9.0, 27.0]
    assert (
        dev.rt.allocator.statistics().misses + dev.rt.allocator.statistics().hits > stats.misses + stats.hits
    )
    assert isinstance(dev.renderer.compiler, aiotg.AIOCompiler)


def test_copies_between_aio_devices_are_aiotinyrt_transfers() -> None:
    a = Tensor(np.arange(1000, dtype=np.int32), device=AIO).realize()
    copies = rt.Device["CPU:6"]._copy_queue.timeline.submitted
    b = (a.to("AIO:6") + 1).numpy()
    assert b.tolist() == list(range(1, 1001))
    assert rt.Device["CPU:6"]._copy_queue.timeline.submitted > copies


@pytest.mark.slow
def test_a_captured_tinyjit_replays_as_one_queue_command_with_vals_substituted() -> None:
    f, w1, w2 = _mlp()
    compute = rt.Device[RT]._compute_queue.timeline
    for i in range(5):
        x = Tensor(np.full((2, 8), i, np.float32), device=AIO).realize()
        before = compute.submitted
        out = f(x).numpy()
        np.testing.assert_allclose(out, _expected(np.full((2, 8), i, np.float32), w1, w2), rtol=1e-5)
        if i >= 2:  # a replay: one graph, one command (kernels of this jit: 4 or more)
            assert compute.submitted - before == 1

    @TinyJit
    def g(a: Tensor) -> Tensor:
        return ((a + 1).contiguous() * 3).sum().realize()

    ones = Tensor.ones(10, device=AIO).contiguous().realize()
    for n in range(2, 8):
        assert g(ones[: Variable("n", 1, 10).bind(n)]).item() == 6 * n


async def test_realize_and_numpy_await_without_blocking_the_loop() -> None:
    a = Tensor(np.arange(12, dtype=np.float32).reshape(3, 4), device=AIO)
    b = (a * a).sum(axis=0)
    await aiotg.realize(b)
    assert b.uop.is_realized
    assert (await aiotg.numpy(b)).tolist() == [80.0, 107.0, 140.0, 179.0]
    assert (await aiotg.numpy(a.T)).tolist() == np.arange(12).reshape(3, 4).T.tolist()


async def test_call_of_a_captured_jit_runs_on_the_loop_and_awaits_held_work() -> None:
    f, w1, w2 = _mlp()
    xs = [Tensor(np.full((2, 8), i, np.float32), device=AIO).realize() for i in range(3)]
    for x in xs[:2]:  # run and capture: in worker threads
        await aiotg.call(f, x)
    async with gate_on(RT) as gate:
        held = await int_buffer(RT)
        gate.launch(held)  # holds CPU:5's compute queue: the replay queues behind it
        done = anyio.Event()
        result: list[np.ndarray] = []

        async def serve() -> None:
            result.append(await aiotg.call_numpy(f, xs[2]))
            done.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(serve)
            await anyio.wait_all_tasks_blocked()
            assert not done.is_set()  # the loop runs while the replay waits for the gate
            gate.open()
        await held.free()
    np.testing.assert_allclose(result[0], _expected(np.full((2, 8), 2, np.float32), w1, w2), rtol=1e-5)


async def test_cancelling_an_awaited_call_keeps_the_work() -> None:
    f, w1, w2 = _mlp()
    xs = [Tensor(np.full((2, 8), i, np.float32), device=AIO).realize() for i in range(3)]
    for x in xs[:2]:
        await aiotg.call(f, x)
    async with gate_on(RT) as gate:
        held = await int_buffer(RT)
        gate.launch(held)
        with anyio.move_on_after(0.01) as scope:
            await aiotg.call(f, xs[2])
        assert scope.cancelled_caught  # the gate was closed: the replay could not have finished
        gate.open()
        await held.free()
    out = f.captured.ret if f.captured is not None else None
    assert out is not None
    np.testing.assert_allclose(
        await aiotg.numpy(out), _expected(np.full((2, 8), 2, np.float32), w1, w2), rtol=1e-5
    )


async def test_bad_input_is_refused_before_anything_is_enqueued() -> None:
    f, _, _ = _mlp()
    on_cpu = Tensor(np.ones((2, 8), np.float32), device="CPU")
    before = [q.timeline.submitted for q in rt.Device[RT].queues.values()]
    with pytest.raises(ValueError, match="is on CPU, not an AIO device"):
        await aiotg.realize(on_cpu)
    with pytest.raises(ValueError, match="not an AIO device"):
        await aiotg.numpy(on_cpu)
    with pytest.raises(ValueError, match="argument 0 is on CPU"):
        await aiotg.call(f, on_cpu)
    with pytest.raises(TypeError, match="TinyJit"):
        await aiotg.call(lambda x: x, on_cpu)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a tinygrad Tensor"):
        await aiotg.realize(np.ones(3))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="symbolic shape"):
        await aiotg.numpy(Tensor.ones(10, device=AIO)[: Variable("k", 1, 10).bind(3)])
    assert [q.timeline.submitted for q in rt.Device[RT].queues.values()] == before


async def test_a_device_error_surfaces_as_our_device_error() -> None:
    a = Tensor(np.arange(4, dtype=np.float32), device=AIO)
    await aiotg.realize(a)
    dev = rt.Device[RT]
    fail_command(dev)
    with pytest.raises(DeviceError, match="boom from the test") as info:
        await aiotg.realize(a + 1)
    assert isinstance(info.value.cause, ValueError)
    await dev.reset()
    assert (await aiotg.numpy(a + 1)).tolist() == [1.0, 2.0, 3.0, 4.0]


async def test_tinygrads_synchronous_waits_refuse_to_block_an_event_loop() -> None:
    dev = TinyDevice[AIO]
    async with gate_on(RT) as gate:
        held = await int_buffer(RT)
        gate.launch(held)  # pending: synchronize() would have to wait
        with pytest.raises(RuntimeError, match="event-loop thread"):
            dev.synchronize()
        gate.open()
        await held.free()
    await anyio.to_thread.run_sync(dev.synchronize)  # in a worker thread it blocks, and returns


def test_a_jit_mixing_threaded_kernels_and_a_symbolic_shrink_replays_correctly() -> None:
    # (on CPU, tinygrad's test_hcq_core_id_runtimevar_merge; it skips on any other device name)
    n = 1 << 18  # large enough for tinygrad to split the kernels over threads (core_id)
    x = Tensor.arange(2 * n).clone(AIO).realize()

    @TinyJit
    def f(t: Tensor, start: Variable) -> tuple[Tensor, Tensor]:
        return (t + 1).contiguous().realize(), t.shrink(((start, start + n),)).contiguous().realize()

    for offset in (0, 5, 7, 100):
        y, z = f(x, Variable("a", 0, n).bind(offset))
        assert y.shape == (2 * n,) and z.shape == (n,)
        assert (y.numpy()[[0, -1]] == [1, 2 * n]).all()
        assert (z.numpy()[[0, -1]] == [offset, offset + n - 1]).all()
