"""The client side: ``RAY:<host>/<device>`` devices whose four components are remote.

- the allocator hands out :class:`RemoteHandle`\\ s (ids of buffers held by the host);
- the compiler compiles on the host (the host's compile cache);
- a program is sent to the host once per connection, named by the hash of its binary;
- the queues are driver-run (:class:`~aiotinyrt.driverqueue.DriverQueue`) whose driver is the
  actor: each command becomes one of the host connection's stream (:mod:`aiotinyrt.ray.stream`:
  every command handed over in one loop turn travels in one actor call, and the reply
  completes every Signal it covers from a waiter thread through the queue's thread-safe
  ``done`` callback, so trio works as asyncio and uvloop do: no Ray ref is awaited on the loop).

Faults: when the actor dies every pending command of its devices fails with a ``DeviceError``
naming the host ("device lost"), sticky until ``reset()`` (which reconnects to the named actor)
or close. A buffer that failed to allocate on the host fails its first use with the host's
``MemoryError`` as the cause. Statistics, the host-side reset and the release at close travel
in the stream, after everything submitted before them.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import anyio
import anyio.to_thread
import numpy as np
from ray import cloudpickle

from aiotinyrt.allocator import Allocator, BufferSpec
from aiotinyrt.buffer import Buffer
from aiotinyrt.compiler import Compiler
from aiotinyrt.device import Compiled, Device
from aiotinyrt.driverqueue import Completion, Done, DriverQueue
from aiotinyrt.program import Program
from aiotinyrt.queue import Queue
from aiotinyrt.ray import shared, staging, wire
from aiotinyrt.ray.staging import Segment
from aiotinyrt.ray.stream import _CONNECTIONS, BATCH_LIMIT, Connection, Part, Reply, connection
from aiotinyrt.ray.wire import Command, HostAdrift, HostLost, RemoteError
from aiotinyrt.signal import DeviceError

__all__ = ["BATCH_LIMIT", "_CONNECTIONS", "RAYDevice", "RemoteAllocator", "RemoteCompiler", "RemoteHandle"]


class _Pieces:
    """One command sent in pieces: completes once every piece replied (the first error wins)."""

    def __init__(self, count: int, done: Done) -> None:
        self._lock = threading.Lock()
        self._left = count
        self._seconds = 0.0
        self._error: BaseException | None = None
        self._done = done

    def piece_done(self, seconds: float, error: BaseException | None) -> None:
        """A piece's ``done`` (any thread)."""
        with self._lock:
            self._left -= 1
            self._seconds += seconds
            self._error = self._error or error
            last = self._left == 0
        if last:
            self._done(self._seconds, self._error)


def _pieces(nbytes: int) -> list[tuple[int, int]]:
    """``(offset, size)`` of the pieces a copy of ``nbytes`` moves in (see ``CHUNK_BYTES``)."""
    step = wire.CHUNK_BYTES
    return [(k, min(step, nbytes - k)) for k in range(0, nbytes, step)]


class _Lease:
    """The staging segment one piece of a copy holds, if any (set by the sender thread when it
    makes the piece, given back to the connection once, when the piece's reply was handled:
    before its command completes, so the next copy finds it free)."""

    __slots__ = ("conn", "kept", "segment")

    def __init__(self, conn: Connection) -> None:
        self.conn = conn
        self.segment: Segment | None = None
        #: the caller's memory a direct copy names (alive until the reply)
        self.kept: np.ndarray[Any, Any] | None = None

    def give_back(self, error: BaseException | None = None) -> None:
        """Let go of the memory the piece named (once its reply was handled). After a
        :class:`~aiotinyrt.ray.wire.HostAdrift` the host may still write it: the caller's
        memory is kept alive for good (:data:`_QUARANTINED`) and the segment closed, never
        leased again."""
        kept, self.kept = self.kept, None
        seg, self.segment = self.segment, None
        if isinstance(error, HostAdrift):
            if kept is not None:
                _QUARANTINED.append(kept)
            if seg is not None:
                seg.close()
        elif seg is not None:
            self.conn.staging.give_back(seg)


