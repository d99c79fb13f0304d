"""What stalls the server's event loop: a watchdog thread that samples the loop thread's stack
while the loop is late, and the garbage collector's pauses.

``serve.py --stall-log PATH`` turns it on: the loop's ticker (``serve.LoopLag``) marks each
tick; a watchdog thread wakes every ``interval`` and, once the loop is more than ``threshold``
late for its next tick, records where the loop thread is (``sys._current_frames()``) until the
tick comes. At exit, PATH gets one JSON document: every stall longer than ``threshold`` (its
lag, the stacks seen during it with their counts) and every collection of the garbage collector
(generation, duration, on which thread). A stall with no stack samples is one during which the
watchdog could not run either: the GIL was held throughout (a collection, or C code holding
it), or the whole process was not scheduled (the machine's load).

A diagnostic, not part of the serving path: off unless asked for.
"""

from __future__ import annotations

import gc
import json
import sys
import threading
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any


class StallWatch:
    """Samples the loop thread's stack while the loop is late; records gc pauses."""

    def __init__(self, path: Path, period: float, threshold: float = 0.010, interval: float = 0.002) -> None:
        self.path = path
        self.period = period
        self.threshold = threshold
        self.interval = interval
        self.loop_thread = threading.get_ident()
        self.beat = time.perf_counter()
        self.stalls: list[dict[str, Any]] = []
        self.collections: list[dict[str, Any]] = []
        self._samples: Counter[tuple[str, ...]] = Counter()
        self._gc_start: dict[int, tuple[float, int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)

    def start(self) -> None:
        """Start watching (call on the loop thread: that is the thread sampled)."""
        self.loop_thread = threading.get_ident()
        self.beat = time.perf_counter()
        gc.callbacks.append(self._on_gc)
        self._thread.start()

    def tick(self, lag: float) -> None:
        """The loop's ticker woke ``lag`` seconds late (called on the loop thread)."""
        now = time.perf_counter()
        if lag > self.threshold:
            stacks = self._samples.most_common(8)
            self.stalls.append(
                {
                    "at": now,
                    "lag_ms": lag * 1e3,
                    "samples": sum(self._samples.values()),
                    "stacks": [{"count": n, "stack": list(stack)} for stack, n in stacks],
                }
            )
        self._samples = Counter()
        self.beat = now

    def _watch(self) -> None:
        while not self._stop.wait(self.interval):
            late = time.perf_counter() - self.beat - self.period
            if late <= self.threshold:
                continue
            frame = sys._current_frames().get(self.loop_thread)
            if frame is None:
                continue
            stack = tuple(
                f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in traceback.extract_stack(frame)[-14:]
            )
            self._samples[stack] += 1

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        ident = threading.get_ident()
        if phase == "start":
            generation = info["generation"]
            objects = len(gc.get_objects(generation)) if generation == 2 else -1
            self._gc_start[ident] = (time.perf_counter(), objects)
            return
        started = self._gc_start.pop(ident, None)
        if started is None:
            return
        self.collections.append(
            {
                "at": started[0],
                "generation": info["generation"],
                "ms": (time.perf_counter() - started[0]) * 1e3,
                "objects": started[1],  # (counted for generation 2 only)
                "collected": info["collected"],
                "loop_thread": ident == self.loop_thread,
            }
        )

    def stop(self) -> None:
        """Stop watching and write the report."""
        self._stop.set()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        slow = [c for c in self.collections if c["ms"] > 1.0]
        by_gen = {
            str(g): {
                "count": sum(1 for c in self.collections if c["generation"] == g),
                "worst_ms": max((c["ms"] for c in self.collections if c["generation"] == g), default=0.0),
            }
            for g in range(3)
        }
        report = {
            "threshold_ms": self.threshold * 1e3,
            "stalls": self.stalls,
            "gc": by_gen,
            "gc_over_1ms": slow,
            "gc_frozen": gc.get_freeze_count(),
        }
        self.path.write_text(json.dumps(report, indent=1))
