"""A load generator for the inference server: bounded requests, bounded concurrency, latency figures.

    python examples/loadgen.py --url http://127.0.0.1:8000 --requests 1000 --concurrency 64 --batch 8

``concurrency`` clients (httpx, one connection each) send ``POST /predict`` with ``batch`` random
8x8 images until ``requests`` have been sent or ``--time-limit`` seconds have passed, then it
prints throughput and p50/p95/p99 latency of the successful requests, and every status seen.
Runs on asyncio, uvloop or trio (``--loop``). ``run_load()`` is the same, for code and tests.
"""

from __future__ import annotations

import argparse
import json
import random
import ssl
import time
from collections import Counter
from dataclasses import dataclass, field

import anyio
import httpx

N_PIXELS = 64


@dataclass
class LoadReport:
    """What a load run measured. Latencies are of successful (200) requests, in seconds."""

    requests: int
    concurrency: int
    batch: int
    elapsed: float
    latencies: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  #: transport errors, by exception type
    bad_answers: int = 0  #: 200 answers of the wrong shape

    @property
    def ok(self) -> int:
        return self.statuses.get(200, 0) - self.bad_answers

    @property
    def throughput(self) -> float:
        """Successful requests per second."""
        return self.ok / self.elapsed if self.elapsed > 0 else 0.0

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile (nearest rank) of successful latencies, in seconds."""
        if not self.latencies:
            return float("nan")
        ordered = sorted(self.latencies)
        rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
        return ordered[rank - 1]

    def summary(self) -> str:
        statuses = ", ".join(f"{code}: {n}" for code, n in sorted(self.statuses.items())) or "none"
        errors = ", ".join(f"{name}: {n}" for name, n in self.errors.most_common()) or "none"
        return "\n".join(
            [
                f"requests      {self.requests} sent, {self.ok} ok, concurrency {self.concurrency}, "
                f"batch {self.batch}",
                f"elapsed       {self.elapsed:.2f} s",
                f"throughput    {self.throughput:.1f} requests/s "
                f"({self.throughput * self.batch:.0f} images/s)",
                f"latency       p50 {self.percentile(50) * 1e3:.1f} ms"
                f"   p95 {self.percentile(95) * 1e3:.1f} ms   p99 {self.percentile(99) * 1e3:.1f} ms",
                f"statuses      {statuses}",
                f"errors        {errors}"
                + (f", {self.bad_answers} malformed answers" if self.bad_answers else ""),
            ]
        )


def make_bodies(batch: int, count: int = 16, seed: int = 0) -> list[bytes]:
    """``count`` distinct request bodies of ``batch`` random images each (pre-encoded, so the
    client spends its time on HTTP, not JSON)."""
    rng = random.Random(seed)
    return [
        json.dumps({"images": [[rng.randint(0, 16) for _ in range(N_PIXELS)] for _ in range(batch)]}).encode()
        for _ in range(count)
    ]


async def run_load(
    url: str,
    *,
    requests: int,
    concurrency: int,
    batch: int,
    time_limit: float = 120.0,
    timeout: float = 30.0,
    bodies: list[bytes] | None = None,
    honor_retry_after: bool = True,
) -> LoadReport:
    """Send ``requests`` POSTs to ``url + "/predict"`` with at most ``concurrency`` in flight.

    Stops sending after ``time_limit`` seconds (requests in flight then finish); each request
    times out after ``timeout`` seconds. A 503 with ``Retry-After`` pauses that user for as long
    (``honor_retry_after``), as a well-behaved client does.
    """
    if requests < 1 or concurrency < 1 or batch < 1:
        raise ValueError("requests, concurrency and batch must be positive")
    bodies = bodies or make_bodies(batch)
    endpoint = url.rstrip("/") + "/predict"
    headers = {"content-type": "application/json"}
    # one client (one keep-alive connection) per simulated user: a single pooled client shared by
    # dozens of tasks spends more time managing its pool than the server spends per request
    limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
    report = LoadReport(requests=0, concurrency=concurrency, batch=batch, elapsed=0.0)
    start = time.perf_counter()
    stop_at = start + time_limit

    tls = ssl.create_default_context()  # made once: each client would otherwise load the CA bundle

    async def user() -> None:
        async with httpx.AsyncClient(limits=limits, timeout=timeout, verify=tls) as http:
            await send(http)

    async def send(http: httpx.AsyncClient) -> None:
        while report.requests < requests and time.perf_counter() < stop_at:
            body = bodies[report.requests % len(bodies)]
            report.requests += 1
            t0 = time.perf_counter()
            try:
                response = await http.post(endpoint, content=body, headers=headers)
            except httpx.HTTPError as exc:
                report.errors[type(exc).__name__] += 1
                continue
            latency = time.perf_counter() - t0
            report.statuses[response.status_code] += 1
            retry = response.headers.get("retry-after", "")
            if honor_retry_after and response.status_code == 503 and retry.isdigit():
                await anyio.sleep(min(int(retry), max(stop_at - time.perf_counter(), 0)))
            if response.status_code == 200:
                try:
                    answer = response.json()
                    good = len(answer["classes"]) == batch and len(answer["probabilities"]) == batch
                except (ValueError, KeyError, TypeError):
                    good = False
                if good:
                    report.latencies.append(latency)
                else:
                    report.bad_answers += 1

    async with anyio.create_task_group() as tg:
        for _ in range(min(concurrency, requests)):
            tg.start_soon(user)
    report.elapsed = time.perf_counter() - start
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Load the inference server and report latency.")
    parser.add_argument("--url", required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--batch", type=int, default=1, help="images per request")
    parser.add_argument(
        "--time-limit", type=float, default=120.0, help="stop sending after this many seconds"
    )
    parser.add_argument("--loop", choices=["asyncio", "uvloop", "trio"], default="asyncio")
    args = parser.parse_args(argv)
    if min(args.requests, args.concurrency, args.batch) < 1:
        parser.error("--requests, --concurrency and --batch must be positive")

    async def run() -> LoadReport:
        return await run_load(
            args.url,
            requests=args.requests,
            concurrency=args.concurrency,
            batch=args.batch,
            time_limit=args.time_limit,
        )

    backend, options = {
        "asyncio": ("asyncio", {}),
        "uvloop": ("asyncio", {"use_uvloop": True}),
        "trio": ("trio", {}),
    }[args.loop]
    report = anyio.run(run, backend=backend, backend_options=options)
    print(report.summary())
    return 0 if report.ok == report.requests else 1


if __name__ == "__main__":
    raise SystemExit(main())
