"""``GET /metrics``: the server's figures in Prometheus' text format, through prometheus-client.

Each server has its own registry (several servers may run in one process, as the tests do):

* ``aiotinyrt_server_requests_total{endpoint,status}``: HTTP requests answered;
* ``aiotinyrt_server_request_seconds{endpoint}``: a histogram of the time from a request's
  arrival to the end of its answer;
* ``aiotinyrt_server_batch_images``: a histogram of images per micro-batch run;
* ``aiotinyrt_device_busy_seconds_total{device}``: kernel time each pipeline stage's device ran;
* ``aiotinyrt_allocator_bytes{device,state}``: memory ``in_use``, ``cached`` and ``peak``;
* ``aiotinyrt_server_queued_images`` and ``aiotinyrt_server_in_flight_batches``.

Request figures are counted by :meth:`ServerMetrics.middleware` (ASGI); device and allocator
figures are read from the running pipeline when scraped.
"""

from __future__ import annotations

import time
from array import array
from collections.abc import Awaitable, Callable, Iterator, MutableMapping
from typing import Any, TypeVar

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
R = TypeVar("R")

#: endpoints counted by name; anything else is "other" (no label per arbitrary path)
ENDPOINTS = ("/predict", "/healthz", "/stats", "/stats/reset", "/metrics")
LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class _PipelineCollector(Collector):
    """Device busy time, allocator bytes and queue figures, read at scrape time."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def collect(self) -> Iterator[Metric]:
        busy = CounterMetricFamily(
            "aiotinyrt_device_busy_seconds", "Kernel time each pipeline device ran", labels=["device"]
        )
        memory = GaugeMetricFamily(
            "aiotinyrt_allocator_bytes", "Device memory of the allocator", labels=["device", "state"]
        )
        pipeline = self.service.pipeline
        for stage in pipeline.stages if pipeline is not None else ():
            name = stage.device.name
            busy.add_metric([name], stage.kernel_seconds)
            stats = stage.device.allocator.statistics()
            memory.add_metric([name, "in_use"], stats.bytes_in_use)
            memory.add_metric([name, "cached"], stats.bytes_cached)
            memory.add_metric([name, "peak"], stats.peak_bytes_in_use)
        yield busy
        yield memory
        batcher = self.service.batcher
        if batcher is not None:
            stats = batcher.statistics()
            yield GaugeMetricFamily(
                "aiotinyrt_server_queued_images", "Images waiting", value=stats.queued_images
            )
            yield GaugeMetricFamily(
                "aiotinyrt_server_in_flight_batches", "Micro-batches running", value=stats.in_flight_batches
            )


class ServerMetrics:
    """One server's metrics: a registry, the request middleware and the batch observer."""

    def __init__(self, service: Any) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "aiotinyrt_server_requests",
            "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "aiotinyrt_server_request_seconds",
            "Seconds from a request's arrival to the end of its answer",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_images = Histogram(
            "aiotinyrt_server_batch_images",
            "Images per micro-batch run",
            buckets=BATCH_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_PipelineCollector(service))

    def exposition(self) -> tuple[bytes, str]:
        """The text format of every metric now, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """``app`` with every HTTP request counted by endpoint and status, and timed."""

        async def counted(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != "http":
                await app(scope, receive, send)
                return
            path = scope.get("path", "")
            endpoint = path if path in ENDPOINTS else "other"
            start = time.perf_counter()
            status = [500]

            async def observe(message: Message) -> None:
                if message["type"] == "http.response.start":
                    status[0] = int(message["status"])
                await send(message)
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    self.requests.labels(endpoint, str(status[0])).inc()
                    self.latency.labels(endpoint).observe(time.perf_counter() - start)

            await app(scope, receive, observe)

        return counted

    def observe_batches(
        self, run: Callable[[Any, array[float], int], Awaitable[R]]
    ) -> Callable[[Any, array[float], int], Awaitable[R]]:
        """``run(slot, pixels, rows)`` (a micro-batch) with its size recorded."""

        async def observed(slot: Any, pixels: array[float], rows: int) -> R:
            self.batch_images.observe(rows)
            return await run(slot, pixels, rows)

        return observed
