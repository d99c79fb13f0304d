"""Copies of a client into or out of a host's memory that it maps itself: one ``memcpy`` on a
client thread, no call to the host.

A device host on this machine allocates its CPU buffers of :data:`SHARED_MIN` bytes or more
in memory files (:attr:`~aiotinyrt.backends.ops_cpu.CPUAllocator.shared_min`). The reply to a
large copy through the host (direct or staged, :mod:`aiotinyrt.ray.staging`) names the
buffer's file (:class:`Shared`: the host's pid and start time, the file's descriptor there
and its inode, where the buffer lies in it); the client remembers it per buffer id
(:class:`HostMemory`) and maps the file through ``/proc/<host pid>/fd/<fd>`` at its next
copy of that buffer (once: the mapping is kept until the buffer is freed, as a staging
segment's is).

A copy is made here, not by the host, when the bytes it touches are *idle as seen from this
client*: no command of the copy's queue is still in flight, and every command of another queue
that it depends on completed (``waits`` empty; one still running would be named there or hold
the copy back). Every command that touches a host buffer is one of its client's (buffers are
per client), and a completed command's reply came after the host's work was done, so no
command is reading or writing those bytes on the host then. Later commands are kept off them
until the copy is done, on the client alone: those of another queue that depend on the copy
find no event of it to wait for on the host and are held back by their queue until it
completes; those of the copy's own queue are held by its driver (``_QueueDriver``) and sent,
in order, once it did. The host knows nothing of the copy.

The memory stays mapped here while the buffer is allocated (a copy under way holds its own
view, so a buffer freed meanwhile is unmapped after it). Opening the file needs the rights of
reading ``/proc/<pid>/fd`` of the host (the same user; not refused by Yama's ``ptrace_scope``
1, which guards attaching only). A file that does not open, or is another than named (another
inode, a process that ended), makes the connection stop asking (:attr:`HostMemory.refused`)
until it moves to another host, and that copy go through the host as before; so does each copy
once the host's process has ended (the host call finds out what became of it).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

#: How long closing a device waits for the copies this process makes into or out of its buffers
#: (:func:`all_idle`).
IDLE_WAIT_S = 60.0

#: CPU buffers of a device host of at least this many bytes are memory files (one descriptor
#: each while allocated; copies of up to ``wire.INLINE_BYTES`` travel in the call anyway).
SHARED_MIN = 1 << 20


class Shared(NamedTuple):
    """A host buffer's memory file on the wire: the pid and start time of the process whose
    descriptor it is, the descriptor and the file's inode, the file's size, where the buffer
    starts in it and how many bytes it has; and the host's process (its pid and start time, as
    its probe reports it): no copy is made here once that has ended."""

    pid: int
    started: str
    fd: int
    ino: int
    size: int
    offset: int
    nbytes: int
    host: tuple[int, str]


def locate(memory: Any, nbytes: int, process: tuple[int, str], host: tuple[int, str]) -> Shared | None:
    """Where another process finds a buffer of ``nbytes`` whose handle is ``memory``
    (``CPUMemory``; anything else: None) of this ``process``, the host's process being
    ``host``; None: not a memory file."""
    fd = getattr(memory, "fd", -1)
    mm = getattr(memory, "mm", None)
    if fd < 0 or mm is None:
        return None
    return Shared(*process, fd, os.fstat(fd).st_ino, len(mm), memory.offset, nbytes, host)


class HostMemory:
    """A connection's known host buffers (client side): buffer id -> :class:`Shared`, and their
    mappings once made. Any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._where: dict[int, Shared] = {}
        self._maps: dict[int, np.ndarray[Any, Any]] = {}
        #: bumped whenever everything is forgotten: a location learned before is not kept
        self.generation = 0
        #: the host's files do not open here: copies go through the host
        self.refused = False
        self.copies = 0  #: copies made here (tests look)

    def remember(self, rid: int, where: Shared, generation: int) -> None:
        """Buffer ``rid`` lies at ``where`` (from a reply to a copy sent in ``generation``)."""
        with self._lock:
            if generation == self.generation and not self.refused:
                self._where.setdefault(rid, where)

    def known(self, rid: int) -> bool:
        """Whether a copy of buffer ``rid`` may be made here (its file is known)."""
        return not self.refused and rid in self._where

    def forget(self, rid: int) -> None:
        """Buffer ``rid`` was freed: drop what is known of it (a copy under way keeps its view)."""
        with self._lock:
            self._where.pop(rid, None)
            self._maps.pop(rid, None)

    def clear(self) -> None:
        """Forget every buffer (the connection moves to another host, or closes); the next host's
        files may open here: try again."""
        with self._lock:
            self._where.clear()
            self._maps.clear()
            self.generation += 1
            self.refused = False

    def view(self, rid: int, offset: int, nbytes: int) -> np.ndarray[Any, Any] | None:
        """``nbytes`` of buffer ``rid`` from ``offset``, mapped here; None when the buffer is not
        known or its host's process has ended, or its file does not open or is another (then
        :attr:`refused` is set)."""
        with self._lock:
            where = self._where.get(rid)
            mapped = self._maps.get(rid)
            generation = self.generation
        if where is None or offset < 0 or offset + nbytes > where.nbytes:
            return None
        if started(where.host[0]) != where.host[1]:  # (the host call finds out what became of it)
            return None
        if mapped is None:
            try:
                mapped = _map(where)
            except (OSError, ValueError):
                with self._lock:
                    self.refused = True
                    self._where.clear()
                    self._maps.clear()
                return None
            with self._lock:
                if self.generation == generation and rid in self._where:
                    self._maps[rid] = mapped
        start = where.offset + offset
        return mapped[start : start + nbytes]


