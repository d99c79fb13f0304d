"""tinygrad models served from async Python: tinygrad's CPU device against AIO, side by side.

    python bench/tinygrad_serving.py            # 2 repetitions, 1200 requests per loaded run (~5-8 min)
    python bench/tinygrad_serving.py --quick    # 1 repetition, 400 requests
    python bench/tinygrad_serving.py --modes aio,http --stall-log /tmp/stalls   # what stalls the loops

Part 1, serving. Each row starts ``examples/tinygrad_digits/serve.py --mode <mode>`` (the digits
CNN, the same weights and the same request bodies for every row) in its own process:

(a) ``blocking``: tinygrad's own CPU device, the jitted model called in the request handler;
(b) ``executor``: the same, in a one-thread executor (what async services do today);
(c) ``aio``:      AIO, ``await``ed, micro-batched (the example server);
(d) ``http``:     a control: the same server answering without a model;
(e) ``aio2``:     as (c), with a model replica on each of ``AIO`` and ``AIO:1`` (``--devices``).

Single-request latency: one client, one request at a time (median). Under load: 64 concurrent
clients (bench/server.py's raw HTTP client), throughput, p50, p99, and the worst lag of a
ticker task on the server's event loop (``sleep(5 ms)``: how late it woke).

Part 2, per-call cost of a jitted 10-kernel function (in this process): CPU time of the calling
thread per call, the call only (its work is enqueued, not waited for; the queue is drained
every 100 calls), on tinygrad's CPU device and on AIO; and for AIO the loop thread's CPU per
``await aiotinyrt.tinygrad.call(...)`` (the call, the enqueue and the await).

Part 3 (with row (e)), the model alone (in this process): the server's micro-batches (``copyin``
and ``call_numpy`` of 32 images into a free slot) back to back on one replica (``AIO``) and on
two (``AIO``, ``AIO:1``): what the devices could serve without the HTTP stack, and whether the
second device adds to it.

Targets (issue 16): (c) single-request latency no worse than (a); (c) throughput >= 1.5x (b)
with p99 no worse; (c)'s loop lag over (d)'s <= 1 ms; AIO's per-call cost <= 0.5x CPU's. A
benchmark, not a test: it prints PASS or MISS and exits 0.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.streams.text
import anyio.to_thread
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
# run as a script, this file's folder comes first on sys.path, and this file is named tinygrad.py
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != BENCH]

from tinygrad import Device, Tensor, TinyJit  # noqa: E402

import aiotinyrt.tinygrad as aiotg  # noqa: E402

_spec = importlib.util.spec_from_file_location("bench_server", BENCH / "server.py")
assert _spec is not None and _spec.loader is not None
server = sys.modules["bench_server"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server)
git_tree, raw_load = server.git_tree, server.raw_load
EXAMPLE = ROOT / "examples" / "tinygrad_digits"
sys.path.insert(0, str(EXAMPLE))  # (serve.py imports model.py and stalls.py from its folder)
_spec = importlib.util.spec_from_file_location("tinygrad_digits_serve", EXAMPLE / "serve.py")
assert _spec is not None and _spec.loader is not None
digits = sys.modules["tinygrad_digits_serve"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(digits)

#: row -> (label, serve.py's arguments)
MODES = {
    "blocking": ("(a) tinygrad CPU, in the handler", ["--mode", "blocking"]),
    "executor": ("(b) tinygrad CPU, one-thread executor", ["--mode", "executor"]),
    "aio": ("(c) AIO, awaited, micro-batched", ["--mode", "aio"]),
    "http": ("(d) control: HTTP stack, no model", ["--mode", "http"]),
    "aio2": ("(e) as (c), replicas on AIO and AIO:1", ["--mode", "aio", "--devices", "AIO,AIO:1"]),
}


def bodies(count: int = 16) -> list[bytes]:
    rng = np.random.default_rng(0)
    return [json.dumps({"images": rng.integers(0, 17, (1, 64)).tolist()}).encode() for _ in range(count)]


async def start_server(mode: str, extra: list[str]) -> tuple[anyio.abc.Process, str]:
    argv = [sys.executable, str(EXAMPLE / "serve.py"), "--port", "0"]
    argv += [*MODES[mode][1], *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(ROOT)}
    process, url = await server.launch_server(argv, env, mode, 600)
    return process, url


async def one_run(mode: str, args: argparse.Namespace, payloads: list[bytes], rep: int) -> dict[str, float]:
    extra = []
    if args.stall_log is not None:
        Path(args.stall_log).mkdir(parents=True, exist_ok=True)
        extra = ["--stall-log", str(Path(args.stall_log) / f"{mode}-{rep}.json")]
    process, url = await start_server(mode, extra)
    try:
        warm = 2 * args.concurrency
        await raw_load(url, requests=warm, concurrency=args.concurrency, batch=1, bodies=payloads)
        single = await raw_load(url, requests=args.single, concurrency=1, batch=1, bodies=payloads)
        async with httpx.AsyncClient(base_url=url) as client:
            await client.post("/stats/reset")
        report = await raw_load(
            url, requests=args.requests, concurrency=args.concurrency, batch=1, bodies=payloads
        )
        async with httpx.AsyncClient(base_url=url) as client:
            stats = (await client.get("/stats")).json()
    finally:
        process.send_signal(signal.SIGTERM)
        with anyio.fail_after(60):
            await process.wait()
        await process.aclose()
    return {
        "single_ms": statistics.median(single.latencies) * 1e3,
        "throughput": report.throughput,
        "p50_ms": report.percentile(50) * 1e3,
        "p99_ms": report.percentile(99) * 1e3,
        "lag_ms": stats["loop_lag"]["worst_ms"],
        "batch": stats["mean_batch"] or 1.0,
        "failed": float(report.requests - report.ok),
    }


def ten_kernel_jit(device: str) -> tuple[Any, Tensor]:
    x = Tensor(np.ones((16, 16), np.float32), device=device).contiguous().realize()

    @TinyJit
    def f(t: Tensor) -> Tensor:
        for i in range(10):
            t = (t * 1.0001 + i).contiguous()
        return t.realize()

    for _ in range(3):
        f(x).numpy()
    return f, x


def per_call_cpu(device: str, calls: int) -> float:
    """Calling thread's CPU seconds per jitted call (enqueue only; drained every 100 calls)."""
    f, x = ten_kernel_jit(device)
    total = 0.0
    for start in range(0, calls, 100):
        t0 = time.thread_time()
        for _ in range(min(100, calls - start)):
            f(x)
        total += time.thread_time() - t0
        Device[device].synchronize()
    return total / calls


