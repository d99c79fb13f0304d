"""The device host: a Ray async actor holding real aiotinyrt devices on its own event loop.

:class:`Host` is the host's whole state and behaviour, usable without Ray (the fast tests drive
it in one process through a stand-in actor handle); :data:`HostActor` is it as a Ray actor class
and :func:`start_host` starts one by name.

A client's batches are taken in the order they were sent (each carries a sequence number: an
async actor may start calls out of order). The commands of a batch are submitted in order to
real Buffers and Programs, whose access records order them as on a local device; a copy or a
wait list is awaited in line, so nothing later is submitted before it is done. The reply is
sent once every command of the batch completed.

Bytes (:mod:`aiotinyrt.ray.staging`): a large copy of a client on this machine names the
client's memory (direct: one copy between it and the buffer with ``process_vm_readv`` /
``process_vm_writev``, in line, a copyin after every pending use of the buffer, a copyout after
its pending writes) or a staging segment of the client's, mapped here at its first use (a
copyin is the buffer's copyin from it, a copyout the buffer's copyout into it, ordered as any
copy). Otherwise a copyin's array arrives in the call (Ray put it in the object store; here it
is read zero-copy) and is copied once, into the buffer, and a copyout is one copy: ``put`` of a
zero-copy view of the buffer, taken after its pending writes and before anything later is
submitted; the reply carries the ref, not the bytes. A host-to-host ``copy_from`` is the
source host writing the destination buffer's memory (direct), or else the destination host
asking the source host for such refs, then one copy in each.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
import ray
from ray import cloudpickle

from aiotinyrt import native
from aiotinyrt.allocator import BufferSpec
from aiotinyrt.backends.ops_cpu import CPUAllocator
from aiotinyrt.buffer import Buffer
from aiotinyrt.device import Compiled, Device, get_available_devices
from aiotinyrt.dtype import dtypes
from aiotinyrt.program import Program
from aiotinyrt.ray import shared, wire
from aiotinyrt.ray.staging import Direct, Mappings, Staged, address, direct_copy, process_here
from aiotinyrt.ray.wire import ACTOR_PREFIX, Command
from aiotinyrt.signal import Signal

#: A buffer reference on the wire: ``(buffer id, bytes, offset)``.
Ref = tuple[int, int, int]
#: One client's buffers: id -> (device name, buffer).
Buffers = dict[int, tuple[str, Buffer]]
#: A command's pending Signal, by command id.
Pending = dict[int, Signal]

#: A ``put`` of at most this many bytes runs on the host's loop; larger ones on a thread.
_PUT_ON_LOOP = 1 << 20


class Host:
    """The state of a device host (the body of :data:`HostActor`)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._bufs: dict[str, Buffers] = {}  # client -> its buffers
        self._progs: dict[tuple[str, str], Program] = {}  # (device, content hash) -> program
        # what failed to allocate or load: client -> buffer id -> (device, error); program -> error
        self._failed: dict[str, dict[int, tuple[str, Exception]]] = {}
        self._unloaded: dict[tuple[str, str], Exception] = {}
        self._sigs: dict[str, Pending] = {}  # client -> command id -> pending signal
        self._next: dict[str, int] = {}  # client -> the batch whose turn it is
        self._turn = asyncio.Condition()
        self._peers: dict[str, Any] = {}  # other hosts' handles, by name
        self._no_direct: set[str] = set()  # peers that may not write this process's memory
        self._staging = Mappings()  # clients' staging segments mapped here
        #: this host's process: its pid and start time (reported by the probe, :meth:`stage`)
        self.process = process_here()
        self._ops: dict[int, Callable[[str, Buffers, Pending, Command], Awaitable[Any]]] = {
            wire.ALLOC: self._alloc,
            wire.FREE: self._free,
            wire.LOAD: self._load,
            wire.COPYIN: self._copyin,
            wire.COPYOUT: self._copyout,
            wire.TRANSFER: self._transfer,
            wire.FETCH: self._fetch,
            wire.RELEASE: self._release,
            wire.STATS: self._stats,
            wire.RESET: self._reset,
            wire.UNSTAGE: self._unstage,
        }

    async def ping(self) -> str:
        """The host's name (a round trip)."""
        return self.name

    async def node(self) -> str:
        """The id of the Ray node the host runs on."""
        return str(ray.get_runtime_context().get_node_id())

    async def _device(self, name: str) -> Compiled:
        await native.prepare()
        dev = Device[name]
        alloc = dev.allocator
        if isinstance(alloc, CPUAllocator) and alloc.shared_min is None:  # (clients here map it)
            alloc.shared_min = shared.SHARED_MIN
        return dev

    async def devices(self) -> list[str]:
        """The devices that open on the host, with their indices (``CPU``, ``CPU:1``, ...)."""
        await native.prepare()
        out = []
        for backend in await anyio.to_thread.run_sync(_local_devices):
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

    async def stage(self, client: str, staged: Staged | Direct, token: bytes) -> tuple[bool, int, str]:
        """Whether this host reads ``token`` through ``staged``: ``client``'s memory (direct),
        or the start of its segment, which then stays mapped (the probe of
        :mod:`aiotinyrt.ray.staging`); and this host's pid and start time (a client waits for
        that process to be gone before it reuses memory a call of it may write)."""
        return (self._staging.probe(client, staged, token), *self.process)

    async def unstage(self, client: str) -> int:
        """Drop every staging segment of ``client`` mapped here; how many there were."""
        count = self._staging.mapped(client)
        self._staging.drop(client)
        return count

    async def buffers(self, client: str) -> int:
        """How many buffers ``client`` holds here."""
        return len(self._bufs.get(client, {}))

    async def reset(self, device: str) -> None:
        """Clear the host device's sticky error (``Compiled.reset``)."""
        dev = await self._device(device)
        await dev.reset()

    async def release(self, client: str, device: str | None = None, ids: Sequence[int] | None = None) -> int:
        """Free every buffer ``client`` holds (on ``device`` only, if given; of those ``ids``
        only, if given); returns how many."""
        keep = None if ids is None else set(ids)
        bufs = self._bufs.get(client, {})

        def mine(i: int, dev: str) -> bool:
            return (device is None or dev == device) and (keep is None or i in keep)

        gone = [i for i, (dev, _) in bufs.items() if mine(i, dev)]
        for i in gone:
            bufs.pop(i)[1].free_nowait()
        failed = self._failed.get(client, {})
        for i in [i for i, (dev, _) in failed.items() if mine(i, dev)]:
            del failed[i]
        await anyio.sleep(0)
        return len(gone)

    async def run(self, blob: bytes, *extra: Sequence[Any]) -> list[Any]:
        """Run one batch of a client's commands (:func:`wire.encode`'s arguments: the pickle
        of the client's id, the batch's number and its commands, then its arrays' buffers and
        its refs where it has any), after the client's earlier batches were submitted; the
        reply holds one entry per command (see :mod:`aiotinyrt.ray.wire`)."""
        client, seq, batch = wire.decode(blob, *extra)
        async with self._turn:
            await self._turn.wait_for(lambda: self._next.get(client, 1) == seq)
        results: list[Any] = [None] * len(batch)
        sigs = self._sigs.setdefault(client, {})
        bufs = self._bufs.setdefault(client, {})
        waiting: list[tuple[int, int, Signal]] = []
        ops = self._ops
        try:
            for i, cmd in enumerate(batch):
                try:
                    if cmd[0] == wire.LAUNCH:  # (the common command: no coroutine of its own)
                        _, cid, device, key, refs, gsz, lsz, vals, waits = cmd
                        prog = self._progs.get((device, key)) or self._no_program(device, key)
                        sig = prog(
                            *[_buffer(bufs, r) for r in refs],
                            global_size=gsz,
                            local_size=lsz,
                            vals=vals,
                            wait_for=[sigs[w] for w in waits if w in sigs],
                        )
                        sigs[cid] = sig
                        waiting.append((i, cid, sig))
                    elif cmd[0] == wire.CALL:  # a host-side callable, on the queue of that name
                        _, cid, device, queue, blob, waits = cmd
                        fn, args = cloudpickle.loads(blob)
                        deps = tuple(sigs[w] for w in waits if w in sigs)
                        sig = (await self._device(device)).queues[queue].submit(fn, args, deps)
                        sigs[cid] = sig
                        waiting.append((i, cid, sig))
                    else:
                        results[i] = await ops[cmd[0]](client, bufs, sigs, cmd)
                except Exception as exc:
                    results[i] = self._failure(client, exc)
        finally:
            self._next[client] = seq + 1
            async with self._turn:
                self._turn.notify_all()
        for i, cid, sig in waiting:
            try:  # (most are done by the time the last one is: no loop round trip for them)
                results[i] = sig.result() if sig.done() else await sig
            except Exception as exc:
                results[i] = self._failure(client, exc)
            sigs.pop(cid, None)
        return results

    async def read(self, client: str, ref: Ref) -> Any:
        """The bytes of one of ``client``'s buffers, for another host's ``copy_from``: a small
        array, or a list holding the ref of one ``put`` straight from the buffer."""
        try:
            buf = _buffer(self._bufs.get(client, {}), ref)
        except _NotHere as exc:
            error = self._explain(client, exc)
            raise error.with_traceback(None) from None  # (a stored error: raised at each such read)
        return await self._export(buf)

    async def write_to(self, client: str, ref: Ref, there: Direct) -> bool:
        """Copy one of ``client``'s buffers straight into another host's memory ``there`` (for
        that host's ``copy_from``), after the buffer's pending writes; False, copying nothing,
        when this host may not write that process's memory."""
        try:
            buf = _buffer(self._bufs.get(client, {}), ref)
        except _NotHere as exc:
            error = self._explain(client, exc)
            raise error.with_traceback(None) from None
        if there.nbytes != buf.nbytes:  # (never past the memory named)
            raise ValueError(f"a copy of {buf.nbytes} bytes into {there.nbytes} bytes")
        view = np.frombuffer(await buf.as_memoryview(), np.uint8)
        try:
            await anyio.to_thread.run_sync(direct_copy, there, address(view), buf.nbytes, True)
        except OSError:
            return False
        return True

    def _failure(self, client: str, exc: Exception) -> Any:
        """The reply entry of a command that failed with ``exc``; never raises (an error that
        does not even format still fails only its own command)."""
        try:
            return wire.failure(self.name, self._explain(client, exc))
        except Exception as bad:
            message = f"{self.name}: {type(exc).__name__} (not reportable: {type(bad).__name__})"
            return (0.0, message, None, None)

    def _explain(self, client: str, exc: Exception) -> Exception:
        """The error a command failed with, for the client: a buffer that is not here is named
        with why (its allocation's own error, where it failed: that exception itself, whatever
        its constructor takes)."""
        if not isinstance(exc, _NotHere):
            return exc
        failed = self._failed.get(client, {}).get(exc.rid)
        if failed is not None:
            return failed[1]
        return RuntimeError(
            f"buffer {exc.rid} is not on host {self.name} (freed, or allocated on a host of this "
            "name the client was connected to before)"
        )

    def _no_program(self, device: str, key: str) -> Program:
        """Raise the error of launching a program that is not loaded here."""
        failed = self._unloaded.get((device, key))
        if failed is not None:
            name, error = failed.args
            raise RuntimeError(f"program {name} did not load on {device}: {type(error).__name__}: {error}")
        raise RuntimeError(f"program {key} is not loaded on {device}")

    # ---- commands (each returns its reply entry; None: the client expects none) ----------------
    async def _alloc(self, client: str, bufs: Buffers, sigs: Pending, cmd: Command) -> Any:
        _, device, rid, nbytes, zero = cmd
        try:
            await self._device(device)
            buf = Buffer(device, nbytes, dtypes.uint8, BufferSpec(zero=zero) if zero else None)
            bufs[rid] = (device, await buf.allocate())
        except Exception as exc:  # (the client learns it at the buffer's first use)
            if isinstance(exc, MemoryError):  # named as the client names the device
                exc = MemoryError(f"RAY:{self.name}/{device}: {str(exc).removeprefix(device + ': ')}")
            self._failed.setdefault(client, {})[rid] = (device, exc)
            raise exc from None
        return None

    async def _free(self, client: str, bufs: Buffers, sigs: Pending, cmd: Command) -> Any:
        entry = bufs.pop(cmd[1], None)
        if entry is not None:
            entry[1].free_nowait()
        else:
            self._failed.get(client, {}).pop(cmd[1], None)
        return None

    async def _load(self, client: str, bufs: Buffers, sigs: Pending, cmd: Command) -> Any:
        _, device, key, name, lib = cmd
        if (device, key) not in self._progs:
            try:
                self._progs[(device, key)] = (await self._device(device)).runtime(name, lib)
            except Exception as exc:  # (its launches fail with it)
                self._unloaded[(device, key)] = _LoadFailed(name, exc)
                raise
            self._unloaded.pop((device, key), None)
        return None

    async def _release(self, client: str, bufs: Buffers, sigs: Pending, cmd: Command) -> Any:
        return (0.0, None, await self.release(client, cmd[1], cmd[2]), None)

    async def _stats(self, client: str, bufs: Buffers, sigs: Pending, cmd: Command) -> Any:
        return (0.0, None, await self.statistics(cmd[1]), None)

    async def _reset(self, client: str, bufs: Buffers, sigs: Pending, cmd: Command) -> Any:
        await self.reset(cmd[1])
        return 0.0

    async def _copyin(self, client: str, bufs: Buffers, sigs: Pending, cmd: Command) -> Any:
        _, _cid, ref, data, waits = cmd
        await _waits(sigs, waits)
        if isinstance(data, Direct):  # (the client's own memory: one copy, by the kernel)
            await _direct(_buffer(bufs, ref), data, write=False)
            return self._located(bufs, ref)
        if isinstance(data, list):  # (the ref of the client's put: read zero-copy)
            data = await wire.STORE.wait(data[0])
        elif isinstance(data, Staged):  # (the client's segment: mapped here)
            data = self._staging.view(client, _fits(data, ref))[: ref[1]]
            await _buffer(bufs, ref).copyin(data)
            return self._located(bufs, ref)
        await _buffer(bufs, ref).copyin(data)
        return 0.0

    async def _copyout(self, client: str, bufs: Buffers, sigs: Pending, cmd: Command) -> Any:
        _, _cid, ref, waits, *staged = cmd
        await _waits(sigs, waits)
        if staged and isinstance(staged[0], Direct):  # (into the client's own memory)
            await _direct(_buffer(bufs, ref), staged[0], write=True)
            return self._located(bufs, ref)
        if staged:  # into the client's segment: the buffer's copyout, ordered as any
            await _buffer(bufs, ref).copyout(self._staging.view(client, _fits(staged[0], ref))[: ref[1]])
            return self._located(bufs, ref)
        return (0.0, None, await self._export(_buffer(bufs, ref)), None)

    def _located(self, bufs: Buffers, ref: Ref) -> Any:
        """The reply entry of a copy with a client on this machine: where the client finds the
        buffer's memory file, if it is one (:mod:`aiotinyrt.ray.shared`), else just done."""
        base = bufs[ref[0]][1]
        where = shared.locate(base.handle(), base.nbytes, process_here(), self.process)
        return 0.0 if where is None else (0.0, None, where, None)

    async def _unstage(self, client: str, bufs: Buffers, sigs: Pending, cmd: Command) -> Any:
        self._staging.drop(client, cmd[1])
        return None

    async def _transfer(self, client: str, bufs: Buffers, sigs: Pending, cmd: Command) -> Any:
        _, _cid, dst, src, waits = cmd
        await _waits(sigs, waits)
        await _buffer(bufs, dst).copy_from(_buffer(bufs, src))
        return 0.0

    async def _fetch(self, client: str, bufs: Buffers, sigs: Pending, cmd: Command) -> Any:
        _, _cid, dst, src_host, src_client, src, waits = cmd
        await _waits(sigs, waits)
        store = wire.STORE
        peer = self._peers.get(src_host)
        if peer is None:
            peer = self._peers[src_host] = store.actor(src_host)
        # ``PIECES_IN_FLIGHT`` pieces asked for ahead: the source host puts the next while this
        # one copies in, and no more of the copy than that is in the object store at once
        rid, nbytes, offset = src
        pieces = [(k, min(wire.CHUNK_BYTES, nbytes - k)) for k in range(0, nbytes, wire.CHUNK_BYTES)]
        ahead = wire.PIECES_IN_FLIGHT
        try:
            direct = src_host not in self._no_direct
            if direct and await self._fetch_direct(src_host, peer, src_client, dst, bufs, src):
                return 0.0
            reads = [peer.read.remote(src_client, (rid, size, offset + k)) for k, size in pieces[:ahead]]
            for n, (k, size) in enumerate(pieces):
                payload = await store.wait(reads[n])
                reads[n] = None  # (the piece's object is freed once copied in)
                data = await store.wait(payload[0]) if isinstance(payload, list) else payload
                await _buffer(bufs, (dst[0], size, dst[2] + k)).copyin(data)
                del payload, data
                if n + ahead < len(pieces):
                    later, later_size = pieces[n + ahead]
                    reads.append(peer.read.remote(src_client, (rid, later_size, offset + later)))
        except Exception:
            self._peers.pop(src_host, None)  # (a host of that name may be started again)
            raise
        return 0.0

    async def _fetch_direct(
        self, src_host: str, peer: Any, src_client: str, dst: Ref, bufs: Buffers, src: Ref
    ) -> bool:
        """``copy_from`` as one copy: the source host writes straight into the destination
        buffer's memory (after every pending use of it), when that is host memory and the
        source host may write this process; False when not (the caller copies through the
        object store; a refused peer is remembered)."""
        if src[1] <= wire.INLINE_BYTES:
            return False
        buf = _buffer(bufs, dst)
        for sig in buf.pending():
            await sig.wait()
        view = buf.device_obj.allocator._as_memoryview(buf.handle(), buf.nbytes)
        if view is None:
            return False
        there = Direct.here(address(np.frombuffer(view, np.uint8)), buf.nbytes)
        if await wire.STORE.wait(peer.write_to.remote(src_client, src, there)):
            return True
        self._no_direct.add(src_host)
        return False

    async def _export(self, buf: Buffer) -> Any:
        """``buf``'s bytes after its pending writes: a copy when small, else ``[ref]`` of one
        ``put`` from a zero-copy view. Awaited in line, so nothing later writes it meanwhile."""
        view = np.frombuffer(await buf.as_memoryview(), np.uint8)
        if view.nbytes <= wire.INLINE_BYTES:
            return view.copy()
        if view.nbytes <= _PUT_ON_LOOP:
            return [wire.STORE.put(view)]
        return [await anyio.to_thread.run_sync(wire.STORE.put, view)]


