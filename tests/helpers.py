"""Shared test helpers: kernels, gates that hold a queue, buffers, fault injection, the
ordering model. Test files import from here, never from each other."""

from __future__ import annotations

import contextlib
import importlib.util
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import strategies as st

import aiotinyrt as rt
from aiotinyrt import Buffer, BufferSpec, Device, Program, Signal, dtypes, native
from aiotinyrt.dtype import ALL_DTYPES, DType
from aiotinyrt.kernel import (
    BufferParam,
    ClangRenderer,
    IntParam,
    Kernel,
)

#: Spins until flag[0] != 0 (gives up after 30 s so a failing test cannot hang the suite), then
#: writes ``value`` to out[0]. Launch it with ``writes=(1,)``: it only reads the flag.
GATE = """
#include <time.h>
void gate(volatile int* restrict flag, int* restrict out, int value) {
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (!flag[0]) {
    clock_gettime(CLOCK_MONOTONIC, &t);
    if (t.tv_sec - t0.tv_sec > 30) break;
  }
  out[0] = value;
}
"""


#: Busy-waits ``ms`` milliseconds of wall time, then increments out[0].
SPIN = """
#include <time.h>
void spin(int* restrict out, int ms) {
  struct timespec t0, t;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  do {
    clock_gettime(CLOCK_MONOTONIC, &t);
  } while ((t.tv_sec - t0.tv_sec) * 1000000000LL + (t.tv_nsec - t0.tv_nsec) < ms * 1000000LL);
  out[0] += 1;
}
"""


#: Writes CLOCK_MONOTONIC (the clock of Python's time.monotonic()) in seconds to out[0].
STAMP = """
#include <time.h>
void stamp(double* restrict out) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  out[0] = (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}
"""


#: Increments out[0]: launches on one queue are observable in order by the final count.
INC = "void inc(int* restrict out) { out[0] += 1; }"


class Gate:
    """A flag in CPU memory the test flips through a zero-copy host view, and the gate kernel."""

    def __init__(self, prog: Program, flag: Buffer, view: memoryview) -> None:
        self.prog = prog
        self.flag = flag
        self.view = view

    def launch(self, out: Buffer, value: int = 42, **kwargs: Any) -> Signal:
        """Enqueue a launch that holds its queue until :meth:`open`, then writes ``value`` to out[0]."""
        return self.prog(self.flag, out, vals=(value,), writes=(1,), **kwargs)

    def open(self) -> None:
        self.view.cast("i")[0] = 1


@contextlib.asynccontextmanager
async def gate_on(device: str) -> AsyncIterator[Gate]:
    """A :class:`Gate` for a CPU device; always opened on exit so nothing stays blocked."""
    prog = await Device[device].program("gate", GATE)
    flag = await Buffer(device, 1, dtypes.int32).allocate()
    await flag.copyin(np.zeros(1, np.int32))
    gate = Gate(prog, flag, await flag.as_memoryview())
    try:
        yield gate
    finally:
        gate.open()
        await flag.free()


def cl_ring(without: str) -> tuple[Any, Any, Any]:
    """CL, its compute queue (a DriverQueue) and that queue's driver (a CLQueue), skipped where
    the queue has no native completion ring (``NATIVE_QUEUE=0``: no ``without``)."""
    from aiotinyrt.backends.cl_queue import CLQueue
    from aiotinyrt.backends.ops_cl import CLDevice

    dev = Device["CL"]
    assert isinstance(dev, CLDevice)
    queue = dev._compute_queue
    driver = queue.driver
    assert isinstance(driver, CLQueue)
    if driver._ring is None:
        pytest.skip(f"NATIVE_QUEUE=0: no completion ring, so no {without}")
    return dev, queue, driver


async def seen_done(sig: Signal, seconds: float = 20) -> bool:
    """Whether ``sig`` is seen done within ``seconds``, its ``done()`` polled every millisecond
    from a worker thread, as a caller without an await polls it (no waiter registered on its
    timeline, which would wake a driver's waiter thread itself)."""

    def poll() -> bool:
        deadline = time.monotonic() + seconds
        while not sig.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        return sig.done()

    return await anyio.to_thread.run_sync(poll)


