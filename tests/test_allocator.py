"""Allocators: validation, out of memory, the LRU cache, BufferSpec, statistics, raw copies."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import pytest

import aiotinyrt as rt
from aiotinyrt import AllocatorStatistics, BufferSpec, Device, DeviceError
from tests.helpers import assert_cancelled_at_entry, gate_on, int_buffer

pytestmark = pytest.mark.anyio

# ---- BufferSpec ---------------------------------------------------------------------------------


def test_buffer_spec_is_frozen_and_hashable() -> None:
    spec = BufferSpec(nolru=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.nolru = False  # type: ignore[misc]
    assert spec == BufferSpec(nolru=True)
    assert hash(spec) == hash(BufferSpec(nolru=True))
    assert spec != BufferSpec()


@pytest.mark.parametrize("field", ["uncached", "cpu_access", "host", "nolru", "zero"])
def test_buffer_spec_flags_must_be_bools(field: str) -> None:
    with pytest.raises(TypeError, match=field):
        BufferSpec(**{field: 1})  # type: ignore[arg-type]


@pytest.mark.parametrize("ptr", [0, -4096, 1.5, "0x1000", True])
def test_buffer_spec_external_ptr_must_be_a_positive_int(ptr: object) -> None:
    with pytest.raises((TypeError, ValueError), match="external_ptr"):
        BufferSpec(external_ptr=ptr)  # type: ignore[arg-type]


def test_buffer_spec_cacheable_only_without_nolru_zero_or_external_ptr() -> None:
    assert BufferSpec().cacheable
    assert BufferSpec(host=True, cpu_access=True, uncached=True).cacheable
    assert not BufferSpec(nolru=True).cacheable
    assert not BufferSpec(zero=True).cacheable
    assert not BufferSpec(external_ptr=4096).cacheable


def test_statistics_is_a_frozen_snapshot() -> None:
    stats = Device["NULL"].allocator.statistics()
    assert isinstance(stats, AllocatorStatistics)
    assert stats.device == "NULL"
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.hits = 0  # type: ignore[misc]
    for field in ("bytes_in_use", "bytes_cached", "hits", "misses"):
        assert type(getattr(stats, field)) is int


# ---- alloc / free validation and accounting ------------------------------------------------------


@pytest.mark.parametrize("nbytes", [0, -1, -4096])
async def test_alloc_of_a_non_positive_size_raises_value_error(nbytes: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        await Device["NULL"].allocator.alloc(nbytes)


@pytest.mark.parametrize("nbytes", [1.0, "64", None, True])
async def test_alloc_of_a_non_int_size_raises_type_error(nbytes: Any) -> None:
    with pytest.raises(TypeError, match="int"):
        await Device["NULL"].allocator.alloc(nbytes)


async def test_alloc_rejects_options_that_are_not_a_buffer_spec() -> None:
    with pytest.raises(TypeError, match="BufferSpec"):
        await Device["NULL"].allocator.alloc(64, {"nolru": True})  # type: ignore[arg-type]


async def test_alloc_and_free_account_bytes_in_use() -> None:
    alloc = Device["CPU"].allocator
    before = alloc.statistics()
    opaque = await alloc.alloc(12345, BufferSpec(nolru=True))
    during = alloc.statistics()
    assert during.bytes_in_use == before.bytes_in_use + 12345
    assert during.allocations == before.allocations + 1
    assert during.peak_bytes_in_use >= during.bytes_in_use
    await alloc.free(opaque, 12345, BufferSpec(nolru=True))
    after = alloc.statistics()
    assert after.bytes_in_use == before.bytes_in_use
    assert after.allocations == before.allocations


async def test_out_of_memory_raises_memory_error_naming_device_size_and_memory_in_use() -> None:
    alloc = Device["CPU"].allocator
    keep = await alloc.alloc(4096, BufferSpec(nolru=True))
    in_use = alloc.statistics().bytes_in_use
    with pytest.raises(MemoryError) as info:
        await alloc.alloc(2**60)
    message = str(info.value)
    assert message.startswith("CPU:")
    assert str(2**60) in message
    assert f"{in_use} bytes in use" in message
    assert alloc.statistics().bytes_in_use == in_use
    await alloc.free(keep, 4096, BufferSpec(nolru=True))


async def test_allocator_limit_caps_memory_in_use() -> None:
    async with rt.open_device("CPU:5") as dev:
        alloc = dev.allocator
        alloc.limit = 10_000
        first = await alloc.alloc(6000)
        with pytest.raises(MemoryError, match=r"CPU:5: .*7000 bytes.*6000 bytes in use.*limit"):
            await alloc.alloc(7000)
        assert alloc.statistics().bytes_in_use == 6000
        second = await alloc.alloc(4000)  # exactly at the limit is fine
        await alloc.free(first, 6000)
        await alloc.free(second, 4000)
        third = await alloc.alloc(7000)  # fits once the memory is back
        await alloc.free(third, 7000)


async def test_out_of_memory_frees_the_cache_and_retries_once() -> None:
    async with rt.open_device("NULL:5") as dev:
        alloc = dev.allocator
        cached = await alloc.alloc(3000)
        await alloc.free(cached, 3000)
        assert alloc.statistics().bytes_cached == 3000

        # the backend reports out of memory until the cache is released
        backend_alloc = alloc._alloc

        def alloc_unless_cached(nbytes: int, options: BufferSpec) -> Any:
            if alloc.statistics().bytes_cached:
                raise MemoryError("device memory exhausted")
            return backend_alloc(nbytes, options)

        alloc._alloc = alloc_unless_cached  # type: ignore[method-assign]
        got = await alloc.alloc(2000)
        assert alloc.statistics().bytes_cached == 0
        await alloc.free(got, 2000)


# ---- the LRU cache --------------------------------------------------------------------------------


async def test_lru_reuses_the_most_recently_freed_handle() -> None:
    alloc = Device["CPU"].allocator
    a = await alloc.alloc(8200)
    b = await alloc.alloc(8200)
    stats = alloc.statistics()
    await alloc.free(a, 8200)
    await alloc.free(b, 8200)
    assert alloc.statistics().bytes_cached == stats.bytes_cached + 16400
    assert await alloc.alloc(8200) is b
    assert await alloc.alloc(8200) is a
    after = alloc.statistics()
    assert after.hits == stats.hits + 2
    assert after.misses == stats.misses
    assert after.bytes_cached == stats.bytes_cached
    await alloc.free(a, 8200)
    await alloc.free(b, 8200)


async def test_lru_keys_on_size_and_spec() -> None:
    alloc = Device["CPU"].allocator
    a = await alloc.alloc(4104)
    await alloc.free(a, 4104)
    other_size = await alloc.alloc(4105)
    other_spec = await alloc.alloc(4104, BufferSpec(host=True))
    assert other_size is not a
    assert other_spec is not a
    assert await alloc.alloc(4104) is a
    for handle, n, spec in (
        (a, 4104, None),
        (other_size, 4105, None),
        (other_spec, 4104, BufferSpec(host=True)),
    ):
        await alloc.free(handle, n, spec)


async def test_lru_env_zero_disables_the_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LRU", "0")
    async with rt.open_device("CPU:7") as dev:
        alloc = dev.allocator
        a = await alloc.alloc(4096)
        await alloc.free(a, 4096)
        b = await alloc.alloc(4096)
        stats = alloc.statistics()
        assert b is not a
        assert stats.hits == 0
        assert stats.misses == 2
        assert stats.bytes_cached == 0
        await alloc.free(b, 4096)


@pytest.mark.parametrize("spec", [BufferSpec(nolru=True), BufferSpec(zero=True)], ids=["nolru", "zero"])
async def test_nolru_and_zero_bypass_the_cache(spec: BufferSpec) -> None:
    alloc = Device["CPU"].allocator
    before = alloc.statistics()
    a = await alloc.alloc(4096, spec)
    await alloc.free(a, 4096, spec)
    assert alloc.statistics().bytes_cached == before.bytes_cached
    b = await alloc.alloc(4096, spec)
    assert b is not a
    assert alloc.statistics().hits == before.hits
    await alloc.free(b, 4096, spec)


async def test_zero_spec_memory_is_zero_filled_even_when_a_dirty_block_is_cached() -> None:
    alloc = Device["CPU"].allocator
    dirty = await alloc.alloc(4096)
    await alloc.copyin(dirty, memoryview(b"\xff" * 4096))
    await alloc.free(dirty, 4096)
    clean = await alloc.alloc(4096, BufferSpec(zero=True))
    out = bytearray(4096)
    await alloc.copyout(memoryview(out), clean)
    assert out == bytes(4096)
    await alloc.free(clean, 4096, BufferSpec(zero=True))


async def test_external_ptr_wraps_caller_memory_and_is_never_cached() -> None:
    alloc = Device["CPU"].allocator
    host = np.zeros(16, np.float32)
    spec = BufferSpec(external_ptr=host.ctypes.data)
    before = alloc.statistics()
    opaque = await alloc.alloc(host.nbytes, spec)
    await alloc.copyin(opaque, np.arange(16, dtype=np.float32).data)
    assert host.tolist() == list(range(16))  # the device memory is the caller's memory
    await alloc.free(opaque, host.nbytes, spec)
    assert alloc.statistics().bytes_cached == before.bytes_cached
    assert host.tolist() == list(range(16))  # still the caller's, still intact
    again = await alloc.alloc(host.nbytes, spec)
    assert alloc.statistics().hits == before.hits
    await alloc.free(again, host.nbytes, spec)


async def test_free_cache_releases_every_cached_allocation() -> None:
    async with rt.open_device("NULL:5") as dev:
        alloc = dev.allocator
        handles = [await alloc.alloc(1000 * (i + 1)) for i in range(3)]
        for i, h in enumerate(handles):
            await alloc.free(h, 1000 * (i + 1))
        assert alloc.statistics().bytes_cached == 6000
        alloc.free_cache()
        assert alloc.statistics().bytes_cached == 0
        assert await alloc.alloc(1000) is not handles[0]


# ---- deferred free --------------------------------------------------------------------------------


async def test_free_after_pending_work_counts_as_in_use_until_that_work_completes() -> None:
    alloc = Device["CPU"].allocator
    async with gate_on("CPU") as gate:
        out = await int_buffer("CPU")
        sig = gate.launch(out)
        opaque = await alloc.alloc(4096, BufferSpec(nolru=True))
        in_use = alloc.statistics().bytes_in_use
        await alloc.free(opaque, 4096, BufferSpec(nolru=True), after=[sig])
        assert alloc.statistics().bytes_in_use == in_use  # returned at once, released later
        gate.open()
        await sig
        assert alloc.statistics().bytes_in_use == in_use - 4096
        await out.free()


# ---- raw copies -----------------------------------------------------------------------------------


async def test_allocator_copyin_copyout_round_trip() -> None:
    alloc = Device["CPU"].allocator
    opaque = await alloc.alloc(256)
    data = np.arange(64, dtype=np.int32)
    await alloc.copyin(opaque, data.data)
    out = np.zeros(64, np.int32)
    await alloc.copyout(out.data, opaque)
    assert out.tolist() == data.tolist()
    await alloc.free(opaque, 256)


async def test_allocator_copies_validate_host_buffers_before_enqueueing() -> None:
    dev = Device["CPU"]
    alloc = dev.allocator
    opaque = await alloc.alloc(64)
    submitted = dev._copy_queue.timeline.submitted
    with pytest.raises(TypeError, match="buffer protocol"):
        await alloc.copyin(opaque, [1, 2, 3])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="read-only"):
        await alloc.copyout(memoryview(b"\0" * 64), opaque)
    with pytest.raises(ValueError, match="contiguous"):
        await alloc.copyin(opaque, np.zeros((4, 4), np.float32)[:, ::2].data)
    with pytest.raises(ValueError, match="0 bytes"):
        await alloc.copyin(opaque, memoryview(b""))
    assert dev._copy_queue.timeline.submitted == submitted
    await alloc.free(opaque, 64)


async def test_allocator_copyin_larger_than_the_allocation_never_reports_success() -> None:
    async with rt.open_device("CPU:4") as dev:
        alloc = dev.allocator
        opaque = await alloc.alloc(16, BufferSpec(nolru=True))
        with pytest.raises((ValueError, DeviceError)) as info:
            await alloc.copyin(opaque, memoryview(bytes(64)))
        if isinstance(info.value, DeviceError):  # failed on the device: the cause is kept
            assert isinstance(info.value.cause, ValueError)
        await dev.reset()
        with pytest.raises((ValueError, DeviceError)) as info:
            await alloc.copyout(memoryview(bytearray(64)), opaque)
        if isinstance(info.value, DeviceError):
            assert isinstance(info.value.cause, ValueError)
        await dev.reset()
        await alloc.free(opaque, 16, BufferSpec(nolru=True))


async def test_allocator_transfer_copies_between_cpu_devices() -> None:
    src_dev, dst_dev = Device["CPU:1"], Device["CPU"]
    src = await src_dev.allocator.alloc(64)
    dst = await dst_dev.allocator.alloc(64)
    await src_dev.allocator.copyin(src, np.arange(16, dtype=np.float32).data)
    await dst_dev.allocator.transfer(dst, src, 64, src_dev)
    out = np.zeros(16, np.float32)
    await dst_dev.allocator.copyout(out.data, dst)
    assert out.tolist() == list(range(16))
    await src_dev.allocator.free(src, 64)
    await dst_dev.allocator.free(dst, 64)


# ---- the checkpoint rule ------------------------------------------------------------------------


async def test_alloc_is_a_checkpoint_and_allocates_nothing_when_cancelled() -> None:
    alloc = Device["CPU"].allocator
    before = alloc.statistics()
    await assert_cancelled_at_entry(lambda: alloc.alloc(4096))
    assert alloc.statistics() == before


async def test_free_is_a_checkpoint_and_frees_nothing_when_cancelled() -> None:
    alloc = Device["CPU"].allocator
    opaque = await alloc.alloc(4096)
    before = alloc.statistics()
    await assert_cancelled_at_entry(lambda: alloc.free(opaque, 4096))
    assert alloc.statistics() == before
    await alloc.free(opaque, 4096)


async def test_allocator_copyin_is_a_checkpoint_and_copies_nothing_when_cancelled() -> None:
    dev = Device["CPU"]
    alloc = dev.allocator
    opaque = await alloc.alloc(16)
    await alloc.copyin(opaque, memoryview(bytes(16)))
    await assert_cancelled_at_entry(lambda: alloc.copyin(opaque, memoryview(b"\x01" * 16)))
    await dev.synchronize()
    out = bytearray(16)
    await alloc.copyout(memoryview(out), opaque)
    assert out == bytes(16)
    await alloc.free(opaque, 16)


async def test_allocator_copyout_is_a_checkpoint_and_copies_nothing_when_cancelled() -> None:
    dev = Device["CPU"]
    alloc = dev.allocator
    opaque = await alloc.alloc(16)
    await alloc.copyin(opaque, memoryview(b"\x01" * 16))
    out = bytearray(16)
    await assert_cancelled_at_entry(lambda: alloc.copyout(memoryview(out), opaque))
    await dev.synchronize()
    assert out == bytes(16)
    await alloc.free(opaque, 16)


async def test_cpu_memory_of_at_least_shared_min_is_a_memory_file_open_while_allocated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LRU", "0")  # (freed memory is released at once, not cached)
    async with rt.open_device("CPU:8") as dev:
        alloc = dev.allocator
        monkeypatch.setattr(alloc, "shared_min", 1 << 20)
        buf = await rt.Buffer(dev.name, 1 << 20, rt.dtypes.uint8).allocate()
        small = await rt.Buffer(dev.name, (1 << 20) - 1, rt.dtypes.uint8).allocate()
        fd = buf.handle().fd
        assert fd >= 0 and small.handle().fd == -1
        assert buf.view(4096, rt.dtypes.uint8, 8192).handle().fd == fd
        await buf.copyin(np.full(1 << 20, 0x3C, np.uint8))
        with open(f"/proc/self/fd/{fd}", "rb") as f:  # (what another process maps: the same bytes)
            assert f.read() == b"\x3c" * (1 << 20)
        ino = os.fstat(fd).st_ino
        await buf.free()
        await small.free()
        try:
            assert os.fstat(fd).st_ino != ino  # (closed at the free; the number may be reused)
        except OSError:
            pass


async def test_memory_files_stop_at_half_the_file_descriptor_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    from aiotinyrt.backends import ops_cpu

    monkeypatch.setattr(ops_cpu, "fd_limit", lambda: 4)  # (room for one: two descriptors each)
    async with rt.open_device("CPU:8") as dev:
        monkeypatch.setattr(dev.allocator, "shared_min", 1 << 20)
        first = await rt.Buffer(dev.name, 1 << 20, rt.dtypes.uint8).allocate()
        second = await rt.Buffer(dev.name, 2 << 20, rt.dtypes.uint8).allocate()
        assert first.handle().fd >= 0 and second.handle().fd == -1
        await first.free()
        dev.allocator.free_cache()
        third = await rt.Buffer(dev.name, 3 << 20, rt.dtypes.uint8).allocate()
        assert third.handle().fd >= 0  # (the first's file was closed: room again)


async def test_a_memory_file_never_freed_is_closed_with_its_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    async with rt.open_device("CPU:8") as dev:
        alloc = dev.allocator
        monkeypatch.setattr(alloc, "shared_min", 1 << 20)
        handle = await alloc.alloc(1 << 20)
        fd, files = handle.fd, alloc._files
        ino = os.fstat(fd).st_ino
        del handle  # (dropped without a free: its mmap goes with it)
        gc.collect()
        assert alloc._files == files - 1
        try:
            assert os.fstat(fd).st_ino != ino
        except OSError:
            pass
