"""The bad-input catalogue: wrong calls across the public API, each with the exception type and a
fragment of the message it must produce, and none of them may enqueue anything.

"Nothing enqueued" is checked, not assumed: around every call the test snapshots every queue's
``submitted`` counter and every allocator's statistics of every opened device (and the set of
opened devices), and they must be unchanged afterwards, with no device left in an error state.
"""

from __future__ import annotations

import inspect
import re
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aiotinyrt as rt
from aiotinyrt import (
    Buffer,
    BufferSpec,
    CompileError,
    Device,
    DeviceError,
    Program,
    Signal,
    dtypes,
)
from aiotinyrt.graph import Graph

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parent.parent

#: Two buffers and one int: ``out[i] = a[i] * 2`` for i < n.
TWICE = (
    "void twice(float* restrict out, const float* restrict a, int n) "
    "{ for (int i = 0; i < n; i++) out[i] = a[i] * 2; }"
)
N = 16
F32 = dtypes.float32


@dataclass
class Ctx:
    """Everything the wrong calls are made with, set up (and settled) before each one."""

    cpu: rt.Compiled
    cpu1: rt.Compiled
    null: rt.Compiled
    prog: Program
    a: Buffer
    b: Buffer
    c1: Buffer  # on CPU:1
    nb: Buffer  # on NULL
    bf16: Buffer
    view: Buffer  # 4 floats of a
    freed: Buffer
    unallocated: Buffer
    handle: Any  # a raw CPU allocation of 64 bytes
    null_handle: Any
    graph: Graph  # one launch of prog, input "x" = a
    closed: rt.Compiled
    closed_prog: Program
    closed_buf: Buffer
    dropped: Signal  # a command dropped when its device was shut down


@pytest.fixture
async def ctx() -> AsyncIterator[Ctx]:
    cpu, cpu1, null = Device["CPU"], Device["CPU:1"], Device["NULL"]
    prog = await cpu.program("twice", TWICE)
    a = await Buffer("CPU", N, F32).allocate()
    b = await Buffer("CPU", N, F32).allocate()
    await a.copyin(np.arange(N, dtype=np.float32))
    await b.copyin(np.ones(N, np.float32))
    c1 = await Buffer("CPU:1", N, F32).allocate()
    nb = await Buffer("NULL", N, F32).allocate()
    bf16 = await Buffer("CPU", N, dtypes.bfloat16).allocate()
    freed = await Buffer("CPU", N, F32).allocate()
    await freed.free()
    handle = await cpu.allocator.alloc(64)
    null_handle = await null.allocator.alloc(64)
    async with cpu.capture(x=a) as graph:
        prog(b, a, vals=(N,))

    closed = Device["NULL:3"]
    closed_prog = await closed.program("k", "k")
    closed_buf = await Buffer("NULL:3", N, F32).allocate()
    await closed.aclose()

    # a command dropped at shutdown (what interpreter exit does with queued work)
    doomed = Device["NULL:4"]
    release = threading.Event()
    doomed._compute_queue.submit(release.wait, (10,))
    dropped = doomed._compute_queue.submit(lambda: None, ())
    doomed._shutdown(drop_queued=True, join_timeout=0)
    release.set()

    await rt.synchronize(cpu, cpu1, null)
    yield Ctx(
        cpu, cpu1, null, prog, a, b, c1, nb, bf16, a.view(4, F32, 8), freed,
        Buffer("CPU", N, F32), handle, null_handle, graph, closed, closed_prog, closed_buf, dropped,
    )  # fmt: skip
    for buf in (a, b, c1, nb, bf16):
        await buf.free()
    await cpu.allocator.free(handle, 64)
    await null.allocator.free(null_handle, 64)
    await rt.synchronize(cpu, cpu1, null)


Call = Callable[[Ctx], object]


def bad(value: object) -> Any:
    """A wrong-typed argument, passed on purpose (typed Any so the table needs no ignores)."""
    return value