#: Memory of callers that a host not known dead may still write (see ``_Lease.give_back``).
_QUARANTINED: list[np.ndarray[Any, Any]] = []


class _Window(threading.Semaphore):
    """The pieces of one copy that may be in flight at once (each holding a staging segment or
    an object in the store; :data:`~aiotinyrt.ray.wire.PIECES_IN_FLIGHT`): the sender thread
    makes a piece (copies or puts its bytes, or sends it for the host to) only once a piece
    before it replied; it waits here, never an event loop."""

    def __init__(self) -> None:
        super().__init__(wire.PIECES_IN_FLIGHT)

    def replied(self, reply: Reply, lease: _Lease) -> Reply:
        """``reply``, then room for the next piece (once, however often it is called; the
        piece's segment goes back if ``reply`` did not give it back)."""
        room = [True]

        def piece_replied(result: Any, error: BaseException | None) -> None:
            try:
                reply(result, error)
            finally:
                if room:
                    room.clear()
                    lease.give_back(error)
                    self.release()

        return piece_replied


def _staged_copyin(
    conn: Connection,
    window: _Window,
    lease: _Lease,
    cid: int,
    ref: tuple[int, int, int],
    data: np.ndarray[Any, Any],
    waits: list[Any],
) -> Command:
    """A copyin piece, once there is room for it (``window``): its address here, which the host
    copies from (direct), or its bytes copied into a staging segment the host reads, or else
    put into the object store (the host reads them there)."""
    window.acquire()
    mode = conn.copy_mode()
    if mode == staging.DIRECT:
        lease.kept = data
        return (wire.COPYIN, cid, ref, staging.Direct.here(staging.address(data), data.nbytes), waits)
    seg = lease.segment = conn.lease(data.nbytes) if mode == staging.STAGED else None
    if seg is None:
        return (wire.COPYIN, cid, ref, [wire.STORE.put(data)], waits)
    np.copyto(seg.array[: data.nbytes], data)
    return (wire.COPYIN, cid, ref, seg.staged, waits)


def _staged_copyout(
    conn: Connection, window: _Window, lease: _Lease, cmd: Command, into: np.ndarray[Any, Any]
) -> Command:
    """A copyout piece into ``into``, once there is room for it: the host copies straight into
    it (direct), or into a staging segment, or else puts the bytes into the object store."""
    window.acquire()
    mode = conn.copy_mode()
    if mode == staging.DIRECT:
        lease.kept = into
        return (*cmd, staging.Direct.here(staging.address(into), into.nbytes))
    seg = lease.segment = conn.lease(cmd[2][1]) if mode == staging.STAGED else None
    return cmd if seg is None else (*cmd, seg.staged)


async def _get(ref: Any) -> Any:
    """The value of a Ray ref, waited for off the loop (any event loop). Cancellation: cancels
    the wait; the remote call goes on."""
    return await anyio.to_thread.run_sync(wire.STORE.get, ref, abandon_on_cancel=True)


class RemoteHandle(NamedTuple):
    """A buffer on the host: its id, and the bytes of it this handle covers."""

    id: int
    nbytes: int
    offset: int = 0


