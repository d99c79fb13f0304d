"""Captured graphs: replay equals eager execution (with and without substituted buffers), graphs
spanning two devices keep their dependencies, captured launches do not run, bad replays raise
before anything is enqueued, and NULL graphs replay."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import aiotinyrt as rt
from aiotinyrt import Buffer, BufferSpec, Device, DeviceError, Program, Signal, dtypes
from aiotinyrt.graph import Graph
from aiotinyrt.queue import HostQueue
from tests.helpers import (
    AXPB,
    BASES,
    FAULTY,
    ORDER_DEVICES,
    CopyGate,
    IntArray,
    N,
    Op,
    assert_stays_pending,
    c_replay_or_skip,
    contents,
    copy_gate_on,
    inject_failure,
    int_array_buffer,
    ops,
    run_on_devices,
)

pytestmark = pytest.mark.anyio


def submitted() -> list[int]:
    """How many commands every queue of CPU, CPU:1 and NULL has been given so far."""
    return [q.timeline.submitted for d in (*ORDER_DEVICES, "NULL") for q in Device[d].queues.values()]


async def axpb_programs() -> dict[str, Program]:
    return {dev: await Device[dev].program("axpb", AXPB) for dev in ORDER_DEVICES}


# ---- replay equals eager execution ---------------------------------------------------------------


@pytest.mark.slow
@settings(
    max_examples=12,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    program=st.lists(ops(kinds=("launch", "launch", "copy"), spins=(0, 3000)), min_size=1, max_size=12),
    seed=st.integers(0, 2**16),
    replays=st.integers(1, 2),
)
async def test_replay_equals_eager_execution_of_the_same_launches_and_copies(
    program: list[Op], seed: int, replays: int
) -> None:
    rng = np.random.default_rng(seed)
    initial = {key: rng.integers(0, 0xFFFF, N, dtype=np.int32) for key in BASES}
    progs = await axpb_programs()
    eager = {key: await int_array_buffer(key[0], initial[key]) for key in BASES}
    graphed = {key: await int_array_buffer(key[0], initial[key]) for key in BASES}
    try:
        for _ in range(replays):
            await run_on_devices(program, eager, progs)
        async with Device["CPU"].capture() as graph:
            await run_on_devices(program, graphed, progs, capturing=True)
        await rt.synchronize(*ORDER_DEVICES)
        for key in BASES:
            assert await contents(graphed[key]) == initial[key].tolist(), "capture ran something"
        signals = [graph.replay() for _ in range(replays)]  # back to back, none awaited yet
        for sig in signals:
            assert isinstance(await sig, float)
        for key in BASES:
            assert await contents(graphed[key]) == await contents(eager[key]), f"base {key}"
    finally:
        for buf in (*eager.values(), *graphed.values()):
            await buf.free()


def chain_expected(x: IntArray) -> list[int]:
    """What :func:`capture_chain` computes: out = ((x * 2 + 1) * 3) & 0xFFFF."""
    return [((int(v) * 2 + 1) & 0xFFFF) * 3 & 0xFFFF for v in x]


async def capture_chain(
    progs: dict[str, Program], x: Buffer, mid: Buffer, far: Buffer, out: Buffer, spin: int = 0
) -> Graph:
    """CPU: mid = x*2+1; CPU:1: far = mid (transfer); CPU:1: out = far*3. Names ``x`` and ``out``."""
    async with Device["CPU"].capture(x=x, out=out) as graph:
        progs["CPU"](mid, x, vals=(x.size, 2, 1, spin), writes=(0,))
        await far.copy_from(mid)
        progs["CPU:1"](out, far, vals=(x.size, 3, 0, spin), writes=(0,))
    return graph


async def small_chain(
    x_values: object,
) -> tuple[dict[str, Program], Buffer, Buffer, Buffer, Buffer, Graph]:
    """:func:`capture_chain` on buffers of 4 ints, ``x`` holding ``x_values`` (a scalar fills
    it): ``(progs, x, mid, far, out, graph)``."""
    progs = await axpb_programs()
    x = await int_array_buffer("CPU", x_values, size=4)
    mid = await int_array_buffer("CPU", 0, size=4)
    far = await int_array_buffer("CPU:1", 0, size=4)
    out = await int_array_buffer("CPU:1", 0, size=4)
    return progs, x, mid, far, out, await capture_chain(progs, x, mid, far, out)


async def test_replay_with_substituted_inputs_and_outputs_equals_eager_execution() -> None:
    progs = await axpb_programs()
    size = 64
    x = await int_array_buffer("CPU", np.arange(size))
    mid = await int_array_buffer("CPU", 0, size=size)
    far = await int_array_buffer("CPU:1", 0, size=size)
    out = await int_array_buffer("CPU:1", 0, size=size)
    graph = await capture_chain(progs, x, mid, far, out, spin=2000)
    assert graph.devices == ["CPU", "CPU:1"]
    rng = np.random.default_rng(7)
    inputs = [rng.integers(0, 0xFFFF, size, dtype=np.int32) for _ in range(4)]
    xs = [await int_array_buffer("CPU", values) for values in inputs]
    outs = [await int_array_buffer("CPU:1", 0, size=size) for _ in inputs]
    # every replay shares mid and far: back to back, each must wait for the last one's reads
    signals = [graph.replay(x=xi, out=oi) for xi, oi in zip(xs, outs, strict=True)]
    original = graph(x=x)  # __call__ is replay; out is the captured buffer
    for sig in [*signals, original]:
        await sig
    for values, oi in zip(inputs, outs, strict=True):
        assert await contents(oi) == chain_expected(values)
    assert await contents(out) == chain_expected(np.arange(size, dtype=np.int32))
    # and eagerly, with the same programs, on the last substitute
    eager_out = await int_array_buffer("CPU:1", 0, size=size)
    progs["CPU"](mid, xs[-1], vals=(size, 2, 1, 0), writes=(0,))
    await far.copy_from(mid)
    await progs["CPU:1"](eager_out, far, vals=(size, 3, 0, 0), writes=(0,))
    assert await contents(eager_out) == await contents(outs[-1])


def refuse(what: str) -> Callable[..., object]:
    def refused(*args: object, **kwargs: object) -> object:
        raise AssertionError(f"{what} ran: the replay was not submitted by C")

    return refused


async def test_a_native_replay_is_submitted_by_c_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every run native (kernel, transfer, kernel): C pushes all of them, with their
    dependencies between the devices and on the previous replay's use of mid and far, and no
    Python submission path runs; each replay still computes what eager execution does."""
    c_replay_or_skip()
    progs = await axpb_programs()
    size = 64
    mid = await int_array_buffer("CPU", 0, size=size)
    far = await int_array_buffer("CPU:1", 0, size=size)
    rng = np.random.default_rng(3)
    inputs = [rng.integers(0, 0xFFFF, size, dtype=np.int32) for _ in range(6)]
    xs = [await int_array_buffer("CPU", values) for values in inputs]
    outs = [await int_array_buffer("CPU:1", 0, size=size) for _ in inputs]
    graph = await capture_chain(progs, xs[0], mid, far, outs[0], spin=2000)
    for name in ("submit_either", "submit_native", "submit"):
        monkeypatch.setattr(HostQueue, name, refuse(f"HostQueue.{name}"))
    signals = [graph.replay(x=xi, out=oi) for xi, oi in zip(xs, outs, strict=True)]
    for sig in signals:
        await sig
    for values, oi in zip(inputs, outs, strict=True):
        assert await contents(oi) == chain_expected(values)