#: (id, the wrong call, the exception it raises, a fragment of its message)
CASES: list[tuple[str, Call, type[BaseException], str]] = [
    # ---- devices
    ("device: unknown backend", lambda c: Device["TPU"], ValueError, "unknown device backend 'TPU'"),
    ("device: index not a number", lambda c: Device["CPU:x"], ValueError, "must be a device index"),
    ("device: empty name", lambda c: Device[""], ValueError, "empty device name"),
    ("device: name not a str", lambda c: Device[bad(1)], TypeError, "device name must be a str"),
    (
        "open_device: unknown",
        lambda c: rt.open_device("NOPE").__aenter__(),
        ValueError,
        "unknown device backend",
    ),
    ("synchronize: unknown device", lambda c: rt.synchronize("NOPE"), ValueError, "unknown device backend"),
    ("dtype: unknown name", lambda c: dtypes.from_name("float33"), ValueError, "unknown dtype 'float33'"),
    # ---- Buffer construction and BufferSpec
    ("Buffer: zero size", lambda c: Buffer("CPU", 0, F32), ValueError, "size must be positive"),
    ("Buffer: negative size", lambda c: Buffer("CPU", -3, F32), ValueError, "size must be positive"),
    ("Buffer: float size", lambda c: Buffer("CPU", bad(2.0), F32), TypeError, "int number of elements"),
    ("Buffer: dtype as str", lambda c: Buffer("CPU", 4, bad("float32")), TypeError, "must be a DType"),
    ("Buffer: numpy dtype", lambda c: Buffer("CPU", 4, bad(np.float32)), TypeError, "must be a DType"),
    (
        "Buffer: options as dict",
        lambda c: Buffer("CPU", 4, F32, bad({"nolru": True})),
        TypeError,
        "BufferSpec or None",
    ),
    (
        "Buffer: unknown device",
        lambda c: Buffer("TPU", 4, F32).allocate(),
        ValueError,
        "unknown device backend",
    ),
    (
        "BufferSpec: int flag",
        lambda c: BufferSpec(nolru=bad(1)),
        TypeError,
        "BufferSpec.nolru must be a bool",
    ),
    (
        "BufferSpec: negative pointer",
        lambda c: BufferSpec(external_ptr=-1),
        ValueError,
        "positive int address",
    ),
    (
        "BufferSpec: float pointer",
        lambda c: BufferSpec(external_ptr=bad(4096.0)),
        ValueError,
        "positive int address",
    ),
    # ---- raw allocator
    ("alloc: zero bytes", lambda c: c.cpu.allocator.alloc(0), ValueError, "size must be positive"),
    ("alloc: negative bytes", lambda c: c.cpu.allocator.alloc(-64), ValueError, "size must be positive"),
    ("alloc: float bytes", lambda c: c.cpu.allocator.alloc(bad(64.0)), TypeError, "int number of bytes"),
    (
        "alloc: options as str",
        lambda c: c.cpu.allocator.alloc(64, bad("nolru")),
        TypeError,
        "BufferSpec or None",
    ),
    ("alloc: on a closed device", lambda c: c.closed.allocator.alloc(64), DeviceError, "closed"),
    ("free: zero bytes", lambda c: c.cpu.allocator.free(c.handle, 0), ValueError, "size must be positive"),
    (
        "copyin: empty source",
        lambda c: c.cpu.allocator.copyin(c.handle, memoryview(b"")),
        ValueError,
        "copyin of 0 bytes",
    ),
    (
        "copyin: not a buffer",
        lambda c: c.cpu.allocator.copyin(c.handle, bad("text")),
        TypeError,
        "buffer protocol",
    ),
    (
        "copyin: more bytes than allocated",
        lambda c: c.cpu.allocator.copyin(c.handle, memoryview(bytes(128))),
        ValueError,
        "128 bytes",
    ),
    (
        "copyout: read-only destination",
        lambda c: c.cpu.allocator.copyout(memoryview(bytes(64)), c.handle),
        ValueError,
        "read-only",
    ),
    (
        "copyout: raw NULL memory",
        lambda c: c.null.allocator.copyout(memoryview(bytearray(64)), c.null_handle),
        RuntimeError,
        "holds no data",
    ),
    (
        "transfer: zero bytes",
        lambda c: c.cpu.allocator.transfer(c.handle, c.handle, 0, c.cpu),
        ValueError,
        "size must be positive",
    ),
    # ---- Buffer lifetime
    ("allocate: twice", lambda c: c.a.allocate(), RuntimeError, "already allocated"),
    ("allocate: after free", lambda c: c.freed.allocate(), RuntimeError, "was freed"),
    ("allocate: a view", lambda c: c.view.allocate(), ValueError, "shares its base's memory"),
    ("free: twice", lambda c: c.freed.free(), RuntimeError, "double free"),
    ("free: never allocated", lambda c: c.unallocated.free(), RuntimeError, "never allocated"),
    # ---- Buffer copies
    ("copyin: wrong size", lambda c: c.a.copyin(np.zeros(N - 1, np.float32)), ValueError, "has 60 bytes but"),
    (
        "copyin: non-contiguous",
        lambda c: c.a.copyin(np.zeros(2 * N, np.float32)[::2]),
        ValueError,
        "C-contiguous",
    ),
    ("copyin: a float", lambda c: c.a.copyin(3.5), TypeError, "buffer protocol"),
    ("copyin: unallocated", lambda c: c.unallocated.copyin(bytes(64)), RuntimeError, "not allocated"),
    ("copyin: freed", lambda c: c.freed.copyin(bytes(64)), RuntimeError, "use after free"),
    ("copyin: buffer of a closed device", lambda c: c.closed_buf.copyin(bytes(64)), DeviceError, "closed"),
    ("copyout: read-only", lambda c: c.a.copyout(bytes(64)), ValueError, "read-only"),
    ("copyout: wrong size", lambda c: c.a.copyout(bytearray(32)), ValueError, "has 32 bytes but"),
    ("copyout: a NULL buffer", lambda c: c.nb.copyout(bytearray(64)), RuntimeError, "holds no data"),
    ("numpy: freed", lambda c: c.freed.numpy(), RuntimeError, "use after free"),
    ("numpy: bfloat16", lambda c: c.bf16.numpy(), TypeError, "no numpy equivalent"),
    ("copy_from: size mismatch", lambda c: c.a.copy_from(c.view), ValueError, "size mismatch"),
    (
        "copy_from: not a Buffer",
        lambda c: c.a.copy_from(bad(np.zeros(N, np.float32))),
        TypeError,
        "needs a Buffer",
    ),
    ("copy_from: NULL into CPU", lambda c: c.a.copy_from(c.nb), RuntimeError, "holds no data"),
    ("copy_from: freed source", lambda c: c.b.copy_from(c.freed), RuntimeError, "use after free"),
    # ---- views
    ("view: too big", lambda c: c.a.view(N + 1, F32), ValueError, "does not fit"),
    ("view: offset past the end", lambda c: c.a.view(1, F32, 64), ValueError, "does not fit"),
    ("view: negative offset", lambda c: c.a.view(1, F32, -4), ValueError, "offset non-negative"),
    ("view: zero size", lambda c: c.a.view(0, F32), ValueError, "view size must be positive"),
    ("view: float offset", lambda c: c.a.view(1, F32, bad(4.0)), TypeError, "must be ints"),
    ("view: dtype as str", lambda c: c.a.view(1, bad("f")), TypeError, "must be a DType"),
    ("view: of a freed buffer", lambda c: c.freed.view(1, F32), RuntimeError, "view of freed"),
    # ---- launches
    ("launch: freed buffer", lambda c: c.prog(c.freed, c.b, vals=(N,)), RuntimeError, "use after free"),
    (
        "launch: unallocated buffer",
        lambda c: c.prog(c.unallocated, c.b, vals=(N,)),
        RuntimeError,
        "not allocated",
    ),
    (
        "launch: another device's buffer",
        lambda c: c.prog(c.c1, c.b, vals=(N,)),
        ValueError,
        "move it with copy_from",
    ),
    ("launch: NULL buffer on CPU", lambda c: c.prog(c.a, c.nb, vals=(N,)), ValueError, "is on NULL, not CPU"),
    ("launch: numpy array", lambda c: c.prog(bad(np.zeros(N)), c.b, vals=(N,)), TypeError, "must be Buffers"),
    (
        "launch: too many buffers",
        lambda c: c.prog(c.a, c.b, c.a, vals=(N,)),
        TypeError,
        "takes 2 buffers, got 3",
    ),
    ("launch: too few buffers", lambda c: c.prog(c.a, vals=(N,)), TypeError, "takes 2 buffers, got 1"),
    ("launch: missing val", lambda c: c.prog(c.a, c.b), TypeError, "takes 1 int vals, got 0"),
    ("launch: too many vals", lambda c: c.prog(c.a, c.b, vals=(N, 1)), TypeError, "takes 1 int vals, got 2"),
    ("launch: float val", lambda c: c.prog(c.a, c.b, vals=(bad(16.0),)), TypeError, "vals must be ints"),
    ("launch: bool val", lambda c: c.prog(c.a, c.b, vals=(True,)), TypeError, "vals must be ints"),
    (
        "launch: val over 32 bits",
        lambda c: c.prog(c.a, c.b, vals=(2**31,)),
        ValueError,
        "does not fit in a 32-bit int",
    ),
    (
        "launch: vals as str",
        lambda c: c.prog(c.a, c.b, vals=bad("1")),
        TypeError,
        "vals must be a sequence of ints",
    ),
    (
        "launch: zero global size",
        lambda c: c.prog(c.a, c.b, vals=(N,), global_size=(0, 1, 1)),
        ValueError,
        "positive in every dimension",
    ),
    (
        "launch: 4-d global size",
        lambda c: c.prog(c.a, c.b, vals=(N,), global_size=(1, 1, 1, 1)),
        ValueError,
        "1 to 3 dimensions",
    ),
    (
        "launch: int global size",
        lambda c: c.prog(c.a, c.b, vals=(N,), global_size=bad(4)),
        TypeError,
        "sequence of 1 to 3 ints",
    ),
    (
        "launch: float local size",
        lambda c: c.prog(c.a, c.b, vals=(N,), local_size=(bad(2.0),)),
        TypeError,
        "must hold ints",
    ),
    (
        "launch: wait_for a float",
        lambda c: c.prog(c.a, c.b, vals=(N,), wait_for=[bad(0.5)]),
        TypeError,
        "must hold Signals",
    ),
    (
        "launch: writes out of range",
        lambda c: c.prog(c.a, c.b, vals=(N,), writes=(2,)),
        ValueError,
        "not a buffer index",
    ),
    (
        "launch: writes as str",
        lambda c: c.prog(c.a, c.b, vals=(N,), writes=bad("0")),
        TypeError,
        "writes= must be a sequence",
    ),
    ("launch: on a closed device", lambda c: c.closed_prog(c.closed_buf), DeviceError, "closed"),
    ("run: not a Program", lambda c: c.cpu.run(bad(print)), TypeError, "needs a Program"),
    (
        "run: another device's Program",
        lambda c: c.cpu1.run(c.prog, c.c1, c.c1, vals=(N,)),
        ValueError,
        "belongs to CPU",
    ),
    # ---- programs and compiling
    (
        "runtime: name not an identifier",
        lambda c: c.cpu.runtime("not a name", c.prog.lib),
        ValueError,
        "C identifier",
    ),
    ("runtime: empty binary", lambda c: c.cpu.runtime("twice", b""), ValueError, "is empty"),
    ("runtime: binary as str", lambda c: c.cpu.runtime("twice", bad("lib")), TypeError, "must be bytes"),
    (
        "runtime: missing symbol",
        lambda c: c.cpu.runtime("nosuch", c.prog.lib),
        ValueError,
        "no function named 'nosuch'",
    ),
    ("program: on a closed device", lambda c: c.closed.program("k", "k"), DeviceError, "closed"),
    (
        "compile: bytes source",
        lambda c: c.cpu.compiler.compile_cached(bad(b"void k(void) {}")),
        TypeError,
        "must be a str",
    ),
    ("compile: not C", lambda c: c.cpu.program("k", "this is not C;"), CompileError, "error"),
    # ---- signals of a closed device, graphs
    (
        "await: a command dropped at shutdown",
        lambda c: c.dropped,
        DeviceError,
        "closed before this command ran",
    ),
    ("replay: unknown input", lambda c: c.graph.replay(y=c.a), KeyError, "no input named 'y'"),
    ("replay: wrong size", lambda c: c.graph.replay(x=c.view), ValueError, "must have 64 bytes"),
    ("replay: wrong device", lambda c: c.graph.replay(x=c.c1), ValueError, "must be on CPU"),
    ("replay: freed buffer", lambda c: c.graph.replay(x=c.freed), RuntimeError, "use after free"),
    ("replay: unallocated buffer", lambda c: c.graph.replay(x=c.unallocated), RuntimeError, "not allocated"),
    (
        "replay: numpy array",
        lambda c: c.graph.replay(x=bad(np.zeros(N, np.float32))),
        TypeError,
        "must be a Buffer",
    ),
]