class RemoteAllocator(Allocator[RemoteHandle]):
    """Hands out ids of buffers the host allocates (in the command stream, ahead of their use);
    copies are queue commands the host runs. Memory counts here as on the host."""

    def __init__(self, device: RAYDevice) -> None:
        super().__init__(device)
        self.remote = device
        #: ids of the host buffers this device allocated and has not freed (closing releases
        #: these: another device of the same name, reopened meanwhile, holds other ids)
        self.held: set[int] = set()

    def _alloc(self, nbytes: int, options: BufferSpec) -> RemoteHandle:
        dev = self.remote
        rid = dev.conn.new_id()
        dev.conn.submit((wire.ALLOC, dev.remote_name, rid, nbytes, options.zero), None)
        self.held.add(rid)
        return RemoteHandle(rid, nbytes)

    def _free(self, opaque: RemoteHandle, nbytes: int, options: BufferSpec) -> None:
        self.held.discard(opaque.id)
        self.remote.conn.staging.memory.forget(opaque.id)
        if not self.remote.released:
            self.remote.conn.submit((wire.FREE, opaque.id), None)

    def _copyin(self, dest: RemoteHandle, src: memoryview) -> None:
        raise TypeError("remote copies run on the host (through the device's queue)")

    def _copyout(self, dest: memoryview, src: RemoteHandle) -> None:
        raise TypeError("remote copies run on the host (through the device's queue)")

    def _transfer(self, dest: RemoteHandle, src: Any, nbytes: int, src_device: Any) -> None:
        raise TypeError("remote copies run on the host (through the device's queue)")

    def _can_transfer_from(self, src_device: Any) -> bool:
        """Another RAY device: host to host, through Ray, never through this process."""
        return isinstance(src_device, RAYDevice)

    def _offset(self, opaque: RemoteHandle, nbytes: int, offset: int) -> RemoteHandle:
        return RemoteHandle(opaque.id, nbytes, opaque.offset + offset)


class RemoteCompiler(Compiler):
    """Compiles on the host (its compile cache); keeps what it got per source here."""

    def __init__(self, device: RAYDevice) -> None:
        super().__init__(None)
        self.remote = device

    async def compile(self, src: str) -> bytes:
        """Compile on the host. Cancellation: cancels the wait; the host compiles on."""
        dev = self.remote
        lib: bytes = await _get(dev.conn.call("compile", dev.remote_name, src))
        return lib


class RemoteProgram(Program):
    """A program of a RAY device: sent to the host once per connection, named by the hash of
    its binary; a launch is a command of the stream."""

    def __init__(self, device: RAYDevice, name: str, lib: bytes, **kwargs: Any) -> None:
        super().__init__(device, name, lib, **kwargs)
        # as the host's program: a raw C kernel on a CPU host is called once and loops itself
        self.RAW_USES_GLOBAL_SIZE = device.remote_name.partition(":")[0] != "CPU"  # type: ignore[misc]
        self.key = hashlib.sha256(name.encode() + b"\0" + self.lib).hexdigest()

    def _launcher(
        self,
        handles: tuple[Any, ...],
        global_size: tuple[int, ...],
        local_size: tuple[int, ...] | None,
        vals: tuple[int, ...],
    ) -> tuple[Callable[..., object], tuple[Any, ...]]:
        return self._remote_launch, (handles, global_size, local_size, vals)

    def _remote_launch(self, *args: Any) -> None:
        raise TypeError("remote launches run on the host (through the device's queue)")


#: One command handed to a driver: ``enqueue``'s arguments.
_Held = tuple[Callable[..., object], tuple[Any, ...], Sequence[object], Done]


