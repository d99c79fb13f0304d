"""A pipelined inference server: the digits MLP served over HTTP through aiotinyrt kernels.

    python examples/inference_server/serve.py --port 8000 [--loop asyncio|uvloop|trio]
        [--width N] [--devices CPU,CPU:1]

* ``POST /predict`` ``{"images": [[64 numbers in 0..16], ...]}`` answers
  ``{"classes": [...], "probabilities": [[10 numbers], ...]}``;
* ``GET /healthz``; ``GET /stats`` (queue depth, in-flight micro-batches, device timelines,
  allocator statistics, event-loop lag); ``POST /stats/reset`` clears the loop-lag record;
* ``GET /metrics``: the same figures for Prometheus (``metrics.py``): request counts by status,
  a latency histogram, micro-batch sizes, device busy time, allocator bytes.

Requests are gathered into micro-batches (bounded wait, bounded size, see ``batcher.py``) and run
through a pipeline of stages over the devices (``mlp.py``). A full queue answers 503 with
``Retry-After``; bad input answers 4xx with a message saying what is wrong. SIGINT or SIGTERM
starts draining (``drain.py``): new requests get 503 and every connection is closed after its
answer until the clients stay away, then the server stops accepting, finishes the requests in
flight, synchronizes and closes the devices.

An ASGI app (starlette) run by hypercorn, on asyncio, uvloop or trio. ``serve()`` runs it
in-process on a socket you give it (tests do), ``main()`` is the command line. ``--mode`` picks
how ``/predict`` computes, for ``bench/server.py``: ``pipelined`` (the server), ``blocking`` (the
same kernels called synchronously in the handler, blocking the event loop) or ``numpy``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import signal
import socket
import sys
import threading
from array import array
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parent))

from baselines import BlockingModel, NumpyModel, zero_result
from batcher import MicroBatcher, Overloaded, ShuttingDown
from drain import DrainGate
from metrics import ServerMetrics
from mlp import (
    N_CLASSES,
    N_PIXELS,
    PIXEL_MAX,
    Pipeline,
    Result,
    load_digits_mlp,
    random_mlp,
)

from aiotinyrt import Device

MODES = ("pipelined", "blocking", "numpy", "http")


@dataclass
class ServerConfig:
    """Everything the server needs; the defaults are the command line's."""

    devices: tuple[str, ...] = ("CPU", "CPU:1")
    width: int | None = None  #: None: the trained digits model; N: random weights, hidden width N
    mode: str = "pipelined"
    max_batch: int = 64  #: images per micro-batch, and per request
    max_wait: float = 0.002  #: seconds the oldest queued request waits for a micro-batch to fill
    slots: int = 4  #: micro-batches in flight
    queue_images: int = 1024  #: queue capacity, in images; past it: 503
    retry_after: int = 1  #: seconds, in the Retry-After of a 503
    close_devices: bool = True  #: synchronize and close the devices at shutdown
    lag_interval: float = 0.005  #: the loop-lag ticker's period
    worker_nice: int = 10  #: OS priority of the device worker threads, below the event loop's (0: same)
    #: after start-up, ``gc.freeze()`` what exists (the model, the app, the imported libraries) so
    #: the collector's full passes, which stall the loop, only scan what requests allocate. The
    #: command line sets it; off by default because it acts on the whole process (tests run
    #: servers in-process). ``stop`` unfreezes.
    gc_freeze: bool = False
    #: at shutdown, keep accepting (answering 503, closing connections) until no request arrived
    #: for this many seconds, at most ``drain_limit`` (see drain.py)
    drain_quiet: float = 2.0
    drain_limit: float = 30.0
    drain_retry_after: int = 10  #: seconds, in every 503 while draining (longer than drain_quiet)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if not self.devices:
            raise ValueError("at least one device is needed")
        self.devices = tuple(Device.canonicalize(d) for d in self.devices)

    @property
    def max_body(self) -> int:
        """Largest request body accepted: a full batch of generously formatted numbers."""
        return 4096 + self.max_batch * N_PIXELS * 32


