"""One submission path for copies: every queued copy and transfer, whichever API made it, passes
:func:`aiotinyrt.copies.submit_copy`, and no queue is handed a copy from anywhere else."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from aiotinyrt import Buffer, Device, copies, dtypes
from aiotinyrt.buffer import enqueue_copy
from aiotinyrt.driverqueue import DriverQueue
from aiotinyrt.host.memory import _MEMMOVE
from aiotinyrt.queue import HostQueue
from tests.helpers import contents, int_array_buffer

pytestmark = pytest.mark.anyio

#: Elements of the large buffers: 128 KiB, past CPU's inline copies, so every copy is queued.
BIG = 1 << 15
_HOOKS = ("_copyin", "_copyout", "_transfer")


class Funnel:
    """What the patched funnel and the patched queues saw."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_queue = False  # (submit_either falls back to submit: count the outer call only)
        self.kinds: list[str] = []  #: per funnel call: in, out, transfer
        self.submitted: list[tuple[str, bool]] = []  #: per queued copy: (hook, inside the funnel)

    def reset(self) -> None:
        self.kinds.clear()
        self.submitted.clear()

    def outside(self) -> list[str]:
        return [hook for hook, inside in self.submitted if not inside]


def _kind(dest: object, src: object) -> str:
    if isinstance(src, memoryview):
        return "in"
    return "out" if isinstance(dest, memoryview) else "transfer"


@pytest.fixture
def funnel(monkeypatch: pytest.MonkeyPatch) -> Iterator[Funnel]:
    seen = Funnel()
    real = copies.submit_copy

    def counting(dest: Any, src: Any, nbytes: int) -> Any:
        seen.kinds.append(_kind(dest, src))
        seen.depth += 1
        try:
            return real(dest, src, nbytes)
        finally:
            seen.depth -= 1

    def watch(method: Callable[..., Any], fn_at: int) -> Callable[..., Any]:
        def submit(self: object, *args: Any, **kwargs: Any) -> Any:
            if seen.in_queue:
                return method(self, *args, **kwargs)
            name = getattr(args[fn_at], "__name__", "")
            if name in _HOOKS:
                seen.submitted.append((name, seen.depth > 0))
            seen.in_queue = True
            try:
                return method(self, *args, **kwargs)
            finally:
                seen.in_queue = False

        return submit

    def watch_native(method: Callable[..., Any]) -> Callable[..., Any]:
        def submit_native(self: object, fn: int, *args: Any, **kwargs: Any) -> Any:
            if not seen.in_queue and fn == _MEMMOVE:  # (inside submit_either: counted there)
                seen.submitted.append(("_memmove", seen.depth > 0))
            return method(self, fn, *args, **kwargs)

        return submit_native

    monkeypatch.setattr(copies, "submit_copy", counting)
    monkeypatch.setattr(HostQueue, "submit_native", watch_native(HostQueue.submit_native))
    for kind in (HostQueue, DriverQueue):
        monkeypatch.setattr(kind, "submit", watch(kind.submit, 0))
        monkeypatch.setattr(kind, "submit_either", watch(kind.submit_either, 1))
    yield seen


async def big(device: str, value: int) -> Buffer:
    return await int_array_buffer(device, value, size=BIG)


async def test_buffer_copies_pass_the_funnel(funnel: Funnel) -> None:
    buf = await Buffer("CPU", BIG, dtypes.int32).allocate()
    await buf.copyin(np.full(BIG, 7, np.int32))
    out = np.zeros(BIG, np.int32)
    await buf.copyout(out)
    assert out.tolist() == [7] * BIG
    assert (await buf.numpy()).tolist() == [7] * BIG
    sig = buf._enqueue_copy(memoryview(np.full(BIG, 8, np.int32)).cast("B"), into=True)
    await sig
    assert funnel.kinds == ["in", "out", "out", "in"]
    assert [hook for hook, _ in funnel.submitted] == ["_copyin", "_copyout", "_copyout", "_copyin"]
    assert funnel.outside() == []
    await buf.free()


async def test_transfers_direct_and_staged_pass_the_funnel(funnel: Funnel) -> None:
    src = await big("CPU", 3)
    funnel.reset()
    near = await Buffer("CPU:1", BIG, dtypes.int32).allocate()
    await near.copy_from(src)  # direct: one _transfer
    toy = await Buffer("TOY", BIG, dtypes.int32).allocate()
    await toy.copy_from(near)  # staged: CPU:1 copies out, TOY copies in
    back = await Buffer("CPU", BIG, dtypes.int32).allocate()
    sig = enqueue_copy(back, toy)  # tinygrad's transfers: staged the other way
    assert sig is not None
    await sig
    assert await contents(back) == [3] * BIG
    assert funnel.kinds[:3] == ["transfer", "transfer", "transfer"]
    hooks = [hook for hook, _ in funnel.submitted]
    assert hooks[:5] == ["_transfer", "_copyout", "_copyin", "_copyout", "_copyin"]
    assert funnel.outside() == []
    for b in (src, near, toy, back):
        await b.free()


