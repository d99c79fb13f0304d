"""Automatic ordering across queues and devices: RAW, WAR, WAW, overlapping and disjoint views.

The property test submits random programs of launches, copies and host writes over two CPU
devices, with copies left in flight while later work is submitted, and checks that every read
and the final contents equal sequential execution of the same program (numpy). The other tests
hold a device queue with a *gate* kernel (it spins until the test flips a flag in host memory)
so that "still pending" is a fact on the device, not a timing guess.

Also home of the helpers the scheduling tests share (``CopyGate``, ``start_copy``,
``assert_stays_pending``).
"""

from __future__ import annotations

import time

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import aiotinyrt as rt
from aiotinyrt import Buffer, BufferSpec, Device, DeviceError, dtypes
from tests.helpers import (
    AXPB,
    BASES,
    ORDER_DEVICES,
    PENDING_WINDOW_S,
    Copy,
    CopyIn,
    IntArray,
    Launch,
    N,
    Op,
    assert_stays_pending,
    contents,
    copy_gate_on,
    done_while,
    int_array_buffer,
    ops,
    run_on_devices,
    start_copy,
)

pytestmark = pytest.mark.anyio


# ---- shared kernels and helpers ------------------------------------------------------------------


# ---- the property: random programs equal sequential execution -----------------------------------


def run_reference(program: list[Op], initial: dict[tuple[str, int], IntArray]) -> list[list[int]]:
    """Sequential execution in numpy; returns what each Read sees, and updates ``initial``."""
    mem = initial
    reads: list[list[int]] = []
    for op in program:
        if isinstance(op, Launch):
            out, inp = mem[op.dev, op.out], mem[op.dev, op.inp]
            for i in range(op.n):  # one element at a time, as the kernel does: views may alias
                out[op.out_off + i] = (int(inp[op.in_off + i]) * op.mul + op.add) & 0xFFFF
        elif isinstance(op, Copy):
            mem[op.dst][op.dst_off : op.dst_off + op.n] = mem[op.src][op.src_off : op.src_off + op.n]
        elif isinstance(op, CopyIn):
            mem[op.dst][op.off : op.off + len(op.values)] = op.values
        else:
            reads.append([int(v) for v in mem[op.src][op.off : op.off + op.n]])
    return reads


# No shrink phase: a misordering shows up as a race, which shrinking turns into minutes of flaky
# replays; the failing program is printed as generated (at most 24 operations).
@pytest.mark.slow
@settings(
    max_examples=40,
    deadline=None,
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
    suppress_health_check=[HealthCheck.too_slow],
)
@given(program=st.lists(ops(), min_size=8, max_size=24), seed=st.integers(0, 2**16))
async def test_random_programs_over_two_devices_equal_sequential_execution(
    program: list[Op], seed: int
) -> None:
    rng = np.random.default_rng(seed)
    initial = {key: rng.integers(0, 0xFFFF, N, dtype=np.int32) for key in BASES}
    progs = {dev: await Device[dev].program("axpb", AXPB) for dev in ORDER_DEVICES}
    bases = {key: await int_array_buffer(key[0], initial[key]) for key in BASES}
    try:
        expected = {key: arr.copy() for key, arr in initial.items()}
        expected_reads = run_reference(program, expected)
        reads = await run_on_devices(program, bases, progs)
        await rt.synchronize(*ORDER_DEVICES)
        assert reads == expected_reads
        for key in BASES:
            assert await contents(bases[key]) == expected[key].tolist(), f"base {key}"
    finally:
        for buf in bases.values():
            await buf.free()


# ---- hazards, one at a time, with the first command held on the device --------------------------


@pytest.mark.slow
async def test_read_after_write_copy_to_another_device_waits_for_the_kernel() -> None:
    src = await int_array_buffer("CPU", 1, size=4)
    out = await int_array_buffer("CPU", 0, size=4)
    far = await int_array_buffer("CPU:1", 0, size=4)
    async with copy_gate_on("CPU") as gate, anyio.create_task_group() as tg:
        held = gate.launch(out, src, add=41)  # out = 42, held
        copy = await start_copy(tg, far, far.copy_from, out)
        await assert_stays_pending(copy, "the copy reading the kernel's output")
        gate.open()
    assert held.done()
    assert await contents(far) == [42] * 4