# ---- input validation ---------------------------------------------------------------------------
class BadInput(Exception):
    """A request the server cannot use; ``status`` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, *, unread_body: bool = False) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.unread_body = unread_body  #: the body was not read to its end: close the connection


def _describe(value: object) -> str:
    text = (
        json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    )
    return text if len(text) <= 40 else text[:37] + "..."


_INT = {int}


def parse_images(payload: object, max_images: int) -> tuple[array[float], int]:
    """Validate ``{"images": [[64 numbers in 0..16], ...]}``; return float32 pixels and the count.

    Raises :class:`BadInput` (422, or 413 for too many images) naming the first problem.
    """
    if not isinstance(payload, dict) or "images" not in payload:
        raise BadInput(422, 'expected a JSON object {"images": [[64 numbers in 0..16], ...]}')
    images = payload["images"]
    if not isinstance(images, list):
        raise BadInput(422, f'"images" must be a list of images, got {_describe(images)}')
    if not images:
        raise BadInput(422, '"images" is empty; send at least one image')
    if len(images) > max_images:
        raise BadInput(413, f"{len(images)} images in one request; at most {max_images} are accepted")
    pixels = array("f")
    for i, image in enumerate(images):
        if not isinstance(image, list) or len(image) != N_PIXELS:
            got = f"{len(image)} values" if isinstance(image, list) else _describe(image)
            raise BadInput(422, f"image {i}: expected a list of {N_PIXELS} pixels (8x8), got {got}")
        # fast path: all ints in range (the common case), else find the first bad pixel
        if set(map(type, image)) == _INT and min(image) >= 0 and max(image) <= PIXEL_MAX:
            pixels.extend(image)
            continue
        for j, p in enumerate(image):
            # the range check also refuses NaN and infinities
            if isinstance(p, bool) or not isinstance(p, (int, float)) or not 0 <= p <= PIXEL_MAX:
                raise BadInput(
                    422, f"image {i}, pixel {j}: expected a number in 0..{PIXEL_MAX}, got {_describe(p)}"
                )
        pixels.extend(float(p) for p in image)
    return pixels, len(images)


def lower_worker_priority(nice: int) -> list[str]:
    """Give the runtime's device worker threads (``aiotinyrt-CPU/compute``, ...) the OS priority
    ``nice`` (Linux: niceness is per thread). On a machine with few cores the event loop thread
    then wins a core whenever it has work: it admits requests and feeds the devices, while the
    workers run kernels with whatever is left. Returns the threads changed."""
    changed = []
    for thread in threading.enumerate():
        if thread.name.startswith("aiotinyrt-") and thread.native_id is not None:
            try:
                os.setpriority(os.PRIO_PROCESS, thread.native_id, nice)
            except (OSError, AttributeError):  # not Linux, or not permitted
                continue
            changed.append(thread.name)
    return changed


# ---- loop lag ---------------------------------------------------------------------------------------
@dataclass
class LoopLag:
    """A ticker's record: how late ``sleep(interval)`` woke up, in seconds."""

    interval: float
    worst: float = 0.0
    total: float = 0.0
    ticks: int = 0

    async def run(self) -> None:
        while True:
            start = anyio.current_time()
            await anyio.sleep(self.interval)
            lag = max(0.0, anyio.current_time() - start - self.interval)
            self.worst = max(self.worst, lag)
            self.total += lag
            self.ticks += 1

    def reset(self) -> None:
        self.worst = self.total = 0.0
        self.ticks = 0

    def as_dict(self) -> dict[str, float | int]:
        mean = self.total / self.ticks if self.ticks else 0.0
        return {"worst_ms": self.worst * 1e3, "mean_ms": mean * 1e3, "ticks": self.ticks}


