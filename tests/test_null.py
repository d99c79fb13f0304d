"""The NULL backend: real queues and signals, no work, no data."""

from __future__ import annotations

import numpy as np
import pytest

import aiotinyrt as rt
from aiotinyrt import Buffer, Device, dtypes
from tests.helpers import int_buffer

pytestmark = pytest.mark.anyio


async def test_null_compiler_accepts_any_source_and_kernels_run() -> None:
    dev = Device["NULL"]
    prog = await dev.program("whatever", "this is {{ not C at all")
    buf = await Buffer("NULL", 1024, dtypes.float32).allocate()
    secs = await dev.run(prog, buf, buf, vals=(1, 2, 3), global_size=(1024, 1, 1))
    assert type(secs) is float
    assert (await dev.compiler.compile_cached("")) != b""  # even empty source yields a binary
    await buf.free()


async def test_null_compiler_compiles_every_time_it_has_no_cache() -> None:
    compiler = Device["NULL"].compiler
    before = compiler.compiles
    await compiler.compile_cached("x")
    await compiler.compile_cached("x")
    assert compiler.compiles == before + 2


async def test_null_copyout_raises_unless_allowed() -> None:
    buf = await Buffer("NULL", 4, dtypes.int32).allocate()
    await buf.copyin(np.arange(4, dtype=np.int32))
    with pytest.raises(RuntimeError, match="NULL_ALLOW_COPYOUT=1"):
        await buf.copyout(np.zeros(4, np.int32))
    with pytest.raises(RuntimeError, match="NULL_ALLOW_COPYOUT=1"):
        await buf.numpy()
    with pytest.raises(RuntimeError, match="NULL_ALLOW_COPYOUT=1"):
        await Device["NULL"].allocator.copyout(memoryview(bytearray(16)), buf.handle())
    await buf.free()


async def test_null_allow_copyout_reads_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NULL_ALLOW_COPYOUT", "1")
    async with rt.open_device("NULL:6"):
        buf = await Buffer("NULL:6", 4, dtypes.int32).allocate()
        await buf.copyin(np.arange(1, 5, dtype=np.int32))
        out = np.full(4, 7, np.int32)
        await buf.copyout(out)
        assert out.tolist() == [0, 0, 0, 0]
        assert (await buf.numpy()).tolist() == [0, 0, 0, 0]
        cpu = await int_buffer("CPU", 9, size=4)
        await cpu.copy_from(buf)
        assert (await cpu.numpy()).tolist() == [0, 0, 0, 0]
        await cpu.free()
        await buf.free()


async def test_null_allocator_accounts_like_a_real_one() -> None:
    async with rt.open_device("NULL:6") as dev:
        alloc = dev.allocator
        a = await Buffer("NULL:6", 1000, dtypes.float64).allocate()
        assert alloc.statistics().bytes_in_use == 8000
        await a.free()
        stats = alloc.statistics()
        assert (stats.bytes_in_use, stats.bytes_cached, stats.misses) == (0, 8000, 1)
        b = await Buffer("NULL:6", 1000, dtypes.float64).allocate()
        assert alloc.statistics().hits == 1
        await b.free()


async def test_null_views_and_copies_between_null_buffers_work() -> None:
    base = await Buffer("NULL", 16, dtypes.float32).allocate()
    view = base.view(4, dtypes.float32, 8)
    other = await Buffer("NULL", 4, dtypes.float32).allocate()
    await view.copy_from(other)
    await other.copy_from(view)
    await base.free()
    await other.free()


async def test_null_launch_validation_matches_other_backends() -> None:
    prog = await Device["NULL"].program("k", "k")
    cpu_buf = await int_buffer("CPU")
    with pytest.raises(ValueError, match="CPU"):
        prog(cpu_buf)
    with pytest.raises(TypeError, match="int"):
        prog(vals=(1.5,))  # type: ignore[arg-type]
    freed = await Buffer("NULL", 1, dtypes.int32).allocate()
    await freed.free()
    with pytest.raises(RuntimeError, match="use after free"):
        prog(freed)
    await cpu_buf.free()


def test_null_is_never_the_default_device(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DEV", raising=False)
    assert Device.DEFAULT != "NULL"