async def direct_launch(dev: Any, driver: Any, gate_us: int) -> tuple[Program, Buffer, Signal]:
    """On CL ``dev`` with the compute queue's ``driver``: an ``out[0] += 1`` program, a zeroed
    int, and a launch of it made right after a launch round trip (two made and awaited, the
    second with batches held ``gate_us``), which goes to the device at once with a claim of its
    own (aiotinyrt/native/clq.c, "Gates"); checked: no batch held, one claim counted."""
    prog = await dev.program("inc", "__kernel void inc(__global int* out) { out[0] += 1; }")
    out = await int_buffer(dev.name)
    await prog(out)  # (the program's repeat launch made)
    driver.gate(gate_us)
    await prog(out)
    direct = prog(out)
    assert not driver.gated() and driver._native.clq_claims(driver._ring) == 1
    return prog, out, direct


async def int_buffer(device: str, value: int = 0, size: int = 1) -> Buffer:
    """An allocated int32 buffer filled with ``value``."""
    buf = await Buffer(device, size, dtypes.int32).allocate()
    await buf.copyin(np.full(size, value, np.int32))
    return buf


async def assert_cancelled_at_entry(call: Callable[[], Awaitable[object]]) -> None:
    """The checkpoint rule: inside an already-cancelled scope the coroutine raises Cancelled and
    the code after it does not run."""
    reached = False
    with anyio.CancelScope() as scope:
        scope.cancel()
        await call()
        reached = True
    assert not reached, "the coroutine returned normally inside a cancelled scope"
    assert scope.cancelled_caught


def fail_command(device: rt.Compiled) -> Signal:
    """Submit a raw command that raises on the device's compute queue."""

    def boom() -> None:
        raise ValueError("boom from the test")

    return device._compute_queue.submit(boom, ())


FAULTY = "CPU:5"  # a device of its own: faults injected here must not leak into others


def inject_failure(device: rt.Compiled, queue: str = "compute") -> Signal:
    """Submit a command that raises ``OSError`` on one of the device's queues."""

    def boom() -> None:
        raise OSError(5, "injected device fault")

    return device.queues[queue].submit(boom, ())


ORDER_DEVICES = ("CPU", "CPU:1")


