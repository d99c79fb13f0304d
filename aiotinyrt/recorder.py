"""Recording traces: what every queue ran and every allocator held while ``PROFILE`` is set,
and writing it as Chrome-trace JSON (loads in Perfetto). Reading a trace back, its summary and its
picture are :mod:`aiotinyrt.trace`.

``PROFILE=1`` (or ``PROFILE=path``) records, for every command a queue runs: its kind (kernel,
copy, transfer, graph replay, wait), name, start and duration, its value on the queue's timeline
and the commands on other queues it depended on; each allocator records its memory in use at
every allocation and free. Profiling starts when the first device opens: a trace path that cannot
be written is an error then (:func:`start`), not at exit. At interpreter exit the registry calls
:func:`write`, which puts every device in the file and says on stderr where.

The file: one process per device, one thread (track) per queue, one ``X`` slice per command
(``cat`` is its kind, ``args`` its timeline value, bytes moved, dependencies), a ``wait`` slice
where a queue's worker waited for another queue before a command, one flow (a ``s``/``f`` pair
with a shared ``id``) per dependency from the command depended on to its dependent, and a counter
track (``C``) of each device's allocator memory in use. Timestamps are microseconds since the
first recorded event.

This module sits low (it imports only :mod:`aiotinyrt.helpers`): queues, allocators and the
registry record into it, and it knows them only by their attributes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aiotinyrt.helpers import getenv_str

DEFAULT_FILE = "aiotinyrt_profile.json"
_checked: dict[str, str] = {}  # PROFILE value -> the absolute path checked writable


def trace_path() -> str | None:
    """The absolute path ``PROFILE`` asks for (``1``: ``aiotinyrt_profile.json`` in the working
    directory), or None when profiling is off."""
    value = getenv_str("PROFILE")
    if not value:
        return None
    return os.path.abspath(DEFAULT_FILE if value == "1" else value)


def start() -> bool:
    """Called when a queue is created: True when profiling is on. The first call for a
    ``PROFILE`` value checks that its file can be written (by opening it for appending, removing
    it again if it did not exist) and raises ``ValueError`` naming the path and the reason."""
    path = trace_path()
    if path is None:
        return False
    value = getenv_str("PROFILE")
    if _checked.get(value) == path:
        return True
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
        if not existed:
            os.unlink(path)
    except OSError as exc:
        raise ValueError(
            f"PROFILE={value!r}: the trace cannot be written to {path}: {exc.strerror or exc}"
        ) from None
    _checked[value] = path
    return True


@dataclass
class Command:
    """One recorded command (times in seconds of ``time.perf_counter``)."""

    kind: str  # kernel, copy, transfer, graph, wait
    name: str
    start: float
    seconds: float
    value: int
    deps: tuple[tuple[str, int], ...]  # (timeline label, value) of each command depended on
    nbytes: int = 0
    waited_from: float | None = None  # when the worker began waiting for deps on other queues


@dataclass
class QueueTrace:
    """The commands one queue ran while profiling (appended by its worker thread only)."""

    label: str
    commands: list[Command] = field(default_factory=list)

    def record(
        self,
        fn: object,
        args: tuple[Any, ...],
        keep: object,
        deps: Sequence[Any],
        waited_from: float | None,
        start: float,
        seconds: float,
        value: int,
    ) -> None:
        """Record one command the worker ran: ``fn(*args)`` with ``keep`` as submitted; ``deps``
        are its dependencies' Signals (``timeline.label``, ``value``)."""
        kind, name, nbytes = classify(fn, args, keep)
        dep_ids = tuple((dep.timeline.label, dep.value) for dep in deps)
        self.commands.append(Command(kind, name, start, seconds, value, dep_ids, nbytes, waited_from))


def _nbytes(obj: object) -> int:
    size = getattr(obj, "nbytes", None)
    return size if isinstance(size, int) else 0


def classify(fn: object, args: tuple[Any, ...], keep: object) -> tuple[str, str, int]:
    """(kind, name, bytes moved) of a queue command, from what it was submitted with."""
    fname = getattr(fn, "__name__", type(fn).__name__)
    if isinstance(keep, tuple) and keep:
        first, last = keep[0], keep[-1]
        if len(keep) == 2 and getattr(last, "_launcher", None) is not None:  # (buffers, Program)
            return "kernel", str(getattr(last, "name", fname)), 0
        entries = getattr(first, "entries", None)
        if entries is not None:  # (a graph's run, ...)
            return "graph", f"graph replay ({len(entries)} commands)", 0
    if fname == "_transfer":
        return "transfer", "transfer", int(args[2])
    if fname in ("_copyin", "_copyout"):
        return "copy", fname[1:], _nbytes(args[1] if fname == "_copyin" else args[0])
    if fname == "_join":
        return "wait", "join (graph replay)", 0
    return "other", fname, 0