class _QueueDriver:
    """The Driver of one queue of a RAY device: turns each command into a stream command, or
    makes a large copy of an idle host buffer here (:mod:`aiotinyrt.ray.shared`), holding the
    queue's later commands until it is done."""

    def __init__(self, device: RAYDevice, queue: str) -> None:
        self.device = device
        self.queue = queue
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)  # (notified when ``_held`` becomes None)
        #: commands handed over while a copy made here is under way, sent in order once it is
        #: done (None: no such copy)
        self._held: collections.deque[_Held] | None = None
        self.waiting = 0  #: threads in :meth:`wait_idle` (tests look)

    def enqueue(
        self, fn: Callable[..., object], args: tuple[Any, ...], waits: Sequence[object], done: Done
    ) -> object:
        with self._lock:
            if self._held is not None:
                self._held.append((fn, args, waits, done))
                return None  # (no event: a dependent on another queue is held back until done)
            here = self._here(fn, args, waits, done)
            if here is not None:
                try:
                    shared.start(self._copy_here, here, (fn, args, waits, done))
                except RuntimeError:  # (no thread to be had, as at interpreter exit: the host's)
                    here = None
                else:
                    self._held = collections.deque()
                    return None
        return self._send(fn, args, waits, done)

    def _here(
        self, fn: Callable[..., object], args: tuple[Any, ...], waits: Sequence[object], done: Done
    ) -> tuple[int, int, np.ndarray[Any, Any], bool] | None:
        """``(buffer id, offset, host array, into the buffer)`` when the command is a copy to
        make here: large, of a buffer whose memory file is known, every command it depends on
        complete (``waits`` empty) and none of this queue still in flight before it, on a device
        without an error and a host not known lost; else None. Caller holds ``_lock``."""
        if waits or not isinstance(done, Completion):
            return None
        func = getattr(fn, "__func__", None)
        if func is RemoteAllocator._copyout:
            out, handle = args
            array = np.frombuffer(out, np.uint8)
        elif func is RemoteAllocator._copyin:
            handle, src = args
            array = np.frombuffer(src, np.uint8)
        else:
            return None
        dev = self.device
        conn = dev.conn
        if array.nbytes <= wire.INLINE_BYTES or not conn.staging.memory.known(handle.id):
            return None
        if done.queue.timeline.completed < done.value - 1 or dev._error is not None or conn.lost is not None:
            return None
        return handle.id, handle.offset, array, func is RemoteAllocator._copyin

    def _copy_here(self, here: tuple[int, int, np.ndarray[Any, Any], bool], cmd: _Held) -> None:
        """Make the copy ``here`` (a copier thread), or send ``cmd`` to the host when the
        buffer's memory does not map here or its host's process ended (the host call then
        finds out what became of it); then the commands held meanwhile."""
        rid, offset, array, into = here
        reported = False
        try:
            memory = self.device.conn.staging.memory
            try:
                view = memory.view(rid, offset, array.nbytes)
            except Exception:  # (never a copy here that may be wrong: the host's way)
                view = None
            if view is None:
                reported = True
                self._send_or_fail(cmd)
            else:
                start = time.perf_counter()
                if into:
                    shared.copy(staging.address(view), staging.address(array), array.nbytes)
                else:
                    shared.copy(staging.address(array), staging.address(view), array.nbytes)
                memory.copies += 1
                del view
                reported = True
                cmd[3](time.perf_counter() - start, None)
        except Exception as exc:  # (the command completes whatever happened)
            if not reported:
                cmd[3](0.0, exc)
        finally:
            self._release()

    def _release(self) -> None:
        """Send the commands held behind a copy made here, in order, up to the next such copy."""
        while True:
            with self._lock:
                held = self._held
                if not held:
                    self._held = None
                    self._idle.notify_all()
                    return
                cmd = held.popleft()
                try:
                    here = self._here(*cmd)
                    if here is not None:
                        shared.start(self._copy_here, here, cmd)
                        return
                except Exception:  # (the host's way: the thread did not start)
                    pass
            self._send_or_fail(cmd)

    def _send_or_fail(self, cmd: _Held) -> None:
        """Send a command held here; one that cannot be sent fails (as in ``enqueue``)."""
        try:
            self._send(*cmd)
        except Exception as exc:
            cmd[3](0.0, exc)

    def wait_idle(self, timeout: float) -> bool:
        """Wait until no copy made here is under way and nothing is held (a blocking wait, for
        ``RAYDevice.aclose``): whether that happened within ``timeout`` seconds."""
        with self._idle:
            self.waiting += 1
            try:
                return self._idle.wait_for(lambda: self._held is None, timeout)
            finally:
                self.waiting -= 1

    def _send(
        self, fn: Callable[..., object], args: tuple[Any, ...], waits: Sequence[object], done: Done
    ) -> object:
        """The command as one of the host connection's stream; its event (the command's id)."""
        dev = self.device
        conn = dev.conn
        cid = next(conn._ids)
        func = getattr(fn, "__func__", None)
        if func is RemoteProgram._remote_launch:
            owner: RemoteProgram = fn.__self__  # type: ignore[attr-defined]
            handles, gsz, lsz, vals = args
            remote = dev.remote_name
            load = ((remote, owner.key), (wire.LOAD, remote, owner.key, owner.name, owner.lib))
            refs = [(h.id, h.nbytes, h.offset) for h in handles]
            cmd: Command = (wire.LAUNCH, cid, remote, owner.key, refs, gsz, lsz, vals, list(waits))
            conn.submit(cmd, _reply(dev, done), load)
            return cid
        if func is RemoteAllocator._copyin:
            dest, src = args
            data = np.frombuffer(src, np.uint8)
            # (the allocator's copyin moves ``len(src)`` bytes, at the start of the handle's
            # range, which may be larger: the host copies exactly the bytes named here)
            dest = RemoteHandle(dest.id, data.nbytes, dest.offset)
            if data.nbytes <= wire.INLINE_BYTES:
                conn.submit((wire.COPYIN, cid, tuple(dest), data, list(waits)), _reply(dev, done))
                return cid
            if conn.staging.mode == staging.DIRECT:  # (one command in the batch: no store memory)
                lease = _Lease(conn)
                lease.kept = data
                there = staging.Direct.here(staging.address(data), data.nbytes)
                cmd = (wire.COPYIN, cid, tuple(dest), there, list(waits))
                conn.submit(cmd, _reply(dev, done, None, lease, dest.id))
                return cid
            # staged (or put) piece by piece by the sender thread: the host copies one piece in
            # while the next is staged (at most ``PIECES_IN_FLIGHT`` in flight)
            pieces = _pieces(data.nbytes)
            whole = _Pieces(len(pieces), done)
            window = _Window()
            parts: list[Part] = []
            for k, size in pieces:
                lease = _Lease(conn)
                piece = (dest.id, size, dest.offset + k)
                first = list(waits) if k == 0 else []
                make = functools.partial(
                    _staged_copyin, conn, window, lease, cid, piece, data[k : k + size], first
                )
                reply = _reply(dev, whole.piece_done, None, lease, dest.id)
                parts.append((make, window.replied(reply, lease)))
            conn.send_apart(parts, puts=True)
        elif func is RemoteAllocator._copyout:
            out, src = args
            src = RemoteHandle(src.id, memoryview(out).nbytes, src.offset)  # (as a copyin's)
            if src.nbytes <= wire.INLINE_BYTES:
                conn.submit((wire.COPYOUT, cid, tuple(src), list(waits)), _reply(dev, done, out))
                return cid
            if conn.staging.mode == staging.DIRECT:
                lease = _Lease(conn)
                lease.kept = np.frombuffer(out, np.uint8)
                there = staging.Direct.here(staging.address(lease.kept), lease.kept.nbytes)
                cmd = (wire.COPYOUT, cid, tuple(src), list(waits), there)
                conn.submit(cmd, _reply(dev, done, out, lease, src.id))
                return cid
            # piece by piece, a call each: this process copies one piece out while the host
            # copies (or puts) the next (sent by the sender thread: at most ``PIECES_IN_FLIGHT``)
            pieces = _pieces(src.nbytes)
            whole = _Pieces(len(pieces), done)
            into = np.frombuffer(out, np.uint8)
            window = _Window()
            parts = []
            for k, size in pieces:
                lease = _Lease(conn)
                first = list(waits) if k == 0 else []
                part: Command = (wire.COPYOUT, cid, (src.id, size, src.offset + k), first)
                reply = _reply(dev, whole.piece_done, into[k : k + size], lease, src.id)
                make = functools.partial(_staged_copyout, conn, window, lease, part, into[k : k + size])
                parts.append((make, window.replied(reply, lease)))
            conn.send_apart(parts, puts=True)
        elif func is RemoteAllocator._transfer:
            dest, src, nbytes, src_dev = args
            dest, src = RemoteHandle(dest.id, nbytes, dest.offset), RemoteHandle(src.id, nbytes, src.offset)
            if src_dev.conn is conn:
                cmd = (wire.TRANSFER, cid, tuple(dest), tuple(src), list(waits))
            else:
                src_conn = src_dev.conn
                cmd = (wire.FETCH, cid, tuple(dest), src_conn.host, src_conn.client, tuple(src), list(waits))
            conn.submit(cmd, _reply(dev, done))
        else:  # any other callable runs on the host's queue of this name (it must pickle)
            try:
                blob = cloudpickle.dumps((fn, args))  # type: ignore[no-untyped-call]
            except Exception as exc:
                raise TypeError(f"{dev.name} runs only callables that pickle; {fn!r}: {exc}") from exc
            conn.submit((wire.CALL, cid, dev.remote_name, self.queue, blob, list(waits)), _reply(dev, done))
        return cid


