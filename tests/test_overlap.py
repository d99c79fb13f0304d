"""Copies overlap compute: a device's copy queue and its compute queue run at the same time, and
two devices' compute queues run at the same time.

Each test holds a compute queue with a gate kernel (it spins on a flag in host memory the test
owns) and shows the other work *completes* while the gate's signal is still pending: no timing,
no sleeps. A runtime that serialised the two would fail the bounded wait instead of hanging.
"""

from __future__ import annotations

import os
import threading

import anyio
import numpy as np
import pytest

import aiotinyrt as rt
from aiotinyrt import Device, Signal, dtypes
from tests.helpers import AXPB, assert_stays_pending, contents, copy_gate_on, done_while, int_array_buffer

pytestmark = pytest.mark.anyio


async def test_copyin_completes_while_a_kernel_holds_the_compute_queue() -> None:
    src = await int_array_buffer("CPU", 1, size=4)
    out = await int_array_buffer("CPU", 0, size=4)
    other = await int_array_buffer("CPU", 0, size=1024)
    async with copy_gate_on("CPU") as gate:
        held = gate.launch(out, src)
        data = np.arange(1024, dtype=np.int32)
        await done_while(other.copyin(data), held, "copyin on the copy queue")
        assert await contents(other) == data.tolist()  # the copy really happened
        assert not held.done()
        gate.open()
        await held
    assert await contents(out) == [1] * 4


async def test_copyout_completes_while_a_kernel_holds_the_compute_queue() -> None:
    src = await int_array_buffer("CPU", 1, size=4)
    out = await int_array_buffer("CPU", 0, size=4)
    other = await int_array_buffer("CPU", np.arange(256))
    dest = np.zeros(256, np.int32)
    async with copy_gate_on("CPU") as gate:
        held = gate.launch(out, src)
        await done_while(other.copyout(dest.data), held, "copyout on the copy queue")
        assert dest.tolist() == list(range(256))
        gate.open()


async def test_transfers_in_and_out_complete_while_a_kernel_holds_the_compute_queue() -> None:
    src = await int_array_buffer("CPU", 1, size=4)
    out = await int_array_buffer("CPU", 0, size=4)
    near = await int_array_buffer("CPU", np.arange(64))
    far = await int_array_buffer("CPU:1", 0, size=64)
    back = await int_array_buffer("CPU", 0, size=64)
    async with copy_gate_on("CPU") as gate:
        held = gate.launch(out, src)
        # CPU:1's copy queue reading CPU memory, then CPU's copy queue reading CPU:1 memory
        await done_while(far.copy_from(near), held, "transfer CPU -> CPU:1")
        await done_while(back.copy_from(far), held, "transfer CPU:1 -> CPU")
        gate.open()
    assert await contents(back) == list(range(64))


async def test_two_devices_run_kernels_at_the_same_time() -> None:
    src = await int_array_buffer("CPU", 1, size=4)
    out = await int_array_buffer("CPU", 0, size=4)
    far = await int_array_buffer("CPU:1", 5, size=4)
    axpb = await Device["CPU:1"].program("axpb", AXPB)
    async with copy_gate_on("CPU") as gate:
        held = gate.launch(out, src)
        await done_while(axpb(far, far, vals=(4, 2, 0, 0)), held, "a kernel on CPU:1")
        gate.open()
    assert await contents(far) == [10] * 4


@pytest.mark.slow
async def test_a_copy_that_must_follow_the_held_kernel_waits_and_an_independent_one_does_not() -> None:
    # The copy queue is in order: a copy that must wait for the held kernel holds the copies
    # behind it too; a copy submitted before it is unaffected.
    src = await int_array_buffer("CPU", 1, size=4)
    out = await int_array_buffer("CPU", 0, size=4)
    free_buf = await int_array_buffer("CPU", 0, size=4)
    async with copy_gate_on("CPU") as gate:
        held = gate.launch(out, src)
        await done_while(free_buf.copyin(np.full(4, 7, np.int32)), held, "an independent copy")
        async with anyio.create_task_group() as tg:
            tg.start_soon(out.copyin, np.full(4, 9, np.int32))  # WAW with the held kernel
            await anyio.wait_all_tasks_blocked()
            copy_queue = Device["CPU"].queues["copy"].timeline
            await assert_stays_pending(Signal(copy_queue, copy_queue.submitted), "a dependent copy")
            gate.open()
    assert await contents(out) == [9] * 4
    assert await contents(free_buf) == [7] * 4


@pytest.mark.slow
async def test_synchronize_gathers_over_the_compute_and_copy_queues() -> None:
    src = await int_array_buffer("CPU", 1, size=4)
    out = await int_array_buffer("CPU", 0, size=4)
    other = await int_array_buffer("CPU", 0, size=4)
    async with copy_gate_on("CPU") as gate:
        gate.launch(out, src)
        await other.copyin(np.full(4, 3, np.int32))  # the copy queue is idle again
        copy_queue = Device["CPU"].queues["copy"].timeline
        assert copy_queue.completed == copy_queue.submitted
        with pytest.raises(TimeoutError):
            with anyio.fail_after(0.2):
                await Device["CPU"].synchronize()  # the compute queue is still held
        gate.open()
        with anyio.fail_after(10):
            await rt.synchronize("CPU")
    assert await contents(out) == [1] * 4


async def test_a_large_copy_and_a_kernel_are_both_in_flight_at_once() -> None:
    # Submit a kernel and a large disjoint copy back to back; the copy finishes first while the
    # kernel is held, then the kernel finishes: the two queues were busy at the same time.
    src = await int_array_buffer("CPU", 2, size=4)
    out = await int_array_buffer("CPU", 0, size=4)
    big = await int_array_buffer("CPU", 0, size=1 << 20)
    payload = np.random.default_rng(0).integers(0, 1 << 30, 1 << 20, dtype=np.int32)
    async with copy_gate_on("CPU") as gate:
        held = gate.launch(out, src)
        await done_while(big.copyin(payload), held, "a 4 MiB copyin")
        gate.open()
        await held
    view = big.view(16, dtypes.int32, 4096)
    assert await contents(view) == payload[1024:1040].tolist()
    assert await contents(out) == [2] * 4


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU masks are Linux-only")
async def test_workers_keep_their_own_cpu_mask_after_long_overlapping_commands() -> None:
    """Workers narrow their CPU mask to be placed away from a busy worker (native queue, long
    commands) and must restore it: after kernels and copies overlapping for a while, every
    worker thread's mask is the process's again."""
    src = await int_array_buffer("CPU", 2, size=4)
    out = await int_array_buffer("CPU", 0, size=4)
    big = await int_array_buffer("CPU", 0, size=1 << 20)
    payload = np.ones(1 << 20, np.int32)
    for _ in range(3):
        await big.copyin(payload)  # a long command on the copy queue
        async with copy_gate_on("CPU") as gate:
            held = gate.launch(out, src)  # a busy compute worker
            await done_while(big.copyin(payload), held, "a 4 MiB copyin")
            gate.open()
            await held
    await rt.synchronize("CPU")
    process = os.sched_getaffinity(0)
    workers = [t for t in threading.enumerate() if t.name.startswith("aiotinyrt-CPU/")]
    assert workers
    for thread in workers:
        assert thread.native_id is not None
        assert os.sched_getaffinity(thread.native_id) == process, thread.name
