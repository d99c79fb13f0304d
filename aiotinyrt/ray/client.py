"""The client side: ``RAY:<host>/<device>`` devices whose four components are remote.

- the allocator hands out :class:`RemoteHandle`\\ s (ids of buffers held by the host);
- the compiler compiles on the host (the host's compile cache);
- a program is sent to the host once per connection, named by the hash of its binary;
- the queues are driver-run (:class:`~aiotinyrt.driverqueue.DriverQueue`) whose driver is the
  actor: every command handed over in one loop turn travels in one actor call (a flush is
  scheduled on the submitting loop; a turn submitting more than :data:`BATCH_LIMIT` commands
  sends a call every that many, so the host starts on them while the client still submits),
  and the reply completes every Signal it covers, from a waiter thread through the queue's
  thread-safe ``done`` callback (so trio works as asyncio and uvloop do: no Ray ref is awaited
  on the loop).

Faults: when the actor dies every pending command of its devices fails with a ``DeviceError``
naming the host ("device lost"), sticky until ``reset()`` (which reconnects to the named actor)
or close. Closing a device releases every buffer it holds on the host.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import queue as _queue
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import anyio
import anyio.to_thread
import numpy as np
import sniffio
from ray import cloudpickle

try:
    import trio
except ImportError:  # (trio is optional)
    trio = None  # type: ignore[assignment]

from aiotinyrt.allocator import Allocator, BufferSpec
from aiotinyrt.buffer import Buffer
from aiotinyrt.compiler import Compiler
from aiotinyrt.device import Compiled, Device
from aiotinyrt.driverqueue import Done, DriverQueue
from aiotinyrt.program import Program
from aiotinyrt.queue import Queue
from aiotinyrt.ray import wire
from aiotinyrt.ray.wire import Command, HostLost, RemoteError
from aiotinyrt.signal import DeviceError

#: What a command's reply is handed to: ``(reply entry, error)``.
Reply = Callable[[Any, BaseException | None], None]
#: A command sent in an actor call of its own: the function making it, and its reply.
Part = tuple[Callable[[], Command], Reply]

#: Commands per actor call at most: a loop turn submitting more sends a call every this many.
BATCH_LIMIT = 1024


class _Connection:
    """One client's link to one host, shared by every RAY device of that host (the driver
    context of their queues): the ordered command stream, its batches and the waiter thread."""

    def __init__(self, host: str) -> None:
        self.host = host
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._batch: list[Command] = []
        self._replies: list[Reply | None] = []
        self._scheduled = False
        self._waiter: threading.Thread | None = None
        self._inflight: _queue.SimpleQueue[tuple[Any, list[Reply | None]] | None] = _queue.SimpleQueue()
        self.calls = 0  #: actor calls made (tests look)
        self.connect()

    def connect(self) -> None:
        """(Re)connect to the named actor; a new client id, nothing loaded there yet."""
        try:
            self.actor = wire.STORE.actor(self.host)
        except ValueError as exc:
            raise DeviceError(f"no device host {self.host!r} is running", device=f"RAY:{self.host}") from exc
        self.client = uuid.uuid4().hex
        self.loaded: set[tuple[str, str]] = set()
        self.lost: str | None = None
        self._seq = 0

    def new_id(self) -> int:
        """A fresh id (buffers, commands)."""
        return next(self._ids)

    def submit(self, cmd: Command, reply: Reply | None) -> None:
        """Queue ``cmd`` for the next batch; the first command of a batch schedules its flush
        on the submitting thread's event loop (or flushes at once outside one)."""
        with self._lock:
            self._batch.append(cmd)
            self._replies.append(reply)
            full = len(self._batch) >= BATCH_LIMIT
            scheduled = self._scheduled
            if scheduled and not full:
                return
            self._scheduled = True
        if full:  # (a flush scheduled for the turn's end sends whatever follows)
            self._send(scheduled=scheduled)
            return
        _soon(self.flush)

    def flush(self) -> None:
        """Send the queued commands in one actor call (any thread)."""
        self._send(scheduled=False)

    def _send(self, scheduled: bool) -> None:
        """Send the queued commands; ``scheduled``: a flush stays scheduled for what follows."""
        with self._lock:
            batch, replies = self._batch, self._replies
            self._batch, self._replies, self._scheduled = [], [], scheduled
            if not batch:
                return
            self._seq += 1
            seq, lost = self._seq, self.lost
        if lost is not None:
            _fail(replies, HostLost(lost))
            return
        try:
            args = wire.encode(batch)
        except Exception as exc:  # (the commands fail as they are; the number still goes)
            _fail(replies, exc)
            batch, replies, args = [], [], wire.encode([])
        try:
            ref: Any = self.actor.run.remote(self.client, seq, *args)
        except Exception as exc:  # the number never reached the host: nothing later can run
            self.lost = f"host {self.host}: device lost ({exc!r})"
            _fail(replies, HostLost(self.lost))
            return
        self._sent(ref, replies)

    def _sent(self, ref: Any, replies: list[Reply | None]) -> None:
        self.calls += 1
        if self._waiter is None:
            self._waiter = threading.Thread(target=self._wait_loop, name=f"ray-{self.host}", daemon=True)
            self._waiter.start()
        self._inflight.put((ref, replies))

    def send_apart(self, parts: list[Part], one_per_turn: bool) -> None:
        """Send what is queued, then each part (a function making its command, and its reply)
        in an actor call of its own, in order: all at once, or (``one_per_turn``: each part puts
        bytes into the object store) one per turn of the submitting event loop, so the loop runs
        other tasks between two pieces' puts while the host copies the last piece in."""
        self.flush()
        with self._lock:
            first = self._seq + 1
            self._seq += len(parts)
        jobs = [(first + k, part) for k, part in enumerate(parts)]
        if not one_per_turn:
            for seq, part in jobs:
                self._send_part(seq, part)
            return
        self._send_each(jobs, 0)

    def _send_each(self, jobs: list[tuple[int, Part]], i: int) -> None:
        self._send_part(*jobs[i])
        if i + 1 < len(jobs):
            _soon(functools.partial(self._send_each, jobs, i + 1))

    def _send_part(self, seq: int, part: Part) -> None:
        make, reply = part
        lost = self.lost
        if lost is not None:
            reply(None, HostLost(lost))
            return
        try:
            batch = [make()]
            args = wire.encode(batch, refs=True)
        except Exception as exc:  # (the put failed: this part fails; its sequence number still goes)
            batch, args = [], wire.encode([], refs=True)
            reply(None, exc)
        try:
            ref: Any = self.actor.run.remote(self.client, seq, *args)
        except Exception as exc:  # the number never reached the host: nothing later can run
            self.lost = f"host {self.host}: device lost ({exc!r})"
            if batch:
                reply(None, HostLost(self.lost))
            return
        self._sent(ref, [reply] if batch else [])

    def _wait_loop(self) -> None:
        while True:
            item = self._inflight.get()
            if item is None:
                return
            ref, replies = item
            try:
                results = wire.STORE.get(ref)
            except Exception as exc:
                self.lost = f"host {self.host}: device lost ({type(exc).__name__})"
                _fail(replies, HostLost(self.lost))
                continue
            for reply, result in zip(replies, results, strict=True):
                if reply is not None:
                    try:
                        reply(result, None)
                    except Exception as exc:  # (fetching a copyout's bytes, say): this command
                        _reply_failed(reply, exc)  # fails; the waiter goes on with the others

    def call(self, method: str, *args: Any) -> Any:
        """A ref of one direct actor call (not part of the command stream)."""
        return getattr(self.actor, method).remote(*args)


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


