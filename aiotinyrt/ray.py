"""Remote devices on Ray actors, driven through the ordinary Device/Buffer/Program/Signal API.

A *device host* is a Ray async actor (:class:`HostActor`) holding real aiotinyrt devices on its
own event loop; :func:`start_host` starts one (placed by the Ray options given: resources, node
affinity). Importing this module registers the ``RAY`` backend: ``Device["RAY:<host>/CPU:1"]``
opens the host's ``CPU:1`` as a :class:`RAYDevice`, a ``Compiled`` whose four components are
remote:

- the allocator hands out :class:`RemoteHandle`\\ s (ids of buffers held by the host);
- the compiler compiles on the host (the host's compile cache);
- a program is sent to the host once per connection, named by the hash of its binary;
- the queues are driver-run (:class:`~aiotinyrt.driverqueue.DriverQueue`) whose driver is the
  actor: every command handed over in one loop turn travels in one actor call (a flush is
  scheduled on the submitting loop), and the reply completes every Signal it covers, from a
  waiter thread through the queue's thread-safe ``done`` callback (so trio works as asyncio and
  uvloop do: no Ray ref is awaited on the loop).

Order and hazards are resolved on the host: it takes a client's batches in the order they were
sent and submits each command to its real devices in order, through real Buffers, whose access
records order them; wait lists name earlier commands, which the host waits for itself.

Faults: when the actor dies every pending command of its devices fails with a ``DeviceError``
naming the host ("device lost"), sticky until ``reset()`` (which reconnects to the named actor)
or close. Closing a device releases every buffer it holds on the host.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import queue as _queue
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any, NamedTuple

import anyio
import anyio.to_thread
import numpy as np
import ray
import sniffio

try:
    import trio
except ImportError:  # (trio is optional)
    trio = None  # type: ignore[assignment]

from aiotinyrt import native
from aiotinyrt.allocator import Allocator, BufferSpec
from aiotinyrt.buffer import Buffer
from aiotinyrt.compiler import Compiler
from aiotinyrt.device import Compiled, Device, get_available_devices
from aiotinyrt.driverqueue import Done, DriverQueue
from aiotinyrt.dtype import dtypes
from aiotinyrt.program import Program
from aiotinyrt.queue import Queue
from aiotinyrt.signal import DeviceError, Signal

#: Ray actor names of device hosts: ``aiotinyrt-host:<name>``.
ACTOR_PREFIX = "aiotinyrt-host:"

#: One command on the wire: a tuple whose first item names the operation.
Command = tuple[Any, ...]
#: What a command's reply is handed to: ``(result, error)``.
Reply = Callable[[Any, BaseException | None], None]


class HostLost(RuntimeError):
    """The device host's actor is gone (killed, its node lost)."""


class RemoteError(RuntimeError):
    """A command failed on the host; the message is the host's error."""


# ---- the host ---------------------------------------------------------------------------------

#: True in a host actor's process.
_IN_HOST = False


