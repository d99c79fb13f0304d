"""How large copies between a client and a device host on the same machine skip the object
store: *direct* (one copy) or *staged* (two), found by a probe once per connection.

A ``ray.put`` is a copy into the store plus the store's own work (creating, sealing and
releasing the object, its serializer); a copy through the store is that and the other side's
copy.

Direct: the host copies straight between the client's memory and the buffer with
``process_vm_readv`` / ``process_vm_writev`` (one copy, by the kernel, on a worker thread of the
host). A copyin's command names the address of the caller's bytes in the client, a copyout's
the address of the destination; the client keeps that memory alive until the reply. The host
makes the copy in line, after every pending use of the buffer (a copyin) or its pending writes
(a copyout), so nothing later touches the buffer meanwhile. It needs the host to be allowed to
read and write the client's memory (the same user, and ptrace access: not under Yama's
``ptrace_scope`` 1 or more, nor where a seccomp profile forbids these calls).

Staged: two plain ``memcpy``\\ s through a *segment* (an anonymous shared-memory file,
``memfd_create``) that the client keeps and reuses, so its pages stay mapped on both sides: a
copyin is the client's copy into the segment (the connection's sender thread) and the host's
copy from it into the buffer (the device's copy queue); a copyout the host's copy out of the
buffer into the segment, ordered like any copyout, and the client's copy from it into the
destination (the connection's waiter thread). Neither runs on an event loop.

The host opens a segment through ``/proc/<client pid>/fd/<fd>`` at its first use and keeps the
mapping (mapping it afresh for each copy costs as much as the copy: its pages fault in again).
The probe, once per connection (and again after a reconnection): the host reads a random token
of the client's, first through ``process_vm_readv`` (direct), else from the start of a segment
through that path (staged). A host on another machine fails both (a pid and fd there name
something else, whose bytes are not the token), and that connection's copies go through the
object store.

Memory. A segment is leased to one piece of one copy from the moment its bytes are written
until that piece's reply was handled, then returned to the connection's free list; free
segments beyond :data:`KEEP_BYTES` are closed, and the host is told to drop its mapping of them
in the command stream (``UNSTAGE``). When the connection is dropped its sender thread closes the
free segments and asks the host to drop every mapping of that client. A host also drops the
mappings of clients whose process is gone whenever it maps a new segment.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import secrets
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from aiotinyrt.ray.shared import HostMemory
from aiotinyrt.ray.shared import started as _started

#: How a connection's large copies travel (:attr:`Staging.mode`).
DIRECT, STAGED, STORE = "direct", "staged", "store"

#: Bytes of free segments a connection keeps for reuse at most (beyond them, segments returned
#: are closed): two pieces of a copyin and two of a copyout in flight at once.
KEEP_BYTES = 256 << 20

#: The smallest segment (sizes are rounded up to a power of two at least this).
MIN_BYTES = 1 << 20

#: Bytes of the probe's token at the start of a segment.
TOKEN_BYTES = 16


class Staged(NamedTuple):
    """A segment on the wire: the client's pid and the segment's fd there, its id (unique per
    connection) and size."""

    pid: int
    fd: int
    id: int
    size: int


class Direct(NamedTuple):
    """Memory of the client on the wire: its pid, the address there, how many bytes of it the
    copy moves (a host refuses a copy of any other size: it never reads or writes past the
    memory the client named), and the process's start time (so that a process reusing the pid
    of a client that died is never written)."""

    pid: int
    addr: int
    nbytes: int
    started: str

    @staticmethod
    def here(addr: int, nbytes: int) -> Direct:
        """``nbytes`` of this process's memory at ``addr``."""
        pid, started = process_here()
        return Direct(pid, addr, nbytes, started)


def process_here() -> tuple[int, str]:
    """This process's pid and start time (read once per process: a forked child reads its own)."""
    global _SELF
    pid = os.getpid()
    if _SELF[0] != pid:
        _SELF = (pid, _started(pid))
    return _SELF


def gone(process: tuple[int, str], deadline: float, pause: float = 0.01) -> bool:
    """Wait until ``process`` (a pid and its start time) has ended, ``deadline``
    (``time.monotonic``) at most, looking every ``pause`` seconds: whether it did (no such pid,
    another process's start time, or a zombie's: it runs no more)."""
    pid, started = process
    while True:
        if _started(pid) != started:  # ("" for no such pid, or a zombie)
            return True
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        threading.Event().wait(min(pause, left))


#: This process's pid and start time, once read.
_SELF = (0, "")


class _Iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _vm_call(write: bool) -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    fn = getattr(libc, "process_vm_writev" if write else "process_vm_readv", None)
    if fn is not None:
        fn.restype = ctypes.c_ssize_t
        iov = ctypes.POINTER(_Iovec)
        fn.argtypes = [ctypes.c_int, iov, ctypes.c_ulong, iov, ctypes.c_ulong, ctypes.c_ulong]
    return fn


_VM_READ, _VM_WRITE = _vm_call(False), _vm_call(True)


