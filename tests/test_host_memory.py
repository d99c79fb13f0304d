"""Host memory handed to a copy belongs to that copy until it ran; host memory holding object
references is refused.

Each test runs on both workers: a device whose queues run in the C ring and one whose queues run
on the pure-Python worker (as with ``NATIVE_QUEUE=0``).
"""

from __future__ import annotations

import ctypes
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import anyio.lowlevel
import numpy as np
import pytest

import aiotinyrt as rt
from aiotinyrt import Buffer, Device, dtypes, native
from tests.helpers import gate_on

pytestmark = pytest.mark.anyio

N = 1 << 18  # int32s: 1 MiB, past the inline copy limit, so every copy here is queued


@pytest.fixture(params=["native", "python"])
async def device(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[rt.Compiled]:
    """A CPU device of its own, its queues on the C ring or on the Python worker."""
    if request.param == "python":
        monkeypatch.setattr(native, "load", lambda: None)
        name = "CPU:9"
    else:
        if native.load() is None:
            pytest.skip("the native queue library is not available here")
        name = "CPU:8"
    dev = Device[name]
    monkeypatch.undo()
    assert all(q.native == (request.param == "native") for q in dev.queues.values())
    yield dev
    await dev.aclose()


async def queue_then_cancel(dev: rt.Compiled, copy: Callable[[], Awaitable[object]]) -> None:
    """Run ``copy`` until it has queued its command on the copy queue, then cancel its wait."""
    timeline = dev._copy_queue.timeline
    before = timeline.submitted
    async with anyio.create_task_group() as tg:
        tg.start_soon(copy)
        while timeline.submitted == before:
            await anyio.lowlevel.checkpoint()
        tg.cancel_scope.cancel()
    assert timeline.completed < timeline.submitted  # queued, not run: the gate holds it


@pytest.mark.parametrize("how", ["buffer", "raw allocator"])
@pytest.mark.parametrize("direction", ["copyin", "copyout"])
async def test_a_cancelled_queued_copy_keeps_the_host_memory_exported_until_it_ran(
    device: rt.Compiled, direction: str, how: str
) -> None:
    async with gate_on(device.name) as gate:
        buf = await Buffer(device.name, N, dtypes.int32).allocate()
        gate.launch(buf, 42)  # writes buf on the compute queue: the copy waits for it
        host = bytearray(np.arange(N, dtype=np.int32).tobytes())
        alloc = device.allocator
        with memoryview(host) as mv:
            if direction == "copyin":
                copy = (
                    (lambda: buf.copyin(mv)) if how == "buffer" else (lambda: alloc.copyin(buf.handle(), mv))
                )
            else:
                copy = (
                    (lambda: buf.copyout(mv))
                    if how == "buffer"
                    else (lambda: alloc.copyout(mv, buf.handle()))
                )
            await queue_then_cancel(device, copy)
        # the caller's view is released, but the queued copy holds an export of its own: the
        # bytearray cannot be resized (which would free the memory the copy reads or writes)
        with pytest.raises(BufferError):
            host.extend(bytes(1 << 20))
        with pytest.raises(BufferError):
            del host[:]
        gate.open()
        await device.synchronize()
    got = np.frombuffer(host, np.int32)
    if direction == "copyin":  # after the gate wrote 42: the copy overwrote all of it
        assert ((await buf.numpy()) == np.arange(N, dtype=np.int32)).all()
    else:
        assert got[0] == 42 and (got[1:] == 0).all()
    await buf.free()


def object_buffers() -> list[object]:
    return [
        np.empty(N, dtype=object),
        np.zeros(N // 2, dtype=[("a", "i4"), ("b", "O")]),
        (ctypes.py_object * (N // 2))(),
    ]


@pytest.mark.parametrize(
    "index", range(3), ids=["object array", "struct with object field", "ctypes py_object"]
)
@pytest.mark.parametrize(
    "call", ["copyin", "copyout", "copyin_nowait", "copyout_nowait", "raw copyin", "raw copyout"]
)
async def test_host_memory_holding_object_references_is_refused_before_anything_is_queued(
    device: rt.Compiled, call: str, index: int
) -> None:
    host = object_buffers()[index]
    nbytes = memoryview(host).nbytes  # type: ignore[arg-type]
    buf = await Buffer(device.name, nbytes, dtypes.uint8).allocate()
    alloc = device.allocator
    before = [q.timeline.submitted for q in device.queues.values()]
    calls: dict[str, Callable[[], object]] = {
        "copyin": lambda: buf.copyin(host),
        "copyout": lambda: buf.copyout(host),
        "copyin_nowait": lambda: buf.copyin_nowait(host),
        "copyout_nowait": lambda: buf.copyout_nowait(host),
        "raw copyin": lambda: alloc.copyin(buf.handle(), host),  # type: ignore[arg-type]
        "raw copyout": lambda: alloc.copyout(host, buf.handle()),  # type: ignore[arg-type]
    }
    with pytest.raises(TypeError, match="object references"):
        result = calls[call]()
        if isinstance(result, Awaitable):
            await result
    assert [q.timeline.submitted for q in device.queues.values()] == before
    await buf.free()


async def test_a_struct_field_named_o_is_plain_data(device: rt.Compiled) -> None:
    host = np.arange(N, dtype=np.int32).view([("O", "i4")])
    buf = await Buffer(device.name, N, dtypes.int32).allocate()
    await buf.copyin(host)
    assert ((await buf.numpy()) == np.arange(N, dtype=np.int32)).all()
    await buf.free()