# ---- the service --------------------------------------------------------------------------------
@dataclass
class Service:
    """The model, the batcher and the counters; started and stopped by the app's lifespan."""

    config: ServerConfig
    pipeline: Pipeline | None = None
    batcher: MicroBatcher[Any, Result] | None = None
    compute: Callable[[array[float], int], Result] | None = None  #: blocking and numpy modes
    blocking: BlockingModel | None = None
    lag: LoopLag = field(default_factory=lambda: LoopLag(0.005))
    ready: anyio.Event = field(default_factory=anyio.Event)
    stopped: anyio.Event = field(default_factory=anyio.Event)
    drain: DrainGate | None = None  #: set by serve(): the HTTP requests received and answered
    draining: bool = False
    reniced: list[str] = field(default_factory=list)  #: worker threads given a lower priority
    metrics: ServerMetrics = field(init=False)
    requests: int = 0
    bad_requests: int = 0
    rejected: int = 0
    errors: int = 0

    def __post_init__(self) -> None:
        self.metrics = ServerMetrics(self)

    async def start(self, tg: anyio.abc.TaskGroup) -> None:
        cfg = self.config
        spec = load_digits_mlp()[0] if cfg.width is None else random_mlp(cfg.width)
        self.pipeline = await Pipeline.create(spec, cfg.devices, max_batch=cfg.max_batch, slots=cfg.slots)
        if cfg.mode == "pipelined":
            self.batcher = MicroBatcher(
                acquire=self.pipeline.acquire,
                release=self.pipeline.release,
                run=self.metrics.observe_batches(self.pipeline.run),
                split=Result.split,
                max_batch=cfg.max_batch,
                max_wait=cfg.max_wait,
                capacity=cfg.queue_images,
            )
            tg.start_soon(self.batcher.run)
        elif cfg.mode == "blocking":
            self.blocking = await BlockingModel.create(self.pipeline)
            self.compute = self.blocking.infer
        elif cfg.mode == "numpy":
            self.compute = (await NumpyModel.create(self.pipeline)).infer
        else:  # "http": a control for bench/server.py, the HTTP stack alone (answers are zeros)
            self.compute = zero_result
        # one micro-batch through every stage: starts every device worker thread, then lower them
        await self.pipeline.infer(array("f", bytes(4 * N_PIXELS)), 1)
        if cfg.worker_nice:
            self.reniced = lower_worker_priority(cfg.worker_nice)
        if cfg.gc_freeze:  # (one full collection on the loop, at start-up, before serving)
            gc.collect()
            gc.freeze()
        self.lag = LoopLag(cfg.lag_interval)
        tg.start_soon(self.lag.run)
        self.ready.set()

    def begin_drain(self) -> None:
        """Refuse new requests (503) and flush the queue without waiting for micro-batches to
        fill; requests already accepted still complete."""
        self.draining = True
        if self.batcher is not None:
            self.batcher.close()

    async def predict(self, pixels: array[float], rows: int) -> Result:
        if self.draining:
            raise ShuttingDown("the server is shutting down")
        if self.compute is not None:
            await anyio.lowlevel.checkpoint()
            return self.compute(pixels, rows)
        assert self.batcher is not None
        return await self.batcher.submit(pixels, rows).result()

    async def stop(self) -> None:
        """Refuse new work, finish everything accepted, then synchronize and close the devices.

        Cancellation: shielded.
        """
        with anyio.CancelScope(shield=True):
            self.begin_drain()
            if self.batcher is not None:
                await self.batcher.wait_until(lambda s: s.queued_requests == 0 and s.in_flight_batches == 0)
            if self.blocking is not None:
                self.blocking.close()
            if self.pipeline is not None:
                devices = self.pipeline.devices
                await self.pipeline.synchronize()
                await self.pipeline.aclose()
                if self.config.close_devices:
                    for device in devices:
                        if not device.closed:
                            await device.aclose()
            if self.config.gc_freeze:
                gc.unfreeze()
            self.stopped.set()

    def statistics(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mode": self.config.mode,
            "model": None if self.pipeline is None else self.pipeline.spec.name,
            "widths": None if self.pipeline is None else self.pipeline.spec.widths,
            "draining": self.draining,
            "requests": {
                "answered": self.requests,
                "bad_input": self.bad_requests,
                "rejected_busy": self.rejected,
                "errors": self.errors,
            },
            "loop_lag": self.lag.as_dict(),
            "gc": {
                "frozen_objects": gc.get_freeze_count(),
                "collections": [g["collections"] for g in gc.get_stats()],
            },
            "worker_threads_reniced": {"nice": self.config.worker_nice, "threads": self.reniced},
        }
        if self.batcher is not None:
            stats = self.batcher.statistics()
            out["queue"] = {
                "requests": stats.queued_requests,
                "images": stats.queued_images,
                "capacity_images": stats.capacity_images,
            }
            out["in_flight_micro_batches"] = stats.in_flight_batches
            out["micro_batches"] = {
                "run": stats.batches,
                "images": stats.images,
                "mean_images": stats.images / stats.batches if stats.batches else 0.0,
                "mean_run_ms": stats.run_seconds / stats.batches * 1e3 if stats.batches else 0.0,
                "max_images": self.config.max_batch,
                "max_wait_ms": self.config.max_wait * 1e3,
                "slots": self.config.slots,
            }
        if self.pipeline is not None:
            devices = {}
            for s, stage in enumerate(self.pipeline.stages):
                dev = stage.device
                devices[dev.name] = {
                    "stage": s,
                    "layers": [stage.first + i for i in range(len(stage.layers))],
                    "closed": dev.closed,
                    "timelines": {
                        tl.name: {"submitted": tl.submitted, "completed": tl.completed}
                        for tl in dev.timelines
                    },
                    "allocator": dataclasses.asdict(dev.allocator.statistics()),
                    "kernel_seconds": stage.kernel_seconds,
                }
            out["devices"] = devices
        return out