async def awaited_call_cpu(calls: int) -> float:
    """The loop thread's CPU seconds per ``await aiotinyrt.tinygrad.call(...)`` on AIO."""
    f, x = await anyio.to_thread.run_sync(ten_kernel_jit, "AIO")
    await aiotg.call(f, x)
    t0 = time.thread_time()
    for _ in range(calls):
        await aiotg.call(f, x)
    return (time.thread_time() - t0) / calls


async def model_alone(replicas: list[Any], batches: int) -> tuple[float, float]:
    """Micro-batches of the example server (``copyin`` + ``call_numpy`` of 32 images into a free
    slot), back to back, spread over ``replicas`` as the server does: images/s and the loop
    thread's CPU milliseconds per micro-batch."""
    pixels = np.zeros((replicas[0].inputs[0].shape[0], 64), np.float32)
    freed = anyio.Event()

    async def one(replica: Any, slot: int) -> None:
        nonlocal freed
        try:
            await aiotg.copyin(replica.inputs[slot], pixels)
            await aiotg.call_numpy(replica.forward, replica.inputs[slot])
        finally:
            replica.free.append(slot)
            freed.set()

    t0, c0 = time.perf_counter(), time.thread_time()
    async with anyio.create_task_group() as tg:
        for _ in range(batches):
            while not any(r.free for r in replicas):
                freed = anyio.Event()
                await freed.wait()
            replica = max(replicas, key=lambda r: len(r.free))
            tg.start_soon(one, replica, replica.free.popleft())
    wall, cpu = time.perf_counter() - t0, time.thread_time() - c0
    return batches * len(pixels) / wall, cpu / batches * 1e3


