"""The device registry and Compiled, the base class of every device.

``Device["CPU"]`` opens a backend found by scanning ``aiotinyrt/backends/ops_*.py`` (the module
``ops_cpu`` provides ``CPUDevice``) and returns the one instance per canonical name. Every opened
device is finalized at interpreter exit: queued work is dropped (its signals fail) and workers are
given a bounded time to finish the command they are running, so exit never hangs.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import pkgutil
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import anyio.to_thread

import aiotinyrt.backends
from aiotinyrt import native
from aiotinyrt.allocator import Allocator
from aiotinyrt.buffer import Buffer
from aiotinyrt.compiler import Compiler
from aiotinyrt.graph import Graph, capture
from aiotinyrt.helpers import debug_level, getenv_str
from aiotinyrt.program import DeviceError, HostQueue, Program, Signal, _capturing
from aiotinyrt.renderer import Kernel, Renderer

# Preferred order when choosing Device.DEFAULT; backends not listed come after, alphabetically.
_DEFAULT_PRIORITY = ("CUDA", "OPENCL", "CPU")
_NEVER_DEFAULT = ("NULL",)


class Compiled:
    """One device: its queues and timelines, allocator, compiler, renderer and program loader.

    Backends pass their components to ``__init__``; everything shared (validation, ordering,
    synchronisation, errors, lifetime) lives here.
    """

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
        self.queues: dict[str, HostQueue] = {q: HostQueue(self, q) for q in queues}
        self._compute_queue = self.queues[queues[0]]
        self._copy_queue = self.queues[queues[-1]]
        self._error: DeviceError | None = None
        self._closed = False
        if debug_level() >= 1:
            print(f"opened device {name} ({type(self).__name__})")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

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
        :class:`~aiotinyrt.renderer.Kernel`, rendered by this device's renderer.

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
        """Wait for queued work, stop the workers, release cached memory and unregister.

        ``Device[name]`` afterwards opens a fresh device. Does not raise the sticky error.

        Cancellation: shielded; closing always completes.
        """
        with anyio.CancelScope(shield=True):
            await self._settle()
            self._shutdown(drop_queued=True, join_timeout=None, free_cache=False)
            await self._settle()  # the workers reach their stop markers; nothing joins on the loop
            # Off the loop thread: unmapping cached memory can take milliseconds, and each worker,
            # past its stop marker, still has to return (a bounded join: after aclose() no worker
            # thread of this device is left, which a test that enumerated threads right after
            # aclose() found not always so under load).
            await anyio.to_thread.run_sync(self._finish_close)

    def _finish_close(self) -> None:
        for q in self.queues.values():
            thread = q._thread
            if thread is not None and thread is not threading.current_thread():
                thread.join(timeout=5.0)
        self.allocator.free_cache()

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
            raise DeviceError(f"{self.name} is closed", device=self.name)

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

    # ---- submission (internal; Program and Buffer call these) -----------------------------------
    def _launch_handles(self, kernel: str, bufs: tuple[Buffer, ...]) -> list[Any]:
        handles = []
        for b in bufs:
            # fast path: an allocated base buffer of this device
            if type(b) is Buffer and b.device == self.name and b._base is None and b._handle is not None:
                handles.append(b._handle)
                continue
            if not isinstance(b, Buffer):
                raise TypeError(f"{kernel}: arguments must be Buffers, got {type(b).__name__}")
            if b.device != self.name:
                raise ValueError(
                    f"{kernel}: buffer {b!r} is on {b.device}, not {self.name}; move it with copy_from"
                )
            handles.append(b.handle())
        return handles

    def _submit_launch(
        self,
        prog: Program,
        handles: list[Any],
        gsz: tuple[int, ...],
        lsz: tuple[int, ...] | None,
        vals: tuple[int, ...],
        bufs: tuple[Buffer, ...],
        deps: tuple[Signal, ...],
        writes: frozenset[int] | None,
    ) -> Signal:
        if self._closed:
            raise DeviceError(f"{self.name} is closed", device=self.name)
        queue = self._compute_queue
        graph = _capturing.get()
        if graph is not None:
            fn, args = prog._launcher(tuple(handles), gsz, lsz, vals)
            flags = [writes is None or i in writes for i in range(len(bufs))]
            return graph._record(queue, fn, args, bufs, flags, deps, prog)
        timeline = queue.timeline
        extra: list[Signal] = []
        for i, b in enumerate(bufs):
            accesses = (b._base or b)._accesses
            # fast path: the only access known is an earlier one on this same queue
            if accesses and (len(accesses) > 1 or accesses[0][2].timeline is not timeline):
                extra.extend(b.dependencies(timeline, writes is None or i in writes))
        if extra:
            deps = deps + tuple(extra)
        waits = queue.native_deps(deps) if deps and queue.native else []
        entry = None if waits is None or not queue.native else prog._native_entry(handles, gsz, vals)
        if entry is not None and waits is not None:  # the worker waits for deps and runs it in C
            sig = queue.submit_native(entry[0], entry[1], entry[2], entry, waits)
        else:
            fn, args = prog._launcher(tuple(handles), gsz, lsz, vals)
            sig = queue.submit(fn, args, deps, (bufs, prog))
        if writes is None:
            for b in bufs:
                if b._base is None:  # a whole-buffer write supersedes every earlier access
                    b._accesses = [(0, b.nbytes, sig, True)]
                else:
                    b.record(sig, True)
        else:
            for i, b in enumerate(bufs):
                b.record(sig, i in writes)
        return sig

    async def _submit_copy(self, dest: Buffer, src: Buffer) -> None:
        """Copy ``src`` into ``dest`` (a buffer of this device) and wait for it."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        src_dev = src.device_obj
        dst_handle, src_handle = dest.handle(), src.handle()
        queue = self._copy_queue
        alloc = self.allocator
        graph = _capturing.get()
        if graph is not None:
            await anyio.lowlevel.checkpoint()
            if src_dev is self or alloc._can_transfer_from(src_dev):
                args = (dst_handle, src_handle, dest.nbytes, src_dev)
                graph._record(queue, alloc._transfer, args, (dest, src), [True, False])
                return
            src_dev.allocator.check_copyout()
            staging = memoryview(bytearray(src.nbytes))
            out_args = (staging, src_handle)
            graph._record(src_dev._copy_queue, src_dev.allocator._copyout, out_args, (src,), [False])
            graph._record(queue, alloc._copyin, (dst_handle, staging), (dest,), [True])
            return
        if src_dev is self or alloc._can_transfer_from(src_dev):
            deps = tuple(src.dependencies(queue.timeline, False) + dest.dependencies(queue.timeline, True))
            call = alloc._native_transfer(dst_handle, src_handle, dest.nbytes) if queue.native else None
            args = (dst_handle, src_handle, dest.nbytes, src_dev)
            sig = queue.submit_either(call, alloc._transfer, args, deps, (dest, src))
            src.record(sig, False)
            dest.record(sig, True)
            await sig
            return
        # staging through host memory: the source's worker copies out, this worker copies in
        src_dev.allocator.check_copyout()
        staging = memoryview(bytearray(src.nbytes))
        src_queue = src_dev._copy_queue
        out_sig = src_queue.submit(
            src_dev.allocator._copyout,
            (staging, src_handle),
            tuple(src.dependencies(src_queue.timeline, False)),
            keep=(src, staging),
        )
        src.record(out_sig, False)
        deps = (out_sig, *dest.dependencies(queue.timeline, True))
        in_sig = queue.submit(alloc._copyin, (dst_handle, staging), deps, keep=(dest, staging))
        dest.record(in_sig, True)
        await in_sig

    async def _submit_transfer(
        self, dest: Any, src: Any, nbytes: int, src_dev: Compiled, deps: tuple[Signal, ...], keep: object
    ) -> None:
        """Raw-handle transfer used by ``Allocator.transfer``."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        self._check_open()
        queue = self._copy_queue
        alloc = self.allocator
        if src_dev is self or alloc._can_transfer_from(src_dev):
            call = alloc._native_transfer(dest, src, nbytes) if queue.native else None
            await queue.submit_either(call, alloc._transfer, (dest, src, nbytes, src_dev), deps, keep)
            return
        src_dev.allocator.check_copyout()
        staging = memoryview(bytearray(nbytes))
        out_sig = src_dev._copy_queue.submit(src_dev.allocator._copyout, (staging, src), deps, keep=keep)
        await queue.submit(self.allocator._copyin, (dest, staging), (out_sig,), keep=(keep, staging))


class _DeviceRegistry:
    """``Device[name]``: one opened :class:`Compiled` per canonical device name."""

    def __init__(self) -> None:
        self._opened: dict[str, Compiled] = {}
        self._lock = threading.RLock()
        self._atexit_registered = False

    @property
    def backends(self) -> list[str]:
        """Backend names found in ``aiotinyrt/backends/ops_*.py`` (upper-case)."""
        return sorted(
            m.name[len("ops_") :].upper()
            for m in pkgutil.iter_modules(aiotinyrt.backends.__path__)
            if m.name.startswith("ops_")
        )

    @staticmethod
    def canonicalize(name: str) -> str:
        """``cpu`` -> ``CPU``, ``CPU:0`` -> ``CPU``, ``cpu:1`` -> ``CPU:1``; anything after the
        first colon keeps its case (``DISK:/Path``)."""
        if not isinstance(name, str):
            raise TypeError(f"device name must be a str, got {type(name).__name__}")
        backend, sep, rest = name.partition(":")
        out = backend.upper() + sep + rest
        return out[:-2] if out.endswith(":0") else out

    def _backend_class(self, backend: str) -> Callable[[str], Compiled]:
        if backend not in self.backends:
            raise ValueError(
                f"unknown device backend {backend!r}; available backends: {', '.join(self.backends)}"
            )
        module = importlib.import_module(f"aiotinyrt.backends.ops_{backend.lower()}")
        cls: Callable[[str], Compiled] = getattr(module, f"{backend}Device")
        return cls

    def __getitem__(self, name: str) -> Compiled:
        canonical = self.canonicalize(name)
        device = self._opened.get(canonical)
        if device is not None:
            return device
        backend, _, suffix = canonical.partition(":")
        if not backend:
            raise ValueError(f"empty device name {name!r}")
        with self._lock:
            device = self._opened.get(canonical)
            if device is not None:
                return device
            cls = self._backend_class(backend)
            if suffix and not getattr(cls, "accepts_path", False) and not suffix.isdigit():
                raise ValueError(f"bad device name {name!r}: the part after ':' must be a device index")
            device = cls(canonical)
            self._opened[canonical] = device
            if not self._atexit_registered:
                atexit.register(self._finalize_all)
                self._atexit_registered = True
            return device

    def __contains__(self, name: str) -> bool:
        return self.canonicalize(name) in self._opened

    def opened(self) -> list[Compiled]:
        """Devices currently open, in the order they were opened."""
        return list(self._opened.values())

    def _forget(self, device: Compiled) -> None:
        with self._lock:
            if self._opened.get(device.name) is device:
                del self._opened[device.name]

    @property
    def DEFAULT(self) -> str:
        """Env ``DEV`` if set, else the first backend that opens here (never NULL)."""
        env = getenv_str("DEV")
        if env:
            return self.canonicalize(env)
        order = [b for b in _DEFAULT_PRIORITY if b in self.backends]
        order += [b for b in self.backends if b not in order and b not in _NEVER_DEFAULT]
        for backend in order:
            try:
                self[backend]
            except Exception:
                continue
            return backend
        raise RuntimeError(f"no device opens here (backends tried: {', '.join(order)})")

    def _finalize_all(self) -> None:
        """Interpreter exit: drop queued work and stop workers, with a bounded wait; write the
        PROFILE trace if asked for."""
        write_profile(self.opened())
        for device in self.opened():
            with contextlib.suppress(Exception):
                device._shutdown(drop_queued=True, join_timeout=float(os.environ.get("EXIT_JOIN_S", "2")))


Device = _DeviceRegistry()


def write_profile(devices: Sequence[Compiled], path: str | None = None) -> str | None:
    """Write every queue's recorded commands as a Chrome-trace/Perfetto JSON file (env
    ``PROFILE``: a path, or ``1`` for ``aiotinyrt_profile.json``). Returns the path written."""
    import json

    target = path or getenv_str("PROFILE")
    if not target:
        return None
    if target == "1":
        target = "aiotinyrt_profile.json"
    events: list[dict[str, Any]] = []
    for pid, device in enumerate(devices):
        events.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": device.name}})
        for tid, queue in enumerate(device.queues.values()):
            events.append(
                {"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": queue.name}}
            )
            for name, start, seconds in list(queue.profile or ()):
                events.append(
                    {"name": name, "ph": "X", "pid": pid, "tid": tid, "ts": start * 1e6, "dur": seconds * 1e6}
                )
    with open(target, "w") as f:
        json.dump({"traceEvents": events}, f)
    return target


def get_available_devices() -> list[str]:
    """Names of the backends that open on this machine."""
    out = []
    for backend in Device.backends:
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

    Cancellation: cancelled before the device opened, nothing is opened; the exit path is
    shielded, so an opened device is always closed.
    """
    await native.prepare()
    device = Device[name]
    try:
        yield device
        with anyio.CancelScope(shield=True):
            await device.synchronize()
    finally:
        await device.aclose()