def _put_copyin(cid: int, ref: tuple[int, int, int], data: np.ndarray[Any, Any], waits: list[Any]) -> Command:
    """A copyin whose bytes this call puts into the object store (the host reads them there)."""
    return (wire.COPYIN, cid, ref, [wire.STORE.put(data)], waits)


def _as_is(cmd: Command) -> Command:
    return cmd


def _soon(fn: Callable[[], None]) -> None:
    """Call ``fn`` at the next turn of the calling thread's event loop (asyncio, uvloop: its
    ``call_soon``; trio: the token's ``run_sync_soon``), or now outside one."""
    try:
        asyncio.get_running_loop().call_soon(fn)
        return
    except RuntimeError:
        pass
    try:
        library = sniffio.current_async_library()
    except sniffio.AsyncLibraryNotFoundError:
        library = ""
    if library == "trio" and trio is not None:
        trio.lowlevel.current_trio_token().run_sync_soon(fn)
    else:
        fn()


def _reply_failed(reply: Reply, exc: BaseException) -> None:
    """A reply handler raised: its command fails with that error (a handler that had already
    completed its command before raising completes nothing twice: see ``_reply``)."""
    with contextlib.suppress(Exception):
        reply(None, exc)


def _fail(replies: Sequence[Reply | None], error: BaseException) -> None:
    for reply in replies:
        if reply is not None:
            reply(None, error)


_CONNECTIONS: dict[str, _Connection] = {}
_CONNECTIONS_LOCK = threading.Lock()


def _connection(host: str) -> _Connection:
    with _CONNECTIONS_LOCK:
        conn = _CONNECTIONS.get(host)
        if conn is None:
            conn = _CONNECTIONS[host] = _Connection(host)
        return conn


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

    def _alloc(self, nbytes: int, options: BufferSpec) -> RemoteHandle:
        dev = self.remote
        rid = dev.conn.new_id()
        dev.conn.submit((wire.ALLOC, dev.remote_name, rid, nbytes, options.zero), None)
        return RemoteHandle(rid, nbytes)

    def _free(self, opaque: RemoteHandle, nbytes: int, options: BufferSpec) -> None:
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