def _reply(
    device: RAYDevice, done: Done, out: Any = None, lease: _Lease | None = None, rid: int | None = None
) -> Reply:
    """The reply handler of one command: its entry (see :mod:`aiotinyrt.ray.wire`) to ``done``;
    a copyout's bytes (small ones in the entry, else the staging segment of ``lease`` or an
    object ref) land in ``out``; where a large copy's entry names the memory file of buffer
    ``rid``, the connection learns it (:mod:`aiotinyrt.ray.shared`). Calls ``done`` at most
    once, even when called again after it raised (see ``_reply_failed``)."""
    reported = False
    memory = device.conn.staging.memory
    generation = memory.generation

    def once(seconds: float, error: BaseException | None) -> None:
        nonlocal reported
        if not reported:
            reported = True
            done(seconds, error)

    def reply(result: Any, error: BaseException | None) -> None:
        done = once
        if error is not None:
            done(0.0, error)
            return
        if result.__class__ is float:
            done(result, None)
            return
        seconds, message, payload, cause = result
        if message is not None:  # (behind an earlier failure of this device: its sticky error)
            sticky = device._error
            done(seconds, sticky or (cause if cause is not None else RemoteError(message)))
            return
        if payload.__class__ is shared.Shared:  # (the copy was made; the memory is named)
            if rid is not None:
                memory.remember(rid, payload, generation)
        elif out is not None:
            data = wire.STORE.get(payload[0]) if isinstance(payload, list) else payload
            np.copyto(np.frombuffer(out, np.uint8), data)  # (zero-copy read of the store)
        done(seconds, None)

    def staged(result: Any, error: BaseException | None) -> None:
        assert lease is not None
        seg = lease.segment
        try:
            made = error is None and (result.__class__ is float or result[1] is None)
            if made and seg is not None and out is not None:
                view = np.frombuffer(out, np.uint8)
                np.copyto(view, seg.array[: view.nbytes])  # (the host copied into the segment)
        finally:
            lease.give_back(error)
        reply(result, error)

    if lease is not None:
        return staged

    return reply


