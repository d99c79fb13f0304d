"""Remote devices on Ray (aiotinyrt/ray/) side by side with bare Ray, on a local cluster.

    python bench/ray.py            # 7 repetitions, 10,000 pipelined launches, 64 MiB copies
    python bench/ray.py --quick    # 3 repetitions, 2,000 launches, 16 MiB copies
    python bench/ray.py --chunk-mib 64   # copies in pieces of 64 MiB (default: wire.CHUNK_BYTES)

Rows: a bare async-actor call per launch (the anchor: ``await actor.f.remote()``, one after
another) and the same calls pipelined (all sent, then gathered); aiotinyrt's remote device:
pipelined launches (all submitted in one loop turn, the last awaited), launch + await round
trip; copyin/copyout against ``ray.put``/``ray.get`` of the same array and against a bare actor
call taking/returning it; copy_from between two hosts. Medians over the repetitions; asyncio.
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


@ray.remote(num_cpus=0)
class Bare:
    """The anchor a user would write: an async actor with a method per operation."""

    async def launch(self) -> None:
        return None

    async def sink(self, data: np.ndarray[Any, Any]) -> int:
        return int(data.nbytes)

    async def source(self, nbytes: int) -> np.ndarray[Any, Any]:
        return np.ones(nbytes, np.uint8)


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    start = time.perf_counter()
    await fn()
    return time.perf_counter() - start


async def main(reps: int, launches: int, copy_mib: int) -> None:
    bare = Bare.remote()
    await bare.launch.remote()
    for name in ("b1", "b2"):
        await airay.start_host(name).ping.remote()
    dev = Device["RAY:b1/CPU"]
    other = Device["RAY:b2/CPU"]
    prog = await dev.program("k", KERNEL)
    a = await Buffer(dev.name, 1, dtypes.float32).allocate()
    b = await Buffer(dev.name, 1, dtypes.float32).allocate()
    await prog(a, b)
    nbytes = copy_mib * MiB
    host = np.ones(nbytes, np.uint8)
    out = np.empty(nbytes, np.uint8)
    big = await Buffer(dev.name, nbytes, dtypes.uint8).allocate()
    far = await Buffer(other.name, nbytes, dtypes.uint8).allocate()
    await big.copyin(host)
    rt_n = 200
    pipe_bare_n = min(launches, 2000)
    rows: dict[str, list[float]] = {}

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
        add(f"copyin {copy_mib} MiB (GB/s)", gbs / await timed(lambda: big.copyin(host)))
        add(f"copyout {copy_mib} MiB (GB/s)", gbs / await timed(lambda: big.copyout(out)))
        start = time.perf_counter()
        ref = ray.put(host)
        put_s = time.perf_counter() - start
        add(f"ray.put {copy_mib} MiB (GB/s)", gbs / put_s)
        start = time.perf_counter()
        np.copyto(out, ray.get(ref))  # (a zero-copy get; the copy makes it land in `out`)
        add(f"ray.get {copy_mib} MiB into an array (GB/s)", gbs / (time.perf_counter() - start))
        del ref
        sink = await timed(lambda: bare.sink.remote(host))
        add(f"bare actor call taking {copy_mib} MiB (GB/s)", gbs / sink)

        async def fetch() -> None:
            np.copyto(out, await bare.source.remote(nbytes))

        add(f"bare actor call returning {copy_mib} MiB (GB/s)", gbs / await timed(fetch))
        add(f"copy_from host to host {copy_mib} MiB (GB/s)", gbs / await timed(lambda: far.copy_from(big)))

    anchor = statistics.median(rows["bare actor call, one after another (µs/call)"])
    med = {row: statistics.median(values) for row, values in rows.items()}
    put = med[f"ray.put {copy_mib} MiB (GB/s)"]
    get = med[f"ray.get {copy_mib} MiB into an array (GB/s)"]
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
        elif row.startswith(("copyin", "copy_from")):
            ratio = f"{value / put:.0%} of ray.put"
        elif row.startswith("copyout"):
            ratio = f"{value / get:.0%} of ray.get into an array"
        print(f"| {row} | {value:,.2f} | {ratio} |")
    for buf in (a, b, big, far):
        await buf.free()
    await dev.aclose()
    await other.aclose()


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
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        if args.quick:
            asyncio.run(main(3, 2000, 16))
        else:
            asyncio.run(main(7, 10000, 64))
    finally:
        ray.shutdown()
        shutil.rmtree(_TMP, ignore_errors=True)
        sys.stdout.flush()
