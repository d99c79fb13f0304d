"""Serve the digits CNN over HTTP: tinygrad's model, run by aiotinyrt, micro-batched.

    python examples/tinygrad_digits/serve.py --port 8001 [--loop asyncio|uvloop|trio] [--devices AIO,AIO:1]
                                             [--mode aio|blocking|executor|http]
    curl -s -XPOST localhost:8001/predict -d '{"images": [[0, 0, 5, 13, ...64 pixels 0..16]]}'

``POST /predict`` ``{"images": [[64 numbers in 0..16], ...]}`` (at most ``max_request`` images)
answers ``{"classes": [...], "probabilities": [[10 numbers], ...]}``; malformed JSON is 400,
wrong shapes or values 422, too many images 413, a full queue 503 with ``Retry-After``.

Requests queue up; a batcher packs them into micro-batches of at most ``batch`` images (the
jit's fixed batch, padded), waiting at most ``max_wait`` for one to fill, and hands each to a
free *slot*: an input tensor of one model replica (``--devices``: one replica per AIO device,
micro-batches spread over them). A micro-batch is one ``await aiotinyrt.tinygrad.copyin`` into
the slot's input tensor and one ``await aiotinyrt.tinygrad.call_numpy`` of the replica's jitted
forward pass: one aiotinyrt graph replay and one copy out, ordered by aiotinyrt's hazard
tracking, with several micro-batches in flight. The loop thread never runs a kernel or waits
for one.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import signal
import socket
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import anyio.lowlevel
import anyio.to_thread
import numpy as np
from hypercorn.config import Config
from model import DigitsCNN
from stalls import StallWatch
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from tinygrad import Tensor, TinyJit

import aiotinyrt.tinygrad as aiotg


@dataclass(frozen=True)
class ServerConfig:
    """What the server runs: model replicas, micro-batch shape and queue bounds."""

    devices: tuple[str, ...] = ("AIO",)
    batch: int = 32  # images per micro-batch (the jit's fixed input shape)
    slots: int = 3  # micro-batches in flight per replica
    max_wait: float = 0.002  # seconds the oldest queued request waits for a micro-batch to fill
    max_request: int = 64  # images per request
    capacity: int = 4096  # queued images before 503
    #: ``aio``: micro-batched on AIO (the server). For bench/tinygrad_serving.py: ``blocking`` calls the
    #: model on tinygrad's own CPU device in the handler; ``executor`` does that in a one-thread
    #: executor (what services do today); ``http`` answers zeros without a model (a control).
    mode: str = "aio"
    #: where ``stalls.StallWatch`` writes what stalled the loop (None: not watched)
    stall_log: str | None = None


def freeze_heap() -> None:
    """Collect, then move every object alive into the collector's permanent generation.

    Loading the model and capturing its jit leaves ~300,000 objects (tinygrad's UOp graphs and
    compiled kernels, the modules): a full collection while serving would scan them all, on the
    loop thread, for 150-550 ms on the 2-core VM. Frozen, they are never scanned; serving itself
    leaves a few hundred live objects behind, so full collections stay short.
    """
    gc.collect()
    gc.freeze()


class Overloaded(Exception):
    """The queue is full: 503."""


@dataclass
class _Ticket:
    images: np.ndarray
    done: anyio.Event = field(default_factory=anyio.Event)
    result: np.ndarray | None = None
    error: BaseException | None = None


class Replica:
    """The model on one AIO device: its weights, its jitted forward pass, its input slots."""

    def __init__(self, device: str, batch: int, slots: int) -> None:
        self.device = device
        self.model = DigitsCNN.load(device)
        self.forward = TinyJit(lambda x: self.model(x).softmax(axis=1).realize())
        self.inputs = [Tensor.zeros(batch, 64, device=device).contiguous().realize() for _ in range(slots)]
        self.free = deque(range(slots))
        self.batches = 0  # micro-batches this replica ran

    def warm_up(self) -> None:
        """Run and capture the jit (compiles: call from a worker thread, before serving)."""
        for _ in range(3):
            self.forward(self.inputs[0]).numpy()


class LoopLag:
    """How late a ticker task wakes from ``sleep(5 ms)`` on the server's loop: the loop's stalls."""

    PERIOD = 0.005

    def __init__(self) -> None:
        self.worst = 0.0
        self.total = 0.0
        self.ticks = 0
        self.watch: StallWatch | None = None

    async def run(self) -> None:
        while True:
            start = time.perf_counter()
            await anyio.sleep(self.PERIOD)
            lag = max(0.0, time.perf_counter() - start - self.PERIOD)
            self.worst = max(self.worst, lag)
            self.total += lag
            self.ticks += 1
            if self.watch is not None:
                self.watch.tick(lag)

    def reset(self) -> None:
        self.worst = self.total = 0.0
        self.ticks = 0


class Direct:
    """bench/tinygrad_serving.py's baselines: the model on tinygrad's CPU device, one jit per request
    size, called synchronously (in the handler, or in a one-thread executor)."""

    def __init__(self) -> None:
        self.model = DigitsCNN.load("CPU")
        self.jits: dict[int, TinyJit] = {}  # type: ignore[type-arg]
        self.limiter = anyio.CapacityLimiter(1)

    def __call__(self, images: np.ndarray) -> np.ndarray:
        jit = self.jits.get(len(images))
        if jit is None:
            jit = self.jits[len(images)] = TinyJit(lambda x: self.model(x).softmax(axis=1).realize())
        return jit(Tensor(images, device="CPU")).numpy()  # type: ignore[no-any-return]


class Service:
    """The queue, the batcher and the replicas."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.lag = LoopLag()
        self.direct: Direct | None = None
        self.replicas: list[Replica] = []
        self._queue: deque[_Ticket] = deque()
        self._queued_images = 0
        self._changed = anyio.Event()
        self._slot_freed = anyio.Event()
        self.ready = anyio.Event()
        self.batches = 0
        self.images = 0
        self._turn = 0
        self.frozen = False

    async def start(self) -> None:
        """Load the replicas and capture their jits, off the loop thread; then freeze the heap
        (:func:`freeze_heap`; :meth:`stop` gives it back)."""
        if self.config.mode in ("blocking", "executor"):
            self.direct = await anyio.to_thread.run_sync(Direct)
        for device in self.config.devices if self.config.mode == "aio" else ():
            replica = await anyio.to_thread.run_sync(Replica, device, self.config.batch, self.config.slots)
            await anyio.to_thread.run_sync(replica.warm_up)
            self.replicas.append(replica)
        await anyio.to_thread.run_sync(freeze_heap)
        self.frozen = True
        self.ready.set()

    def stop(self) -> None:
        """Give the heap back to the garbage collector (the lifespan's end)."""
        if self.frozen:
            gc.unfreeze()
            self.frozen = False

    async def predict(self, images: np.ndarray) -> np.ndarray:
        """Queue ``images`` (``N x 64`` float32) and wait for their probabilities.

        Cancellation: abandons the wait; the images still run.
        """
        mode = self.config.mode
        if mode == "http":
            await anyio.lowlevel.checkpoint()
            return np.full((len(images), 10), 0.1, np.float32)
        if self.direct is not None:
            self.batches += 1
            self.images += len(images)
            if mode == "blocking":
                await anyio.lowlevel.checkpoint()
                return self.direct(images)
            return await anyio.to_thread.run_sync(self.direct, images, limiter=self.direct.limiter)
        if self._queued_images + len(images) > self.config.capacity:
            raise Overloaded
        ticket = _Ticket(images)
        self._queue.append(ticket)
        self._queued_images += len(images)
        self._changed.set()
        await ticket.done.wait()
        if ticket.error is not None:
            raise ticket.error
        assert ticket.result is not None
        return ticket.result

    def _take_slot(self) -> tuple[Replica, int] | None:
        """A free slot of the replica with the most free slots; ties go to the replica after
        the one used last (so micro-batches alternate between replicas even one at a time)."""
        count = len(self.replicas)
        if not count:
            return None
        order = [self.replicas[(self._turn + i) % count] for i in range(count)]
        replica = max(order, key=lambda r: len(r.free))
        if not replica.free:
            return None
        self._turn = (self.replicas.index(replica) + 1) % count
        return replica, replica.free.popleft()

    async def run_batcher(self) -> None:
        """Forever: take a free slot, gather a micro-batch, start it in its own task."""
        async with anyio.create_task_group() as tg:
            while True:
                slot = self._take_slot()
                if slot is None:
                    self._slot_freed = anyio.Event()
                    await self._slot_freed.wait()
                    continue
                while not self._queue:
                    self._changed = anyio.Event()
                    await self._changed.wait()
                deadline = anyio.current_time() + self.config.max_wait
                while self._queued_images < self.config.batch and anyio.current_time() < deadline:
                    self._changed = anyio.Event()
                    with anyio.move_on_after(deadline - anyio.current_time()):
                        await self._changed.wait()
                tickets: list[_Ticket] = []
                rows = 0
                while self._queue and rows + len(self._queue[0].images) <= self.config.batch:
                    ticket = self._queue.popleft()
                    tickets.append(ticket)
                    rows += len(ticket.images)
                self._queued_images -= rows
                tg.start_soon(self._run_batch, slot, tickets)

    async def _run_batch(self, slot: tuple[Replica, int], tickets: list[_Ticket]) -> None:
        replica, index = slot
        try:
            pixels = np.zeros((self.config.batch, 64), np.float32)
            rows = 0
            for ticket in tickets:
                pixels[rows : rows + len(ticket.images)] = ticket.images
                rows += len(ticket.images)
            x = replica.inputs[index]
            await aiotg.copyin(x, pixels)  # ordered after the previous replay reading this slot
            probs = await aiotg.call_numpy(replica.forward, x)
            rows = 0
            for ticket in tickets:
                ticket.result = probs[rows : rows + len(ticket.images)]
                rows += len(ticket.images)
                ticket.done.set()
            self.batches += 1
            replica.batches += 1
            self.images += rows
        except BaseException as exc:
            for ticket in tickets:
                if not ticket.done.is_set():
                    ticket.error = exc
                    ticket.done.set()
            if not isinstance(exc, Exception):
                raise
        finally:
            replica.free.append(index)
            self._slot_freed.set()