# ---- the ASGI app ---------------------------------------------------------------------------------
def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


async def _read_body(request: Request, limit: int) -> bytes:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise BadInput(
            413, f"request body of {length} bytes is over the limit of {limit} bytes", unread_body=True
        )
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadInput(413, f"request body is over the limit of {limit} bytes", unread_body=True)
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(config: ServerConfig) -> tuple[Starlette, Service]:
    """The starlette app and its service (started by the app's lifespan)."""
    service = Service(config)

    async def predict(request: Request) -> Response:
        try:
            body = await _read_body(request, config.max_body)
            try:
                payload = json.loads(body)
            except (ValueError, UnicodeDecodeError) as exc:
                raise BadInput(400, f"malformed JSON: {exc}") from None
            pixels, rows = parse_images(payload, config.max_batch)
        except BadInput as exc:
            service.bad_requests += 1
            return _error(exc.status, exc.message, {"Connection": "close"} if exc.unread_body else None)
        try:
            result = await service.predict(pixels, rows)
        except Overloaded as exc:  # and ShuttingDown
            service.rejected += 1
            return _error(503, str(exc), {"Retry-After": str(config.retry_after)})
        except Exception as exc:  # a device error: say so, keep serving
            service.errors += 1
            return _error(500, f"inference failed: {exc}")
        service.requests += 1
        probs = result.probabilities
        return JSONResponse(
            {
                "classes": result.classes.tolist(),
                "probabilities": [probs[i * N_CLASSES : (i + 1) * N_CLASSES].tolist() for i in range(rows)],
            }
        )

    async def healthz(request: Request) -> Response:
        if service.draining:
            return _error(503, "shutting down", {"Retry-After": str(config.retry_after)})
        return JSONResponse({"status": "ok"})

    async def stats(request: Request) -> Response:
        return JSONResponse(service.statistics())

    async def metrics(request: Request) -> Response:
        body, content_type = service.metrics.exposition()
        return Response(body, media_type=content_type)

    async def reset_stats(request: Request) -> Response:
        service.lag.reset()
        return JSONResponse({"status": "reset"})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            try:
                await service.start(tg)
                yield
            finally:
                await service.stop()
                tg.cancel_scope.cancel()

    routes = [
        Route("/predict", predict, methods=["POST"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/stats", stats, methods=["GET"]),
        Route("/stats/reset", reset_stats, methods=["POST"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan), service


# ---- running it -----------------------------------------------------------------------------------
def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket (``port=0``: a free port, see ``getsockname()``)."""
    return socket.create_server((host, port), backlog=1024)


async def serve(
    config: ServerConfig,
    sock: socket.socket,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    on_ready: Callable[[Service], None] | None = None,
    graceful_timeout: float = 30.0,
) -> Service:
    """Serve on ``sock`` (a listening socket; the server takes it over) until ``shutdown_trigger``
    returns, then drain and stop. Runs on whichever loop it is awaited from (asyncio, uvloop, trio).

    Returns the stopped service (its statistics stay readable).
    """
    from hypercorn.config import Config

    app, service = create_app(config)
    hyper = Config()
    hyper.bind = [f"fd://{sock.detach()}"]
    hyper.graceful_timeout = graceful_timeout
    hyper.accesslog = None
    hyper.loglevel = "WARNING"
    hyper.backlog = 1024

    gate = service.drain = DrainGate(service.metrics.middleware(app), retry_after=config.drain_retry_after)

    async def trigger() -> None:
        await shutdown_trigger()
        service.begin_drain()  # new requests: 503; the accepted ones finish
        gate.draining = True  # every response closes its connection
        await gate.wait_quiet(config.drain_quiet, config.drain_limit)  # then hypercorn stops accepting

    async def announce() -> None:
        await service.ready.wait()
        if on_ready is not None:
            on_ready(service)

    async with anyio.create_task_group() as tg:
        tg.start_soon(announce)
        if _running_on_trio():
            from hypercorn.trio import serve as hyper_serve
        else:
            from hypercorn.asyncio import serve as hyper_serve  # type: ignore[assignment]
        await hyper_serve(gate, hyper, shutdown_trigger=trigger)  # type: ignore[arg-type]
        tg.cancel_scope.cancel()
    return service


def _running_on_trio() -> bool:
    trio = sys.modules.get("trio")
    if trio is None:
        return False
    try:
        trio.lowlevel.current_task()
    except RuntimeError:
        return False
    return True


async def wait_for_signal() -> None:
    """Return at the first SIGINT or SIGTERM."""
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            print(f"{signal.Signals(signum).name}: draining", flush=True)
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve the digits MLP through aiotinyrt kernels.")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--loop", choices=["asyncio", "uvloop", "trio"], default="asyncio")
    parser.add_argument("--width", type=int, default=None, help="hidden width of a random MLP (load tests)")
    parser.add_argument("--devices", default="CPU,CPU:1", help="one pipeline stage per device")
    parser.add_argument("--mode", choices=MODES, default="pipelined", help="for bench/server.py")
    parser.add_argument(
        "--no-gc-freeze", action="store_true", help="do not gc.freeze() the start-up heap (see ServerConfig)"
    )
    args = parser.parse_args(argv)
    if args.width is not None and args.width < 1:
        parser.error("--width must be positive")
    config = ServerConfig(
        devices=tuple(d for d in args.devices.split(",") if d),
        width=args.width,
        mode=args.mode,
        gc_freeze=not args.no_gc_freeze,
    )
    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]

    def ready(service: Service) -> None:
        assert service.pipeline is not None
        stages = " -> ".join(
            f"{s.device.name}[layers {s.first}..{s.first + len(s.layers) - 1}]"
            for s in service.pipeline.stages
        )
        print(
            f"serving {service.pipeline.spec.name} {service.pipeline.spec.widths} on http://{host}:{port} "
            f"({args.loop}, {config.mode}: {stages})",
            flush=True,
        )

    async def run() -> None:
        service = await serve(config, sock, shutdown_trigger=wait_for_signal, on_ready=ready)
        http = service.drain
        assert http is not None
        print(
            f"stopped: {service.requests} requests answered, devices "
            f"{'closed' if config.close_devices else 'left open'}; "
            f"HTTP requests: {http.received} received, {http.answered} answered",
            flush=True,
        )

    backend, options = {
        "asyncio": ("asyncio", {}),
        "uvloop": ("asyncio", {"use_uvloop": True}),
        "trio": ("trio", {}),
    }[args.loop]
    anyio.run(run, backend=backend, backend_options=options)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
