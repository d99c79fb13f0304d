"""Access records, and the dependencies they imply (read-after-write, write-after-read,
write-after-write).

Every command that touches a buffer reads or writes a byte range ``[start, end)`` of its *base*
allocation. The base keeps a short list of the accesses still worth knowing about, each an
:data:`Access` ``(start, end, signal, is_write)``. A new access depends on every overlapping
pending write and, if it writes, on every overlapping pending read. Dependencies on the
command's own queue are implied by that queue's order and dropped; the rest travel with the
command and are resolved by the queue's executor (a worker or the driver), never by the event
loop. A write forgets the accesses it fully covers (it is ordered after them, so anything later
that overlaps them overlaps it too); disjoint views never wait for each other.

This module is the one definition of the record. The native extension module reads and writes
the same tuples (``aiotinyrt/native/pyext.c`` and ``replay.c``: a plain 4-tuple, fields in this
order; a whole-buffer write is ``[(0, nbytes, signal, True)]``), so the layout is fixed: a
tuple subclass would send every launch to the slower Python path.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TypeAlias

from aiotinyrt.signal import Signal, Timeline

#: ``(start, end, signal, is_write)``: bytes ``[start, end)`` of a base allocation, used by the
#: command of ``signal``.
Access: TypeAlias = tuple[int, int, Signal, bool]


def whole_write(nbytes: int, sig: Signal) -> list[Access]:
    """The access list of a base buffer just written whole by ``sig``: it supersedes the rest."""
    return [(0, nbytes, sig, True)]


def conflicts(accesses: list[Access], start: int, end: int, write: bool) -> Iterator[Signal]:
    """Pending commands (any queue) a new access to ``[start, end)`` must follow: for a write,
    every pending access of overlapping bytes; for a read, the pending writes."""
    for a_start, a_end, sig, a_write in accesses:
        if (a_write or write) and a_start < end and start < a_end and sig.timeline.completed < sig.value:
            yield sig


def dependencies(
    accesses: list[Access], start: int, end: int, timeline: Timeline, write: bool
) -> list[Signal]:
    """Signals on other timelines that a new access on ``timeline`` must wait for."""
    if not accesses:
        return []
    return [sig for sig in conflicts(accesses, start, end, write) if sig.timeline is not timeline]


def idle(accesses: list[Access], start: int, end: int, write: bool) -> bool:
    """No pending command on any queue conflicts with a new access to ``[start, end)``: an
    access now, on the calling thread, is ordered exactly as one queued now would be."""
    return not accesses or next(conflicts(accesses, start, end, write), None) is None


def pending(accesses: list[Access]) -> list[Signal]:
    """Signals of every access not done yet, or abandoned at close while it may still run (see
    :mod:`aiotinyrt.lifetime`: its memory is never released)."""
    return [
        sig
        for _, _, sig, _ in accesses
        if sig.timeline.completed < sig.value or sig.value >= sig.timeline._abandoned
    ]


def pending_writes(accesses: list[Access], start: int, end: int) -> list[Signal]:
    """Signals of writes to ``[start, end)`` that are not done yet."""
    return [
        sig
        for a_start, a_end, sig, a_write in accesses
        if a_write and a_start < end and start < a_end and sig.timeline.completed < sig.value
    ]


def recorded(accesses: list[Access], start: int, end: int, sig: Signal, write: bool) -> list[Access]:
    """The access list after the command of ``sig`` reads or writes ``[start, end)`` (may be
    ``accesses`` itself, changed in place)."""
    if write:
        accesses = [a for a in accesses if not (start <= a[0] and a[1] <= end)]
    else:
        # A read supersedes earlier reads of the same bytes on the same queue: that queue
        # finishes them first, so waiting for this one waits for them. This keeps the list
        # short when many launches read a buffer without writing it.
        timeline = sig.timeline
        if accesses:
            last = accesses[-1]
            if not last[3] and last[2].timeline is timeline and last[0] == start and last[1] == end:
                accesses[-1] = (start, end, sig, False)
                return accesses
        if len(accesses) >= 8:
            accesses = [
                a
                for a in accesses
                if a[2].timeline.completed < a[2].value
                and (a[3] or a[2].timeline is not timeline or not (start <= a[0] and a[1] <= end))
            ]
    accesses.append((start, end, sig, write))
    return accesses