def _parse(body: bytes, limit: int) -> np.ndarray | JSONResponse:
    try:
        doc = json.loads(body)
    except ValueError:
        return JSONResponse({"error": "malformed JSON"}, 400)
    images = doc.get("images") if isinstance(doc, dict) else None
    if not isinstance(images, list) or not images:
        return JSONResponse({"error": "expected {'images': [[64 pixels], ...]}"}, 422)
    if len(images) > limit:
        return JSONResponse({"error": f"at most {limit} images per request"}, 413)
    if not all(isinstance(row, list) and len(row) == 64 for row in images):
        return JSONResponse({"error": "every image is a list of 64 pixels"}, 422)
    try:
        arr = np.array(images, dtype=np.float64)
    except (TypeError, ValueError):
        return JSONResponse({"error": "pixels must be numbers"}, 422)
    if not np.isfinite(arr).all() or arr.min() < 0 or arr.max() > 16:
        return JSONResponse({"error": "pixels must be in 0..16"}, 422)
    return arr.astype(np.float32)


def create_app(config: ServerConfig) -> tuple[Starlette, Service]:
    """The ASGI app and its service (started by the app's lifespan)."""
    service = Service(config)

    async def predict(request: Request) -> JSONResponse:
        parsed = _parse(await request.body(), config.max_request)
        if isinstance(parsed, JSONResponse):
            return parsed
        try:
            probs = await service.predict(parsed)
        except Overloaded:
            return JSONResponse({"error": "overloaded"}, 503, headers={"Retry-After": "1"})
        return JSONResponse({"classes": probs.argmax(axis=1).tolist(), "probabilities": probs.tolist()})

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse({"ready": service.ready.is_set()}, 200 if service.ready.is_set() else 503)

    async def stats(request: Request) -> JSONResponse:
        mean = service.images / service.batches if service.batches else math.nan
        lag = service.lag
        return JSONResponse(
            {
                "mode": config.mode,
                "batches": service.batches,
                "images": service.images,
                "mean_batch": None if math.isnan(mean) else mean,
                "replicas": {r.device: r.batches for r in service.replicas},
                "loop_lag": {
                    "worst_ms": lag.worst * 1e3,
                    "mean_ms": lag.total / lag.ticks * 1e3 if lag.ticks else 0.0,
                },
            }
        )

    async def reset(request: Request) -> JSONResponse:
        service.lag.reset()
        service.batches = service.images = 0
        for replica in service.replicas:
            replica.batches = 0
        return JSONResponse({})

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with anyio.create_task_group() as tg:
            if not service.ready.is_set():
                await service.start()
            if config.stall_log is not None:
                service.lag.watch = StallWatch(Path(config.stall_log), LoopLag.PERIOD)
                service.lag.watch.start()
            tg.start_soon(service.run_batcher)
            tg.start_soon(service.lag.run)
            try:
                yield
            finally:
                tg.cancel_scope.cancel()
                service.stop()
                if service.lag.watch is not None:
                    service.lag.watch.stop()

    routes = [
        Route("/predict", predict, methods=["POST"]),
        Route("/healthz", healthz),
        Route("/stats", stats),
        Route("/stats/reset", reset, methods=["POST"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan), service


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0: a free one)."""
    sock = socket.create_server((host, port), backlog=1024)
    sock.setblocking(False)
    return sock


def _on_trio() -> bool:
    try:
        import sniffio

        return sniffio.current_async_library() == "trio"
    except Exception:
        return False


async def serve(
    config: ServerConfig,
    sock: socket.socket,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    on_ready: Callable[[Service], None] | None = None,
) -> Service:
    """Serve on ``sock`` until ``shutdown_trigger`` returns (asyncio, uvloop or trio)."""
    app, service = create_app(config)
    await service.start()  # (loading and compiling before hypercorn starts its startup timeout)
    hyper = Config()
    hyper.bind = [f"fd://{sock.detach()}"]
    hyper.accesslog = None
    hyper.loglevel = "WARNING"
    hyper.graceful_timeout = 10

    async def announce() -> None:
        await service.ready.wait()
        if on_ready is not None:
            on_ready(service)

    if _on_trio():
        from hypercorn.trio import serve as hyper_serve
    else:
        from hypercorn.asyncio import serve as hyper_serve  # type: ignore[assignment]
    async with anyio.create_task_group() as tg:
        tg.start_soon(announce)
        await hyper_serve(app, hyper, shutdown_trigger=shutdown_trigger)  # type: ignore[arg-type]
        tg.cancel_scope.cancel()
    return service


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--loop", choices=["asyncio", "uvloop", "trio"], default="asyncio")
    parser.add_argument("--devices", default="AIO")
    parser.add_argument("--mode", choices=["aio", "blocking", "executor", "http"], default="aio")
    parser.add_argument("--stall-log", help="write what stalled the event loop to this JSON file at exit")
    args = parser.parse_args()
    config = ServerConfig(devices=tuple(args.devices.split(",")), mode=args.mode, stall_log=args.stall_log)
    sock = listen(args.host, args.port)
    port = sock.getsockname()[1]

    async def run() -> None:
        stop = anyio.Event()

        async def signals() -> None:
            with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as received:
                async for _ in received:
                    stop.set()
                    return

        async with anyio.create_task_group() as tg:
            tg.start_soon(signals)
            started = time.perf_counter()
            await serve(
                config,
                sock,
                shutdown_trigger=stop.wait,
                on_ready=lambda s: print(
                    f"serving on http://{args.host}:{port} ({time.perf_counter() - started:.1f} s)",
                    flush=True,
                ),
            )
            tg.cancel_scope.cancel()

    backend = "trio" if args.loop == "trio" else "asyncio"
    options = {"use_uvloop": True} if args.loop == "uvloop" else {}
    anyio.run(run, backend=backend, backend_options=options)


if __name__ == "__main__":
    main()