@pytest.mark.slow
async def test_write_after_read_kernel_on_another_device_waits_for_the_copy_reading_its_output() -> None:
    near = await int_array_buffer("CPU", 7, size=4)
    far = await int_array_buffer("CPU:1", 0, size=4)
    ones = await int_array_buffer("CPU", 1, size=4)
    axpb = await Device["CPU"].program("axpb", AXPB)
    async with copy_gate_on("CPU:1") as gate, anyio.create_task_group() as tg:
        gate.launch(far, far)  # holds CPU:1 with a write of far ...
        copy = await start_copy(tg, far, far.copy_from, near)  # ... so this read of near waits
        overwrite = axpb(near, ones, vals=(4, 1, 99, 0), writes=(0,))  # near = 100: after the copy
        await assert_stays_pending(overwrite, "the kernel overwriting what a pending copy reads")
        assert not copy.done()
        gate.open()
    assert await contents(far) == [7] * 4
    assert await contents(near) == [100] * 4


@pytest.mark.slow
async def test_write_after_write_on_the_copy_queue_waits_for_the_kernel_on_the_compute_queue() -> None:
    src = await int_array_buffer("CPU", 5, size=8)
    out = await int_array_buffer("CPU", 0, size=8)
    async with copy_gate_on("CPU") as gate, anyio.create_task_group() as tg:
        gate.launch(out, src)  # out = 5, held
        copy = await start_copy(tg, out, out.copyin, np.full(8, 9, np.int32))  # then out = 9
        await assert_stays_pending(copy, "the copy overwriting the kernel's output")
        gate.open()
    assert await contents(out) == [9] * 8


@pytest.mark.slow
async def test_write_after_write_from_another_device_lands_last() -> None:
    out = await int_array_buffer("CPU", 0, size=8)
    src = await int_array_buffer("CPU", 3, size=8)
    far = await int_array_buffer("CPU:1", 8, size=8)
    async with copy_gate_on("CPU") as gate, anyio.create_task_group() as tg:
        gate.launch(out, src)  # out = 3, held
        copy = await start_copy(tg, out, out.copy_from, far)  # then out = 8 from CPU:1
        await assert_stays_pending(copy, "the transfer overwriting the kernel's output")
        gate.open()
    assert await contents(out) == [8] * 8


@pytest.mark.slow
async def test_host_read_waits_for_a_pending_write_but_not_for_a_pending_read() -> None:
    buf = await int_array_buffer("CPU", 2, size=4)
    other = await int_array_buffer("CPU", 0, size=4)
    async with copy_gate_on("CPU") as gate:
        gate.launch(other, buf)  # reads buf (writes=(1,)), writes other; held
        assert await contents(buf) == [2] * 4  # read-after-read: no wait
        with pytest.raises(TimeoutError):
            with anyio.fail_after(PENDING_WINDOW_S):
                await other.numpy()  # read-after-write: waits for the held kernel
        gate.open()
        assert await contents(other) == [2] * 4


async def test_a_host_read_is_not_changed_by_a_write_submitted_after_it() -> None:
    # numpy() is called while the buffer's last write is held; a transfer into the buffer is
    # submitted after that call. The read must see the held write's result, not the transfer's
    # (write-after-read, with the host as the reader).
    buf = await int_array_buffer("CPU", 0, size=4)
    ones = await int_array_buffer("CPU", 1, size=4)
    far = await int_array_buffer("CPU:1", 0, size=4)
    twos = await int_array_buffer("CPU:1", 2, size=4)
    seen: list[list[int]] = []

    async def read() -> None:
        seen.append(await contents(buf))

    async with (
        copy_gate_on("CPU") as near_gate,
        copy_gate_on("CPU:1") as far_gate,
        anyio.create_task_group() as tg,
    ):
        near_gate.launch(buf, ones)  # buf = 1, held
        far_gate.launch(far, twos)  # far = 2, held
        tg.start_soon(read)
        await anyio.wait_all_tasks_blocked()  # the read is made, waiting for buf = 1
        overwrite = await start_copy(tg, buf, buf.copy_from, far)  # buf = 2, after the read
        near_gate.open()
        far_gate.open()
        # Give the device the chance to run the overwrite before the reader task resumes: poll
        # the device's own progress without yielding to the loop (bounded).
        deadline = time.monotonic() + PENDING_WINDOW_S
        while not overwrite.done() and time.monotonic() < deadline:
            pass
    assert seen == [[1] * 4], "the host read returned data written after it was made"


