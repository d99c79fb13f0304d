"""Memory ownership and release: adopted handles are checked, statistics never go negative,
memory freed under a zero-copy host view comes back when the last view goes, and no free unmaps
on the event loop thread."""

from __future__ import annotations

import gc
import mmap
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from aiotinyrt import Buffer, BufferSpec, Device, dtypes
from aiotinyrt.allocator import AllocatorStatistics
from aiotinyrt.host import memory as host_memory

pytestmark = pytest.mark.anyio

DEV = "CPU:3"  # a device of its own: its statistics are this file's alone


def stats(device: str = DEV) -> AllocatorStatistics:
    return Device[device].allocator.statistics()


def assert_sane(s: AllocatorStatistics) -> None:
    assert s.bytes_in_use >= 0 and s.allocations >= 0 and s.bytes_cached >= 0, s


# ---- adopted handles -------------------------------------------------------------------------------


async def test_adopting_something_that_is_not_a_handle_is_a_type_error() -> None:
    before = stats()
    for wrong in (12345, b"\0" * 64, object(), np.zeros(16, np.int32), "CPU"):
        with pytest.raises(TypeError, match="CPUMemory"):
            await Buffer(DEV, 16, dtypes.int32).allocate(opaque=wrong)
    assert stats() == before


async def test_adopting_a_handle_smaller_than_the_buffer_is_a_value_error() -> None:
    alloc = Device[DEV].allocator
    handle = await alloc.alloc(64)
    before = stats()
    with pytest.raises(ValueError, match="has 64 bytes, the buffer needs 4096"):
        await Buffer(DEV, 1024, dtypes.int32).allocate(opaque=handle)
    assert stats() == before
    await alloc.free(handle, 64)


async def test_adopting_another_buffers_memory_is_refused() -> None:
    owner = await Buffer(DEV, 16, dtypes.int32).allocate()
    before = stats()
    with pytest.raises(ValueError, match="another Buffer's memory"):
        await Buffer(DEV, 16, dtypes.int32).allocate(opaque=owner.handle())
    handle = await Device[DEV].allocator.alloc(64)
    adopted = await Buffer(DEV, 16, dtypes.int32).allocate(opaque=handle)
    with pytest.raises(ValueError, match="another Buffer's memory"):
        await Buffer(DEV, 16, dtypes.int32).allocate(opaque=handle)
    await adopted.free()
    await owner.free()
    assert stats().bytes_in_use == before.bytes_in_use - 64


async def test_adopting_a_freed_handle_a_view_or_another_devices_is_refused() -> None:
    alloc = Device[DEV].allocator
    freed = await alloc.alloc(64)
    await alloc.free(freed, 64)
    base = await Buffer(DEV, 64, dtypes.int32).allocate()
    other = await Device["CPU:4"].allocator.alloc(64)
    before = stats()
    for handle in (freed, base.view(16, dtypes.int32, 64).handle(), other):
        with pytest.raises(ValueError, match="not a live allocation"):
            await Buffer(DEV, 16, dtypes.int32).allocate(opaque=handle)
    assert stats() == before
    await base.free()
    await Device["CPU:4"].allocator.free(other, 64)


async def test_an_adopted_handle_is_freed_once_and_statistics_never_go_negative() -> None:
    alloc = Device[DEV].allocator
    start = stats()
    handle = await alloc.alloc(8192)
    buf = await Buffer(DEV, 1024, dtypes.int32).allocate(opaque=handle)  # larger than the buffer
    await buf.copyin(np.arange(1024, dtype=np.int32))
    assert ((await buf.numpy()) == np.arange(1024)).all()
    await buf.free()
    assert stats().bytes_in_use == start.bytes_in_use
    with pytest.raises(ValueError, match="not a live allocation"):
        await alloc.free(handle, 8192)  # the buffer freed it: a second free is refused
    assert_sane(stats())
    assert stats().bytes_in_use == start.bytes_in_use and stats().allocations == start.allocations


async def test_a_raw_double_free_or_a_free_larger_than_the_allocation_is_refused() -> None:
    alloc = Device[DEV].allocator
    start = stats()
    handle = await alloc.alloc(4096)
    with pytest.raises(ValueError, match="free of 8192 bytes"):
        await alloc.free(handle, 8192)
    await alloc.free(handle, 4096)
    with pytest.raises(ValueError, match="not a live allocation"):
        await alloc.free(handle, 4096)
    assert stats().bytes_in_use == start.bytes_in_use
    assert_sane(stats())


