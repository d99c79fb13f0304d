"""FAKE: a backend whose queues are driver-run (aiotinyrt.driverqueue), over a fake driver.

The driver runs each queue's commands in order on a thread of its own, waits for the events in a
command's wait list first, and reports completion through the queue's callback from that thread
(as an OpenCL event callback would). Kernels are Python functions over the buffers' bytes, as on
the TOY backend, so results can be checked; memory is host memory.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from aiotinyrt import Compiled
from aiotinyrt.driverqueue import Done, DriverQueue
from aiotinyrt.queue import Queue
from tests.toy_backend import ToyAllocator, ToyCompiler, ToyProgram


class FakeDriver:
    """One thread per driver queue ("stream"); events are ``threading.Event``s."""

    def __init__(self) -> None:
        self._streams: dict[int, queue.SimpleQueue[Any]] = {}
        self._threads: list[threading.Thread] = []
        #: how many commands were handed to the driver (tests look)
        self.enqueued = 0

    def stream(self) -> int:
        """A new in-order stream; returns its id."""
        work: queue.SimpleQueue[Any] = queue.SimpleQueue()
        sid = len(self._streams)
        self._streams[sid] = work
        thread = threading.Thread(target=self._run, args=(work,), name=f"fake-driver-{sid}", daemon=True)
        thread.start()
        self._threads.append(thread)
        return sid

    def _run(self, work: queue.SimpleQueue[Any]) -> None:
        while True:
            item = work.get()
            if item is None:
                return
            fn, args, waits, done, event = item
            for wait in waits:
                wait.wait()
            start = time.perf_counter()
            error: BaseException | None = None
            try:
                fn(*args)
            except BaseException as exc:
                error = exc
            event.set()
            done(time.perf_counter() - start, error)

    def enqueue(
        self,
        stream: int,
        fn: Callable[..., object],
        args: tuple[Any, ...],
        waits: Sequence[object],
        done: Done,
    ) -> object:
        event = threading.Event()
        self.enqueued += 1
        self._streams[stream].put((fn, args, list(waits), done, event))
        return event

    def close(self) -> None:
        for work in self._streams.values():
            work.put(None)


class _Stream:
    """The Driver a DriverQueue sees: one stream of the fake driver."""

    def __init__(self, driver: FakeDriver) -> None:
        self.fake = driver
        self.sid = driver.stream()

    def enqueue(
        self, fn: Callable[..., object], args: tuple[Any, ...], waits: Sequence[object], done: Done
    ) -> object:
        return self.fake.enqueue(self.sid, fn, args, waits, done)


class FAKEDevice(Compiled):
    def __init__(self, name: str) -> None:
        self.driver = FakeDriver()  # (before the base class makes the queues)
        super().__init__(name, ToyAllocator(self), ToyCompiler(), ToyProgram)

    def _make_queue(self, name: str) -> Queue:
        # one stream per queue; the streams of one driver see each other's events
        return DriverQueue(self, name, _Stream(self.driver), context=self.driver)

    def _on_close(self) -> None:
        self.driver.close()