#: Direct copies of at least this many bytes are split between two threads (the kernel's copy
#: pins each page first: two threads copy 64 MiB ~1.2x as fast as one, BENCHMARKS.md, Ray).
SPLIT_BYTES = 8 << 20


def direct_copy(there: Direct, local: int, nbytes: int, write: bool) -> None:
    """Copy ``nbytes`` between ``local`` (this process) and the client's memory ``there``:
    into the client when ``write``, else out of it; in two threads from :data:`SPLIT_BYTES` on.
    ``OSError`` unless every byte moved, or when the process is not the client that sent
    ``there`` (it ended, and its pid was reused); ``ValueError``, copying nothing, when
    ``nbytes`` is not the size of the memory ``there`` names."""
    if nbytes != there.nbytes:
        raise ValueError(f"a copy of {nbytes} bytes, but the client named {there.nbytes} bytes of its memory")
    if _started(there.pid) != there.started:
        raise OSError(f"process {there.pid} (a client) is gone")
    if nbytes < SPLIT_BYTES or (os.cpu_count() or 1) < 2:
        _vm_copy(there.pid, local, there.addr, nbytes, write)
        return
    half = nbytes // 2
    errors: list[BaseException] = []

    def second() -> None:
        try:
            _vm_copy(there.pid, local + half, there.addr + half, nbytes - half, write)
        except BaseException as exc:
            errors.append(exc)

    helper = threading.Thread(target=second, name="aiotinyrt-direct-copy", daemon=True)
    helper.start()
    try:
        _vm_copy(there.pid, local, there.addr, half, write)
    finally:
        helper.join()
    if errors:
        raise errors[0]


def _vm_copy(pid: int, local: int, remote: int, nbytes: int, write: bool) -> None:
    """Copy ``nbytes`` between ``local`` (this process) and ``remote`` (process ``pid``): into
    the other process when ``write``, else out of it. ``OSError`` unless every byte moved."""
    fn = _VM_WRITE if write else _VM_READ
    if fn is None:
        raise OSError("process_vm_readv/process_vm_writev are not available here")
    done = 0
    while done < nbytes:
        here, there = _Iovec(local + done, nbytes - done), _Iovec(remote + done, nbytes - done)
        moved = fn(pid, ctypes.byref(here), 1, ctypes.byref(there), 1, 0)
        if moved <= 0:
            err = ctypes.get_errno()
            raise OSError(err, f"process {pid}: {os.strerror(err) if moved else 'nothing copied'}")
        done += moved


def address(array: np.ndarray[Any, Any]) -> int:
    """The address of a contiguous array's first byte."""
    return int(array.ctypes.data)