#: Spins until flag[0] != 0 (gives up after 20 s so a broken runtime cannot hang the suite), then
#: out[i] = in[i] + add for i < n. Launch it with ``writes=(1,)``: it reads the flag and ``in``.
COPY_GATE = r"""
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


class CopyGate:
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
async def copy_gate_on(device: str) -> AsyncIterator[CopyGate]:
    """A closed :class:`CopyGate` on a CPU device; opened on exit, which waits (shielded) for the
    launches so the host flag outlives them."""
    prog = await Device[device].program("gate", COPY_GATE)
    host: IntArray = np.zeros(16, np.int32)
    flag = await Buffer(device, 1, dtypes.int32, BufferSpec(external_ptr=host.ctypes.data)).allocate()
    gate = CopyGate(device, prog, host, flag)
    try:
        yield gate
    finally:
        gate.open()
        with anyio.CancelScope(shield=True):
            for sig in gate.launched:
                with contextlib.suppress(RuntimeError):  # failed, or captured into a graph
                    await sig
            await flag.free()


async def int_array_buffer(device: str, values: object, size: int | None = None) -> Buffer:
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


N = 24  #: elements in each base buffer


BASES = tuple((dev, b) for dev in ORDER_DEVICES for b in range(2))  #: two base buffers per device


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
        dev = draw(st.sampled_from(ORDER_DEVICES))
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


def c_replay_or_skip() -> None:
    if native.replayer() is None:
        pytest.skip(
            "the C launch and replay are part of the extension module, built only with Python's headers"
        )


STEP_CPU = "void step3(unsigned int* t, int j) { t[0] = t[0] * 3u + (unsigned int)j; }"


STEP_CPU1 = "void step5(unsigned int* t, int j) { t[0] = t[0] * 5u + (unsigned int)j; }"


CHAIN_DEVICES = ("CPU", "CPU:1")


def model(launches: int) -> int:
    t = 0
    for j in range(launches):
        t = (t * (3 if j % 2 == 0 else 5) + j) & 0xFFFFFFFF
    return t


async def chain(
    progs: tuple[Program, Program],
    launches: int,
    wait_every: int,
    cancel_fraction: float,
    rng: random.Random,
    counts: dict[str, int],
) -> None:
    """One task: a chain of ``launches`` launches alternating between the two devices."""
    word = np.zeros(1, np.uint32)
    addr = word.ctypes.data
    bufs = [
        await Buffer(d, 1, dtypes.uint32, BufferSpec(external_ptr=addr)).allocate() for d in CHAIN_DEVICES
    ]
    prev: list[Signal] = []
    for j in range(launches):
        sig = progs[j % 2](bufs[j % 2], vals=(j,), wait_for=prev)
        prev = [sig]
        if j % wait_every == wait_every - 1:
            if rng.random() < cancel_fraction:
                with anyio.move_on_after(rng.uniform(0, 2e-4)) as scope:
                    await sig
                counts["armed"] += 1
                counts["cancelled"] += scope.cancelled_caught
            else:
                await sig
            counts["waits"] += 1
    await prev[-1]
    counts["waits"] += 1
    for buf in bufs:
        await buf.free()
    assert int(word[0]) == model(launches), "a cross-device chain ran out of order"


#: The event loops and queue workers the subprocess tests run under (``NATIVE_QUEUE=0``: python).
LOOPS = ["asyncio", "trio"] + (["uvloop"] if importlib.util.find_spec("uvloop") is not None else [])
WORKERS = ["native", "python"]


# ---- the renderer suite's kernels and their CPU runner (also run on CL) ----


NDArray = Any  # numpy arrays (numpy is an optional test dependency)


def f32(name: str, access: str = "r") -> BufferParam:
    return BufferParam(name, dtypes.float32, access)  # type: ignore[arg-type]


SAXPY = Kernel(
    "saxpy",
    [f32("out", "w"), f32("x"), f32("y"), IntParam("a")],
    "out[gidx0] = a * x[gidx0] + y[gidx0];",
)


def _np_dtype(dt: DType) -> Any:
    return np.dtype(np.uint16) if dt == dtypes.bfloat16 else np.dtype(dt.fmt)


async def run_cpu(
    kernel: Kernel,
    global_size: Sequence[int],
    arrays: Sequence[NDArray],
    vals: Sequence[int] = (),
    *,
    core_count: int = 1,
    core_ids: Sequence[int] | None = None,
) -> list[NDArray]:
    """Render for the CPU, load it as raw C with ``dev.program(name, src)`` and launch chunk
    ``core_id`` of ``core_count`` for each id in ``core_ids`` (default: all, one after another);
    return every buffer's contents."""
    dev = Device["CPU"]
    prog = await dev.program(kernel.name, ClangRenderer().render(kernel))
    bufs = []
    for param, array in zip(kernel.buffers, arrays, strict=True):
        assert array.dtype == _np_dtype(param.dtype)
        buf = await Buffer("CPU", array.size, param.dtype).allocate()
        await buf.copyin(np.ascontiguousarray(array))
        bufs.append(buf)
    launch = kernel.launch_vals(vals, global_size)
    for core_id in range(core_count) if core_ids is None else core_ids:
        prog(*bufs, vals=(*launch, core_id, core_count), writes=kernel.writes)
    outs = []
    for buf, array in zip(bufs, arrays, strict=True):
        out = np.empty_like(array)
        await buf.copyout(out)
        outs.append(out)
        await buf.free()
    return outs


def bf16_to_f32(bits: NDArray) -> NDArray:
    """bfloat16 bits (any unsigned int array) -> float32 values."""
    result: NDArray = (bits.astype(np.uint32) << 16).view(np.float32)
    return result


