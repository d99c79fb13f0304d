"""Remote devices on Ray (aiotinyrt/ray/) side by side with bare Ray, on a local cluster.

    python bench/ray.py            # 7 repetitions, 10,000 pipelined launches, 64 MiB copies
    python bench/ray.py --quick    # 3 repetitions, 2,000 launches, 16 MiB copies
    python bench/ray.py --chunk-mib 16   # copies in pieces of 16 MiB (default: wire.CHUNK_BYTES)

The cluster is the bench's own (``address="local"``: 2 CPUs, a 1 GiB object store, so store
memory is reused from the first repetition on). Medians over the repetitions; asyncio. Rows:

- bare actor call, one after another: ``await actor.launch.remote()`` of a method returning
  None, 200 times (the anchor of the launch rows); pipelined: 2,000 sent, then gathered.
- remote launches pipelined: a one-float kernel on ``RAY:b1/CPU``, all submitted in one loop
  turn, the last awaited; round trip: one launch awaited, 200 times.
- copyin / copyout: ``Buffer.copyin`` / ``copyout`` of 64 MiB between a numpy array here and a
  buffer of ``RAY:b1/CPU``; the stall row is the longest a 1 ms sleep on the loop overslept
  during the copyin (what the copy took from other tasks).
- ray.put: one ``ray.put`` of the same array (the object store's own put: one copy into the
  store); ray.get into an array: ``ray.get`` of that object (zero-copy, it is mapped here) and
  ``np.copyto`` into the destination array: one copy. The issue's targets compare the copies
  with these two.
- bare Ray copyin: what a copyin does, written with bare Ray: ``ray.put`` here, then a call of
  an actor that copies the array into memory of its own (two copies, as a copyin); its put is
  reported below it. Bare Ray copyout: the actor puts its memory, ``ray.get`` here and
  ``np.copyto`` into the array (two copies, as a copyout); the actor's put is reported below.
- copy_from host to host: ``copy_from`` from that buffer into one of ``RAY:b2/CPU``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

# This file is called ray.py: drop bench/ from the path so ``import ray`` finds Ray.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
_TMP = tempfile.mkdtemp(prefix="aiotinyrt-bench-")
os.environ.setdefault("CACHEDB", os.path.join(_TMP, "cache.db"))

import numpy as np  # noqa: E402
import ray  # noqa: E402

from aiotinyrt import Buffer, Device, dtypes  # noqa: E402
from aiotinyrt import ray as airay  # noqa: E402
from aiotinyrt.ray import wire  # noqa: E402

KERNEL = "void k(float* restrict a, const float* restrict b) { a[0] = b[0] + 1.0f; }"
MiB = 1 << 20
#: The object store's size: small enough that its memory is reused (warm) from the first
#: repetition on, as in a long-running service; Ray's default (30 % of RAM) would hand each put
#: memory never touched before, whose page faults then dominate every row that puts.
STORE_BYTES = 1 << 30
LIKE_IN = "bare Ray copyin: ray.put here, an actor copies it into its memory (GB/s)"
LIKE_OUT = "bare Ray copyout: an actor puts its memory, ray.get here into an array (GB/s)"


@ray.remote(num_cpus=0)
class Bare:
    """The anchor a user would write: an async actor with a method per operation, holding an
    array of its own (the stand-in for a device buffer in its memory)."""

    def __init__(self, nbytes: int) -> None:
        self.memory = np.ones(nbytes, np.uint8)

    async def launch(self) -> None:
        return None

    async def take(self, refs: list[Any]) -> None:
        """What a copyin does on a host: read the put array zero-copy, copy it into memory."""
        np.copyto(self.memory, await refs[0])

    async def give(self) -> tuple[list[Any], float]:
        """What a copyout does on a host: put its memory, hand back the ref (and the put's
        seconds)."""
        start = time.perf_counter()
        ref = ray.put(self.memory)
        return [ref], time.perf_counter() - start


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


async def main(reps: int, launches: int, copy_mib: int) -> None:
    nbytes = copy_mib * MiB
    bare = Bare.remote(nbytes)
    await bare.launch.remote()
    for name in ("b1", "b2"):
        await airay.start_host(name).ping.remote()
    dev = Device["RAY:b1/CPU"]
    other = Device["RAY:b2/CPU"]
    prog = await dev.program("k", KERNEL)
    a = await Buffer(dev.name, 1, dtypes.float32).allocate()
    b = await Buffer(dev.name, 1, dtypes.float32).allocate()
    await prog(a, b)
    host = np.ones(nbytes, np.uint8)
    out = np.empty(nbytes, np.uint8)
    big = await Buffer(dev.name, nbytes, dtypes.uint8).allocate()
    far = await Buffer(other.name, nbytes, dtypes.uint8).allocate()
    await big.copyin(host)
    rt_n = 200
    pipe_bare_n = min(launches, 2000)
    rows: dict[str, list[float]] = {}
    parts: list[float] = []  # (the put times the bare Ray copies report)

    def add(row: str, value: float) -> None:
        rows.setdefault(row, []).append(value)

    for _ in range(reps):
        t = await timed(lambda: _sequential(bare, rt_n))
        add("bare actor call, one after another (µs/call)", t / rt_n * 1e6)
        t = await timed(lambda: asyncio.gather(*[bare.launch.remote() for _ in range(pipe_bare_n)]))
        add("bare actor calls pipelined (µs/call)", t / pipe_bare_n * 1e6)

        async def pipelined() -> None:
            sig = None
            for _ in range(launches):
                sig = prog(a, b)
            await sig

        t = await timed(pipelined)
        add(f"remote launches pipelined, {launches:,} (µs/launch)", t / launches * 1e6)

        async def round_trips() -> None:
            for _ in range(rt_n):
                await prog(a, b)

        t = await timed(round_trips)
        add("remote launch + await round trip (µs)", t / rt_n * 1e6)

        gbs = nbytes / 1e9
        stall: list[float] = []
        add(f"copyin {copy_mib} MiB (GB/s)", gbs / await _watched(lambda: big.copyin(host), stall))
        add("longest event-loop stall during that copyin (ms)", stall[0] * 1e3)
        add(f"copyout {copy_mib} MiB (GB/s)", gbs / await timed(lambda: big.copyout(out)))
        start = time.perf_counter()
        ref = ray.put(host)
        put_s = time.perf_counter() - start
        add(f"ray.put {copy_mib} MiB (GB/s)", gbs / put_s)
        start = time.perf_counter()
        np.copyto(out, ray.get(ref))  # (a zero-copy get; the copy makes it land in `out`)
        add(f"ray.get {copy_mib} MiB into an array (GB/s)", gbs / (time.perf_counter() - start))
        del ref
        parts.clear()
        add(LIKE_IN, gbs / await timed(lambda: _take(bare, host, parts)))
        add("  its ray.put here (GB/s)", gbs / parts.pop())
        add(LIKE_OUT, gbs / await timed(lambda: _give(bare, out, parts)))
        add("  its ray.put in the actor (GB/s)", gbs / parts.pop())
        add(f"copy_from host to host {copy_mib} MiB (GB/s)", gbs / await timed(lambda: far.copy_from(big)))

    anchor = statistics.median(rows["bare actor call, one after another (µs/call)"])
    med = {row: statistics.median(values) for row, values in rows.items()}
    put = med[f"ray.put {copy_mib} MiB (GB/s)"]
    get = med[f"ray.get {copy_mib} MiB into an array (GB/s)"]
    like_in, like_out = med[LIKE_IN], med[LIKE_OUT]
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    chunk = wire.CHUNK_BYTES // MiB
    print(f"bench/ray.py: {reps} repetitions, medians; Ray {ray.__version__}, {os.cpu_count()} cores")
    print(f"copies in pieces of {chunk} MiB")
    print(f"load average at the end (1 / 5 / 15 min): {load}\n")
    print("| row | median | vs bare actor call / the object store |")
    print("|---|---|---|")
    for row, value in med.items():
        ratio = f"{anchor / value:.1f}× the rate" if "µs" in row else ""
        if "round trip" in row:
            ratio = f"{value / anchor:.2f}× one call"
        elif row.startswith("copyin"):
            ratio = f"{value / put:.0%} of ray.put; {value / like_in:.0%} of bare Ray's"
        elif row.startswith("copy_from"):
            ratio = f"{value / put:.0%} of ray.put"
        elif row.startswith("copyout"):
            ratio = (
                f"{value / get:.0%} of ray.get into an array; {value / like_out:.0%} of bare Ray's copyout"
            )
        print(f"| {row} | {value:,.2f} | {ratio} |")
    for buf in (a, b, big, far):
        await buf.free()
    await dev.aclose()
    await other.aclose()


async def _take(bare: Any, data: np.ndarray[Any, Any], put: list[float]) -> None:
    start = time.perf_counter()
    ref = ray.put(data)
    put.append(time.perf_counter() - start)
    await bare.take.remote([ref])


async def _give(bare: Any, out: np.ndarray[Any, Any], put: list[float]) -> None:
    refs, seconds = await bare.give.remote()
    put.append(seconds)
    np.copyto(out, await refs[0])


async def _watched(fn: Callable[[], Awaitable[object]], stall: list[float]) -> float:
    """``timed(fn)``, while a task on the loop measures the longest time the loop did not run
    it past a 1 ms sleep (appended to ``stall``)."""
    longest = 0.0
    done = asyncio.Event()

    async def tick() -> None:
        nonlocal longest
        while not done.is_set():
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            longest = max(longest, time.perf_counter() - start - 0.001)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)
    seconds = await timed(fn)
    done.set()
    await ticker
    stall.append(longest)
    return seconds


async def _sequential(bare: Any, n: int) -> None:
    for _ in range(n):
        await bare.launch.remote()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--chunk-mib", type=int, default=None, help="the copies' piece size")
    args = parser.parse_args()
    if args.chunk_mib is not None:
        wire.CHUNK_BYTES = args.chunk_mib * MiB
    # (address="local": a cluster of its own, even where another is running on the machine)
    ray.init(
        address="local",
        num_cpus=2,
        object_store_memory=STORE_BYTES,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        if args.quick:
            asyncio.run(main(3, 2000, 16))
        else:
            asyncio.run(main(7, 10000, 64))
    finally:
        ray.shutdown()
        shutil.rmtree(_TMP, ignore_errors=True)
        sys.stdout.flush()