# ---- writing -------------------------------------------------------------------------------------
def events(devices: Sequence[Any]) -> list[dict[str, Any]]:
    """The Chrome-trace events of every queue and allocator of ``devices`` (opened devices:
    ``name``, ``queues`` with ``profile`` and ``timeline``, ``allocator.memory_trace``)."""
    meta: list[dict[str, Any]] = []
    recorded: list[tuple[str, int, int, Command]] = []
    memory: list[tuple[int, float, int]] = []
    for pid, device in enumerate(devices):
        meta.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": device.name}})
        for tid, queue in enumerate(device.queues.values()):
            meta.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": queue.name}}
            )
            trace = queue.profile
            label = queue.timeline.label
            recorded.extend((label, pid, tid, c) for c in list(trace.commands if trace is not None else ()))
        memory.extend((pid, t, n) for t, n in list(device.allocator.memory_trace or ()))
    times = [c.waited_from if c.waited_from is not None else c.start for *_, c in recorded]
    origin = min([*times, *(t for _, t, _ in memory)], default=0.0)

    def us(t: float) -> float:
        return round((t - origin) * 1e6, 3)

    out: list[dict[str, Any]] = []
    by_id: dict[tuple[str, int], tuple[int, int, float]] = {}
    for label, pid, tid, c in recorded:
        # a flow starts inside the slice it leaves (Perfetto binds it to the enclosing slice): at its end
        by_id[(label, c.value)] = (pid, tid, us(c.start) + max(round(c.seconds * 1e6, 3) - 0.001, 0.0))
    flow = 0
    for _, pid, tid, c in recorded:
        if c.waited_from is not None and c.start > c.waited_from:
            out.append(
                {"name": "wait", "cat": "wait", "ph": "X", "pid": pid, "tid": tid, "ts": us(c.waited_from),
                 "dur": us(c.start) - us(c.waited_from), "args": {"for": [f"{lbl}@{v}" for lbl, v in c.deps]}}
            )  # fmt: skip
        args: dict[str, Any] = {"value": c.value, "deps": [f"{lbl}@{v}" for lbl, v in c.deps]}
        if c.nbytes:
            args["bytes"] = c.nbytes
        ts = us(c.start)
        out.append({"name": c.name, "cat": c.kind, "ph": "X", "pid": pid, "tid": tid, "ts": ts,
                    "dur": max(round(c.seconds * 1e6, 3), 0.001), "args": args})  # fmt: skip
        for dep in c.deps:
            source = by_id.get(dep)
            if source is None:
                continue
            flow += 1
            spid, stid, sts = source
            out.append({"name": "dependency", "cat": "dependency", "ph": "s", "id": flow, "pid": spid,
                        "tid": stid, "ts": sts})  # fmt: skip
            out.append({"name": "dependency", "cat": "dependency", "ph": "f", "bp": "e", "id": flow,
                        "pid": pid, "tid": tid, "ts": ts})  # fmt: skip
    for pid, t, n in memory:
        out.append({"name": "memory in use", "ph": "C", "pid": pid, "ts": us(t), "args": {"bytes": n}})
    out.sort(key=lambda e: e["ts"])
    return meta + out


def write(devices: Sequence[Any], path: str | None = None, *, announce: bool = True) -> str | None:
    """Write the trace of ``devices`` to ``path`` (default: ``PROFILE``'s); with ``announce``,
    one line on stderr says where and how much. Returns the path, or None when not profiling."""
    target = path or trace_path()
    if target is None:
        return None
    evs = events(devices)
    with open(target, "w") as f:
        json.dump({"traceEvents": evs, "displayTimeUnit": "ms"}, f)
    if announce:
        commands = sum(1 for e in evs if e["ph"] == "X" and e.get("cat") != "wait")
        print(
            f"aiotinyrt: wrote a trace of {commands} commands to {target} "
            f"(open it in Perfetto; summary: python -m aiotinyrt trace {target})",
            file=sys.stderr,
        )
    return target


def now() -> float:
    """The clock traces use (``time.perf_counter``)."""
    return time.perf_counter()
