"""Automatic ordering across queues and devices: RAW, WAR, WAW, overlapping and disjoint views.

The property test submits random programs of launches, copies and host writes over two CPU
devices, with copies left in flight while later work is submitted, and checks that every read
and the final contents equal sequential execution of the same program (numpy). The other tests
hold a device queue with a *gate* kernel (it spins until the test flips a flag in host memory)
so that "still pending" is a fact on the device, not a timing guess.

Also home of the helpers the scheduling tests share (``Gate``, ``start_copy``,
``assert_stays_pending``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import aiotinyrt as rt
from aiotinyrt import Buffer, BufferSpec, Device, DeviceError, Program, Signal, dtypes

pytestmark = pytest.mark.anyio

DEVICES = ("CPU", "CPU:1")

# ---- shared kernels and helpers ------------------------------------------------------------------

#: Spins until flag[0] != 0 (gives up after 20 s so a broken runtime cannot hang the suite), then
#: out[i] = in[i] + add for i < n. Launch it with ``writes=(1,)``: it reads the flag and ``in``.
GATE = r"""
#include <time.h>
void gate(volatile int* flag, int* out, const int* in, int n, int add) {
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (!flag[0]) {
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (t.tv_sec - t0.tv_sec > 20) break;
  }
  for (int i = 0; i < n; i++) out[i] = in[i] + add;
}
"""

#: out[i] = (in[i] * mul + add) & 0xFFFF, one element at a time, idling ``spin`` iterations before
#: each so that misordered work would land in the middle of it. ``out`` and ``in`` may alias.
AXPB = r"""
void axpb(int* out, const int* in, int n, int mul, int add, int spin) {
  for (int i = 0; i < n; i++) {
    for (volatile int s = 0; s < spin; s++) {}
    out[i] = (in[i] * mul + add) & 0xFFFF;
  }
}
"""

IntArray = npt.NDArray[np.int32]

#: How long a negative check ("this stays pending") gives a broken runtime to show itself. A
#: correct runtime passes whatever the machine load; only the detection of a bug depends on it.
PENDING_WINDOW_S = 0.2


class Gate:
    """A gate kernel on ``device`` and its flag, in host memory the test owns (wrapped with
    ``BufferSpec(external_ptr=...)``, so flipping it involves no runtime call and no ordering)."""

    def __init__(self, device: str, prog: Program, host: IntArray, flag: Buffer) -> None:
        self.device = device
        self.prog = prog
        self.host = host
        self.flag = flag
        self.launched: list[Signal] = []

    def launch(self, out: Buffer, inp: Buffer, add: int = 0, **kwargs: Any) -> Signal:
        """Enqueue ``out = inp + add``, held until :meth:`open`. ``inp`` is only read."""
        kwargs.setdefault("writes", (1,))
        sig = self.prog(self.flag, out, inp, vals=(out.size, add), **kwargs)
        self.launched.append(sig)
        return sig

    def open(self) -> None:
        self.host[0] = 1

    @property
    def is_open(self) -> bool:
        return bool(self.host[0])


@contextlib.asynccontextmanager
async def gate_on(device: str) -> AsyncIterator[Gate]:
    """A closed :class:`Gate` on a CPU device; opened on exit, which waits (shielded) for the
    launches so the host flag outlives them."""
    prog = await Device[device].program("gate", GATE)
    host: IntArray = np.zeros(16, np.int32)
    flag = await Buffer(device, 1, dtypes.int32, BufferSpec(external_ptr=host.ctypes.data)).allocate()
    gate = Gate(device, prog, host, flag)
    try:
        yield gate
    finally:
        gate.open()
        with anyio.CancelScope(shield=True):
            for sig in gate.launched:
                with contextlib.suppress(RuntimeError):  # failed, or captured into a graph
                    await sig
            await flag.free()


async def int_buffer(device: str, values: object, size: int | None = None) -> Buffer:
    """An allocated int32 buffer holding ``values`` (a scalar fills ``size`` elements)."""
    data = np.asarray(values, np.int32)
    if size is not None:
        data = np.full(size, data, np.int32)
    buf = await Buffer(device, int(data.size), dtypes.int32).allocate()
    await buf.copyin(data)
    return buf


async def contents(buf: Buffer) -> list[int]:
    return [int(v) for v in await buf.numpy()]


async def start_copy(
    tg: anyio.abc.TaskGroup, dest: Buffer, call: Callable[..., Coroutine[Any, Any, object]], *args: object
) -> Signal:
    """Start ``call(*args)`` (``dest.copy_from`` or ``dest.copyin``, which wait for their copy) in
    a task and return once the copy is *enqueued* on ``dest``'s copy queue, with a Signal for it,
    or once it is done, when it ran on the loop thread without being queued (a small copy into
    memory no pending command touches: then the Signal is one that is already done).

    The caller carries on submitting while the copy is in flight; a failed copy fails ``tg``.
    """
    timeline = dest.device_obj.queues["copy"].timeline
    before = timeline.submitted
    finished = anyio.Event()

    async def run() -> None:
        try:
            await call(*args)
        finally:
            finished.set()

    tg.start_soon(run)
    while timeline.submitted == before and not finished.is_set():  # it submits before it waits
        await anyio.lowlevel.checkpoint()
    if timeline.submitted == before:
        return Signal(timeline, 0)  # copied inline: nothing was queued
    assert timeline.submitted == before + 1
    return Signal(timeline, before + 1)


async def assert_stays_pending(sig: Signal, what: str) -> None:
    """Fail if ``sig`` completes within :data:`PENDING_WINDOW_S` (it must be held by a gate)."""
    with pytest.raises(TimeoutError):
        await sig.wait(timeout=PENDING_WINDOW_S)
    assert not sig.done(), f"{what} ran while the work it must follow was held"


async def done_while(work: Awaitable[object], gate_sig: Signal, what: str) -> None:
    """Await ``work`` (bounded, so a runtime that wrongly serialises fails instead of hanging)
    and check the gated ``gate_sig`` is still pending: the two did not serialise."""
    with anyio.fail_after(10):
        await work
    assert not gate_sig.done(), f"{what}: the gate opened early, the test proves nothing"


# ---- the property: random programs equal sequential execution -----------------------------------

N = 24  #: elements in each base buffer
BASES = tuple((dev, b) for dev in DEVICES for b in range(2))  #: two base buffers per device


@dataclass(frozen=True)
class Launch:
    """``axpb`` on ``dev``: base ``out`` [out_off, +n) = f(base ``inp`` [in_off, +n)), same device."""

    dev: str
    out: int
    out_off: int
    inp: int
    in_off: int
    n: int
    mul: int
    add: int
    spin: int
    declare_writes: bool  # pass writes=(0,) (else the raw-kernel default: every buffer written)


@dataclass(frozen=True)
class Copy:
    """``copy_from`` of n elements between any two bases (any devices), never overlapping."""

    dst: tuple[str, int]
    dst_off: int
    src: tuple[str, int]
    src_off: int
    n: int


@dataclass(frozen=True)
class CopyIn:
    """Host data into [off, +n) of a base."""

    dst: tuple[str, int]
    off: int
    values: tuple[int, ...]


@dataclass(frozen=True)
class Read:
    """Read [off, +n) of a base back to the host in the middle of the program."""

    src: tuple[str, int]
    off: int
    n: int


Op = Launch | Copy | CopyIn | Read


@st.composite
def ops(
    draw: st.DrawFn,
    kinds: tuple[str, ...] = ("launch", "launch", "copy", "copy", "copyin", "read"),
    spins: tuple[int, ...] = (0, 100_000),
) -> Op:
    """One random operation; ``kinds`` weights the choice, ``spins`` are the kernel idle loops."""
    kind = draw(st.sampled_from(kinds))
    n = draw(st.integers(1, N))
    off = st.integers(0, N - n)
    if kind == "launch":
        dev = draw(st.sampled_from(DEVICES))
        return Launch(
            dev,
            draw(st.integers(0, 1)),
            draw(off),
            draw(st.integers(0, 1)),
            draw(off),
            n,
            draw(st.integers(1, 3)),
            draw(st.integers(0, 100)),
            draw(st.sampled_from(spins)),
            draw(st.booleans()),
        )
    if kind == "copy":
        dst, src = draw(st.sampled_from(BASES)), draw(st.sampled_from(BASES))
        dst_off, src_off = draw(off), draw(off)
        if dst == src and dst_off < src_off + n and src_off < dst_off + n:
            dst = (dst[0], 1 - dst[1])  # memcpy of overlapping ranges is undefined: another base
        return Copy(dst, dst_off, src, src_off, n)
    if kind == "copyin":
        values = tuple(draw(st.lists(st.integers(0, 0xFFFF), min_size=n, max_size=n)))
        return CopyIn(draw(st.sampled_from(BASES)), draw(off), values)
    return Read(draw(st.sampled_from(BASES)), draw(off), n)


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


async def run_on_devices(
    program: list[Op],
    bases: dict[tuple[str, int], Buffer],
    progs: dict[str, Program],
    *,
    capturing: bool = False,
) -> list[list[int]]:
    """Submit ``program`` as fast as it goes: launches return at once, copies stay in flight
    (each in its own task, enqueued in program order) while later operations are submitted.

    ``capturing``: inside ``dev.capture()``, where ``copy_from`` records and returns at once.
    """

    def view(base: tuple[str, int], off: int, n: int) -> Buffer:
        return bases[base].view(n, dtypes.int32, off * 4)

    reads: list[list[int]] = []
    async with anyio.create_task_group() as tg:
        for op in program:
            if isinstance(op, Launch):
                out, inp = view((op.dev, op.out), op.out_off, op.n), view((op.dev, op.inp), op.in_off, op.n)
                progs[op.dev](
                    out,
                    inp,
                    vals=(op.n, op.mul, op.add, op.spin),
                    writes=(0,) if op.declare_writes else None,
                )
            elif isinstance(op, Copy):
                dst, src = view(op.dst, op.dst_off, op.n), view(op.src, op.src_off, op.n)
                if capturing:
                    await dst.copy_from(src)
                else:
                    await start_copy(tg, dst, dst.copy_from, src)
            elif isinstance(op, CopyIn):
                dst = view(op.dst, op.off, len(op.values))
                await start_copy(tg, dst, dst.copyin, np.array(op.values, np.int32))
            else:
                reads.append(await contents(view(op.src, op.off, op.n)))
    return reads


# No shrink phase: a misordering shows up as a race, which shrinking turns into minutes of flaky
# replays; the failing program is printed as generated (at most 24 operations).
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
    progs = {dev: await Device[dev].program("axpb", AXPB) for dev in DEVICES}
    bases = {key: await int_buffer(key[0], initial[key]) for key in BASES}
    try:
        expected = {key: arr.copy() for key, arr in initial.items()}
        expected_reads = run_reference(program, expected)
        reads = await run_on_devices(program, bases, progs)
        await rt.synchronize(*DEVICES)
        assert reads == expected_reads
        for key in BASES:
            assert await contents(bases[key]) == expected[key].tolist(), f"base {key}"
    finally:
        for buf in bases.values():
            await buf.free()


# ---- hazards, one at a time, with the first command held on the device --------------------------


async def test_read_after_write_copy_to_another_device_waits_for_the_kernel() -> None:
    src = await int_buffer("CPU", 1, size=4)
    out = await int_buffer("CPU", 0, size=4)
    far = await int_buffer("CPU:1", 0, size=4)
    async with gate_on("CPU") as gate, anyio.create_task_group() as tg:
        held = gate.launch(out, src, add=41)  # out = 42, held
        copy = await start_copy(tg, far, far.copy_from, out)
        await assert_stays_pending(copy, "the copy reading the kernel's output")
        gate.open()
    assert held.done()
    assert await contents(far) == [42] * 4


async def test_write_after_read_kernel_on_another_device_waits_for_the_copy_reading_its_output() -> None:
    near = await int_buffer("CPU", 7, size=4)
    far = await int_buffer("CPU:1", 0, size=4)
    ones = await int_buffer("CPU", 1, size=4)
    axpb = await Device["CPU"].program("axpb", AXPB)
    async with gate_on("CPU:1") as gate, anyio.create_task_group() as tg:
        gate.launch(far, far)  # holds CPU:1 with a write of far ...
        copy = await start_copy(tg, far, far.copy_from, near)  # ... so this read of near waits
        overwrite = axpb(near, ones, vals=(4, 1, 99, 0), writes=(0,))  # near = 100: after the copy
        await assert_stays_pending(overwrite, "the kernel overwriting what a pending copy reads")
        assert not copy.done()
        gate.open()
    assert await contents(far) == [7] * 4
    assert await contents(near) == [100] * 4


async def test_write_after_write_on_the_copy_queue_waits_for_the_kernel_on_the_compute_queue() -> None:
    src = await int_buffer("CPU", 5, size=8)
    out = await int_buffer("CPU", 0, size=8)
    async with gate_on("CPU") as gate, anyio.create_task_group() as tg:
        gate.launch(out, src)  # out = 5, held
        copy = await start_copy(tg, out, out.copyin, np.full(8, 9, np.int32))  # then out = 9
        await assert_stays_pending(copy, "the copy overwriting the kernel's output")
        gate.open()
    assert await contents(out) == [9] * 8


async def test_write_after_write_from_another_device_lands_last() -> None:
    out = await int_buffer("CPU", 0, size=8)
    src = await int_buffer("CPU", 3, size=8)
    far = await int_buffer("CPU:1", 8, size=8)
    async with gate_on("CPU") as gate, anyio.create_task_group() as tg:
        gate.launch(out, src)  # out = 3, held
        copy = await start_copy(tg, out, out.copy_from, far)  # then out = 8 from CPU:1
        await assert_stays_pending(copy, "the transfer overwriting the kernel's output")
        gate.open()
    assert await contents(out) == [8] * 8


async def test_host_read_waits_for_a_pending_write_but_not_for_a_pending_read() -> None:
    buf = await int_buffer("CPU", 2, size=4)
    other = await int_buffer("CPU", 0, size=4)
    async with gate_on("CPU") as gate:
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
    buf = await int_buffer("CPU", 0, size=4)
    ones = await int_buffer("CPU", 1, size=4)
    far = await int_buffer("CPU:1", 0, size=4)
    twos = await int_buffer("CPU:1", 2, size=4)
    seen: list[list[int]] = []

    async def read() -> None:
        seen.append(await contents(buf))

    async with gate_on("CPU") as near_gate, gate_on("CPU:1") as far_gate, anyio.create_task_group() as tg:
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


async def test_overlapping_view_copy_waits_for_the_kernel_writing_the_other_view() -> None:
    base = await int_buffer("CPU", 0, size=16)
    src = await int_buffer("CPU", 1, size=8)
    fill = await int_buffer("CPU", 2, size=8)
    left, right = base.view(8, dtypes.int32, 0), base.view(8, dtypes.int32, 4 * 4)  # overlap [4, 8)
    async with gate_on("CPU") as gate, anyio.create_task_group() as tg:
        gate.launch(left, src)  # base[0:8] = 1, held
        copy = await start_copy(tg, right, right.copy_from, fill)  # base[4:12] = 2, after it
        await assert_stays_pending(copy, "a copy into an overlapping view")
        gate.open()
    assert await contents(base) == [1] * 4 + [2] * 8 + [0] * 4


async def test_disjoint_views_do_not_serialise_a_copy_behind_a_held_kernel() -> None:
    base = await int_buffer("CPU", 0, size=16)
    src = await int_buffer("CPU", 1, size=8)
    left, right = base.view(8, dtypes.int32, 0), base.view(8, dtypes.int32, 8 * 4)
    async with gate_on("CPU") as gate:
        held = gate.launch(left, src)  # writes base[0:8], held until the gate opens
        await done_while(right.copyin(np.full(8, 3, np.int32)), held, "copyin into a disjoint view")
        await done_while(right.numpy(), held, "host read of a disjoint view")
        far = await int_buffer("CPU:1", 0, size=8)
        await done_while(far.copy_from(right), held, "transfer out of a disjoint view")
        await done_while(right.copy_from(far), held, "transfer into a disjoint view")
        gate.open()
    assert await contents(base) == [1] * 8 + [3] * 8
    assert await contents(far) == [3] * 8


async def test_work_on_a_disjoint_view_flows_on_to_another_device_while_the_other_view_is_held() -> None:
    # CPU:1's compute queue is held writing lo; the transfer of hi and a kernel on CPU reading it go on
    base = await int_buffer("CPU:1", list(range(8)))
    lo, hi = base.view(4, dtypes.int32, 0), base.view(4, dtypes.int32, 16)
    axpb = await Device["CPU"].program("axpb", AXPB)
    near = await int_buffer("CPU", 4, size=4)
    async with gate_on("CPU:1") as gate, anyio.create_task_group() as tg:
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


async def test_a_partial_write_does_not_hide_earlier_writes_it_does_not_cover() -> None:
    base = await int_buffer("CPU", 0, size=16)
    src = await int_buffer("CPU", 1, size=8)
    far = await int_buffer("CPU:1", 0, size=16)
    left, right = base.view(8, dtypes.int32, 0), base.view(8, dtypes.int32, 8 * 4)
    async with gate_on("CPU") as gate, anyio.create_task_group() as tg:
        held = gate.launch(left, src)  # base[0:8] = 1, held
        await done_while(right.copyin(np.full(8, 2, np.int32)), held, "copyin into the other half")
        copy = await start_copy(tg, far, far.copy_from, base)  # reads both halves
        await assert_stays_pending(copy, "a transfer of the whole base while half of it is written")
        gate.open()
    assert await contents(far) == [1] * 8 + [2] * 8


async def test_a_write_to_the_whole_base_waits_for_work_on_any_view() -> None:
    base = await int_buffer("CPU", 0, size=8)
    src = await int_buffer("CPU", 6, size=2)
    async with gate_on("CPU") as gate, anyio.create_task_group() as tg:
        gate.launch(base.view(2, dtypes.int32, 12), src)  # base[3:5] = 6, held
        copy = await start_copy(tg, base, base.copyin, np.arange(8, dtype=np.int32))
        await assert_stays_pending(copy, "a whole-buffer copyin over a view being written")
        gate.open()
    assert await contents(base) == list(range(8))


# ---- explicit dependencies and writes= ------------------------------------------------------------


async def test_wait_for_orders_a_launch_after_a_signal_of_another_device() -> None:
    # Two devices wrap the same host memory: the runtime cannot know they alias, so only
    # wait_for orders the reader after the writer.
    shared: IntArray = np.zeros(4, np.int32)
    spec = BufferSpec(external_ptr=shared.ctypes.data)
    near = await Buffer("CPU", 4, dtypes.int32, spec).allocate()
    far_alias = await Buffer("CPU:1", 4, dtypes.int32, spec).allocate()
    src = await int_buffer("CPU", 20, size=4)
    out = await int_buffer("CPU:1", 0, size=4)
    axpb = await Device["CPU:1"].program("axpb", AXPB)
    try:
        async with gate_on("CPU") as gate:
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
    out = await int_buffer("CPU:1", 5, size=1)
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
    buf = await int_buffer("CPU", 11, size=4)
    out = await int_buffer("CPU", 0, size=4)
    far = await int_buffer("CPU:1", 0, size=4)
    async with gate_on("CPU") as gate:
        held = gate.launch(out, buf, writes=(1,))  # reads buf
        await done_while(far.copy_from(buf), held, "a transfer reading what the kernel only reads")
        gate.open()
    assert await contents(far) == [11] * 4


async def test_without_writes_a_raw_kernel_is_taken_to_write_every_buffer() -> None:
    buf = await int_buffer("CPU", 11, size=4)
    out = await int_buffer("CPU", 0, size=4)
    far = await int_buffer("CPU:1", 0, size=4)
    async with gate_on("CPU") as gate, anyio.create_task_group() as tg:
        gate.launch(out, buf, writes=None)
        copy = await start_copy(tg, far, far.copy_from, buf)
        await assert_stays_pending(copy, "a transfer reading a buffer a raw kernel may write")
        gate.open()
    assert await contents(far) == [11] * 4


async def test_a_write_after_a_declared_read_still_waits_for_it() -> None:
    buf = await int_buffer("CPU", 11, size=4)
    out = await int_buffer("CPU", 0, size=4)
    async with gate_on("CPU") as gate, anyio.create_task_group() as tg:
        gate.launch(out, buf, writes=(1,))  # out = buf, read when the gate opens
        copy = await start_copy(tg, buf, buf.copyin, np.full(4, 99, np.int32))
        await assert_stays_pending(copy, "a copy overwriting what a held kernel reads")
        gate.open()
    assert await contents(out) == [11] * 4
    assert await contents(buf) == [99] * 4