# ---- views -------------------------------------------------------------------------------------


@pytest.mark.slow
async def test_overlapping_view_copy_waits_for_the_kernel_writing_the_other_view() -> None:
    base = await int_array_buffer("CPU", 0, size=16)
    src = await int_array_buffer("CPU", 1, size=8)
    fill = await int_array_buffer("CPU", 2, size=8)
    left, right = base.view(8, dtypes.int32, 0), base.view(8, dtypes.int32, 4 * 4)  # overlap [4, 8)
    async with copy_gate_on("CPU") as gate, anyio.create_task_group() as tg:
        gate.launch(left, src)  # base[0:8] = 1, held
        copy = await start_copy(tg, right, right.copy_from, fill)  # base[4:12] = 2, after it
        await assert_stays_pending(copy, "a copy into an overlapping view")
        gate.open()
    assert await contents(base) == [1] * 4 + [2] * 8 + [0] * 4


async def test_disjoint_views_do_not_serialise_a_copy_behind_a_held_kernel() -> None:
    base = await int_array_buffer("CPU", 0, size=16)
    src = await int_array_buffer("CPU", 1, size=8)
    left, right = base.view(8, dtypes.int32, 0), base.view(8, dtypes.int32, 8 * 4)
    async with copy_gate_on("CPU") as gate:
        held = gate.launch(left, src)  # writes base[0:8], held until the gate opens
        await done_while(right.copyin(np.full(8, 3, np.int32)), held, "copyin into a disjoint view")
        await done_while(right.numpy(), held, "host read of a disjoint view")
        far = await int_array_buffer("CPU:1", 0, size=8)
        await done_while(far.copy_from(right), held, "transfer out of a disjoint view")
        await done_while(right.copy_from(far), held, "transfer into a disjoint view")
        gate.open()
    assert await contents(base) == [1] * 8 + [3] * 8
    assert await contents(far) == [3] * 8


async def test_work_on_a_disjoint_view_flows_on_to_another_device_while_the_other_view_is_held() -> None:
    # CPU:1's compute queue is held writing lo; the transfer of hi and a kernel on CPU reading it go on
    base = await int_array_buffer("CPU:1", list(range(8)))
    lo, hi = base.view(4, dtypes.int32, 0), base.view(4, dtypes.int32, 16)
    axpb = await Device["CPU"].program("axpb", AXPB)
    near = await int_array_buffer("CPU", 4, size=4)
    async with copy_gate_on("CPU:1") as gate, anyio.create_task_group() as tg:
        held = gate.launch(lo, lo, add=1)  # base[0:4] += 1, held on CPU:1
        copy = await start_copy(tg, near, near.copy_from, hi)  # reads base[4:8] on CPU's copy queue
        with anyio.fail_after(10):
            await copy.wait()
        after = axpb(near, near, vals=(4, 2, 0, 0))  # near *= 2 on CPU: depends on the copy only
        with anyio.fail_after(10):
            await after
        assert not held.done()
        gate.open()
    assert await contents(near) == [8, 10, 12, 14]
    assert await contents(base) == [1, 2, 3, 4, 4, 5, 6, 7]


@pytest.mark.slow
async def test_a_partial_write_does_not_hide_earlier_writes_it_does_not_cover() -> None:
    base = await int_array_buffer("CPU", 0, size=16)
    src = await int_array_buffer("CPU", 1, size=8)
    far = await int_array_buffer("CPU:1", 0, size=16)
    left, right = base.view(8, dtypes.int32, 0), base.view(8, dtypes.int32, 8 * 4)
    async with copy_gate_on("CPU") as gate, anyio.create_task_group() as tg:
        held = gate.launch(left, src)  # base[0:8] = 1, held
        await done_while(right.copyin(np.full(8, 2, np.int32)), held, "copyin into the other half")
        copy = await start_copy(tg, far, far.copy_from, base)  # reads both halves
        await assert_stays_pending(copy, "a transfer of the whole base while half of it is written")
        gate.open()
    assert await contents(far) == [1] * 8 + [2] * 8