def snapshot() -> dict[str, Any]:
    """Everything a wrong call must leave unchanged."""
    return {
        dev.name: (
            [tl.submitted for tl in dev.timelines],
            [tl.completed for tl in dev.timelines],
            dev.allocator.statistics(),
            dev._error,
        )
        for dev in Device.opened()
    }


@pytest.mark.slow
@pytest.mark.parametrize(("call", "exc", "fragment"), [pytest.param(*case[1:], id=case[0]) for case in CASES])
async def test_wrong_call_raises_before_enqueueing_anything(
    ctx: Ctx, call: Call, exc: type[BaseException], fragment: str
) -> None:
    before = snapshot()
    try:
        with pytest.raises(exc, match=re.escape(fragment)):
            result = call(ctx)
            if inspect.isawaitable(result):
                await result
        assert snapshot() == before
    finally:  # a call that did reach a device must not poison the cases after it
        for dev in Device.opened():
            if dev._error is not None:
                await dev.reset()


def test_the_catalogue_has_at_least_30_distinct_wrong_calls() -> None:
    ids = [case[0] for case in CASES]
    assert len(set(ids)) == len(ids)
    assert len(ids) >= 30


TRANSFER_SCRIPT = """
import anyio
from aiotinyrt import Device

async def main() -> None:
    cpu, cpu1 = Device["CPU"], Device["CPU:1"]
    small, big = await cpu.allocator.alloc(4096), await cpu1.allocator.alloc(1 << 24)
    for what, call in [
        ("source too small", lambda: cpu1.allocator.transfer(big, small, 1 << 24, cpu)),
        ("destination too small", lambda: cpu.allocator.transfer(small, big, 1 << 24, cpu1)),
    ]:
        before = [tl.submitted for d in (cpu, cpu1) for tl in d.timelines]
        try:
            await call()
            print(what, "copied")
        except ValueError as exc:
            print(what, "ValueError", exc)
        assert [tl.submitted for d in (cpu, cpu1) for tl in d.timelines] == before, "enqueued"

anyio.run(main)
"""


def test_raw_transfer_of_more_bytes_than_allocated_is_refused_not_a_crash() -> None:
    """``Allocator.transfer`` takes a byte count from the caller: more than either allocation
    holds must be a ``ValueError`` before enqueueing, not a memcpy past the end of the mapping
    (run in a subprocess: the failure mode is a segfault)."""
    result = subprocess.run(
        [sys.executable, "-c", TRANSFER_SCRIPT], capture_output=True, text=True, timeout=60, cwd=ROOT
    )
    assert result.returncode == 0, f"exit status {result.returncode} (-11: segfault) {result.stderr}"
    lines = result.stdout.splitlines()
    assert [line.split(" ValueError")[0] for line in lines] == ["source too small", "destination too small"]
    assert all("bytes" in line for line in lines)
