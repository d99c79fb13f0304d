"""Compiled, the base class of every device, and the functions over opened devices.

A device holds its four components (allocator, compiler, program loader, renderer) and its
queues; backends pass the components to ``Compiled.__init__`` and everything shared
(validation, ordering, synchronisation, errors, lifetime) lives in the base classes. The
registry that opens devices by name is :mod:`aiotinyrt.registry`.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, cast

import anyio
import anyio.lowlevel
import anyio.to_thread

from aiotinyrt import native, registry
from aiotinyrt.allocator import Allocator
from aiotinyrt.buffer import Buffer
from aiotinyrt.compiler import Compiler
from aiotinyrt.graph import Graph, capture
from aiotinyrt.helpers import debug_level, get_logger
from aiotinyrt.kernel import Kernel, Renderer
from aiotinyrt.lifetime import close_timeout, exit_join_s, fork_generation, forked_error_message
from aiotinyrt.program import Program
from aiotinyrt.queue import HostQueue, Queue
from aiotinyrt.registry import _DeviceRegistry
from aiotinyrt.signal import DeviceError, Signal

_log = get_logger("device")


class Compiled:
    """One device: its queues and timelines, allocator, compiler, renderer and program loader.

    Backends pass their components to ``__init__``; everything shared (validation, ordering,
    synchronisation, errors, lifetime) lives here.
    """

    # The sticky error and the closed flag are slots: the CL repeat launch (native/clfast.c)
    # reads both on every launch by their offsets. Everything else keeps a ``__dict__``.
    __slots__ = ("__dict__", "__weakref__", "_closed", "_error")

    def __init__(
        self,
        name: str,
        allocator: Allocator[Any],
        compiler: Compiler,
        runtime: Callable[..., Program],
        renderer: Renderer | None = None,
        queues: Sequence[str] = ("compute", "copy"),
    ) -> None:
        self.name = name
        self._allocator = allocator
        self._compiler = compiler
        self._runtime = runtime
        self._renderer = renderer
        self.queues: dict[str, Queue] = {q: self._make_queue(q) for q in queues}
        self._compute_queue = self.queues[queues[0]]
        self._copy_queue = self.queues[queues[-1]]
        self._error: DeviceError | None = None
        self._closed = False
        self._generation = fork_generation()  # a forked child refuses to use this device
        if debug_level() >= 1:
            _log.debug("opened device %s (%s)", name, type(self).__name__)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    def _make_queue(self, name: str) -> Queue:
        """Backend hook: the queue called ``name``, of the kind this backend's work needs. The
        default is host-run (:class:`~aiotinyrt.queue.HostQueue`: a worker thread runs the
        commands); a backend with a driver returns a
        :class:`~aiotinyrt.driverqueue.DriverQueue` over it."""
        return HostQueue(self, name)

    # ---- components -----------------------------------------------------------------------------
    @property
    def allocator(self) -> Allocator[Any]:
        """This device's memory allocator."""
        return self._allocator

    @property
    def compiler(self) -> Compiler:
        """This device's compiler (source -> binary, with a persistent cache)."""
        return self._compiler

    @property
    def renderer(self) -> Renderer | None:
        """This device's renderer (portable kernel -> source), if it has one."""
        return self._renderer

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def timelines(self) -> list[Any]:
        """The timeline of every queue of this device."""
        return [q.timeline for q in self.queues.values()]

    def count(self) -> int:
        """How many devices of this backend this machine offers (``CPU``: one per core)."""
        return 1

    # ---- programs -----------------------------------------------------------------------------
    def runtime(self, name: str, lib: bytes) -> Program:
        """Load a compiled kernel. Cheap and synchronous."""
        self._check_open()
        return self._runtime(self, name, lib)

    async def program(self, name: str | Kernel, src: str | None = None) -> Program:
        """Compile (through the cache) and load a kernel: ``program(name, c_source)`` for raw
        source in this backend's language, or ``program(kernel)`` for a portable
        :class:`~aiotinyrt.kernel.Kernel`, rendered by this device's renderer.

        Cancellation: cancels the wait; if this call was running the compiler, the compiler
        process is killed (see ``Compiler.compile_cached``).
        """
        self._check_open()
        if isinstance(name, Kernel):
            if src is not None:
                raise TypeError("program(kernel) takes no source: the device's renderer writes it")
            if self.renderer is None:
                raise ValueError(f"{self.name} has no renderer for portable kernels; pass C source instead")
            kernel_src = self.renderer.render(name)
            lib = await self.compiler.compile_cached(kernel_src)
            return self._runtime(self, name.name, lib, src=kernel_src, kernel=name)
        if not isinstance(name, str):
            raise TypeError(
                f"program() needs a kernel name and source, or a Kernel; got {type(name).__name__}"
            )
        if not isinstance(src, str):
            raise TypeError(
                f"program({name!r}, src): src must be a str of source code, got {type(src).__name__}"
            )
        lib = await self.compiler.compile_cached(src)
        return self._runtime(self, name, lib, src=src)

    async def run(self, prog: Program, *bufs: Buffer, **kwargs: Any) -> float:
        """Launch ``prog`` and wait for it; returns the device execution time in seconds.

        Cancellation: cancels the wait only; the launch runs to completion.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        if not isinstance(prog, Program):
            raise TypeError(f"run() needs a Program, got {type(prog).__name__}")
        if prog.device is not self:
            raise ValueError(f"{prog!r} belongs to {prog.device.name}, not {self.name}")
        return await prog(*bufs, **kwargs)

    def capture(self, **named: Buffer) -> contextlib.AbstractAsyncContextManager[Graph]:
        """``async with dev.capture(x=buf) as graph:`` records launches and ``copy_from`` made by
        this task (on any device) instead of running them; ``graph.replay(x=other)`` then runs
        the whole recording as one command per device queue. Named buffers can be replaced at
        replay. See :mod:`aiotinyrt.graph`.

        Cancellation: the block's exit (which may compile a native replay) is a normal await;
        cancelled there, the graph is left unsealed and cannot be replayed.
        """
        self._check_open()
        return capture(self, named)

    # ---- synchronisation ------------------------------------------------------------------------
    def _latest(self) -> list[Signal]:
        return [Signal(q.timeline, q.timeline.submitted) for q in self.queues.values()]

    def _barrier(self) -> tuple[Signal, ...]:
        """Signals of the last command of every queue, where not yet done."""
        return tuple(s for s in self._latest() if not s.done())

    async def _settle(self) -> None:
        for sig in self._latest():
            await sig._settle()

    async def synchronize(self) -> None:
        """Wait for everything submitted to this device so far (a gather over its timelines).

        Raises this device's sticky ``DeviceError`` if a command failed.

        Cancellation: cancels the wait only; the work continues.
        """
        await self._settle()
        if self._error is not None:
            raise self._error

    async def reset(self) -> None:
        """Wait for queued work to drain, then clear the sticky error so the device runs again.

        Cancellation: cancelled while draining, the error stays set.
        """
        await self._settle()
        self._error = None
        for q in self.queues.values():
            q._halt(False)

    async def aclose(self) -> None:
        """Wait for queued work (at most env ``CLOSE_TIMEOUT_S`` seconds, default 30), stop the
        workers, release cached memory and unregister. Queued commands not started by then are
        dropped (their signals fail); a command still running ``EXIT_JOIN_S`` seconds (default
        2) later is abandoned: its worker is left running, the memory it uses stays allocated,
        and one ``RuntimeWarning`` names it (see :mod:`aiotinyrt.lifetime`). Closing is bounded
        by about ``CLOSE_TIMEOUT_S + EXIT_JOIN_S``.

        ``Device[name]`` afterwards opens a fresh device. Does not raise the sticky error.

        Cancellation: cancelled (or interrupted by Ctrl-C) while waiting for queued work, it
        stops waiting and closes at once, as after the timeout, then propagates the
        cancellation; the close itself is shielded and always completes.
        """
        if self._closed:
            await anyio.lowlevel.checkpoint()
            return
        try:
            await self._drain(close_timeout())
        finally:
            with anyio.CancelScope(shield=True):
                self._shutdown(drop_queued=True, join_timeout=None, free_cache=False)
                # Off the loop thread: each worker, past its stop marker, still has to return
                # (a bounded join: after aclose() no worker thread of this device is left unless
                # it was abandoned), and unmapping cached memory can take milliseconds.
                await anyio.to_thread.run_sync(self._join_workers)
                for q in self.queues.values():
                    if isinstance(q, HostQueue):
                        q.abandon_if_stuck(at_exit=False)
                await anyio.to_thread.run_sync(self.allocator.free_cache)

    async def _drain(self, limit: float) -> None:
        """Wait for everything submitted so far, at most ``limit`` seconds, without raising
        (neither the sticky error nor a timeout). Cancellation: propagates."""
        deadline = anyio.current_time() + limit
        for sig in self._latest():
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                return
            try:
                await sig._settle(remaining)
            except TimeoutError:
                return

    def _join_workers(self) -> None:
        """Join every worker thread, all of them within ``EXIT_JOIN_S`` seconds together."""
        deadline = time.monotonic() + exit_join_s()
        for q in self.queues.values():
            thread = q._thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _shutdown(self, *, drop_queued: bool, join_timeout: float | None, free_cache: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        for q in self.queues.values():
            q.stop(drop_queued=drop_queued, join_timeout=join_timeout)
        self._on_close()
        if free_cache:
            with contextlib.suppress(Exception):
                self.allocator.free_cache()
        Device._forget(self)

    def _on_close(self) -> None:
        """Backend hook: release backend resources after the queues stopped."""

    def _healthy(self) -> bool:
        """Open and without a sticky error (commands would run)."""
        return not self._closed and self._error is None

    def _check_open(self) -> None:
        if self._closed:
            raise self._refusal()

    def _refusal(self) -> DeviceError:
        """The error of using this device after it closed (or in a forked child)."""
        if self._generation != fork_generation():
            return DeviceError(forked_error_message(self.name), device=self.name)
        return DeviceError(f"{self.name} is closed", device=self.name)

    def _forked(self) -> None:
        """In a forked child, where none of its worker threads exist: refuse use from now on
        (takes no lock; one may have been held by a thread that does not exist here)."""
        self._closed = True
        for q in self.queues.values():
            q._stopping = True  # (the C launch path looks here)
        self._allocator._lock = threading.RLock()  # (works wherever a Lock did)

    def _fail(self, exc: BaseException, sig: Signal) -> DeviceError:
        """Turn an exception raised by a command into the device's sticky error. Worker thread."""
        error = DeviceError(
            f"{self.name}: command {sig.timeline.label}@{sig.value} failed: {exc!r}",
            device=self.name,
            cause=exc,
        )
        if self._error is None:
            self._error = error
            for q in self.queues.values():
                q._halt(True)
        return error