def bf16_reference(x: NDArray) -> NDArray:
    """float32 -> bfloat16 bits, round to nearest even, computed independently of the kernels'
    bit trick: pick the nearer of the two bfloat16 neighbours in float64, ties to the even one."""
    x = np.asarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    down = (bits >> 16).astype(np.uint32)
    up = down + 1
    with np.errstate(invalid="ignore", over="ignore"):
        d_down = np.abs(x.astype(np.float64) - bf16_to_f32(down).astype(np.float64))
        d_up = np.abs(bf16_to_f32(up).astype(np.float64) - x.astype(np.float64))
    pick_up = (d_up < d_down) | ((d_up == d_down) & (down % 2 == 1))
    out = np.where(pick_up, up, down).astype(np.uint16)
    finite = np.isfinite(x)
    # overflow past the largest finite bfloat16 rounds to infinity, which is the "up" neighbour
    big = finite & (np.abs(x) > np.float32(3.3961776e38))
    out[big] = np.where(x[big] > 0, 0x7F80, 0xFF80)
    out[np.isinf(x)] = (bits[np.isinf(x)] >> 16).astype(np.uint16)
    return out


SPECIAL_F32 = np.array(
    [0.0, -0.0, 1.0, -1.5, 3.14159265, 65504.0, 65520.0, 1e-8, 6e-5, 1e30, -1e38, 3.4e38, np.inf, -np.inf]
    + [
        float(np.uint32(b).view(np.float32))
        for b in (0x3F808000, 0x3F818000, 0x3F80FFFF, 0x00000001, 0x7F7FFFFF)
    ],
    dtype=np.float32,
)


CONVERT = Kernel(
    "convert16",
    [
        f32("x"),
        BufferParam("h", dtypes.float16, "rw"),
        BufferParam("b", dtypes.bfloat16, "rw"),
        f32("back", "w"),
    ],
    "h[gidx0] = x[gidx0]; b[gidx0] = x[gidx0]; back[gidx0] = h[gidx0] + b[gidx0] * 0.0f;",
)


def _every_dtype_kernel() -> Kernel:
    params: list[BufferParam | IntParam] = []
    lines = []
    for dt in ALL_DTYPES:
        params += [BufferParam(f"a_{dt.name}", dt), BufferParam(f"o_{dt.name}", dt, "w")]
        lines.append(f"o_{dt.name}[gidx0] = a_{dt.name}[gidx0] + a_{dt.name}[gidx0 + 1];")
    return Kernel("every_dtype", params, "\n".join(lines))


EVERY_DTYPE = _every_dtype_kernel()


def _every_dtype_inputs(n: int) -> list[NDArray]:
    rng = np.random.default_rng(7)
    arrays = []
    for dt in ALL_DTYPES:
        if dt == dtypes.bool:
            a = rng.integers(0, 2, n + 1).astype(np.bool_)
        elif dt.is_int:
            assert dt.fmt is not None
            info = np.iinfo(dt.fmt)
            a = rng.integers(info.min, info.max, n + 1, dtype=dt.fmt, endpoint=True)
        elif dt == dtypes.bfloat16:
            a = bf16_reference(rng.standard_normal(n + 1).astype(np.float32) * 100)
        else:
            a = (rng.standard_normal(n + 1) * 100).astype(dt.fmt)
        arrays += [a, np.zeros(n + 1, _np_dtype(dt))]
    return arrays


MATMUL = Kernel(
    "matmul",
    [f32("c", "w"), f32("a"), f32("b"), IntParam("K")],
    """
    // c[M, N] = a[M, K] @ b[K, N]; gidx1 is the row, gidx0 the column, gsz0 = N
    float32 acc = 0.0f;
    for (int k = 0; k < K; k++) {
      acc += a[gidx1 * K + k] * b[k * gsz0 + gidx0];
    }
    c[gidx1 * gsz0 + gidx0] = acc;
    """,
)


GRID = Kernel(
    "grid",
    [BufferParam("o", dtypes.int32, "w")],
    "o[(gidx2 * gsz1 + gidx1) * gsz0 + gidx0] = gidx0 + 100 * gidx1 + 10000 * gidx2 + 1;",
)