class _Host:
    """The state of a device host (the body of :class:`HostActor`, usable without Ray)."""

    def __init__(self, name: str) -> None:
        global _IN_HOST
        _IN_HOST = True
        self.name = name
        self._bufs: dict[str, dict[int, tuple[str, Buffer]]] = {}  # client -> id -> (device, buffer)
        self._progs: dict[tuple[str, str], Program] = {}  # (device, content hash) -> program
        self._sigs: dict[str, dict[int, Signal]] = {}  # client -> command id -> pending signal
        self._next: dict[str, int] = {}  # client -> the batch whose turn it is
        self._turn = asyncio.Condition()

    async def ping(self) -> str:
        """The host's name (a round trip)."""
        return self.name

    async def _device(self, name: str) -> Compiled:
        await native.prepare()
        return Device[name]

    async def devices(self) -> list[str]:
        """The devices that open on the host, with their indices (``CPU``, ``CPU:1``, ...)."""
        await native.prepare()
        out = []
        for backend in await anyio.to_thread.run_sync(get_available_devices):
            count = Device[backend].count() if backend == "CPU" else 1
            out += [backend] + [f"{backend}:{i}" for i in range(1, count)]
        return out

    async def compile(self, device: str, src: str) -> bytes:
        """Compile ``src`` for ``device`` through the host's compile cache."""
        dev = await self._device(device)
        return await dev.compiler.compile_cached(src)

    async def statistics(self, device: str) -> dict[str, Any]:
        """The host device's allocator statistics, as a dict."""
        dev = await self._device(device)
        return asdict(dev.allocator.statistics())

    async def buffers(self, client: str) -> int:
        """How many buffers ``client`` holds here."""
        return len(self._bufs.get(client, {}))

    async def reset(self, device: str) -> None:
        """Clear the host device's sticky error (``Compiled.reset``)."""
        dev = await self._device(device)
        await dev.reset()

    async def release(self, client: str, device: str | None = None) -> int:
        """Free every buffer ``client`` holds (on ``device`` only, if given); returns how many."""
        bufs = self._bufs.get(client, {})
        gone = [i for i, (dev, _) in bufs.items() if device is None or dev == device]
        for i in gone:
            bufs.pop(i)[1].free_nowait()
        await anyio.sleep(0)
        return len(gone)

    async def run(self, client: str, seq: int, batch: list[Command]) -> list[Any]:
        """Run one batch of ``client``'s commands, after its earlier batches were submitted; the
        reply holds one ``(seconds, error message or None, payload)`` per command."""
        async with self._turn:
            await self._turn.wait_for(lambda: self._next.get(client, 1) == seq)
        results: list[Any] = [None] * len(batch)
        sigs = self._sigs.setdefault(client, {})
        waiting: list[tuple[int, int, Signal]] = []
        try:
            for i, cmd in enumerate(batch):
                try:
                    out = await self._submit(client, sigs, cmd)
                except Exception as exc:
                    results[i] = (0.0, f"{self.name}: {exc}", None)
                    continue
                if isinstance(out, Signal):
                    sigs[cmd[1]] = out
                    waiting.append((i, cmd[1], out))
                else:
                    results[i] = out
        finally:
            self._next[client] = seq + 1
            async with self._turn:
                self._turn.notify_all()
        for i, cid, sig in waiting:
            try:  # (most are done by the time the last one is: no loop round trip for them)
                results[i] = (sig.result() if sig.done() else await sig, None, None)
            except Exception as exc:
                results[i] = (0.0, f"{self.name}: {exc}", None)
            sigs.pop(cid, None)
        return results

    def _buffer(self, client: str, rid: int, nbytes: int, offset: int) -> Buffer:
        base = self._bufs[client][rid][1]
        if offset == 0 and nbytes == base.nbytes:
            return base
        return base.view(nbytes, dtypes.uint8, offset)

    async def _waits(self, sigs: dict[int, Signal], waits: Sequence[int]) -> None:
        for w in waits:
            sig = sigs.get(w)
            if sig is not None:
                await sig

    async def _submit(self, client: str, sigs: dict[int, Signal], cmd: Command) -> Any:
        op = cmd[0]
        if op == "alloc":
            _, device, rid, nbytes, zero = cmd
            buf = Buffer(device, nbytes, dtypes.uint8, BufferSpec(zero=zero) if zero else None)
            await self._device(device)
            self._bufs.setdefault(client, {})[rid] = (device, await buf.allocate())
            return None
        if op == "free":
            entry = self._bufs.get(client, {}).pop(cmd[1], None)
            if entry is not None:
                entry[1].free_nowait()
            return None
        if op == "load":
            _, device, key, name, lib = cmd
            if (device, key) not in self._progs:
                self._progs[(device, key)] = (await self._device(device)).runtime(name, lib)
            return None
        if op == "launch":
            _, _cid, device, key, refs, gsz, lsz, vals, waits = cmd
            bufs = [self._buffer(client, *r) for r in refs]
            deps = [sigs[w] for w in waits if w in sigs]
            prog = self._progs[(device, key)]
            return prog(*bufs, global_size=gsz, local_size=lsz, vals=vals, wait_for=deps)
        if op == "copyin":
            _, _cid, ref, data, waits = cmd
            await self._waits(sigs, waits)
            await self._buffer(client, *ref).copyin(data)
            return (0.0, None, None)
        if op == "copyout":
            _, _cid, ref, waits = cmd
            await self._waits(sigs, waits)
            buf = self._buffer(client, *ref)
            out = np.empty(buf.nbytes, np.uint8)
            await buf.copyout(out)
            return (0.0, None, out)
        if op == "transfer":
            _, _cid, dst, src, waits = cmd
            await self._waits(sigs, waits)
            await self._buffer(client, *dst).copy_from(self._buffer(client, *src))
            return (0.0, None, None)
        if op == "fetch":
            _, _cid, dst, src_host, src_client, src, waits = cmd
            await self._waits(sigs, waits)
            data = await ray.get_actor(ACTOR_PREFIX + src_host).read.remote(src_client, src)
            await self._buffer(client, *dst).copyin(data)
            return (0.0, None, None)
        raise ValueError(f"unknown remote command {op!r}")

    async def read(self, client: str, ref: tuple[int, int, int]) -> np.ndarray[Any, Any]:
        """The bytes of one of ``client``'s buffers (another host's ``copy_from``)."""
        buf = self._buffer(client, *ref)
        out = np.empty(buf.nbytes, np.uint8)
        await buf.copyout(out)
        return out