#: ``Device["CPU"]``: the registry (:mod:`aiotinyrt.registry`), typed by what it holds.
Device = cast("_DeviceRegistry[Compiled]", registry.Device)


def get_available_devices() -> list[str]:
    """Names of the backends that open on this machine, and the names a backend lists itself
    (a ``available_devices()`` on its class: ``RAY:<host>/CPU`` for every connected host)."""
    out = []
    for backend in Device.backends:
        try:
            lister = getattr(Device._backend_class(backend), "available_devices", None)
        except Exception:
            continue
        if lister is not None:
            try:
                out.extend(lister())
            except Exception:
                pass
            continue
        try:
            Device[backend]
        except Exception:
            continue
        out.append(backend)
    return out


async def synchronize(*devices: Compiled | str) -> None:
    """Wait for every given device (default: every opened device), concurrently; then raise the
    first device's sticky error, if any.

    Cancellation: cancels the waits only; the work continues.
    """
    devs = [Device[d] if isinstance(d, str) else d for d in devices] or Device.opened()
    if not devs:
        await anyio.lowlevel.checkpoint()
        return
    failures: list[BaseException] = []

    async def settle(dev: Compiled) -> None:
        try:
            await dev._settle()
        except Exception as exc:  # a timeout: report it after every device was waited for
            failures.append(exc)

    async with anyio.create_task_group() as tg:
        for dev in devs:
            tg.start_soon(settle, dev)
    if failures:
        raise failures[0]
    for dev in devs:
        if dev._error is not None:
            raise dev._error


@contextlib.asynccontextmanager
async def open_device(name: str) -> AsyncIterator[Compiled]:
    """``async with open_device("CPU:1") as dev``: the device, synchronized and closed on exit.
    The native queue library is built or loaded off the event loop first (see
    :func:`aiotinyrt.native.prepare`).

    Cancellation: cancelled before the device opened, nothing is opened. An opened device is
    always closed: on exit it waits for queued work as :meth:`Compiled.aclose` does (bounded by
    ``CLOSE_TIMEOUT_S``; cancelled, it closes at once), then raises the sticky error, if any.
    """
    await native.prepare()
    device = Device[name]
    try:
        yield device
        await device._drain(close_timeout())  # (bounded: a kernel that never returns is abandoned)
        if device._error is not None:
            raise device._error
    finally:
        await device.aclose()