class _NotHere(Exception):
    """A command names a buffer the host does not hold (see ``Host._explain``)."""

    def __init__(self, rid: int) -> None:
        super().__init__(rid)
        self.rid = rid


class _LoadFailed(Exception):
    """A program's load failed: ``args`` are its name and the error."""


def _buffer(bufs: Buffers, ref: Ref) -> Buffer:
    rid, nbytes, offset = ref
    entry = bufs.get(rid)
    if entry is None:
        raise _NotHere(rid)
    base = entry[1]
    if offset == 0 and nbytes == base.nbytes:
        return base
    return base.view(nbytes, dtypes.uint8, offset)


async def _direct(buf: Buffer, there: Direct, write: bool) -> None:
    """Copy between ``buf`` and the client's memory at ``there`` (into the client when
    ``write``), on a worker thread: a copyin after every pending use of the buffer, a copyout
    after its pending writes (awaited in line by the caller, so nothing later touches the buffer
    meanwhile). A device whose memory is not host memory goes through a host array.
    ``ValueError``, copying nothing, unless ``there`` names exactly the buffer's bytes."""
    if there.nbytes != buf.nbytes:
        raise ValueError(f"a copy of {buf.nbytes} bytes, but the client named {there.nbytes} bytes")
    view: memoryview | None
    if write:
        view = await buf.as_memoryview()  # (zero-copy on CPU; elsewhere a copy, ordered)
    else:
        for sig in buf.pending():
            await sig.wait()
        view = buf.device_obj.allocator._as_memoryview(buf.handle(), buf.nbytes)
    here = np.frombuffer(view, np.uint8) if view is not None else np.empty(buf.nbytes, np.uint8)
    await anyio.to_thread.run_sync(direct_copy, there, address(here), buf.nbytes, write)
    if view is None:
        await buf.copyin(here)