class _QueueDriver:
    """The Driver of one queue of a RAY device: turns each command into a stream command."""

    def __init__(self, device: RAYDevice, queue: str) -> None:
        self.device = device
        self.queue = queue

    def enqueue(
        self, fn: Callable[..., object], args: tuple[Any, ...], waits: Sequence[object], done: Done
    ) -> object:
        dev = self.device
        conn = dev.conn
        cid = next(conn._ids)
        func = getattr(fn, "__func__", None)
        if func is RemoteProgram._remote_launch:
            owner: RemoteProgram = fn.__self__  # type: ignore[attr-defined]
            handles, gsz, lsz, vals = args
            remote = dev.remote_name
            if (remote, owner.key) not in conn.loaded:
                conn.loaded.add((remote, owner.key))
                conn.submit((wire.LOAD, remote, owner.key, owner.name, owner.lib), None)
            refs = [(h.id, h.nbytes, h.offset) for h in handles]
            cmd: Command = (wire.LAUNCH, cid, remote, owner.key, refs, gsz, lsz, vals, list(waits))
            conn.submit(cmd, _reply(dev, done))
            return cid
        if func is RemoteAllocator._copyin:
            dest, src = args
            data = np.frombuffer(src, np.uint8)
            if data.nbytes <= wire.INLINE_BYTES:
                conn.submit((wire.COPYIN, cid, tuple(dest), data, list(waits)), _reply(dev, done))
                return cid
            # put into the object store piece by piece, one per loop turn: the host copies one
            # piece in while the next is put
            pieces = _pieces(data.nbytes)
            whole = _Pieces(len(pieces), done)
            parts: list[Part] = [
                (
                    functools.partial(
                        _put_copyin,
                        cid,
                        (dest.id, size, dest.offset + k),
                        data[k : k + size],
                        list(waits) if k == 0 else [],
                    ),
                    _reply(dev, whole.piece_done),
                )
                for k, size in pieces
            ]
            conn.send_apart(parts, one_per_turn=True)
        elif func is RemoteAllocator._copyout:
            out, src = args
            if src.nbytes <= wire.CHUNK_BYTES:
                conn.submit((wire.COPYOUT, cid, tuple(src), list(waits)), _reply(dev, done, out))
                return cid
            # piece by piece, a call each: this process copies one piece out while the host
            # puts the next
            pieces = _pieces(src.nbytes)
            whole = _Pieces(len(pieces), done)
            into = np.frombuffer(out, np.uint8)
            parts = []
            for k, size in pieces:
                piece = (wire.COPYOUT, cid, (src.id, size, src.offset + k), list(waits) if k == 0 else [])
                parts.append(
                    (functools.partial(_as_is, piece), _reply(dev, whole.piece_done, into[k : k + size]))
                )
            conn.send_apart(parts, one_per_turn=False)
        elif func is RemoteAllocator._transfer:
            dest, src, _nbytes, src_dev = args
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


def _reply(device: RAYDevice, done: Done, out: Any = None) -> Reply:
    """The reply handler of one command: its entry (see :mod:`aiotinyrt.ray.wire`) to ``done``;
    a copyout's bytes (small ones in the entry, else an object ref) land in ``out``. Calls
    ``done`` at most once, even when called again after it raised (see ``_reply_failed``)."""
    reported = False

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
        if out is not None:
            data = wire.STORE.get(payload[0]) if isinstance(payload, list) else payload
            np.copyto(np.frombuffer(out, np.uint8), data)  # (zero-copy read of the store)
        done(seconds, None)

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
        self.conn = _connection(host)  # (before the base class makes the queues)
        super().__init__(name, RemoteAllocator(self), RemoteCompiler(self), RemoteProgram)

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
        """The host device's allocator statistics (a dict of ``AllocatorStatistics``' fields).

        Cancellation: cancels the wait only."""
        return dict(await _get(self.conn.call("statistics", self.remote_name)))

    async def reset(self) -> None:
        """Wait for queued work, clear the sticky error here and on the host; after the host
        was lost, reconnect to the actor of that name (buffers held there are gone).

        Cancellation: cancelled while draining or reconnecting, the error stays set."""
        await self._settle()
        conn = self.conn
        if conn.lost is not None:
            await anyio.to_thread.run_sync(conn.connect)
        else:
            await _get(conn.call("reset", self.remote_name))
        await super().reset()

    async def aclose(self) -> None:
        """Close as ``Compiled.aclose`` does, then release every buffer this device holds on
        the host (awaited, so the host's statistics show it).

        Cancellation: shielded; closing always completes."""
        await super().aclose()
        with anyio.CancelScope(shield=True):
            self.released = True
            conn = self.conn
            if conn.lost is None:
                conn.flush()
                try:
                    await _get(conn.call("release", conn.client, self.remote_name))
                except Exception:
                    pass  # (the host is gone: so is its memory)


Device.register("RAY", RAYDevice)