#: The Ray actor class of a device host (an async actor: commands run on its event loop).
HostActor = ray.remote(_Host)


def start_host(name: str, **ray_options: Any) -> Any:
    """Start a device host called ``name`` and return its actor handle. ``ray_options`` go to
    ``HostActor.options`` (``num_cpus``, ``resources``, ``scheduling_strategy``, ...) and place
    it; the actor is named ``aiotinyrt-host:<name>`` so clients find it by name. The host lives
    as long as the process that started it (this module keeps the handle), or until
    ``ray.kill``; pass ``lifetime="detached"`` for one that outlives it."""
    if not isinstance(name, str) or not name or "/" in name or ":" in name:
        raise ValueError(f"host names are non-empty and hold no '/' or ':', got {name!r}")
    options = {"num_cpus": 0, **ray_options, "name": ACTOR_PREFIX + name}
    handle = _STARTED[name] = HostActor.options(**options).remote(name)
    return handle


#: Handles of the hosts this process started (a named actor lives while a handle does).
_STARTED: dict[str, Any] = {}


# ---- the client -------------------------------------------------------------------------------


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
            self.actor = ray.get_actor(ACTOR_PREFIX + self.host)
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
            if self._scheduled:
                return
            self._scheduled = True
        try:
            asyncio.get_running_loop().call_soon(self.flush)
            return
        except RuntimeError:
            pass
        try:
            library = sniffio.current_async_library()
        except sniffio.AsyncLibraryNotFoundError:
            library = ""
        if library == "trio" and trio is not None:
            trio.lowlevel.current_trio_token().run_sync_soon(self.flush)
        else:
            self.flush()

    def flush(self) -> None:
        """Send the queued commands in one actor call (any thread)."""
        with self._lock:
            batch, replies = self._batch, self._replies
            self._batch, self._replies, self._scheduled = [], [], False
            if not batch:
                return
            self._seq += 1
            seq, lost = self._seq, self.lost
        if lost is not None:
            _fail(replies, HostLost(lost))
            return
        try:
            ref: Any = self.actor.run.remote(self.client, seq, batch)
        except Exception as exc:
            _fail(replies, HostLost(f"host {self.host}: device lost ({exc!r})"))
            return
        self.calls += 1
        if self._waiter is None:
            self._waiter = threading.Thread(target=self._wait_loop, name=f"ray-{self.host}", daemon=True)
            self._waiter.start()
        self._inflight.put((ref, replies))

    def _wait_loop(self) -> None:
        while True:
            item = self._inflight.get()
            if item is None:
                return
            ref, replies = item
            try:
                results = ray.get(ref)
            except Exception as exc:
                self.lost = f"host {self.host}: device lost ({type(exc).__name__})"
                _fail(replies, HostLost(self.lost))
                continue
            for reply, result in zip(replies, results, strict=True):
                if reply is not None:
                    reply(result, None)

    def call(self, method: str, *args: Any) -> Any:
        """A ref of one direct actor call (not part of the command stream)."""
        return getattr(self.actor, method).remote(*args)


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
    return await anyio.to_thread.run_sync(ray.get, ref, abandon_on_cancel=True)


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
        dev.conn.submit(("alloc", dev.remote_name, rid, nbytes, options.zero), None)
        return RemoteHandle(rid, nbytes)

    def _free(self, opaque: RemoteHandle, nbytes: int, options: BufferSpec) -> None:
        if not self.remote.released:
            self.remote.conn.submit(("free", opaque.id), None)

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

    def __init__(self, device: RAYDevice) -> None:
        self.device = device

    def enqueue(
        self, fn: Callable[..., object], args: tuple[Any, ...], waits: Sequence[object], done: Done
    ) -> object:
        dev = self.device
        conn = dev.conn
        cid = conn.new_id()
        func = getattr(fn, "__func__", None)
        owner = getattr(fn, "__self__", None)
        if func is RemoteProgram._remote_launch and isinstance(owner, RemoteProgram):
            handles, gsz, lsz, vals = args
            loaded = (dev.remote_name, owner.key)
            if loaded not in conn.loaded:
                conn.loaded.add(loaded)
                conn.submit(("load", dev.remote_name, owner.key, owner.name, owner.lib), None)
            refs = [tuple(h) for h in handles]
            cmd: Command = ("launch", cid, dev.remote_name, owner.key, refs, gsz, lsz, vals, list(waits))
            conn.submit(cmd, _reply(done))
        elif func is RemoteAllocator._copyin:
            dest, src = args
            data = np.frombuffer(src, np.uint8)
            conn.submit(("copyin", cid, tuple(dest), data, list(waits)), _reply(done))
        elif func is RemoteAllocator._copyout:
            out, src = args
            conn.submit(("copyout", cid, tuple(src), list(waits)), _reply(done, out))
        elif func is RemoteAllocator._transfer:
            dest, src, _nbytes, src_dev = args
            if src_dev.conn is conn:
                cmd = ("transfer", cid, tuple(dest), tuple(src), list(waits))
            else:
                src_conn = src_dev.conn
                cmd = ("fetch", cid, tuple(dest), src_conn.host, src_conn.client, tuple(src), list(waits))
            conn.submit(cmd, _reply(done))
        else:
            raise TypeError(f"{dev.name} runs only its own launches and copies, not {fn!r}")
        return cid


def _reply(done: Done, out: memoryview | None = None) -> Reply:
    def reply(result: Any, error: BaseException | None) -> None:
        if error is not None:
            done(0.0, error)
            return
        seconds, message, payload = result
        if message is not None:
            done(seconds, RemoteError(message))
            return
        if out is not None:
            np.copyto(np.frombuffer(out, np.uint8), payload)
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
        return DriverQueue(self, name, _QueueDriver(self), context=self.conn)

    @staticmethod
    def available_devices() -> list[str]:
        """``RAY:<host>/<device>`` for every device of every host of the connected Ray cluster
        (none when Ray is not initialized). Blocks for one call per host."""
        if not ray.is_initialized() or _IN_HOST:
            return []  # (a host lists its own devices only)
        actors = ray.util.list_named_actors()
        hosts = sorted(n[len(ACTOR_PREFIX) :] for n in actors if n.startswith(ACTOR_PREFIX))
        refs = [ray.get_actor(ACTOR_PREFIX + h).devices.remote() for h in hosts]
        names: list[list[str]] = ray.get(refs, timeout=60)
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