def _fits(staged: Staged, ref: Ref) -> Staged:
    """``staged``, unless the copy of ``ref`` does not fit in that segment (``ValueError``)."""
    if ref[1] > staged.size:
        raise ValueError(f"a copy of {ref[1]} bytes through a staging segment of {staged.size} bytes")
    return staged


async def _waits(sigs: Pending, waits: Sequence[int]) -> None:
    for w in waits:
        sig = sigs.get(w)
        if sig is not None:
            await sig


def _local_devices() -> list[str]:
    """``get_available_devices()`` of this process, without RAY devices (a host lists its own)."""
    wire.listing.active = True
    try:
        return [n for n in get_available_devices() if not n.startswith("RAY")]
    finally:
        wire.listing.active = False


#: The Ray actor class of a device host (an async actor: commands run on its event loop).
HostActor = ray.remote(Host)

#: Handles of the hosts this process started (a named actor lives while a handle does).
_STARTED: dict[str, Any] = {}


def start_host(name: str, **ray_options: Any) -> Any:
    """Start a device host called ``name`` and return its actor handle. ``ray_options`` go to
    ``HostActor.options`` (``num_cpus``, ``resources``, ``scheduling_strategy``, ...) and place
    it; the actor is named ``aiotinyrt-host:<name>`` in the namespace ``aiotinyrt``, so clients
    of any job of the cluster find it by name. The host lives as long as the process that
    started it (this module keeps the handle), or until ``ray.kill``; pass
    ``lifetime="detached"`` for one that outlives it."""
    if not isinstance(name, str) or not name or "/" in name or ":" in name:
        raise ValueError(f"host names are non-empty and hold no '/' or ':', got {name!r}")
    options = {"num_cpus": 0, **ray_options, "name": ACTOR_PREFIX + name, "namespace": wire.NAMESPACE}
    handle = _STARTED[name] = HostActor.options(**options).remote(name)
    return handle