async def two_devices(args: argparse.Namespace) -> None:
    """Part 3: the model alone on one replica (AIO) and on two (AIO, AIO:1), interleaved."""
    config = digits.ServerConfig()
    replicas = []
    for device in ("AIO", "AIO:1"):
        replica = await anyio.to_thread.run_sync(digits.Replica, device, config.batch, config.slots)
        await anyio.to_thread.run_sync(replica.warm_up)
        replicas.append(replica)
    results: dict[int, list[tuple[float, float]]] = {1: [], 2: []}
    for _ in range(3):
        for count in (1, 2):
            results[count].append(await model_alone(replicas[:count], args.batches))
    print()
    print(
        f"The model alone: {args.batches} micro-batches of {config.batch} images back to back, "
        f"{config.slots} slots per replica, median of 3 (interleaved)"
    )
    rows = [["replicas", "images/s", "loop thread CPU per micro-batch"]]
    for count, label in ((1, "AIO"), (2, "AIO, AIO:1")):
        rate = statistics.median(r[0] for r in results[count])
        cpu = statistics.median(r[1] for r in results[count])
        rows.append([label, f"{rate:.0f}", f"{cpu:.2f} ms"])
    table(rows)


async def main(args: argparse.Namespace) -> None:
    payloads = bodies()
    load_start = " ".join(f"{x:.2f}" for x in os.getloadavg())
    selected = args.modes.split(",")
    unknown = set(selected) - set(MODES)
    if unknown:
        raise SystemExit(f"unknown --modes {sorted(unknown)}: choose from {', '.join(MODES)}")
    runs: dict[str, list[dict[str, float]]] = {mode: [] for mode in selected}
    for rep in range(args.reps):
        for mode in selected:
            run = await one_run(mode, args, payloads, rep)
            runs[mode].append(run)
            print(
                f"  rep {rep + 1}/{args.reps} {mode:<9} single {run['single_ms']:.2f} ms"
                f"  {run['throughput']:7.1f} req/s  p99 {run['p99_ms']:.1f} ms  lag {run['lag_ms']:.2f} ms",
                flush=True,
            )

    def med(mode: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[mode])

    head = [
        "server",
        "single request",
        "requests/s",
        "p50",
        "p99",
        "loop lag worst",
        "images/batch",
        "failed",
    ]
    rows = [head]
    for mode in selected:
        label = MODES[mode][0]
        worst = max(r["lag_ms"] for r in runs[mode])
        rows.append(
            [
                label,
                f"{med(mode, 'single_ms'):.2f} ms",
                f"{med(mode, 'throughput'):.1f}",
                f"{med(mode, 'p50_ms'):.1f} ms",
                f"{med(mode, 'p99_ms'):.1f} ms",
                f"{worst:.2f} ms",
                f"{med(mode, 'batch'):.1f}",
                f"{sum(r['failed'] for r in runs[mode]):.0f}",
            ]
        )
    print()
    print(
        f"Serving the digits CNN: 1 image per request, {args.concurrency} concurrent clients, "
        f"{args.requests} requests per loaded run, single-request latency over {args.single} requests, "
        f"median of {args.reps}"
    )
    table(rows)

    if set(selected) >= {"blocking", "executor", "aio", "http"}:
        await per_call_and_verdicts(args, runs, med)
    if "aio" in selected and "aio2" in selected:
        one, two = med("aio", "throughput"), med("aio2", "throughput")
        lags = [max(r["lag_ms"] for r in runs[m]) for m in ("aio2", "aio")]
        print(
            f"\n(e) two replicas (AIO, AIO:1): {two:.1f} req/s vs (c) one: {one:.1f} req/s "
            f"({two / one:.2f}x); p99 {med('aio2', 'p99_ms'):.1f} vs {med('aio', 'p99_ms'):.1f} ms; "
            f"loop lag {lags[0]:.2f} vs {lags[1]:.2f} ms"
        )
    if "aio2" in selected:
        await two_devices(args)
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    print(f"\n{machine}, tree {git_tree()}, load average at the start {load_start}, at the end {load}")


