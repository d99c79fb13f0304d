"""Remote devices on Ray (aiotinyrt/ray/) side by side with bare Ray, on a local cluster.

    python bench/ray.py            # 7 repetitions, 10,000 pipelined launches, 64 MiB copies
    python bench/ray.py --quick    # 3 repetitions, 2,000 launches, 16 MiB copies
    python bench/ray.py --chunk-mib 16   # staged and store copies in pieces of 16 MiB
    python bench/ray.py --only roundtrip [--reps N]   # the launch rows, and where a round trip goes

The cluster is the bench's own (``address="local"``: 2 CPUs, a 1 GiB object store, so store
memory is reused from the first repetition on). Medians over the repetitions; asyncio. Rows:

- bare actor call, one after another: ``await actor.launch.remote()`` of a method returning
  None (the anchor of the launch rows), 200 calls, each followed by one round trip (below) and
  each call timed: the row is the median call, so anchor and round trip see the same load;
  pipelined: 2,000 sent, then gathered.
- remote launches pipelined: a one-float kernel on ``RAY:b1/CPU``, all submitted in one loop
  turn, the last awaited; round trip: one launch awaited (the median of the 200 calls made in
  turn with the anchor's).
- copyin / copyout: ``Buffer.copyin`` / ``copyout`` of 64 MiB between a numpy array here and a
  buffer of ``RAY:b1/CPU`` with nothing pending on it, as a user makes them: one ``memcpy`` here
  between the array and the host's memory, mapped (``aiotinyrt/ray/shared.py``; the first copy
  of the buffer goes through the host and names its memory). The stall row is the longest a 1
  ms sleep on the loop overslept during the copyin (what the copy took from other tasks). The
  indented rows: the same copies through the host (the connection told not to map its
  memory), the way the connection's probe chose (printed above the table: ``direct`` where the
  host may read and write this process's memory: one copy by the host), then with the way set
  to ``staged`` (a shared-memory segment, two copies) and ``store`` (``ray.put`` / ``get``, two
  copies), as where the host may not (another user, Yama's ptrace_scope, another machine).
- ray.put: one ``ray.put`` of the same array (the object store's own put: one copy into the
  store); ray.get into an array: ``ray.get`` of that object (zero-copy, it is mapped here) and
  ``np.copyto`` into the destination array: one copy. The issue's targets compare the copies
  with these two.
- bare Ray copyin: what a copyin does, written with bare Ray: ``ray.put`` here, then a call of
  an actor that copies the array into memory of its own (two copies, as a copyin); its put is
  reported below it. Bare Ray copyout: the actor puts its memory, ``ray.get`` here and
  ``np.copyto`` into the array (two copies, as a copyout); the actor's put is reported below.
- bare Ray direct copyin / copyout: the best pattern of this machine, written with bare Ray
  and no stream: a call of the actor that copies this process's array into its memory with
  ``process_vm_readv`` (``staging.direct_copy``: two threads), or writes its memory into the
  array here with ``process_vm_writev``: one round trip and one copy, the ceiling of the direct
  way.
- copy_from host to host: ``copy_from`` from that buffer into one of ``RAY:b2/CPU`` (one copy,
  the source host writing the destination's memory, where it may; else through the store).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import threading
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
from aiotinyrt.ray import staging, wire  # noqa: E402

KERNEL = "void k(float* restrict a, const float* restrict b) { a[0] = b[0] + 1.0f; }"
MiB = 1 << 20
#: The object store's size: small enough that its memory is reused (warm) from the first
#: repetition on, as in a long-running service; Ray's default (30 % of RAM) would hand each put
#: memory never touched before, whose page faults then dominate every row that puts.
STORE_BYTES = 1 << 30
LIKE_IN = "bare Ray copyin: ray.put here, an actor copies it into its memory (GB/s)"
LIKE_OUT = "bare Ray copyout: an actor puts its memory, ray.get here into an array (GB/s)"
DIRECT_IN = "bare Ray direct copyin: an actor copies the array here into its memory (GB/s)"
DIRECT_OUT = "bare Ray direct copyout: an actor writes its memory into the array here (GB/s)"


@ray.remote(num_cpus=0)
class Bare:
    """The anchor a user would write: an async actor with a method per operation, holding an
    array of its own (the stand-in for a device buffer in its memory)."""

    def __init__(self, nbytes: int) -> None:
        self.memory = np.ones(nbytes, np.uint8)

    async def launch(self) -> None:
        return None

    async def take_bytes(self, blob: bytes) -> None:
        return None

    async def take(self, refs: list[Any]) -> None:
        """What a copyin does on a host: read the put array zero-copy, copy it into memory."""
        np.copyto(self.memory, await refs[0])

    async def pull(self, there: Any) -> None:
        """The direct way's best pattern: copy the caller's array into memory (one kernel copy)."""
        await asyncio.to_thread(
            staging.direct_copy, there, staging.address(self.memory), self.memory.nbytes, False
        )

    async def push(self, there: Any) -> None:
        """The direct way's best pattern: write memory into the caller's array."""
        await asyncio.to_thread(
            staging.direct_copy, there, staging.address(self.memory), self.memory.nbytes, True
        )

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


async def roundtrip(reps: int, n: int) -> None:
    """``--only roundtrip``: the launch rows only, and where a round trip's time goes: the host's
    ``run`` of an empty batch and of one launch awaited straight on the loop (another client id,
    so its batches are numbered apart from the device's), and a bare call whose reply a thread
    ``ray.get``\\ s and hands to the loop (the stream's waiter-thread path)."""
    bare = Bare.remote(1)
    await bare.launch.remote()
    host = airay.start_host("b1")
    await host.ping.remote()
    dev = Device["RAY:b1/CPU"]
    prog = await dev.program("k", KERNEL)
    a = await Buffer(dev.name, 1, dtypes.float32).allocate()
    b = await Buffer(dev.name, 1, dtypes.float32).allocate()
    await prog(a, b)
    client, seq = "bench-" + os.urandom(4).hex(), 0

    async def run(batch: list[Any]) -> None:
        nonlocal seq
        seq += 1
        await host.run.remote(*wire.encode(client, seq, batch))

    await run([(wire.ALLOC, "CPU", 1, 4, False), (wire.ALLOC, "CPU", 2, 4, False)])
    launch = (wire.LAUNCH, 0, "CPU", prog.key, [(1, 4, 0), (2, 4, 0)], (1,), None, (), [])  # type: ignore[attr-defined]
    loop = asyncio.get_running_loop()

    async def threaded() -> None:
        fut = loop.create_future()

        def wait(ref: Any) -> None:
            ray.get(ref)
            loop.call_soon_threadsafe(fut.set_result, None)

        threading.Thread(target=wait, args=(bare.launch.remote(),)).start()
        await fut

    rows: dict[str, list[float]] = {}
    steps: list[tuple[str, Callable[[], Awaitable[object]]]] = [
        ("bare actor call (µs)", lambda: bare.launch.remote()),
        ("bare actor call, its reply ray.get on a new thread (µs)", threaded),
        ("bare actor call of one bytes argument (µs)", lambda: bare.take_bytes.remote(b"x" * 200)),
        ("host ping, awaited on the loop (µs)", lambda: host.ping.remote()),
        ("host run of an empty batch, awaited on the loop (µs)", lambda: run([])),
        ("host run of one launch, awaited on the loop (µs)", lambda: run([launch])),
        ("remote launch + await round trip (µs)", lambda: prog(a, b)),
    ]
    for _ in range(reps):
        # one call of each row in turn, timed apart: the rows see the same load
        for _ in range(n):
            for row, step in steps:
                start = time.perf_counter()
                await step()
                rows.setdefault(row, []).append((time.perf_counter() - start) * 1e6)
        t = await timed(lambda: _pipelined(prog, a, b, 2000))
        rows.setdefault("remote launches pipelined, 2,000 (µs/launch)", []).append(t / 2000 * 1e6)
        t = await timed(lambda: asyncio.gather(*[bare.launch.remote() for _ in range(2000)]))
        rows.setdefault("bare actor calls pipelined, 2,000 (µs/call)", []).append(t / 2000 * 1e6)
    await run([(wire.FREE, 1), (wire.FREE, 2)])
    anchor = statistics.median(rows[steps[0][0]])
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"bench/ray.py --only roundtrip: {reps} × {n} calls of each row, interleaved; Ray {ray.__version__}"
    )
    print(f"load average at the end (1 / 5 / 15 min): {load}\n")
    print("| row | median | quartiles | vs one bare actor call |")
    print("|---|---|---|---|")
    for row, values in rows.items():
        med = statistics.median(values)
        ratio = f"{anchor / med:.1f}× the rate" if "pipelined" in row else f"{med / anchor:.2f}×"
        q1, _, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (med, med, med)
        print(f"| {row} | {med:,.0f} | {q1:,.0f}..{q3:,.0f} | {ratio} |")
    for buf in (a, b):
        await buf.free()
    await dev.aclose()


async def _pipelined(prog: Any, a: Buffer, b: Buffer, n: int) -> None:
    sig = None
    for _ in range(n):
        sig = prog(a, b)
    await sig


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
        # the anchor and the round trip call by call in turn, each call timed: both see the
        # same load (timed as two blocks, the first took the previous repetition's copies'
        # aftermath, or a burst of another job, alone)
        bare_s: list[float] = []
        trip_s: list[float] = []
        for _ in range(rt_n):
            bare_s.append(await timed(lambda: bare.launch.remote()))
            trip_s.append(await timed(lambda: prog(a, b)))
        add("bare actor call, one after another (µs/call)", statistics.median(bare_s) * 1e6)
        t = await timed(lambda: asyncio.gather(*[bare.launch.remote() for _ in range(pipe_bare_n)]))
        add("bare actor calls pipelined (µs/call)", t / pipe_bare_n * 1e6)

        async def pipelined() -> None:
            sig = None
            for _ in range(launches):
                sig = prog(a, b)
            await sig

        t = await timed(pipelined)
        add(f"remote launches pipelined, {launches:,} (µs/launch)", t / launches * 1e6)
        add("remote launch + await round trip (µs)", statistics.median(trip_s) * 1e6)

        gbs = nbytes / 1e9
        stall: list[float] = []
        add(f"copyin {copy_mib} MiB (GB/s)", gbs / await _watched(lambda: big.copyin(host), stall))
        add("longest event-loop stall during that copyin (ms)", stall[0] * 1e3)
        add(f"copyout {copy_mib} MiB (GB/s)", gbs / await timed(lambda: big.copyout(out)))
        conn = dev.conn  # type: ignore[attr-defined]
        probed = conn.staging.mode
        conn.staging.memory.refused = True  # (every copy through the host)
        for mode in dict.fromkeys((probed, staging.STAGED, staging.STORE)):
            conn.staging.mode = mode
            add(f"  copyin {mode} (GB/s)", gbs / await timed(lambda: big.copyin(host)))
            add(f"  copyout {mode} (GB/s)", gbs / await timed(lambda: big.copyout(out)))
        conn.staging.mode = probed
        conn.staging.memory.refused = False
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
        there_in = staging.Direct.here(staging.address(host), host.nbytes)
        add(DIRECT_IN, gbs / await timed(lambda there=there_in: bare.pull.remote(there)))
        there_out = staging.Direct.here(staging.address(out), out.nbytes)
        add(DIRECT_OUT, gbs / await timed(lambda there=there_out: bare.push.remote(there)))
        add(f"copy_from host to host {copy_mib} MiB (GB/s)", gbs / await timed(lambda: far.copy_from(big)))

    anchor = statistics.median(rows["bare actor call, one after another (µs/call)"])
    med = {row: statistics.median(values) for row, values in rows.items()}
    put = med[f"ray.put {copy_mib} MiB (GB/s)"]
    get = med[f"ray.get {copy_mib} MiB into an array (GB/s)"]
    like_in, like_out = med[LIKE_IN], med[LIKE_OUT]
    load = " / ".join(f"{x:.2f}" for x in os.getloadavg())
    chunk = wire.CHUNK_BYTES // MiB
    print(f"bench/ray.py: {reps} repetitions, medians; Ray {ray.__version__}, {os.cpu_count()} cores")
    print(f"copies in pieces of {chunk} MiB, {dev.conn.staging.mode} (the connection's probe)")  # type: ignore[attr-defined]
    print(f"load average at the end (1 / 5 / 15 min): {load}\n")
    print("| row | median | vs bare actor call / the object store |")
    print("|---|---|---|")
    for row, value in med.items():
        ratio = f"{anchor / value:.1f}× the rate" if "µs" in row else ""
        if "round trip" in row:
            ratio = f"{value / anchor:.2f}× one call"
        elif row in (DIRECT_IN, DIRECT_OUT):
            ratio = (
                f"{value / put:.0%} of ray.put"
                if row == DIRECT_IN
                else f"{value / get:.0%} of ray.get into an array"
            )
        elif row.lstrip().startswith("copyin"):
            ratio = f"{value / put:.0%} of ray.put; {value / like_in:.0%} of bare Ray's"
        elif row.startswith("copy_from"):
            ratio = f"{value / put:.0%} of ray.put"
        elif row.lstrip().startswith("copyout"):
            ratio = (
                f"{value / get:.0%} of ray.get into an array; {value / like_out:.0%} of bare Ray's copyout"
            )
        print(f"| {row} | {value:,.2f} | {ratio} |")
    trips = rows["remote launch + await round trip (µs)"]
    calls = rows["bare actor call, one after another (µs/call)"]
    each = " ".join(f"{t / c:.2f}" for t, c in zip(trips, calls, strict=True))
    print(f"\nround trip / bare actor call, each repetition: {each}")
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


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--chunk-mib", type=int, default=None, help="the staged and store copies' piece size")
    parser.add_argument("--only", choices=["roundtrip"], help="the launch rows and a round trip's breakdown")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (default 7, --quick 3)")
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
        if args.only == "roundtrip":
            asyncio.run(roundtrip(args.reps or (3 if args.quick else 7), 200))
        elif args.quick:
            asyncio.run(main(args.reps or 3, 2000, 16))
        else:
            asyncio.run(main(args.reps or 7, 10000, 64))
    finally:
        ray.shutdown()
        shutil.rmtree(_TMP, ignore_errors=True)
        sys.stdout.flush()