class Segment:
    """A client's shared-memory segment (see the module docstring)."""

    def __init__(self, sid: int, size: int) -> None:
        self.fd = os.memfd_create(f"aiotinyrt-staging-{sid}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, size)
            self._map: mmap.mmap | None = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.array: np.ndarray[Any, Any] = np.frombuffer(self._map, np.uint8)
        self.staged = Staged(os.getpid(), self.fd, sid, size)
        self.size = size

    def close(self) -> None:
        """Close the fd; the mapping goes with the last view of it (once)."""
        if self._map is not None:
            self._map = None
            self.array = np.empty(0, np.uint8)
            os.close(self.fd)


def _size_class(nbytes: int) -> int:
    return max(MIN_BYTES, 1 << (nbytes - 1).bit_length())


class Staging:
    """A connection's way of copying (:attr:`mode`) and its segments (client side): probed and
    leased by the sender thread, returned from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: list[Segment] = []
        self._next_id = 1
        #: DIRECT, STAGED or STORE; None until the probe of the current host ran
        self.mode: str | None = None
        #: bumped (under the lock) whenever the mode is forgotten: a probe begun before sets none
        self._generation = 0
        self.retired: list[int] = []  #: ids of closed segments the host may still map
        self.host: tuple[Any, str] | None = None  #: (actor, client id) that mapped segments
        self.closed = False
        self.made = 0  #: segments made (tests look)
        #: the host's buffers this connection copies into and out of itself
        #: (:mod:`aiotinyrt.ray.shared`)
        self.memory = HostMemory()

    def probed(self, probe: Callable[[Any, bytes], bool]) -> str:
        """:attr:`mode`, probing the host first if not yet (``probe(descriptor, token)``: whether
        the host read ``token`` there; a round trip each). The sender thread only."""
        with self._lock:
            if self.mode is not None:
                return self.mode
            generation = self._generation
        mode = STORE
        expected = token()
        mine = np.frombuffer(expected, np.uint8).copy()
        if _VM_READ is not None and probe(Direct.here(address(mine), TOKEN_BYTES), expected):
            mode = DIRECT
        elif hasattr(os, "memfd_create"):
            seg = self.lease(TOKEN_BYTES)
            if seg is not None:
                seg.array[:TOKEN_BYTES] = mine
                if probe(seg.staged, expected):
                    mode = STAGED
                    self.give_back(seg)
                else:
                    seg.close()
        with self._lock:  # (a reconnection meanwhile: this was the old host's; the new one probes)
            if self._generation == generation:
                self.mode = mode
        return mode

    def lease(self, nbytes: int) -> Segment | None:
        """A segment of at least ``nbytes`` for one piece, or None: segments cannot be made
        here. The sender thread only."""
        size = _size_class(nbytes)
        with self._lock:
            fits = [s for s in self._free if s.size >= size]
            seg = min(fits, key=lambda s: s.size) if fits else None
            if seg is not None:
                self._free.remove(seg)
            sid = self._next_id
            self._next_id += 1
        if seg is None:
            try:
                seg = Segment(sid, size)
            except OSError:
                return None
            self.made += 1
        return seg

    def give_back(self, seg: Segment) -> None:
        """Return a leased segment (any thread); the free ones beyond :data:`KEEP_BYTES` close
        (their ids join :attr:`retired`, for the host to drop)."""
        with self._lock:
            if self.closed:
                seg.close()
                return
            self._free.append(seg)
            while sum(s.size for s in self._free) > KEEP_BYTES:
                old = self._free.pop(0)
                old.close()
                self.retired.append(old.staged.id)

    def take_retired(self) -> list[int]:
        """The ids closed since the last call (to tell the host)."""
        with self._lock:
            ids, self.retired = self.retired, []
            return ids

    def forget_mode(self) -> None:
        """Probe again before the next large copy (any thread): a probe running now sets no
        mode (the connection is being moved to another host)."""
        with self._lock:
            self.mode = None
            self._generation += 1
        self.memory.clear()

    def reconnected(self) -> None:
        """The connection now talks to a new host: probe it; the old one's mappings are its own."""
        with self._lock:
            self.mode = None
            self._generation += 1
            self.retired = []
            self.host = None
        self.memory.clear()

    def close(self) -> None:
        """The connection is gone: close the free segments (leased ones close when returned)
        and ask the host to drop every mapping of this client (not waited for)."""
        with self._lock:
            self.closed = True
            free, self._free = self._free, []
            host, self.host = self.host, None
        for seg in free:
            seg.close()
        self.memory.clear()
        if host is not None and not _ray_shut_down(host[0]):
            try:
                host[0].unstage.remote(host[1])
            except Exception:  # (the host is gone, or Ray is: so are its mappings)
                pass


def _ray_shut_down(handle: object) -> bool:
    """Whether ``handle`` is a Ray actor's and Ray is no longer initialized in this process: a
    call on it would start a new local Ray instance (Ray initializes itself on first use),
    here from a connection's sender thread at interpreter exit."""
    if not type(handle).__module__.startswith("ray."):
        return False
    ray = sys.modules.get("ray")
    return ray is not None and not ray.is_initialized()


def token() -> bytes:
    """A fresh probe token."""
    return secrets.token_bytes(TOKEN_BYTES)


class Mappings:
    """A host's mappings of its clients' segments: client id -> segment id -> a view."""

    def __init__(self) -> None:
        self._maps: dict[str, dict[int, np.ndarray[Any, Any]]] = {}
        self._pids: dict[str, int] = {}

    def view(self, client: str, staged: Staged) -> np.ndarray[Any, Any]:
        """The segment ``staged`` of ``client``, mapped at its first use (``OSError`` when it
        cannot be opened)."""
        maps = self._maps.get(client)
        view = maps.get(staged.id) if maps is not None else None
        if view is None:
            self._sweep()
            fd = os.open(f"/proc/{staged.pid}/fd/{staged.fd}", os.O_RDWR)
            try:
                view = np.frombuffer(mmap.mmap(fd, staged.size), np.uint8)
            finally:
                os.close(fd)
            self._maps.setdefault(client, {})[staged.id] = view
            self._pids[client] = staged.pid
        return view

    def probe(self, client: str, staged: Staged | Direct, expected: bytes) -> bool:
        """Whether ``expected`` (the client's token) is what this host reads through
        ``staged``: the client's memory (direct), or the start of a segment, which then stays
        mapped."""
        if isinstance(staged, Direct):
            got = np.zeros(len(expected), np.uint8)
            try:
                direct_copy(staged, address(got), len(expected), write=False)
            except OSError:
                return False
            return got.tobytes() == expected
        try:
            view = self.view(client, staged)
        except (OSError, ValueError):
            return False
        if view[:TOKEN_BYTES].tobytes() != expected:
            self.drop(client, [staged.id])
            return False
        return True

    def drop(self, client: str, ids: list[int] | None = None) -> None:
        """Drop the mappings of ``client`` (those ``ids`` only, if given); each is unmapped when
        the last view of it (a copy still running) is gone."""
        maps = self._maps.get(client, {})
        for sid in list(maps) if ids is None else ids:
            maps.pop(sid, None)
        if not maps:
            self._maps.pop(client, None)
            self._pids.pop(client, None)

    def mapped(self, client: str) -> int:
        """How many segments of ``client`` are mapped here."""
        return len(self._maps.get(client, {}))

    def _sweep(self) -> None:
        """Drop the mappings of clients whose process is gone."""
        for client, pid in list(self._pids.items()):
            if not os.path.exists(f"/proc/{pid}"):
                self.drop(client)