async def per_call_and_verdicts(
    args: argparse.Namespace, runs: dict[str, list[dict[str, float]]], med: Callable[[str, str], float]
) -> None:
    """Part 2 (per-call cost) and the targets' verdicts (needs rows (a) to (d))."""
    # (synchronous tinygrad: in a worker thread; on the loop, AIO's blocking calls would refuse)
    cpu_call = await anyio.to_thread.run_sync(per_call_cpu, "CPU", args.calls)
    aio_call = await anyio.to_thread.run_sync(per_call_cpu, "AIO", args.calls)
    awaited = await awaited_call_cpu(args.calls)
    print()
    print(
        f"Per call of a jitted 10-kernel function (16x16 float32), calling thread's CPU, {args.calls} calls"
    )
    table(
        [
            ["device", "CPU per call (enqueue)", "loop thread per awaited call"],
            ["tinygrad CPU", f"{cpu_call * 1e6:.0f} µs", "-"],
            ["AIO", f"{aio_call * 1e6:.0f} µs", f"{awaited * 1e6:.0f} µs"],
        ]
    )

    a_single, c_single = med("blocking", "single_ms"), med("aio", "single_ms")
    b_tp, c_tp = med("executor", "throughput"), med("aio", "throughput")
    b_p99, c_p99 = med("executor", "p99_ms"), med("aio", "p99_ms")
    c_lag = max(r["lag_ms"] for r in runs["aio"])
    d_lag = max(r["lag_ms"] for r in runs["http"])
    print()
    verdicts = [
        (
            c_single <= a_single,
            f"(c) single request {c_single:.2f} ms vs (a) {a_single:.2f} ms (target: no worse)",
        ),
        (c_tp >= 1.5 * b_tp, f"(c) throughput {c_tp / b_tp:.2f}x (b) (target >= 1.5x)"),
        (c_p99 <= b_p99, f"(c) p99 {c_p99:.1f} ms vs (b) {b_p99:.1f} ms (target: no worse)"),
        (
            c_lag - d_lag <= 1.0,
            f"(c) loop lag {c_lag:.2f} ms, {c_lag - d_lag:+.2f} ms over (d) (target <= 1 ms)",
        ),
        (aio_call <= 0.5 * cpu_call, f"AIO per-call cost {aio_call / cpu_call:.2f}x CPU's (target <= 0.5x)"),
    ]
    for ok, line in verdicts:
        print(f"{'PASS' if ok else 'MISS'}  {line}")


def table(rows: list[list[str]]) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for i, row in enumerate(rows):
        cells = [row[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True))]
        print("| " + " | ".join(cells) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 repetition of 400 requests")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--single", type=int, default=200)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=300, help="micro-batches per run of part 3")
    parser.add_argument("--stall-log", help="folder: each server writes what stalled its loop there")
    parser.add_argument("--modes", default=",".join(MODES), help="which rows to run (comma-separated)")
    args = parser.parse_args()
    if args.quick:
        args.reps, args.requests, args.single, args.calls, args.batches = 1, 400, 100, 500, 100
    anyio.run(main, args)


if __name__ == "__main__":
    cli()
