"""Buffer: lifetime, copies, zero-copy host views, views, cross-device copies, hazards, misuse."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import numpy as np
import pytest

from aiotinyrt import Buffer, BufferSpec, Device, dtypes
from tests.helpers import INC, Gate, assert_cancelled_at_entry, gate_on, int_buffer

COPY_ONE = "void copy1(int* restrict out, const int* restrict src) { out[0] = src[0]; }"

pytestmark = pytest.mark.anyio

COPY1 = "void copy1(int* restrict out, const int* restrict in) { out[0] = in[0]; }"


async def start_then_open(gate: Gate, call: Callable[[], Coroutine[Any, Any, object]]) -> None:
    """Start ``call`` while the gate holds the device, let it block, then open the gate."""
    async with anyio.create_task_group() as tg:
        tg.start_soon(call)
        await anyio.wait_all_tasks_blocked()
        gate.open()


# ---- construction and lifetime ------------------------------------------------------------------


def test_buffer_constructor_validates_its_arguments() -> None:
    with pytest.raises(TypeError, match="DType"):
        Buffer("CPU", 4, "float32")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="int"):
        Buffer("CPU", 4.0, dtypes.float32)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="positive"):
        Buffer("CPU", 0, dtypes.float32)
    with pytest.raises(ValueError, match="positive"):
        Buffer("CPU", -3, dtypes.float32)
    with pytest.raises(TypeError, match="BufferSpec"):
        Buffer("CPU", 4, dtypes.float32, {"nolru": True})  # type: ignore[arg-type]


def test_buffer_canonicalizes_its_device_name_and_knows_its_size() -> None:
    buf = Buffer("cpu:0", 10, dtypes.float64)
    assert buf.device == "CPU"
    assert buf.nbytes == 80
    assert not buf.is_allocated()
    assert buf.base is buf


async def test_allocate_returns_the_buffer_and_accounts_its_bytes() -> None:
    alloc = Device["CPU"].allocator
    before = alloc.statistics().bytes_in_use
    buf = Buffer("CPU", 1000, dtypes.int16, BufferSpec(nolru=True))
    assert await buf.allocate() is buf
    assert buf.is_allocated()
    assert alloc.statistics().bytes_in_use == before + 2000
    await buf.free()
    assert buf.freed
    assert not buf.is_allocated()
    assert alloc.statistics().bytes_in_use == before


async def test_buffer_on_an_unknown_device_fails_to_allocate_with_value_error() -> None:
    with pytest.raises(ValueError, match="unknown device backend"):
        await Buffer("NOPE", 4, dtypes.float32).allocate()


async def test_allocating_twice_or_after_free_raises() -> None:
    buf = await Buffer("NULL", 4, dtypes.float32).allocate()
    with pytest.raises(RuntimeError, match="already allocated"):
        await buf.allocate()
    await buf.free()
    with pytest.raises(RuntimeError, match="freed"):
        await buf.allocate()


async def test_async_with_allocates_and_frees() -> None:
    alloc = Device["CPU"].allocator
    before = alloc.statistics().bytes_in_use
    async with Buffer("CPU", 256, dtypes.uint8, BufferSpec(nolru=True)) as buf:
        assert buf.is_allocated()
        assert alloc.statistics().bytes_in_use == before + 256
        await buf.copyin(bytes(range(256)))
        assert (await buf.numpy()).tolist() == list(range(256))
    assert buf.freed
    assert alloc.statistics().bytes_in_use == before


async def test_async_with_tolerates_a_free_inside_the_block() -> None:
    async with Buffer("NULL", 4, dtypes.float32) as buf:
        await buf.free()
    assert buf.freed


async def test_async_with_frees_when_the_body_raises() -> None:
    with pytest.raises(KeyError):
        async with Buffer("NULL", 4, dtypes.float32) as buf:
            raise KeyError("body failed")
    assert buf.freed


async def test_use_after_free_raises_a_clear_error() -> None:
    dev = Device["CPU"]
    prog = await dev.program("inc", INC)
    buf = await int_buffer("CPU")
    await buf.free()
    submitted = (dev._compute_queue.timeline.submitted, dev._copy_queue.timeline.submitted)
    with pytest.raises(RuntimeError, match="use after free"):
        await buf.copyin(np.zeros(1, np.int32))
    with pytest.raises(RuntimeError, match="use after free"):
        await buf.copyout(np.zeros(1, np.int32))
    with pytest.raises(RuntimeError, match="use after free"):
        await buf.numpy()
    with pytest.raises(RuntimeError, match="use after free"):
        prog(buf)
    with pytest.raises(RuntimeError, match="freed"):
        buf.view(1, dtypes.int32)
    assert (dev._compute_queue.timeline.submitted, dev._copy_queue.timeline.submitted) == submitted


async def test_double_free_raises_a_clear_error() -> None:
    buf = await int_buffer("CPU")
    await buf.free()
    with pytest.raises(RuntimeError, match="double free"):
        await buf.free()


async def test_free_of_a_never_allocated_buffer_raises() -> None:
    with pytest.raises(RuntimeError, match="never allocated"):
        await Buffer("CPU", 4, dtypes.float32).free()


async def test_unallocated_buffer_cannot_be_used() -> None:
    buf = Buffer("CPU", 1, dtypes.int32)
    prog = await Device["CPU"].program("inc", INC)
    with pytest.raises(RuntimeError, match="not allocated"):
        await buf.copyin(np.zeros(1, np.int32))
    with pytest.raises(RuntimeError, match="not allocated"):
        prog(buf)


async def test_views_of_a_freed_base_become_unusable() -> None:
    base = await Buffer("CPU", 8, dtypes.int32).allocate()
    view = base.view(4, dtypes.int32, 16)
    await base.free()
    assert view.freed
    with pytest.raises(RuntimeError, match="use after free"):
        await view.numpy()


# ---- copies -----------------------------------------------------------------------------------------


async def test_copyin_copyout_round_trip() -> None:
    buf = await Buffer("CPU", 8, dtypes.float32).allocate()
    data = np.linspace(-1, 1, 8, dtype=np.float32)
    assert await buf.copyin(data) is buf
    out = np.zeros(8, np.float32)
    await buf.copyout(out)
    assert out.tolist() == data.tolist()
    mv_out = bytearray(32)
    await buf.copyout(mv_out)
    assert bytes(mv_out) == data.tobytes()
    await buf.free()


async def test_copies_of_the_wrong_size_raise_value_error_before_enqueueing() -> None:
    dev = Device["CPU"]
    buf = await Buffer("CPU", 8, dtypes.float32).allocate()
    submitted = dev._copy_queue.timeline.submitted
    with pytest.raises(ValueError, match="31 bytes"):
        await buf.copyin(bytes(31))
    with pytest.raises(ValueError, match="64 bytes"):
        await buf.copyin(np.zeros(8, np.float64))
    with pytest.raises(ValueError, match="16 bytes"):
        await buf.copyout(np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="read-only"):
        await buf.copyout(bytes(32))
    with pytest.raises(TypeError, match="buffer protocol"):
        await buf.copyin([0.0] * 8)
    assert dev._copy_queue.timeline.submitted == submitted
    await buf.free()


async def test_numpy_returns_a_typed_copy() -> None:
    buf = await Buffer("CPU", 4, dtypes.int64).allocate()
    await buf.copyin(np.array([1, -2, 2**40, -(2**62)], np.int64))
    arr = await buf.numpy()
    assert arr.dtype == np.int64
    assert arr.tolist() == [1, -2, 2**40, -(2**62)]
    arr[0] = 99  # a copy: the buffer is untouched
    assert (await buf.numpy()).tolist()[0] == 1
    await buf.free()


async def test_numpy_of_a_dtype_without_numpy_equivalent_raises_type_error() -> None:
    buf = await Buffer("CPU", 4, dtypes.bfloat16).allocate()
    with pytest.raises(TypeError, match="bfloat16"):
        await buf.numpy()
    await buf.free()


async def test_as_memoryview_is_zero_copy_on_cpu() -> None:
    dev = Device["CPU"]
    prog = await dev.program("inc", INC)
    buf = await int_buffer("CPU", 10)
    mv = await buf.as_memoryview()
    assert mv.format == "B"
    assert mv.nbytes == 4
    assert mv.cast("i")[0] == 10
    await dev.run(prog, buf)
    assert mv.cast("i")[0] == 11  # the same memory, not a snapshot
    mv.cast("i")[0] = 100
    assert (await buf.numpy()).tolist() == [100]
    del mv
    await buf.free()


async def test_as_memoryview_waits_for_the_pending_write() -> None:
    async with gate_on("CPU") as gate:
        buf = await int_buffer("CPU")
        gate.launch(buf, 77)
        seen: list[int] = []

        async def read() -> None:
            seen.append((await buf.as_memoryview()).cast("i")[0])

        await start_then_open(gate, read)
        assert seen == [77]
        await buf.free()


async def test_memoryview_keeps_freed_memory_alive_and_out_of_the_cache() -> None:
    buf = await int_buffer("CPU", 5, size=1024)
    mv = await buf.as_memoryview()
    address = buf.handle().addr
    await buf.free()
    other = await int_buffer("CPU", 9, size=1024)
    assert other.handle().addr != address  # not reused while the view exists
    assert mv.cast("i")[1023] == 5  # still readable, still intact
    del mv
    await other.free()


# ---- views ----------------------------------------------------------------------------------------


async def test_view_shares_memory_with_its_base_at_a_byte_offset() -> None:
    dev = Device["CPU"]
    prog = await dev.program("inc", INC)
    base = await int_buffer("CPU", 0, size=8)
    view = base.view(2, dtypes.int32, 12)
    assert view.base is base
    assert view.nbytes == 8
    await view.copyin(np.array([5, 6], np.int32))
    assert (await base.numpy()).tolist() == [0, 0, 0, 5, 6, 0, 0, 0]
    await dev.run(prog, view)
    assert (await base.numpy()).tolist() == [0, 0, 0, 6, 6, 0, 0, 0]
    inner = view.view(1, dtypes.int32, 4)  # offsets compose
    assert inner.base is base
    assert (await inner.numpy()).tolist() == [6]
    as_bytes = base.view(4, dtypes.uint8, 12)
    assert (await as_bytes.numpy()).tolist() == [6, 0, 0, 0]
    await base.free()


@pytest.mark.parametrize(("size", "offset"), [(9, 0), (1, 29), (8, 4), (0, 0), (1, -4)])
async def test_view_that_does_not_fit_raises_value_error(size: int, offset: int) -> None:
    base = await Buffer("NULL", 8, dtypes.int32).allocate()
    with pytest.raises(ValueError):
        base.view(size, dtypes.int32, offset)
    await base.free()


async def test_a_view_cannot_be_allocated_and_freeing_it_keeps_the_base() -> None:
    base = await int_buffer("CPU", 3, size=4)
    view = base.view(2, dtypes.int32)
    with pytest.raises(ValueError, match="base"):
        await view.allocate()
    await view.free()
    assert base.is_allocated()
    assert (await base.numpy()).tolist() == [3, 3, 3, 3]
    await base.free()


# ---- copy_from ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("src_dev", "dst_dev"), [("CPU", "CPU"), ("CPU", "CPU:1"), ("CPU:1", "CPU")])
async def test_copy_from_between_cpu_devices(src_dev: str, dst_dev: str) -> None:
    src = await Buffer(src_dev, 16, dtypes.float32).allocate()
    dst = await Buffer(dst_dev, 16, dtypes.float32).allocate()
    await src.copyin(np.arange(16, dtype=np.float32))
    assert await dst.copy_from(src) is dst
    assert (await dst.numpy()).tolist() == list(range(16))
    await src.free()
    await dst.free()


async def test_copy_from_cpu_to_null_and_back_is_refused_without_copyout() -> None:
    cpu = await int_buffer("CPU", 4, size=4)
    null = await Buffer("NULL", 4, dtypes.int32).allocate()
    await null.copy_from(cpu)
    with pytest.raises(RuntimeError, match="NULL_ALLOW_COPYOUT"):
        await cpu.copy_from(null)
    assert (await cpu.numpy()).tolist() == [4, 4, 4, 4]
    await cpu.free()
    await null.free()


async def test_copy_from_validates_its_source() -> None:
    dst = await Buffer("CPU", 4, dtypes.float32).allocate()
    other = await Buffer("CPU", 5, dtypes.float32).allocate()
    with pytest.raises(TypeError, match="Buffer"):
        await dst.copy_from(np.zeros(4, np.float32))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="size mismatch"):
        await dst.copy_from(other)
    same_bytes = await Buffer("CPU", 2, dtypes.float64).allocate()
    await dst.copy_from(same_bytes)  # sizes are compared in bytes
    for b in (dst, other, same_bytes):
        await b.free()


async def test_copy_from_is_ordered_after_a_pending_write_to_the_source() -> None:
    async with gate_on("CPU:1") as gate:
        src = await int_buffer("CPU:1")
        dst = await int_buffer("CPU", -1)
        gate.launch(src, 42)
        await start_then_open(gate, lambda: dst.copy_from(src))
        assert (await dst.numpy()).tolist() == [42]
        await src.free()
        await dst.free()


async def test_copy_from_is_ordered_after_pending_reads_of_the_destination() -> None:
    copy1 = await Device["CPU"].program("copy1", COPY1)
    async with gate_on("CPU") as gate:
        blocker = await int_buffer("CPU")
        gate.launch(blocker)  # holds the compute queue
        dst = await int_buffer("CPU", 8)
        seen = await int_buffer("CPU")
        copy1(seen, dst, writes=(0,))  # a pending read of dst, queued behind the gate
        src = await int_buffer("CPU:1", 9)
        await start_then_open(gate, lambda: dst.copy_from(src))
        await Device["CPU"].synchronize()
        assert (await seen.numpy()).tolist() == [8]  # the read saw the value before the copy
        assert (await dst.numpy()).tolist() == [9]
        for b in (blocker, dst, seen, src):
            await b.free()


async def test_copyout_is_ordered_after_a_pending_kernel_write() -> None:
    async with gate_on("CPU") as gate:
        buf = await int_buffer("CPU")
        sig = gate.launch(buf, 123)
        out = np.zeros(1, np.int32)
        await start_then_open(gate, lambda: buf.copyout(out))
        assert sig.done()
        assert out.tolist() == [123]
        await buf.free()


async def test_copyin_is_ordered_after_a_pending_kernel_read() -> None:
    copy1 = await Device["CPU"].program("copy1", COPY1)
    async with gate_on("CPU") as gate:
        blocker = await int_buffer("CPU")
        gate.launch(blocker)  # holds the compute queue
        src = await int_buffer("CPU", 8)
        seen = await int_buffer("CPU")
        read = copy1(seen, src, writes=(0,))
        await start_then_open(gate, lambda: src.copyin(np.array([9], np.int32)))
        assert read.done()
        assert (await seen.numpy()).tolist() == [8]  # write-after-read: the kernel read first
        assert (await src.numpy()).tolist() == [9]
        for b in (blocker, src, seen):
            await b.free()


async def test_small_copies_of_idle_memory_run_inline_and_the_rest_are_queued() -> None:
    """copyin/copyout of at most ``inline_copy_bytes`` into memory no pending command touches run
    on the loop thread (nothing is queued, the data is there on return); larger ones, and those
    that must wait for a pending access of the same bytes, go through the copy queue in order."""
    alloc = Device["CPU"].allocator
    limit = alloc.inline_copy_bytes
    assert limit >= 4
    copy = Device["CPU"].queues["copy"].timeline
    small = await Buffer("CPU", limit // 4, dtypes.int32).allocate()
    large = await Buffer("CPU", limit // 4 + 1, dtypes.int32).allocate()
    before = copy.submitted
    await small.copyin(np.arange(limit // 4, dtype=np.int32))
    out = np.zeros(limit // 4, np.int32)
    await small.copyout(out)
    assert out.tolist() == list(range(limit // 4))
    assert copy.submitted == before, "an idle small copy was queued"
    await large.copyin(np.ones(limit // 4 + 1, np.int32))
    assert copy.submitted == before + 1, "a copy above the limit ran on the loop thread"
    async with gate_on("CPU") as gate:
        held = await int_buffer("CPU")
        gate.launch(held, 5)  # a pending write of `held`, holding the compute queue
        await small.copyin(np.full(limit // 4, 7, np.int32))  # other memory: not held up
        assert copy.submitted == before + 1
        value = np.zeros(1, np.int32)
        await start_then_open(gate, lambda: held.copyout(value))
        assert copy.submitted == before + 2, "a read of memory with a pending write ran inline"
        assert value.tolist() == [5]
        await held.free()
    assert (await small.numpy()).tolist() == [7] * (limit // 4)
    for b in (small, large):
        await b.free()


async def test_copies_nowait_run_at_once_or_raise_would_block_having_copied_nothing() -> None:
    """copyin_nowait/copyout_nowait copy on the calling thread at once (nothing queued, no
    checkpoint) when the bytes are idle and the copy small; otherwise they raise
    ``anyio.WouldBlock`` and copy nothing. Bad arguments and freed buffers raise as copyin does;
    a backend without host memory (NULL) always says WouldBlock."""
    limit = Device["CPU"].allocator.inline_copy_bytes
    copy = Device["CPU"].queues["copy"].timeline
    small = await Buffer("CPU", 4, dtypes.int32).allocate()
    large = await Buffer("CPU", limit // 4 + 1, dtypes.int32).allocate()
    before = copy.submitted
    small.copyin_nowait(np.arange(4, dtype=np.int32))
    out = np.zeros(4, np.int32)
    small.copyout_nowait(out)
    assert out.tolist() == [0, 1, 2, 3]
    assert copy.submitted == before, "a copy without waiting was queued"
    big = np.ones(limit // 4 + 1, np.int32)
    with pytest.raises(anyio.WouldBlock, match="does not run on the calling thread"):
        large.copyin_nowait(big)
    with pytest.raises(anyio.WouldBlock, match="does not run on the calling thread"):
        large.copyout_nowait(big)
    assert big.tolist() == [1] * big.size
    with pytest.raises(ValueError, match="bytes"):
        small.copyin_nowait(np.arange(5, dtype=np.int32))
    held = await int_buffer("CPU")
    async with gate_on("CPU") as gate:
        write = gate.launch(held, 5)  # a pending write of `held`, holding the compute queue
        value = np.full(1, 3, np.int32)
        with pytest.raises(anyio.WouldBlock, match="pending commands use"):
            held.copyin_nowait(value)
        with pytest.raises(anyio.WouldBlock, match="pending commands write"):
            held.copyout_nowait(value)
        assert value.tolist() == [3]
        small.copyin_nowait(np.full(4, 9, np.int32))  # other memory: not held up
    await write
    held.copyout_nowait(value)
    assert value.tolist() == [5]
    assert (await small.numpy()).tolist() == [9] * 4
    await small.free()
    with pytest.raises(RuntimeError, match="use after free"):
        small.copyin_nowait(np.zeros(4, np.int32))
    null = await Buffer("NULL", 4, dtypes.int32).allocate()
    with pytest.raises(anyio.WouldBlock):
        null.copyin_nowait(np.zeros(4, np.int32))
    for b in (large, held, null):
        await b.free()


@pytest.mark.parametrize("direction", ["copyin", "copyout"])
async def test_a_small_copy_whose_buffer_is_freed_at_its_checkpoint_raises_use_after_free(
    monkeypatch: pytest.MonkeyPatch, direction: str
) -> None:
    """The inline path yields once before copying; a free by another task in that window must
    give the use-after-free error, not a memcpy into memory that is cached or unmapped."""
    buf = await Buffer("CPU", 4, dtypes.int32).allocate()
    in_use = Device["CPU"].allocator.statistics().bytes_in_use
    real = anyio.lowlevel.checkpoint

    async def free_then_checkpoint() -> None:
        monkeypatch.setattr(anyio.lowlevel, "checkpoint", real)
        buf.free_nowait()  # what a task running at this checkpoint may do
        await real()

    monkeypatch.setattr(anyio.lowlevel, "checkpoint", free_then_checkpoint)
    host = np.full(4, 7, np.int32)
    with pytest.raises(RuntimeError, match="use after free"):
        await (buf.copyin(host) if direction == "copyin" else buf.copyout(host))
    assert Device["CPU"].allocator.statistics().bytes_in_use == in_use - buf.nbytes
    assert host.tolist() == [7] * 4


async def test_kernel_is_ordered_after_a_pending_copy_on_the_copy_queue() -> None:
    copy1 = await Device["CPU"].program("copy1", COPY1)
    async with gate_on("CPU:1") as gate:
        remote = await int_buffer("CPU:1")
        gate.launch(remote, 31)  # pending write of the copy source
        local = await int_buffer("CPU")
        seen = await int_buffer("CPU")

        async def copy_then_launch() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(local.copy_from, remote)
                await anyio.wait_all_tasks_blocked()
                await copy1(seen, local, writes=(0,))  # read-after-write across queues

        await start_then_open(gate, copy_then_launch)
        assert (await seen.numpy()).tolist() == [31]
        for b in (remote, local, seen):
            await b.free()


# ---- free with work pending -------------------------------------------------------------------------


async def test_free_with_work_pending_defers_the_release_until_the_work_completes() -> None:
    alloc = Device["CPU"].allocator
    async with gate_on("CPU") as gate:
        out = await int_buffer("CPU", 0, size=1024)
        address = out.handle().addr
        sig = gate.launch(out, 42)
        in_use = alloc.statistics().bytes_in_use
        await out.free()  # returns at once
        assert not sig.done()
        assert alloc.statistics().bytes_in_use == in_use  # still in use by the kernel
        other = await int_buffer("CPU", 0, size=1024)
        assert other.handle().addr != address  # not handed out while the kernel may write it
        before = alloc.statistics()
        gate.open()
        assert type(await sig) is float  # the kernel ran on live memory
        after = alloc.statistics()
        assert after.bytes_in_use == before.bytes_in_use - 4096
        assert after.bytes_cached == before.bytes_cached + 4096
        assert (await other.numpy()).tolist() == [0] * 1024  # untouched by the freed buffer's kernel
        third = await Buffer("CPU", 1024, dtypes.int32).allocate()
        assert third.handle().addr == address  # released to the cache once the kernel finished
        await other.free()
        await third.free()


# ---- the checkpoint rule ------------------------------------------------------------------------


async def test_allocate_is_a_checkpoint_and_allocates_nothing_when_cancelled() -> None:
    alloc = Device["CPU"].allocator
    before = alloc.statistics()
    buf = Buffer("CPU", 4, dtypes.float32)
    await assert_cancelled_at_entry(buf.allocate)
    assert not buf.is_allocated()
    assert alloc.statistics() == before


async def test_free_is_a_checkpoint_and_frees_nothing_when_cancelled() -> None:
    buf = await int_buffer("CPU", 3)
    await assert_cancelled_at_entry(buf.free)
    assert buf.is_allocated()
    assert (await buf.numpy()).tolist() == [3]
    await buf.free()


async def test_copyin_is_a_checkpoint_and_copies_nothing_when_cancelled() -> None:
    buf = await int_buffer("CPU", 3)
    await assert_cancelled_at_entry(lambda: buf.copyin(np.array([4], np.int32)))
    await Device["CPU"].synchronize()
    assert (await buf.numpy()).tolist() == [3]
    await buf.free()


async def test_copyout_is_a_checkpoint_and_copies_nothing_when_cancelled() -> None:
    buf = await int_buffer("CPU", 3)
    out = np.zeros(1, np.int32)
    await assert_cancelled_at_entry(lambda: buf.copyout(out))
    await Device["CPU"].synchronize()
    assert out.tolist() == [0]
    await buf.free()


async def test_as_memoryview_and_numpy_are_checkpoints() -> None:
    buf = await int_buffer("CPU", 3)
    await assert_cancelled_at_entry(buf.as_memoryview)
    await assert_cancelled_at_entry(buf.numpy)
    await buf.free()


async def test_copy_from_is_a_checkpoint_and_copies_nothing_when_cancelled() -> None:
    src = await int_buffer("CPU:1", 5)
    dst = await int_buffer("CPU", 3)
    await assert_cancelled_at_entry(lambda: dst.copy_from(src))
    await Device["CPU"].synchronize()
    assert (await dst.numpy()).tolist() == [3]
    await src.free()
    await dst.free()


async def test_many_pending_reads_of_a_buffer_keep_its_access_list_short() -> None:
    # reads of the same bytes on one queue supersede each other: a buffer only ever read by
    # thousands of queued launches must not drag an ever longer list through every launch
    dev = Device["CPU"]
    prog = await dev.program("copy1", COPY_ONE)
    out = await Buffer("CPU", 1, dtypes.int32).allocate()
    src = await Buffer("CPU", 1, dtypes.int32).allocate()
    await src.copyin(np.array([7], np.int32))
    held = await int_buffer("CPU")
    async with gate_on("CPU") as gate:
        gate.launch(held)  # the compute queue runs nothing until the gate opens
        sigs = [prog(out, src, writes=(0,)) for _ in range(2000)]
        assert not sigs[0].done()
        assert len(src._accesses) <= 8
        gate.open()
        await sigs[-1]
    assert (await out.numpy()).tolist() == [7]
    for buf in (out, src, held):
        await buf.free()
