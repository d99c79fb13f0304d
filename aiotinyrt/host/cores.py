"""The core pool: threads that run the chunks of a kernel launch split over several cores.

A host-code backend's queue worker runs chunk 0 itself and hands the others to the pool; the
launch completes when every chunk has (``run_split`` is the command the queue runs).
"""

from __future__ import annotations

import queue
import threading
from typing import Any


class CorePool:
    """Daemon threads that run the chunks of a split kernel launch (chunk 0 runs on the queue's
    own worker). Daemon, so a kernel that never returns cannot hold up interpreter exit."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: queue.SimpleQueue[tuple[Any, tuple[Any, ...], threading.Semaphore, list[BaseException]]]
        self._tasks = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _ensure(self, n: int) -> None:
        with self._lock:
            while len(self._threads) < n:
                thread = threading.Thread(
                    target=self._run, name=f"aiotinyrt-{self.name}/core{len(self._threads) + 1}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def _run(self) -> None:
        while True:
            fn, args, done, errors = self._tasks.get()
            if fn is None:
                return
            try:
                fn(*args)
            except BaseException as exc:
                errors.append(exc)
            done.release()

    def run_split(self, fn: Any, args: tuple[Any, ...], threads: int) -> None:
        """Run ``fn(*args, core_id, threads)`` for every core_id, concurrently; raise the first
        error after all chunks finished."""
        self._ensure(threads - 1)
        done = threading.Semaphore(0)
        errors: list[BaseException] = []
        for core in range(1, threads):
            self._tasks.put((fn, (*args, core, threads), done, errors))
        try:
            fn(*args, 0, threads)
        finally:
            for _ in range(threads - 1):
                done.acquire()
        if errors:
            raise errors[0]

    def close(self) -> None:
        """Stop the pool's threads (each exits after the chunk it runs, if any)."""
        for _ in self._threads:
            self._tasks.put((None, (), threading.Semaphore(), []))