class RAYDevice(Compiled):
    """``RAY:<host>/<device>``: the device ``<device>`` of the device host ``<host>``."""

    #: the part after ``RAY:`` is ``<host>/<device>``, not an index
    accepts_path = True

    def __init__(self, name: str) -> None:
        host, sep, remote = name.partition(":")[2].partition("/")
        if not host or not sep or not remote:
            raise ValueError(f"RAY devices are named RAY:<host>/<device>, got {name!r}")
        self.host = host
        self.remote_name = Device.canonicalize(remote)
        self.released = False
        self.conn = connection(host)  # (before the base class makes the queues)
        self.memory = RemoteAllocator(self)
        super().__init__(name, self.memory, RemoteCompiler(self), RemoteProgram)

    def _make_queue(self, name: str) -> Queue:
        return DriverQueue(self, name, _QueueDriver(self, name), context=self.conn)

    @staticmethod
    def available_devices() -> list[str]:
        """``RAY:<host>/<device>`` for every device of every host of the connected Ray cluster
        (none when Ray is not initialized). Blocks for one call per host."""
        if getattr(wire.listing, "active", False):
            return []  # (a host lists its own devices only)
        store = wire.STORE
        hosts = store.hosts()
        refs = [store.actor(h).devices.remote() for h in hosts]
        names: list[list[str]] = [store.get(ref, timeout=60) for ref in refs]
        return [f"RAY:{h}/{d}" for h, devs in zip(hosts, names, strict=True) for d in devs]

    def capture(self, **named: Buffer) -> Any:
        """Not supported on RAY devices: raises ``NotImplementedError`` (nothing is recorded)."""
        raise NotImplementedError(f"{self.name}: graph capture is not supported on RAY devices")

    async def statistics(self) -> dict[str, Any]:
        """The host device's allocator statistics (a dict of ``AllocatorStatistics``' fields),
        taken after every command submitted before (it travels in the command stream).

        Cancellation: cancels the wait only."""
        return dict(await self.conn.request((wire.STATS, self.remote_name), self.name))

    async def reset(self) -> None:
        """Wait for queued work, clear the sticky error here and on the host; after the host
        was lost (found by an earlier command or by this reset's own), reconnect to the actor
        of that name (buffers held there are gone; the connection is every device of the
        host's, so theirs are gone too).

        Cancellation: cancelled while draining or reconnecting, the error stays set."""
        await self._settle()
        conn = self.conn
        reconnects = conn.reconnects  # (another device's reset may reconnect meanwhile)
        if conn.lost is None:
            try:
                await conn.request((wire.RESET, self.remote_name), self.name)
            except DeviceError as exc:  # (the host died unnoticed: the reset is what finds out)
                found = conn.lost is not None or conn.reconnects != reconnects
                if not isinstance(exc.cause, HostLost) or not found:
                    raise
        if conn.lost is not None or conn.reconnects != reconnects:
            await anyio.to_thread.run_sync(conn.reconnect, reconnects)
        await super().reset()

    async def aclose(self) -> None:
        """Close as ``Compiled.aclose`` does, then release every buffer this device allocated
        on the host and did not free (by id: not those of a device of this name opened again
        meanwhile), after everything submitted before (in the command stream; awaited, so the
        host's statistics show it).

        Cancellation: shielded; closing always completes."""
        try:
            await super().aclose()
        finally:
            await self._release_buffers()

    async def _release_buffers(self) -> None:
        """The end of :meth:`aclose` (also when the close was cancelled)."""
        with anyio.CancelScope(shield=True):
            self.released = True
            conn = self.conn
            # (a copy made here into or out of a buffer about to be released ends first, and the
            # commands held behind it are sent before the release: a close cut short by its
            # timeout or a cancellation never frees host memory under a copy of this process)
            queues = [q for q in self.queues.values() if isinstance(q, DriverQueue)]
            drivers = [q.driver for q in queues if isinstance(q.driver, _QueueDriver)]
            idle = await anyio.to_thread.run_sync(shared.all_idle, drivers)
            held = sorted(self.memory.held)
            for rid in held:
                conn.staging.memory.forget(rid)
            if conn.lost is None and idle:  # (else the memory is left to the host: never freed
                with contextlib.suppress(DeviceError):  # under a copy; the host is gone: so is it)
                    self.memory.held.clear()
                    await conn.request((wire.RELEASE, self.remote_name, held), self.name)


Device.register("RAY", RAYDevice)