async def test_raw_allocator_copies_pass_the_funnel(funnel: Funnel) -> None:
    cpu, cpu1, toy = Device["CPU"], Device["CPU:1"], Device["TOY"]
    nbytes = BIG * 4
    a = await cpu.allocator.alloc(nbytes)
    b = await cpu1.allocator.alloc(nbytes)
    t = await toy.allocator.alloc(nbytes)
    await cpu.allocator.copyin(a, memoryview(np.full(BIG, 5, np.int32)).cast("B"))
    await cpu1.allocator.transfer(b, a, nbytes, cpu)  # direct
    await toy.allocator.transfer(t, b, nbytes, cpu1)  # staged
    out = np.zeros(BIG, np.int32)
    await toy.allocator.copyout(memoryview(out).cast("B"), t)
    assert out.tolist() == [5] * BIG
    assert funnel.kinds == ["in", "transfer", "transfer", "out"]
    hooks = [hook for hook, _ in funnel.submitted]
    assert hooks == ["_copyin", "_transfer", "_copyout", "_copyin", "_copyout"]
    assert funnel.outside() == []
    await cpu.allocator.free(a, nbytes)
    await cpu1.allocator.free(b, nbytes)
    await toy.allocator.free(t, nbytes)


async def test_cpu_raw_copyout_and_a_staged_raw_transfer_out_of_cpu_pass_the_funnel(funnel: Funnel) -> None:
    cpu, toy = Device["CPU"], Device["TOY"]
    nbytes = BIG * 4
    a = await cpu.allocator.alloc(nbytes)
    t = await toy.allocator.alloc(nbytes)
    await cpu.allocator.copyin(a, memoryview(np.full(BIG, 6, np.int32)).cast("B"))
    out = np.zeros(BIG, np.int32)
    await cpu.allocator.copyout(memoryview(out).cast("B"), a)  # native on CPU
    assert out.tolist() == [6] * BIG
    await toy.allocator.transfer(t, a, nbytes, cpu)  # staged: CPU's native copy-out, TOY's copy-in
    await toy.allocator.copyout(memoryview(out).cast("B"), t)
    assert out.tolist() == [6] * BIG
    assert funnel.kinds == ["in", "out", "transfer", "out"]
    assert funnel.outside() == []
    await cpu.allocator.free(a, nbytes)
    await toy.allocator.free(t, nbytes)


async def test_copies_of_a_driver_run_device_pass_the_funnel(funnel: Funnel) -> None:
    fake = await Buffer("FAKE", BIG, dtypes.int32).allocate()
    await fake.copyin(np.full(BIG, 4, np.int32))  # (FAKE copies are never inline)
    cpu = await Buffer("CPU", BIG, dtypes.int32).allocate()
    await cpu.copy_from(fake)  # staged: FAKE copies out, CPU copies in
    out = np.zeros(BIG, np.int32)
    await Device["FAKE"].allocator.copyout(memoryview(out).cast("B"), fake.handle())
    assert out.tolist() == [4] * BIG
    assert await contents(cpu) == [4] * BIG
    assert funnel.kinds[:3] == ["in", "transfer", "out"]
    assert [hook for hook, _ in funnel.submitted][:4] == ["_copyin", "_copyout", "_copyin", "_copyout"]
    assert funnel.outside() == []
    await fake.free()
    await cpu.free()


async def test_a_captured_transfer_is_recorded_by_the_funnel(funnel: Funnel) -> None:
    x = await int_array_buffer("CPU", 2, size=4)
    far = await int_array_buffer("CPU:1", 0, size=4)
    funnel.reset()
    async with Device["CPU"].capture() as graph:
        await far.copy_from(x)
    assert funnel.kinds == ["transfer"]
    assert funnel.submitted == [], "a captured copy is recorded, not queued"
    await graph.replay()
    assert funnel.submitted == [], "a replay is submitted as a replay, not as copies"
    assert await contents(far) == [2] * 4
    assert funnel.outside() == []
    await x.free()
    await far.free()


async def test_the_funnel_check_sees_a_copy_submitted_around_it(funnel: Funnel) -> None:
    # the watch itself: a copy handed to a queue directly is counted as outside the funnel
    queue = Device["TOY"]._copy_queue
    assert isinstance(queue, HostQueue)
    handle = Device["TOY"].allocator.alloc_nowait(16)
    sig = queue.submit(Device["TOY"].allocator._copyin, (handle, memoryview(bytes(16))))
    await sig
    assert funnel.outside() == ["_copyin"]
    Device["TOY"].allocator.free_nowait(handle, 16)


@pytest.mark.parametrize("pair", [("CPU", "CPU:1"), ("CPU", "TOY"), ("TOY", "CPU")])
@pytest.mark.parametrize("sizes", [(4, 1 << 20), (1 << 20, 4)])
async def test_a_transfer_between_buffers_of_different_sizes_is_refused_before_it_is_queued(
    pair: tuple[str, str], sizes: tuple[int, int]
) -> None:
    # direct (CPU -> CPU:1) and staged (through host memory) alike: no copy past either end
    src = await Buffer(pair[0], sizes[0], dtypes.int32).allocate()
    dest = await Buffer(pair[1], sizes[1], dtypes.int32).allocate()
    queues = [Device[name]._copy_queue for name in pair]
    before = [q.timeline.submitted for q in queues]
    with pytest.raises(ValueError, match="size mismatch"):
        enqueue_copy(dest, src)
    with pytest.raises(ValueError, match="size mismatch"):  # a view smaller than the destination
        enqueue_copy(dest, src.view(2, dtypes.int32, offset=4))
    assert [q.timeline.submitted for q in queues] == before
    for buf in (src, dest):
        await buf.free()


async def test_the_funnel_refuses_more_bytes_than_an_end_holds() -> None:
    src = await Buffer("CPU", 4, dtypes.int32).allocate()
    dest = await Buffer("TOY", 1 << 20, dtypes.int32).allocate()
    with pytest.raises(ValueError, match="does not fit an end of 16 bytes"):
        copies.submit_copy(dest, src, dest.nbytes)
    with pytest.raises(ValueError, match="does not fit an end of 16 bytes"):
        copies.submit_copy(memoryview(bytearray(32)), src, 32)
    for buf in (src, dest):
        await buf.free()
