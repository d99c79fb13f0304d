"""Event-loop lag while freeing 1 GiB of touched CPU memory, with the mappings unmapped on the
unmapper thread (how the runtime frees) and, for comparison, unmapped by the freeing thread (the
loop), for each way memory leaves without the cache: ``free()`` of ``nolru`` and ``zero``
buffers, ``free()`` with the cache disabled (``LRU=0``) and ``free_cache()``.

    python bench/free_lag.py                    # 4 x 256 MiB, every loop
    python bench/free_lag.py --mib 128 --count 2 --loops trio

A ticker task sleeps 1 ms at a time and records how late it wakes; the table shows the largest
lateness (the loop's lag) and the time the loop spent inside the frees.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np

from aiotinyrt import Buffer, BufferSpec, Device, dtypes
from aiotinyrt.backends import ops_cpu
from aiotinyrt.host import memory as host_memory

LOOPS = {"asyncio": ("asyncio", {}), "uvloop": ("asyncio", {"use_uvloop": True}), "trio": ("trio", {})}
DEV = "CPU:2"


async def measure(free_all: Callable[[], Awaitable[None]]) -> tuple[float, float]:
    """(largest loop lag, seconds the loop spent in ``free_all``), both in ms."""
    lag = [0.0]
    stop = anyio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            before = time.perf_counter()
            await anyio.sleep(0.001)
            lag[0] = max(lag[0], time.perf_counter() - before - 0.001)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await anyio.sleep(0.02)
        lag[0] = 0.0
        start = time.perf_counter()
        await free_all()
        spent = time.perf_counter() - start
        await anyio.to_thread.run_sync(host_memory.unmapper.drain)  # the unmapping itself, off the loop
        await anyio.sleep(0.02)
        stop.set()
    return lag[0] * 1e3, spent * 1e3


async def touched(nbytes: int, count: int, spec: BufferSpec | None) -> list[Buffer]:
    bufs = [await Buffer(DEV, nbytes, dtypes.uint8, spec).allocate() for _ in range(count)]
    ones = np.ones(nbytes, np.uint8)
    for b in bufs:
        await b.copyin(ones)
    return bufs


async def case(how: str, nbytes: int, count: int) -> tuple[float, float]:
    alloc = Device[DEV].allocator
    assert isinstance(alloc, ops_cpu.CPUAllocator)
    spec = {"nolru": BufferSpec(nolru=True), "zero": BufferSpec(zero=True)}.get(how)
    bufs = await touched(nbytes, count, spec)
    enabled = alloc.enabled
    if how == "LRU=0":
        alloc.enabled = False
    try:
        if how == "free_cache()":
            for b in bufs:
                await b.free()

            async def free_all() -> None:
                alloc.free_cache()
                await anyio.lowlevel.checkpoint()

        else:

            async def free_all() -> None:
                for b in bufs:
                    await b.free()

        return await measure(free_all)
    finally:
        alloc.enabled = enabled


async def run(nbytes: int, count: int) -> list[tuple[str, str, float, float]]:
    # the machine's own noise: the same ticker while nothing is freed
    rows = [("nothing (baseline)", "-", *await measure(anyio.lowlevel.checkpoint))]
    inline = host_memory.UNMAP_INLINE_BYTES
    for how in ("nolru", "zero", "LRU=0", "free_cache()"):
        for where, limit in (("unmapper thread", inline), ("loop thread", 1 << 62)):
            host_memory.UNMAP_INLINE_BYTES = limit
            try:
                lag, spent = await case(how, nbytes, count)
            finally:
                host_memory.UNMAP_INLINE_BYTES = inline
            rows.append((how, where, lag, spent))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="size of each buffer")
    parser.add_argument("--count", type=int, default=4, help="buffers freed at once")
    parser.add_argument("--loops", default="asyncio,uvloop,trio")
    args = parser.parse_args()
    print(f"freeing {args.count} x {args.mib} MiB of touched memory\n")
    print("| loop | how | unmapped on | max loop lag ms | loop time in the frees ms |")
    print("|---|---|---|---:|---:|")
    for loop in args.loops.split(","):
        backend, options = LOOPS[loop]
        rows = anyio.run(run, args.mib << 20, args.count, backend=backend, backend_options=options)
        for how, where, lag, spent in rows:
            print(f"| {loop} | {how} | {where} | {lag:.2f} | {spent:.2f} |")


if __name__ == "__main__":
    main()
