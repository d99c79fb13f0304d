"""Micro-batching with back-pressure: requests queue up, the batcher packs them into micro-batches.

A request (``rows`` images) is accepted only if the queue has room for its images; otherwise
``submit`` raises :class:`Overloaded` at once (the server answers 503 with ``Retry-After``):
nothing is dropped silently, every accepted request gets its result or an error.

The batcher takes a pipeline slot *first*, then gathers: it waits until ``max_batch`` images are
queued or the oldest queued request has waited ``max_wait`` seconds, whichever comes first, and
starts the micro-batch in a task of its own. While every slot is busy, requests accumulate, so
the busier the server, the fuller the micro-batches. Requests are never split.
"""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio
import anyio.abc

SlotT = TypeVar("SlotT")
ResultT = TypeVar("ResultT")


class Overloaded(Exception):
    """The queue is full: retry later (HTTP 503)."""


class ShuttingDown(Overloaded):
    """The server is draining and accepts no new work (HTTP 503)."""


class Ticket(Generic[ResultT]):
    """One accepted request: its images, and its result once the micro-batch that ran it is done."""

    __slots__ = ("_done", "_error", "_result", "enqueued", "pixels", "rows")

    def __init__(self, pixels: array[float], rows: int, enqueued: float) -> None:
        self.pixels = pixels
        self.rows = rows
        self.enqueued = enqueued
        self._done = anyio.Event()
        self._result: ResultT | None = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def set_result(self, result: ResultT) -> None:
        self._result = result
        self._done.set()

    def set_error(self, error: BaseException) -> None:
        self._error = error
        self._done.set()

    async def result(self) -> ResultT:
        """Wait for the result; raises the micro-batch's error if it failed.

        Cancellation: abandons the wait; the request still runs (its result is discarded).
        """
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result


@dataclass(frozen=True)
class BatcherStatistics:
    """A snapshot: what is queued, in flight, and done so far."""

    queued_requests: int
    queued_images: int
    capacity_images: int
    in_flight_batches: int
    batches: int
    requests: int
    images: int
    rejected: int
    failed: int
    run_seconds: float  #: time micro-batches spent running (summed over micro-batches in flight)
    paused: bool
    closed: bool