async def test_a_replay_c_cannot_wait_for_runs_in_python(monkeypatch: pytest.MonkeyPatch) -> None:
    """An access C cannot wait for (a signal carrying a Python error) makes the C replay decline
    before pushing anything; the Python path then submits the replay, which still computes the
    right result."""
    c_replay_or_skip()
    _progs, x, _mid, _far, out, graph = await small_chain(np.arange(4))
    await graph.replay()  # (plans built and cached)
    timeline = Device["CPU"].queues["compute"].timeline
    odd = Signal(timeline, timeline.completed)  # done, but with an error Python must look at
    odd._error = RuntimeError("an error only Python knows")
    x.record(odd, False)
    before = submitted()
    calls: list[HostQueue] = []
    either = HostQueue.submit_either

    def counted(queue: HostQueue, *args: object) -> Signal:
        calls.append(queue)
        return either(queue, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(HostQueue, "submit_either", counted)
    replayed = graph.replay()
    # every run (and a join, when a run it covers is already done) went through Python
    assert [q for q in calls[: len(graph._runs)]] == [run.queue for run in graph._runs]
    assert sum(submitted()) - sum(before) == len(calls)
    await replayed
    assert await contents(out) == chain_expected(np.arange(4, dtype=np.int32))


async def test_replay_substitutes_views_of_a_named_buffer() -> None:
    # A kernel captured on a view of the named input must read the substitute's bytes at replay.
    progs = await axpb_programs()
    x = await int_array_buffer("CPU", np.arange(8))
    out = await int_array_buffer("CPU", 0, size=4)
    async with Device["CPU"].capture(x=x) as graph:
        progs["CPU"](out, x.view(4, dtypes.int32, 16), vals=(4, 1, 0, 0), writes=(0,))
    other = await int_array_buffer("CPU", 100, size=8)
    await graph.replay(x=other)
    assert await contents(out) == [100] * 4, "the replay read the captured buffer, not the substitute"


async def test_replay_with_a_substitute_does_not_need_the_captured_buffer_any_more() -> None:
    # As with a tinygrad JIT input, the buffer used at capture may be gone by the time of replay.
    x = await int_array_buffer("CPU", 1, size=4)
    far = await int_array_buffer("CPU:1", 0, size=4)
    async with Device["CPU"].capture(x=x) as graph:
        await far.copy_from(x)
    await x.free()
    await graph.replay(x=await int_array_buffer("CPU", 5, size=4))
    assert await contents(far) == [5] * 4


# ---- dependencies in graphs spanning two devices -------------------------------------------------


async def replay_behind(gate: CopyGate, graph: Graph, queue: HostQueue, what: str) -> None:
    """Replay ``graph`` while ``gate`` holds a kernel it depends on: the newest command of
    ``queue`` (the graph's) stays pending until the gate opens, then the replay completes."""
    replayed = graph.replay()
    gate.launched.append(replayed)
    timeline = queue.timeline
    await assert_stays_pending(Signal(timeline, timeline.submitted), what)
    gate.open()
    await replayed


@pytest.mark.slow
@pytest.mark.parametrize("size", [4, 20_000])  # (16 B and 80 KB: above CPU's inline_copy_bytes)
async def test_a_two_device_graph_keeps_the_dependencies_between_its_devices(size: int) -> None:
    """Kernel on CPU -> transfer to CPU:1 -> kernel on CPU:1. A small hand-over is folded into
    the CPU kernel's run (run by CPU's worker right after it), a large one stays on CPU:1's copy
    queue (where it overlaps CPU's next kernel); either way CPU:1's kernel waits for CPU's."""
    x = await int_array_buffer("CPU", 20, size=size)
    mid = await int_array_buffer("CPU", 0, size=size)
    far = await int_array_buffer("CPU:1", 0, size=size)
    out = await int_array_buffer("CPU:1", 0, size=size)
    axpb = await Device["CPU:1"].program("axpb", AXPB)
    small = far.nbytes <= Device["CPU:1"].allocator.inline_copy_bytes
    async with copy_gate_on("CPU") as gate:
        async with Device["CPU"].capture() as graph:
            gate.launch(mid, x, add=1)  # mid = 21, held at replay until the gate opens
            await far.copy_from(mid)  # must wait for the CPU kernel
            axpb(out, far, vals=(size, 2, 0, 0), writes=(0,))  # CPU:1 compute: after the copy
        expected = [Device["CPU"].queues["compute"], Device["CPU:1"].queues["compute"]]
        if not small:
            expected.insert(1, Device["CPU:1"].queues["copy"])
        assert [run.queue for run in graph._runs] == expected
        assert all(run.native is not None or run.transfer is not None for run in graph._runs)
        await replay_behind(
            gate, graph, Device["CPU:1"].queues["compute"], "CPU:1's kernel, before its input"
        )
    assert await contents(far) == [21] * size
    assert await contents(out) == [42] * size


async def test_a_replay_whose_folded_transfer_writes_a_closed_device_raises_before_enqueueing() -> None:
    """The hand-over to another device runs on the source device's worker; once the destination
    device is closed, a replay raises its DeviceError and enqueues nothing (its memory is not
    written from the other device's worker)."""
    progs = await axpb_programs()
    x = await int_array_buffer("CPU", 1, size=4)
    mid = await int_array_buffer("CPU", 0, size=4)
    async with rt.open_device("CPU:3") as dest:
        far = await int_array_buffer(dest.name, 0, size=4)
        async with Device["CPU"].capture() as graph:
            progs["CPU"](mid, x, vals=(4, 2, 1, 0), writes=(0,))
            await far.copy_from(mid)  # small: folded into the CPU run
        assert [run.queue for run in graph._runs] == [Device["CPU"].queues["compute"]]
        await graph.replay()
        assert await contents(far) == [3] * 4
    before = submitted()
    with pytest.raises(DeviceError, match="closed"):
        graph.replay()
    assert submitted() == before


@pytest.mark.slow
async def test_a_transfer_draining_a_kernel_joins_its_run_and_waits_for_it() -> None:
    """A transfer reading what the previous kernel on its device wrote is folded into that
    kernel's compute run (one native command), which waits for the kernel's input."""
    src = await int_array_buffer("CPU:1", 5, size=4)
    mid = await int_array_buffer("CPU:1", 0, size=4)
    out = await int_array_buffer("CPU:1", 0, size=4)
    axpb = await Device["CPU:1"].program("axpb", AXPB)
    async with Device["CPU:1"].capture(out=out) as graph:
        axpb(mid, src, vals=(4, 2, 1, 0), writes=(0,))
        await out.copy_from(mid)  # drains the kernel: same run
    assert [run.queue for run in graph._runs] == [Device["CPU:1"].queues["compute"]]
    assert graph._runs[0].native is not None
    other = await int_array_buffer("CPU:1", 0, size=4)
    async with copy_gate_on("CPU:1") as gate:
        gate.launch(src, src)  # an eager write of src, held
        replayed = graph.replay(out=other)
        gate.launched.append(replayed)
        await assert_stays_pending(replayed, "a folded copy of a kernel waiting for its input")
        gate.open()
        await replayed
    assert await contents(other) == [11] * 4  # the gate kernel leaves src as it was: 5 * 2 + 1


async def test_a_captured_transfer_next_to_unrelated_work_stays_on_the_copy_queue() -> None:
    """Only a transfer draining the previous kernel on its device is folded into the compute
    run; one beside unrelated work keeps overlapping it."""
    a = await int_array_buffer("CPU:1", 1, size=4)
    b = await int_array_buffer("CPU:1", 0, size=4)
    src = await int_array_buffer("CPU", 7, size=4)
    dst = await int_array_buffer("CPU:1", 0, size=4)
    axpb = await Device["CPU:1"].program("axpb", AXPB)
    async with Device["CPU:1"].capture() as graph:
        axpb(b, a, vals=(4, 2, 0, 0), writes=(0,))
        await dst.copy_from(src)  # touches neither a nor b
        axpb(a, b, vals=(4, 1, 1, 0), writes=(0,))
    assert [run.queue for run in graph._runs] == [
        Device["CPU:1"].queues["compute"],
        Device["CPU:1"].queues["copy"],
        Device["CPU:1"].queues["compute"],
    ]
    await graph.replay()
    assert await contents(dst) == [7] * 4
    assert await contents(a) == [3] * 4


async def test_a_chain_replay_needs_no_join_and_fails_when_its_first_run_fails() -> None:
    """Stage 1 -> transfer -> stage 2: the last run waits for every other one, so its signal is
    the replay's (no joining command), and a failure of the first run still fails it."""
    async with rt.open_device(FAULTY) as dev:
        near = await dev.program("axpb", AXPB)
        far_prog = await Device["CPU:1"].program("axpb", AXPB)
        x = await int_array_buffer(FAULTY, 1, size=4)
        mid = await int_array_buffer(FAULTY, 0, size=4)
        far = await int_array_buffer("CPU:1", 0, size=4)
        out = await int_array_buffer("CPU:1", 0, size=4)
        async with dev.capture() as graph:
            near(mid, x, vals=(4, 2, 1, 0), writes=(0,))
            await far.copy_from(mid)
            far_prog(out, far, vals=(4, 3, 0, 0), writes=(0,))
        compute = Device["CPU:1"].queues["compute"].timeline
        held = await int_array_buffer(FAULTY, 0, size=4)
        async with copy_gate_on(FAULTY) as gate:
            gate.launch(held, held)  # keeps stage 1 pending while the replay is submitted
            before = compute.submitted
            replayed = graph.replay()
            assert compute.submitted == before + 1, "a joining command was queued"
            gate.open()
            await replayed
        assert await contents(out) == chain_expected(np.ones(4, np.int32))
        async with copy_gate_on(FAULTY) as gate:
            gate.launch(held, held)  # holds the compute queue: the replay is queued behind a fault
            fault = inject_failure(dev)
            replayed = graph.replay()
            gate.open()
            with pytest.raises(DeviceError):
                await fault
            with pytest.raises(DeviceError, match="failed"):
                await replayed
        await Device["CPU:1"].synchronize()  # the dependent device is not poisoned
        await dev.reset()
        # the failed replay left done, failed accesses on its buffers: no dependency (as for
        # single launches), so the next replay runs
        await graph.replay()
        assert await contents(out) == chain_expected(np.ones(4, np.int32))
        for buf in (x, mid, held):
            await buf.free()
    for buf in (far, out):
        await buf.free()


@pytest.mark.slow
async def test_a_replay_signal_covers_runs_the_last_one_does_not_wait_for() -> None:
    """Two independent runs (CPU held by a gate, CPU:1 free): the replay's signal must not be
    done before the held one is (it joins them)."""
    held = await int_array_buffer("CPU", 0, size=4)
    src = await int_array_buffer("CPU:1", 1, size=4)
    out = await int_array_buffer("CPU:1", 0, size=4)
    axpb = await Device["CPU:1"].program("axpb", AXPB)
    async with copy_gate_on("CPU") as gate:
        async with Device["CPU"].capture() as graph:
            gate.launch(held, held)
            axpb(out, src, vals=(4, 2, 0, 0), writes=(0,))
        replayed = graph.replay()
        gate.launched.append(replayed)
        await assert_stays_pending(replayed, "a replay whose first run is held")
        gate.open()
        await replayed
    assert await contents(out) == [2] * 4


@pytest.mark.slow
async def test_wait_for_between_captured_launches_is_kept_at_replay() -> None:
    # Two devices wrap the same host memory, so only the captured wait_for orders them.
    shared: IntArray = np.zeros(4, np.int32)
    spec = BufferSpec(external_ptr=shared.ctypes.data)
    near = await Buffer("CPU", 4, dtypes.int32, spec).allocate()
    far_alias = await Buffer("CPU:1", 4, dtypes.int32, spec).allocate()
    src = await int_array_buffer("CPU", 20, size=4)
    out = await int_array_buffer("CPU:1", 0, size=4)
    axpb = await Device["CPU:1"].program("axpb", AXPB)
    try:
        async with copy_gate_on("CPU") as gate:
            async with Device["CPU"].capture() as graph:
                held = gate.launch(near, src, add=1)  # shared = 21
                axpb(out, far_alias, vals=(4, 2, 0, 0), writes=(0,), wait_for=[held])
            what = "a captured launch with wait_for on a held one"
            await replay_behind(gate, graph, Device["CPU:1"].queues["compute"], what)
        assert await contents(out) == [42] * 4
    finally:
        await near.free()
        await far_alias.free()


@pytest.mark.slow
async def test_a_replay_is_ordered_after_eager_work_on_its_buffers_and_before_later_work() -> None:
    progs, x, _mid, _far, out, graph = await small_chain(0)
    src = await int_array_buffer("CPU", 10, size=4)
    late = await int_array_buffer("CPU:1", 0, size=4)
    async with copy_gate_on("CPU") as gate:
        gate.launch(x, src)  # eager: x = 10, held
        replayed = graph.replay()  # reads x: after the gate
        gate.launched.append(replayed)
        await assert_stays_pending(replayed, "a replay reading a buffer an eager kernel writes")
        after = progs["CPU:1"](late, out, vals=(4, 1, 1, 0), writes=(0,))  # reads the replay's out
        gate.open()
        await after
    assert await contents(out) == chain_expected(np.full(4, 10, np.int32))
    assert await contents(late) == [v + 1 for v in chain_expected(np.full(4, 10, np.int32))]


# ---- what capture does and does not do ----------------------------------------------------------


async def test_captured_launches_do_not_run_and_their_signals_raise_when_awaited() -> None:
    progs = await axpb_programs()
    buf = await int_array_buffer("CPU", 3, size=4)
    far = await int_array_buffer("CPU:1", 0, size=4)
    async with Device["CPU"].capture() as graph:
        sig = progs["CPU"](buf, buf, vals=(4, 2, 0, 0))
        await far.copy_from(buf)
    assert sig.done()
    with pytest.raises(RuntimeError, match="captured"):
        await sig
    await rt.synchronize(*ORDER_DEVICES)
    assert await contents(buf) == [3] * 4
    assert await contents(far) == [0] * 4
    assert len(graph) == 2
    await graph.replay()
    assert await contents(buf) == [6] * 4
    assert await contents(far) == [6] * 4


async def test_wait_for_on_a_signal_from_outside_the_capture_raises() -> None:
    progs = await axpb_programs()
    buf = await int_array_buffer("CPU", 3, size=4)
    outside = progs["CPU"](buf, buf, vals=(4, 1, 0, 0))
    async with Device["CPU"].capture():
        with pytest.raises(ValueError, match="wait_for"):
            progs["CPU"](buf, buf, vals=(4, 1, 0, 0), wait_for=[outside])


async def test_replay_of_an_empty_graph_or_from_inside_the_capture_raises() -> None:
    progs = await axpb_programs()
    buf = await int_array_buffer("CPU", 3, size=4)
    async with Device["CPU"].capture() as empty:
        pass
    with pytest.raises(RuntimeError, match="empty"):
        empty.replay()
    async with Device["CPU"].capture() as graph:
        progs["CPU"](buf, buf, vals=(4, 1, 0, 0))
        with pytest.raises(RuntimeError, match="capture"):
            graph.replay()


# ---- bad replays raise before anything is enqueued ----------------------------------------------


async def _bad_substitutes() -> list[tuple[str, Callable[[], object], type[Exception], str]]:
    wrong_size = await int_array_buffer("CPU", 0, size=8)
    foreign = await int_array_buffer("CPU:1", 0, size=4)
    null = await Buffer("NULL", 4, dtypes.int32).allocate()
    freed = await int_array_buffer("CPU", 0, size=4)
    await freed.free()
    unallocated = Buffer("CPU", 4, dtypes.int32)
    return [
        ("wrong size", lambda: wrong_size, ValueError, "bytes"),
        ("another CPU device", lambda: foreign, ValueError, "must be on CPU"),
        ("another backend", lambda: null, ValueError, "must be on CPU"),
        ("freed", lambda: freed, RuntimeError, "free"),
        ("unallocated", lambda: unallocated, RuntimeError, "not allocated"),
        ("not a buffer", lambda: np.zeros(4, np.int32), TypeError, "Buffer"),
    ]


async def test_replay_with_a_bad_substitute_raises_before_enqueueing_anything() -> None:
    _progs, x, mid, _far, _out, graph = await small_chain(1)
    good_out = await int_array_buffer("CPU:1", 0, size=4)
    bad = await _bad_substitutes()
    before = submitted()
    for what, make, error, match in bad:
        with pytest.raises(error, match=match):
            graph.replay(out=good_out, x=make())  # type: ignore[arg-type]
        assert submitted() == before, f"a replay with a {what} substitute enqueued work"
    with pytest.raises(KeyError, match="no input named"):
        graph.replay(y=x)
    assert submitted() == before
    assert mid.pending() == [] and good_out.pending() == []
    await graph.replay(x=x, out=good_out)  # the graph itself is fine
    assert await contents(good_out) == chain_expected(np.ones(4, np.int32))


async def test_replay_plans_are_reused_per_substitution_set_and_rebuilt_after_a_free() -> None:
    """Alternating substitution sets replay from remembered plans (identical results); freeing a
    remembered substitute raises the use-after-free error instead of replaying its stale plan."""
    _progs, _x, _mid, _far, _out, graph = await small_chain(1)
    xs = [await int_array_buffer("CPU", np.full(4, i, np.int32), size=4) for i in range(3)]
    outs = [await int_array_buffer("CPU:1", 0, size=4) for _ in range(3)]
    for round_ in range(3):
        for i in range(3):
            await xs[i].copyin(np.full(4, i + round_, np.int32))
            await graph.replay(x=xs[i], out=outs[i])
            assert await contents(outs[i]) == chain_expected(np.full(4, i + round_, np.int32))
    assert len(graph._plan_cache) == 3
    await outs[1].free()
    before = submitted()
    with pytest.raises(RuntimeError, match="use after free"):
        graph.replay(x=xs[1], out=outs[1])
    assert submitted() == before
    replacement = await int_array_buffer("CPU:1", 0, size=4)
    await graph.replay(x=xs[1], out=replacement)
    assert await contents(replacement) == chain_expected(np.full(4, 3, np.int32))


async def test_replay_with_a_freed_captured_buffer_raises_before_enqueueing_anything() -> None:
    _progs, _x, _mid, far, _out, graph = await small_chain(1)
    await far.free()  # used by the graph's last two runs, after a CPU run that is fine
    before = submitted()
    with pytest.raises(RuntimeError, match="use after free"):
        graph.replay()
    assert submitted() == before


# ---- NULL --------------------------------------------------------------------------------------


async def test_a_graph_on_null_replays_with_and_without_substitutes() -> None:
    null = Device["NULL"]
    prog = await null.program("k", "void k(int* a, int* b) {}")
    a = await Buffer("NULL", 16, dtypes.float32).allocate()
    b = await Buffer("NULL", 16, dtypes.float32).allocate()
    c = await Buffer("NULL", 16, dtypes.float32).allocate()
    async with null.capture(a=a) as graph:
        prog(a, b)
        await c.copy_from(b)
        prog(c, a, writes=(0,))
    assert graph.devices == ["NULL"]
    compute, copy = null.queues["compute"].timeline, null.queues["copy"].timeline
    done_before = compute.completed + copy.completed
    other = await Buffer("NULL", 16, dtypes.float32).allocate()
    assert isinstance(await graph.replay(), float)
    assert isinstance(await graph.replay(a=other), float)
    assert compute.completed + copy.completed > done_before
    with pytest.raises(ValueError, match="bytes"):
        graph.replay(a=await Buffer("NULL", 8, dtypes.float32).allocate())
    await null.synchronize()