@pytest.mark.slow
async def test_a_write_to_the_whole_base_waits_for_work_on_any_view() -> None:
    base = await int_array_buffer("CPU", 0, size=8)
    src = await int_array_buffer("CPU", 6, size=2)
    async with copy_gate_on("CPU") as gate, anyio.create_task_group() as tg:
        gate.launch(base.view(2, dtypes.int32, 12), src)  # base[3:5] = 6, held
        copy = await start_copy(tg, base, base.copyin, np.arange(8, dtype=np.int32))
        await assert_stays_pending(copy, "a whole-buffer copyin over a view being written")
        gate.open()
    assert await contents(base) == list(range(8))


# ---- explicit dependencies and writes= ------------------------------------------------------------


@pytest.mark.slow
async def test_wait_for_orders_a_launch_after_a_signal_of_another_device() -> None:
    # Two devices wrap the same host memory: the runtime cannot know they alias, so only
    # wait_for orders the reader after the writer.
    shared: IntArray = np.zeros(4, np.int32)
    spec = BufferSpec(external_ptr=shared.ctypes.data)
    near = await Buffer("CPU", 4, dtypes.int32, spec).allocate()
    far_alias = await Buffer("CPU:1", 4, dtypes.int32, spec).allocate()
    src = await int_array_buffer("CPU", 20, size=4)
    out = await int_array_buffer("CPU:1", 0, size=4)
    axpb = await Device["CPU:1"].program("axpb", AXPB)
    try:
        async with copy_gate_on("CPU") as gate:
            held = gate.launch(near, src, add=1)  # shared = 21, held
            reader = axpb(out, far_alias, vals=(4, 2, 0, 0), writes=(0,), wait_for=[held])
            await assert_stays_pending(reader, "a launch with wait_for on a held signal")
            gate.open()
            await reader
        assert await contents(out) == [42] * 4
    finally:
        await near.free()
        await far_alias.free()


async def test_wait_for_a_failed_signal_fails_the_dependent_launch_without_running_it() -> None:
    out = await int_array_buffer("CPU:1", 5, size=1)
    axpb = await Device["CPU:1"].program("axpb", AXPB)
    failing = Device["CPU"].queues["compute"].submit(_raise, ())
    try:
        dependent = axpb(out, out, vals=(1, 1, 1, 0), wait_for=[failing])
        with pytest.raises(DeviceError, match="depends on"):
            await dependent
        assert await contents(out) == [5]
    finally:
        await Device["CPU"].reset()


def _raise() -> None:
    raise RuntimeError("failing on purpose")


async def test_writes_marks_the_other_buffers_read_only_so_reads_do_not_wait() -> None:
    buf = await int_array_buffer("CPU", 11, size=4)
    out = await int_array_buffer("CPU", 0, size=4)
    far = await int_array_buffer("CPU:1", 0, size=4)
    async with copy_gate_on("CPU") as gate:
        held = gate.launch(out, buf, writes=(1,))  # reads buf
        await done_while(far.copy_from(buf), held, "a transfer reading what the kernel only reads")
        gate.open()
    assert await contents(far) == [11] * 4


@pytest.mark.slow
async def test_without_writes_a_raw_kernel_is_taken_to_write_every_buffer() -> None:
    buf = await int_array_buffer("CPU", 11, size=4)
    out = await int_array_buffer("CPU", 0, size=4)
    far = await int_array_buffer("CPU:1", 0, size=4)
    async with copy_gate_on("CPU") as gate, anyio.create_task_group() as tg:
        gate.launch(out, buf, writes=None)
        copy = await start_copy(tg, far, far.copy_from, buf)
        await assert_stays_pending(copy, "a transfer reading a buffer a raw kernel may write")
        gate.open()
    assert await contents(far) == [11] * 4


@pytest.mark.slow
async def test_a_write_after_a_declared_read_still_waits_for_it() -> None:
    buf = await int_array_buffer("CPU", 11, size=4)
    out = await int_array_buffer("CPU", 0, size=4)
    async with copy_gate_on("CPU") as gate, anyio.create_task_group() as tg:
        gate.launch(out, buf, writes=(1,))  # out = buf, read when the gate opens
        copy = await start_copy(tg, buf, buf.copyin, np.full(4, 99, np.int32))
        await assert_stays_pending(copy, "a copy overwriting what a held kernel reads")
        gate.open()
    assert await contents(out) == [11] * 4
    assert await contents(buf) == [99] * 4