class MicroBatcher(Generic[SlotT, ResultT]):
    """Gathers requests into micro-batches and runs them with ``acquire``/``run``/``release``.

    ``run(slot, pixels, rows)`` computes a micro-batch; ``split(result, sizes)`` cuts its result
    into one per request.
    """

    def __init__(
        self,
        *,
        acquire: Callable[[], Awaitable[SlotT]],
        release: Callable[[SlotT], None],
        run: Callable[[SlotT, array[float], int], Awaitable[ResultT]],
        split: Callable[[ResultT, list[int]], list[ResultT]],
        max_batch: int,
        max_wait: float,
        capacity: int,
    ) -> None:
        if max_batch < 1 or capacity < max_batch:
            raise ValueError(f"need 1 <= max_batch <= capacity, got {max_batch} and {capacity}")
        self._acquire, self._release, self._run, self._split = acquire, release, run, split
        self.max_batch = max_batch
        self.max_wait = max_wait
        self.capacity = capacity
        self._queue: deque[Ticket[ResultT]] = deque()
        self._queued_images = 0
        self._changed = anyio.Event()
        self._closed = False
        self._paused = False
        self._in_flight = 0
        self._batches = self._requests = self._images = self._rejected = self._failed = 0
        self._busy = 0.0  # seconds micro-batches spent in run(), summed

    # ---- producers ------------------------------------------------------------------------------
    def submit(self, pixels: array[float], rows: int) -> Ticket[ResultT]:
        """Queue a request of ``rows`` images (``1 <= rows <= max_batch``).

        Raises :class:`Overloaded` when the queue cannot take ``rows`` more images and
        :class:`ShuttingDown` after :meth:`close`.
        """
        if not 1 <= rows <= self.max_batch:
            raise ValueError(f"a request has 1..{self.max_batch} images, got {rows}")
        if self._closed:
            self._rejected += 1
            raise ShuttingDown("the server is shutting down")
        if self._queued_images + rows > self.capacity:
            self._rejected += 1
            raise Overloaded(
                f"server busy: {self._queued_images} images queued (capacity {self.capacity}); retry later"
            )
        ticket: Ticket[ResultT] = Ticket(pixels, rows, anyio.current_time())
        self._queue.append(ticket)
        self._queued_images += rows
        self._notify()
        return ticket

    def close(self) -> None:
        """Accept no more requests; :meth:`run` returns once the queue is drained and every
        micro-batch has finished."""
        self._closed = True
        self._paused = False  # draining overrides a pause
        self._notify()

    def pause(self) -> None:
        """Stop starting micro-batches (requests still queue, up to capacity)."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        self._notify()

    def statistics(self) -> BatcherStatistics:
        return BatcherStatistics(
            queued_requests=len(self._queue),
            queued_images=self._queued_images,
            capacity_images=self.capacity,
            in_flight_batches=self._in_flight,
            batches=self._batches,
            requests=self._requests,
            images=self._images,
            rejected=self._rejected,
            failed=self._failed,
            run_seconds=self._busy,
            paused=self._paused,
            closed=self._closed,
        )

    async def wait_until(self, predicate: Callable[[BatcherStatistics], bool]) -> None:
        """Wait until ``predicate(self.statistics())`` holds (checked after every change)."""
        while not predicate(self.statistics()):
            await self._changed.wait()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    # ---- the batching loop ------------------------------------------------------------------------
    async def run(self) -> None:
        """Form and start micro-batches until closed and drained.

        Cancellation: stops forming batches; micro-batches already started are cancelled (their
        enqueued device work still completes) and their requests fail with :class:`ShuttingDown`.
        """
        async with anyio.create_task_group() as tg:
            while True:
                if not self._queue or self._paused:
                    if self._closed and not self._queue:
                        break
                    await self._changed.wait()
                    continue
                slot = await self._acquire()
                try:
                    await self._gather()
                    batch = self._take()
                except BaseException:
                    self._release(slot)
                    raise
                self._in_flight += 1
                tg.start_soon(self._run_batch, slot, batch)
        # the task group waited for every micro-batch

    async def _gather(self) -> None:
        """Wait for a full micro-batch, or until the oldest request has waited ``max_wait``."""
        deadline = self._queue[0].enqueued + self.max_wait
        while self._queued_images < self.max_batch and not self._closed:
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                return
            with anyio.move_on_after(remaining):
                await self._changed.wait()

    def _take(self) -> list[Ticket[ResultT]]:
        batch: list[Ticket[ResultT]] = []
        rows = 0
        while self._queue and rows + self._queue[0].rows <= self.max_batch:
            ticket = self._queue.popleft()
            batch.append(ticket)
            rows += ticket.rows
        self._queued_images -= rows
        return batch

    async def _run_batch(self, slot: SlotT, batch: list[Ticket[ResultT]]) -> None:
        try:
            if len(batch) == 1:
                pixels = batch[0].pixels
            else:
                pixels = array("f")
                for ticket in batch:
                    pixels.extend(ticket.pixels)
            sizes = [ticket.rows for ticket in batch]
            start = anyio.current_time()
            result = await self._run(slot, pixels, sum(sizes))
            self._busy += anyio.current_time() - start
            for ticket, part in zip(batch, self._split(result, sizes), strict=True):
                ticket.set_result(part)
            self._batches += 1
            self._requests += len(batch)
            self._images += sum(sizes)
        except Exception as exc:
            self._failed += len(batch)
            for ticket in batch:
                ticket.set_error(exc)
        finally:
            for ticket in batch:
                if not ticket.done():
                    ticket.set_error(ShuttingDown("the server shut down before this request ran"))
            self._release(slot)
            self._in_flight -= 1
            self._notify()
