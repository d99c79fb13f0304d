"""One device used from two event loops running in two threads at the same time.

Decision (docs/architecture.md, "Threads and event loops"): this is supported. Submission is safe
from several threads at once (queue order is value order, whoever submits), and every waiting
task is woken on its own loop. These tests run two loops (any pair of asyncio, uvloop and trio)
in two threads against the same ``CPU``/``CPU:1``/``NULL`` devices at once and check the results,
the queues and that neither side deadlocks (every thread is joined with a deadline).
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import pytest

from aiotinyrt import Buffer, Device, Signal, dtypes
from tests.helpers import CHAIN_DEVICES, GATE, INC, STEP_CPU, STEP_CPU1, chain

LOOPS: dict[str, tuple[str, dict[str, Any]]] = {
    "asyncio": ("asyncio", {}),
    "trio": ("trio", {}),
    "uvloop": ("asyncio", {"use_uvloop": True}),
}
PAIRS = [("asyncio", "trio"), ("trio", "trio"), ("asyncio", "asyncio"), ("uvloop", "trio")]
JOIN_S = 60.0


def run_loops(
    loops: tuple[str, str], work: Callable[[int], Awaitable[object]], join_s: float = JOIN_S
) -> list[object]:
    """Run ``work(i)`` on loop ``loops[i]`` in thread ``i``, both at once; return the results.

    The threads meet at a barrier inside their loops before starting, so the work overlaps.
    Raises the first thread's exception; fails if a thread does not finish (a deadlock).
    """
    barrier = threading.Barrier(2, timeout=join_s)
    results: list[object] = [None, None]
    errors: list[BaseException] = []

    async def body(i: int) -> None:
        await anyio.to_thread.run_sync(barrier.wait)
        results[i] = await work(i)

    def thread(i: int) -> None:
        backend, options = LOOPS[loops[i]]
        try:
            anyio.run(body, i, backend=backend, backend_options=options)
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=thread, args=(i,), name=f"loop-{i}-{loops[i]}", daemon=True) for i in range(2)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + join_s
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t.name for t in threads if t.is_alive()]
    assert not stuck, f"deadlock: {stuck} did not finish within {join_s} s"
    if errors:
        raise errors[0]
    return results


def precompile(*programs: tuple[str, str, str]) -> None:
    """Compile ``(device, name, source)`` up front, so the threads under test hit the cache and
    race on launches, not on compiling (which has its own test)."""

    async def compile_all() -> None:
        for device, name, src in programs:
            await Device[device].program(name, src)

    anyio.run(compile_all)


def assert_devices_idle(*names: str) -> None:
    for name in names:
        for q in Device[name].queues.values():
            assert q.queued() == 0, q
            assert q.timeline.pending_waiters() == 0, q.timeline


@pytest.mark.parametrize("loops", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_two_loops_launch_copy_and_read_on_shared_devices_at_once(loops: tuple[str, str]) -> None:
    launches = 2000
    precompile(("CPU", "inc", INC), ("CPU:1", "inc", INC))

    async def work(i: int) -> list[int]:
        inc = await Device["CPU"].program("inc", INC)
        inc1 = await Device["CPU:1"].program("inc", INC)
        out = await Buffer("CPU", 4, dtypes.int32).allocate()
        await out.copyin(np.full(4, 100 * i, np.int32))
        mirror = await Buffer("CPU:1", 4, dtypes.int32).allocate()
        for j in range(launches):
            sig = inc(out)
            if j % 10 == 9:
                await sig
        await mirror.copy_from(out)  # ordered after the launches, across devices
        for _ in range(launches // 4):
            inc1(mirror)
        await out.copy_from(mirror)
        got: list[int] = (await out.numpy()).tolist()
        await out.free()
        await mirror.free()
        return got

    results = run_loops(loops, work)
    expected = [[100 * i + launches + launches // 4, 100 * i, 100 * i, 100 * i] for i in range(2)]
    assert results == expected
    assert_devices_idle("CPU", "CPU:1")


@pytest.mark.parametrize("loops", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_two_loops_incrementing_one_buffer_lose_no_launch(loops: tuple[str, str]) -> None:
    launches = 3000
    shared: dict[str, Any] = {}

    async def setup() -> None:
        shared["inc"] = await Device["CPU"].program("inc", INC)
        shared["buf"] = await Buffer("CPU", 1, dtypes.int32).allocate()
        await shared["buf"].copyin(np.zeros(1, np.int32))

    anyio.run(setup)

    async def work(i: int) -> float:
        inc, buf = shared["inc"], shared["buf"]
        last: Signal | None = None
        for j in range(launches):
            last = inc(buf)
            if j % 50 == 49:
                await last
        assert last is not None
        return await last

    results = run_loops(loops, work)
    assert all(type(r) is float for r in results)

    async def check() -> list[int]:
        got: list[int] = (await shared["buf"].numpy()).tolist()
        await shared["buf"].free()
        return got

    assert anyio.run(check) == [2 * launches]
    assert_devices_idle("CPU")


@pytest.mark.parametrize("loops", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_one_signal_awaited_from_two_loops_wakes_both(loops: tuple[str, str]) -> None:
    shared: dict[str, Any] = {}

    async def setup() -> None:
        prog = await Device["CPU"].program("gate", GATE)
        flag = await Buffer("CPU", 1, dtypes.int32).allocate()
        out = await Buffer("CPU", 1, dtypes.int32).allocate()
        await flag.copyin(np.zeros(1, np.int32))
        shared.update(flag=flag, out=out, view=(await flag.as_memoryview()).cast("i"))
        shared["sig"] = prog(flag, out, vals=(77,), writes=(1,))

    anyio.run(setup)
    sig: Signal = shared["sig"]
    woken_on: list[int] = []

    async def work(i: int) -> float:
        secs = await sig
        woken_on.append(threading.get_ident())
        return secs

    def open_when_both_wait() -> None:
        # the test thread opens the gate once both loops have registered their wait
        deadline = time.monotonic() + JOIN_S
        while sig.timeline.pending_waiters() < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        shared["view"][0] = 1

    opener = threading.Thread(target=open_when_both_wait)
    opener.start()
    try:
        results = run_loops(loops, work)
    finally:
        shared["view"][0] = 1
        opener.join()
    assert results[0] == results[1] and type(results[0]) is float
    assert len(set(woken_on)) == 2  # each loop's task resumed in its own thread

    async def check() -> list[int]:
        got: list[int] = (await shared["out"].numpy()).tolist()
        del shared["view"]
        await shared["out"].free()
        await shared["flag"].free()
        return got

    assert anyio.run(check) == [77]
    assert_devices_idle("CPU")


@pytest.mark.slow
@pytest.mark.parametrize("loops", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_two_loops_running_cross_device_chains_with_cancelled_waits(loops: tuple[str, str]) -> None:
    precompile((CHAIN_DEVICES[0], "step3", STEP_CPU), (CHAIN_DEVICES[1], "step5", STEP_CPU1))

    async def work(i: int) -> dict[str, int]:
        progs = (
            await Device[CHAIN_DEVICES[0]].program("step3", STEP_CPU),
            await Device[CHAIN_DEVICES[1]].program("step5", STEP_CPU1),
        )
        counts = {"waits": 0, "armed": 0, "cancelled": 0}
        rng = random.Random(i)
        async with anyio.create_task_group() as tg:
            for _ in range(20):
                tg.start_soon(chain, progs, 200, 5, 0.1, random.Random(rng.random()), counts)
        return counts

    results = run_loops(loops, work)  # each chain checks its own result
    assert all(isinstance(r, dict) and r["waits"] == 20 * 41 for r in results)
    assert_devices_idle(*CHAIN_DEVICES)


@pytest.mark.parametrize("loops", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_two_loops_on_the_null_device_share_its_queues_in_order(loops: tuple[str, str]) -> None:
    launches = 5000

    async def work(i: int) -> list[int]:
        prog = await Device["NULL"].program("k", "k")
        sigs = [prog() for _ in range(launches)]
        await sigs[-1]
        assert all(s.done() and not s.failed() for s in sigs)
        return [s.value for s in sigs]

    values = run_loops(loops, work)
    a, b = (v for v in values if isinstance(v, list))
    assert len(set(a) | set(b)) == 2 * launches  # every launch got its own timeline value
    assert a == sorted(a) and b == sorted(b)  # each thread's launches in its own call order
    assert_devices_idle("NULL")


@pytest.mark.slow
@pytest.mark.parametrize("loops", PAIRS, ids=["-".join(p) for p in PAIRS])
def test_two_loops_compiling_the_same_source_at_once_both_get_it(loops: tuple[str, str]) -> None:
    """Single flight spans loops: the second loop waits for (or repeats) the first one's compile,
    and never touches the first loop's primitives."""
    src = f"// {uuid.uuid4()}\n{INC}\n"

    async def work(i: int) -> list[int]:
        dev = Device["CPU"]
        prog = await dev.program("inc", src)
        buf = await Buffer("CPU", 1, dtypes.int32).allocate()
        await buf.copyin(np.zeros(1, np.int32))
        await dev.run(prog, buf)
        got: list[int] = (await buf.numpy()).tolist()
        await buf.free()
        return got

    assert run_loops(loops, work, join_s=15) == [[1], [1]]