async def test_the_ownership_records_keep_no_handle_alive() -> None:
    """A buffer or raw handle dropped without free() is collected as before (its memory goes with
    it); the records of who owns what hold no reference to it."""
    buf = await Buffer(DEV, 1024, dtypes.int32).allocate()
    raw = await Device[DEV].allocator.alloc(4096)
    refs = [weakref.ref(buf.handle()), weakref.ref(raw)]
    del buf, raw
    gc.collect()
    assert [r() for r in refs] == [None, None]


# ---- memory comes back -------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", [None, BufferSpec(nolru=True)], ids=["cached", "nolru"])
async def test_memory_freed_under_a_host_view_is_unmapped_when_the_last_view_goes(
    spec: BufferSpec | None,
) -> None:
    buf = await Buffer(DEV, 1 << 20, dtypes.int32, spec).allocate()  # 4 MiB: past the inline unmap
    await buf.copyin(np.arange(1 << 20, dtype=np.int32))
    mm = buf.handle().mm
    view = await buf.as_memoryview()
    part = view[16:32]  # a slice keeps it too
    await buf.free()
    del view
    gc.collect()
    host_memory.unmapper.drain()
    assert not mm.closed, "unmapped while a slice of the view is alive"
    assert bytes(part) == np.arange(4, 8, dtype=np.int32).tobytes()
    del part  # the last view: the memory goes back now, not at some later unrelated free
    host_memory.unmapper.drain()
    assert mm.closed


async def test_a_view_of_live_memory_does_not_keep_it_out_of_the_cache_after_it_goes() -> None:
    buf = await Buffer(DEV, 4096, dtypes.int32).allocate()
    view = await buf.as_memoryview()
    del view
    handle = buf.handle()
    await buf.free()
    again = await Buffer(DEV, 4096, dtypes.int32).allocate()
    assert again.handle() is handle  # reused from the cache: no view holds it
    await again.free()


# ---- no unmapping on the loop thread ------------------------------------------------------------


@pytest.fixture
def unmapped_in(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, int]]]:
    """(thread id, bytes) of every mapping the CPU allocator unmaps."""
    seen: list[tuple[int, int]] = []
    real = host_memory._close_mapping

    def recording(mm: mmap.mmap) -> None:
        seen.append((threading.get_ident(), len(mm)))
        real(mm)

    monkeypatch.setattr(host_memory, "_close_mapping", recording)
    yield seen


BIG = 64 << 20  # bytes


def big_ones(seen: list[tuple[int, int]]) -> list[int]:
    host_memory.unmapper.drain()
    return [thread for thread, nbytes in seen if nbytes >= BIG]


@pytest.mark.parametrize("spec", [BufferSpec(nolru=True), BufferSpec(zero=True)], ids=["nolru", "zero"])
async def test_freeing_a_large_uncached_buffer_unmaps_off_the_loop_thread(
    unmapped_in: list[tuple[int, int]], spec: BufferSpec
) -> None:
    buf = await Buffer(DEV, BIG, dtypes.uint8, spec).allocate()
    await buf.copyin(np.ones(BIG, np.uint8))  # touched pages: unmapping them takes time
    await buf.free()
    threads = big_ones(unmapped_in)
    assert len(threads) == 1 and threads[0] != threading.get_ident()


async def test_freeing_with_the_cache_disabled_unmaps_off_the_loop_thread(
    unmapped_in: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(Device[DEV].allocator, "enabled", False)  # as with LRU=0
    buf = await Buffer(DEV, BIG, dtypes.uint8).allocate()
    await buf.free()
    threads = big_ones(unmapped_in)
    assert len(threads) == 1 and threads[0] != threading.get_ident()


async def test_free_cache_and_the_out_of_memory_retry_unmap_off_the_loop_thread(
    unmapped_in: list[tuple[int, int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    alloc: Any = Device[DEV].allocator
    bufs = [await Buffer(DEV, BIG, dtypes.uint8).allocate() for _ in range(2)]
    for b in bufs:
        await b.free()
    assert alloc.statistics().bytes_cached >= 2 * BIG
    alloc.free_cache()
    assert len(big_ones(unmapped_in)) == 2
    # out of memory: the cache is emptied and the allocation retried
    cached = await Buffer(DEV, BIG, dtypes.uint8).allocate()
    await cached.free()
    real_alloc = alloc._alloc
    calls = [0]

    def fail_once(nbytes: int, options: BufferSpec) -> Any:
        calls[0] += 1
        if calls[0] == 1:
            raise MemoryError("injected")
        return real_alloc(nbytes, options)

    alloc._alloc = fail_once
    try:
        fresh = await Buffer(DEV, BIG + 4096, dtypes.uint8).allocate()
    finally:
        del alloc._alloc
    assert calls[0] == 2
    await fresh.free()  # into the cache
    alloc.free_cache()
    threads = big_ones(unmapped_in)
    assert len(threads) == 4 and threading.get_ident() not in threads