INTEGER_OPS = Kernel(
    "integer_ops",
    [
        BufferParam("o", dtypes.int64, "w"),
        BufferParam("u", dtypes.uint32, "w"),
        BufferParam("a", dtypes.int32),
    ],
    """
    int32 v = a[gidx0];
    int64 acc = 0;
    if (v % 3 == 0) { acc = v * 4294967296ll; } else if (v < 0) { acc = -v; } else { acc = v >> 1; }
    acc += min(v, 5) + max(v, -5) * 2 + abs(v - 10);
    acc ^= (v & 0xF0) | (v << 2);
    acc += v > 3 && v <= 20 ? 1000 : -1000;
    o[gidx0] = acc;
    u[gidx0] = (uint32)v * 2654435761u >> 7;
    """,
)


MATH = Kernel(
    "math_funcs",
    [BufferParam("o", dtypes.float32, "w"), BufferParam("d", dtypes.float64, "w"), f32("x")],
    """
    float v = x[gidx0];
    int base = gidx0 * 8;
    o[base + 0] = sqrt(fabs(v));
    o[base + 1] = exp(v / 4.0f);
    o[base + 2] = log(fabs(v) + 1.0f);
    o[base + 3] = sin(v) + cos(v) + tanh(v);
    o[base + 4] = floor(v) + ceil(v) * 10.0f + trunc(v) * 100.0f + round(v) * 1000.0f;
    o[base + 5] = pow(fabs(v), 1.5f) + exp2(v / 8.0f) + log2(fabs(v) + 2.0f);
    o[base + 6] = fmin(v, 0.5f) + fmax(v, -0.5f) + tan(v / 10.0f);
    o[base + 7] = (float)(int)v;
    d[gidx0] = sqrt((double)fabs(v)) + exp((double)v / 4.0);
    """,
)


@dataclass
class Case:
    """A kernel with inputs, run on every backend that is here and compared."""

    kernel: Kernel
    global_size: tuple[int, int, int]
    make_inputs: Callable[[], list[NDArray]]
    vals: tuple[int, ...] = ()
    exact: bool = True  # bit-exact across backends, else close (float math libraries differ)


def _cases() -> list[Case]:
    rng = np.random.default_rng(3)
    x = rng.standard_normal(64).astype(np.float32)
    a_mm, b_mm = (
        rng.standard_normal((9, 7)).astype(np.float32),
        rng.standard_normal((7, 11)).astype(np.float32),
    )
    n = 33
    return [
        Case(SAXPY, (64, 1, 1), lambda: [np.zeros(64, np.float32), x, x * 2], (3,), exact=False),
        Case(
            MATMUL,
            (11, 9, 1),
            lambda: [np.zeros(99, np.float32), a_mm.ravel(), b_mm.ravel()],
            (7,),
            exact=False,
        ),
        Case(GRID, (5, 4, 3), lambda: [np.zeros(60, np.int32)]),
        Case(
            INTEGER_OPS,
            (81, 1, 1),
            lambda: [np.zeros(81, np.int64), np.zeros(81, np.uint32), np.arange(-40, 41, dtype=np.int32)],
        ),
        Case(
            MATH,
            (53, 1, 1),
            lambda: [
                np.zeros(53 * 8, np.float32),
                np.zeros(53, np.float64),
                np.linspace(-6.5, 6.5, 53).astype(np.float32),
            ],
            exact=False,
        ),
        Case(
            CONVERT,
            (SPECIAL_F32.size, 1, 1),
            lambda: [
                SPECIAL_F32,
                np.zeros(SPECIAL_F32.size, np.float16),
                np.zeros(SPECIAL_F32.size, np.uint16),
                np.zeros(SPECIAL_F32.size, np.float32),
            ],
        ),
        Case(EVERY_DTYPE, (n, 1, 1), lambda: _every_dtype_inputs(n)),
    ]


CASES = _cases()


def loop_name(anyio_backend: Any) -> str:
    """The event loop an ``anyio_backend`` parameter names: asyncio, trio or uvloop."""
    name, options = anyio_backend
    return "uvloop" if options.get("use_uvloop") else str(name)


async def filled_buffer(device: str, values: np.ndarray[Any, Any]) -> Buffer:
    """A buffer on ``device`` of ``values``' size and dtype, holding them."""
    buf = await Buffer(device, values.size, dtypes.from_name(str(values.dtype))).allocate()
    await buf.copyin(values)
    return buf