def started(pid: int) -> str:
    """The start time of process ``pid`` (field 22 of its stat), or "" where there is none or
    it has ended (a zombie: it runs no more)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[-1].split()
    except OSError:
        return ""
    return "" if fields[0] in (b"Z", b"X") else fields[19].decode()


def _map(where: Shared) -> np.ndarray[Any, Any]:
    """The memory file ``where`` names, mapped here (``OSError`` when it does not open,
    ``ValueError`` when what opened is not that file of that process)."""
    fd = os.open(f"/proc/{where.pid}/fd/{where.fd}", os.O_RDWR)
    try:
        st = os.fstat(fd)
        if st.st_ino != where.ino or st.st_size < where.size or where.offset + where.nbytes > where.size:
            raise ValueError(f"/proc/{where.pid}/fd/{where.fd} is not the host's memory file")
        if started(where.pid) != where.started:  # (the host ended; its pid was reused)
            raise ValueError(f"process {where.pid} is not the host")
        return np.frombuffer(mmap.mmap(fd, where.size), np.uint8)
    finally:
        os.close(fd)


def copy(dst: int, src: int, nbytes: int) -> None:
    """``memcpy`` of ``nbytes`` from address ``src`` to ``dst``, the GIL released. One thread:
    two gained nothing here (64 MiB out of a host's memory: 13.8 ms in two threads against 11.5
    in one, medians of 15 beside Ray's own threads on 2 cores)."""
    ctypes.memmove(dst, src, nbytes)


def start(target: Callable[..., None], *args: Any) -> None:
    """Run ``target(*args)`` on a thread of its own, for a copy made here (``RuntimeError`` when
    no thread starts: then it never runs). A thread per copy, not a pool: a pool may keep work it
    failed to start a thread for and run it later."""
    threading.Thread(target=target, args=args, name="aiotinyrt-ray-copy", daemon=True).start()


class _Idles(Protocol):
    def wait_idle(self, timeout: float) -> bool: ...


def all_idle(drivers: Sequence[_Idles]) -> bool:
    """Wait until none of ``drivers`` (a device's queue drivers) makes a copy here
    (:data:`IDLE_WAIT_S` in all at most; a copy is one ``memcpy``): whether none does."""
    deadline = time.monotonic() + IDLE_WAIT_S
    return all(d.wait_idle(max(0.0, deadline - time.monotonic())) for d in drivers)
