"""The ``AIO`` tinygrad device: tinygrad's front-end on aiotinyrt's four components.

``AIO`` (``AIO:1``, ``AIO:2``, ...) is a tinygrad ``Compiled`` device whose pieces are aiotinyrt's:

* **Renderer**: tinygrad's own C renderer (``ClangRenderer``) writes the kernel source.
* **Compiler**: aiotinyrt's compiler of the wrapped backend compiles it, through aiotinyrt's
  compile cache (in memory and the sqlite file), not tinygrad's.
* **Program**: aiotinyrt loads the binary (``Compiled.runtime``) and every tinygrad launch is one
  aiotinyrt launch on the device's compute queue: it returns at once; ``wait=True`` (tinygrad's
  timing, ``DEBUG>=2``) blocks on the launch's Signal with :meth:`Signal.wait_blocking`.
* **Allocator**: every tinygrad buffer is an aiotinyrt :class:`~aiotinyrt.Buffer` (bytes) from
  the device's LRU allocator (statistics included); views are aiotinyrt views, frees are
  deferred until the work using the memory completes. Copies between ``AIO:n`` devices are
  aiotinyrt copies, queued and ordered by aiotinyrt's hazard tracking, never waited for.

Which aiotinyrt backend ``AIO`` wraps is the environment setting ``AIO_BACKEND`` (default
``CPU``): ``AIO:n`` is aiotinyrt's ``<AIO_BACKEND>:n``. Only backends whose kernels are C
(``CPU``) can run tinygrad's rendered kernels today.

tinygrad calls its runtime synchronously. Nothing here blocks except where tinygrad's contract
says the call returns finished (copies out to the host, ``synchronize``, ``wait=True``): those
use :meth:`Signal.wait_blocking`, which raises ``RuntimeError`` on an event-loop thread. Async
code uses :mod:`aiotinyrt.tinygrad`'s awaitable API instead.
"""

from __future__ import annotations

import dataclasses
import platform
from typing import Any

import anyio
import tinygrad.device as tg_device
from tinygrad.device import Compiled, LRUAllocator, TinyELF
from tinygrad.device import Compiler as TinyCompiler
from tinygrad.helpers import Target
from tinygrad.renderer.cstyle import ClangRenderer

from aiotinyrt.allocator import BufferSpec
from aiotinyrt.buffer import Buffer, enqueue_copy
from aiotinyrt.compiler import CompileError
from aiotinyrt.compiler import Compiler as RtCompiler
from aiotinyrt.device import Compiled as RtCompiled
from aiotinyrt.device import Device as RtDevice
from aiotinyrt.dtype import dtypes
from aiotinyrt.program import Program as RtProgram
from aiotinyrt.signal import Signal
from aiotinyrt.tinygrad.graph import AIOGraph
from aiotinyrt.tinygrad.sync import aiotinyrt_name, run_sync


# ---- Compiler and Renderer -------------------------------------------------------------------------
class AIOCompiler(TinyCompiler):
    """tinygrad's Compiler interface over aiotinyrt's compiler and compile cache."""

    def __init__(self, device: str) -> None:
        super().__init__(None)  # tinygrad's disk cache is not used: aiotinyrt's is
        self.device = device

    def _rt_compiler(self) -> RtCompiler:
        return RtDevice[aiotinyrt_name(self.device)].compiler

    def compile_cached(self, src: str) -> bytes:
        """Source -> shared object through aiotinyrt's caches; compile errors become tinygrad's
        ``CompileError`` (with aiotinyrt's, carrying the diagnostics, as the cause)."""
        compiler = self._rt_compiler()
        try:
            return run_sync(compiler.compile_cached, src)
        except CompileError as exc:
            raise tg_device.CompileError(f"{exc}\n{exc.diagnostics}") from exc

    def compile(self, src: str) -> bytes:
        """Same as :meth:`compile_cached` (the cache is aiotinyrt's)."""
        return self.compile_cached(src)


class AIORenderer(ClangRenderer):
    """tinygrad's C renderer, compiling through :class:`AIOCompiler`."""

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self.compiler = AIOCompiler(target.device or "AIO")


# ---- Program -----------------------------------------------------------------------------------------
class AIOProgram(tg_device.Program["AIODevice"]):
    """One loaded kernel. A call is one aiotinyrt launch per tinygrad thread (``core_id``) on the
    device's compute queue; it returns at once unless ``wait`` (then: the device seconds)."""

    def __init__(self, dev: AIODevice, obj: TinyELF) -> None:
        self.dev, self.name, self.signature = dev, obj.name, obj.signature
        self.program: RtProgram = dev.rt.runtime(obj.name, obj.lib)
        #: position of the thread index among all arguments (buffers then vals), if threaded
        self.core_slot = next((slot for name, slot, *_ in obj.signature if name == "core_id"), None)

    def __call__(
        self,
        *bufs: Buffer,
        global_size: tuple[int, ...] = (1, 1, 1),
        local_size: tuple[int, ...] | None = None,
        vals: tuple[int | None, ...] = (),
        wait: bool = False,
        timeout: int | None = None,
        **kwargs: Any,
    ) -> float | None:
        """Launch (``vals`` may hold None for ``core_id``). ``timeout`` (tinygrad's BEAM search
        asks to give up on slow candidates) is not applied: a kernel on a host queue cannot be
        stopped, and returning early would time the next candidate behind it (tinygrad's own
        CPU device ignores it too)."""
        program = self.program
        signals = [
            program(*bufs, vals=v) if v else program(*bufs) for v in self.launch_vals(bufs, global_size, vals)
        ]
        if not wait:
            return None
        return sum(sig.wait_blocking() for sig in signals)

    def launch_vals(
        self, bufs: tuple[Any, ...], global_size: tuple[int, ...], vals: tuple[int | None, ...]
    ) -> list[tuple[int, ...]]:
        """The vals of each aiotinyrt launch: one per thread, ``core_id`` filled in."""
        if self.core_slot is None:
            return [vals]  # type: ignore[list-item]
        at = self.core_slot - len(bufs)
        out = []
        for tid in range(int(global_size[0])):
            one = list(vals)
            one[at] = tid
            out.append(tuple(one))
        return out  # type: ignore[return-value]


# ---- Allocator ---------------------------------------------------------------------------------------
def _spec(options: tg_device.BufferSpec) -> BufferSpec:
    return BufferSpec(**dataclasses.asdict(options))


class AIOAllocator(LRUAllocator["AIODevice"]):
    """tinygrad's Allocator interface over aiotinyrt Buffers (bytes) of the wrapped device.

    tinygrad's ``LRUAllocator`` sits on top: tinygrad code relies on a freed buffer's opaque
    coming back from the cache (a view made before ``free_intermediates`` is used after the base
    is allocated again), so freed aiotinyrt Buffers are kept for reuse by tinygrad's cache and
    handed to aiotinyrt's allocator (whose own LRU cache then holds the memory) when tinygrad
    flushes it (``free_cache``, or out of memory).
    """

    def __init__(self, dev: AIODevice) -> None:
        super().__init__(dev, supports_copy_from_disk=False, supports_transfer=True)

    def _alloc(self, size: int, options: tg_device.BufferSpec) -> Buffer:
        return Buffer(self.dev.rt.name, size, dtypes.uint8, _spec(options)).allocate_nowait()

    def _free(self, opaque: Buffer, options: tg_device.BufferSpec) -> None:
        if not opaque.freed and not self.dev.rt.closed:
            opaque.free_nowait()  # deferred until the work using it completes

    def _offset(self, buf: Buffer, size: int, offset: int) -> Buffer:
        return buf.view(size, dtypes.uint8, offset)

    def _copyin(self, dest: Buffer, src: memoryview) -> None:
        """Host -> device, finished on return (the source may change afterwards): on the calling
        thread when small and nothing pending touches the bytes, else queued and waited for."""
        data = memoryview(src).cast("B")
        if data.nbytes != dest.nbytes:
            dest = dest.view(data.nbytes, dtypes.uint8, 0)
        try:
            dest.copyin_nowait(data)
        except anyio.WouldBlock:
            dest._enqueue_copy(data, into=True).wait_blocking()

    def _copyout(self, dest: memoryview, src: Buffer) -> None:
        """Device -> host, finished on return (after the pending writes of ``src``)."""
        data = memoryview(dest).cast("B")
        if data.nbytes != src.nbytes:
            src = src.view(data.nbytes, dtypes.uint8, 0)
        try:
            src.copyout_nowait(data)
        except anyio.WouldBlock:
            src._enqueue_copy(data, into=False).wait_blocking()

    def _transfer(self, dest: Buffer, src: Buffer, sz: int, src_dev: AIODevice, dest_dev: AIODevice) -> None:
        """``AIO:n`` -> ``AIO:m``: an aiotinyrt copy on the destination's copy queue, ordered
        after the pending writes of ``src`` and accesses of ``dest``; not waited for."""
        if dest.nbytes != sz:
            dest = dest.view(sz, dtypes.uint8, 0)
        if src.nbytes != sz:
            src = src.view(sz, dtypes.uint8, 0)
        enqueue_copy(dest, src)


# ---- Device ------------------------------------------------------------------------------------------
def _arch() -> str:
    machine = platform.machine().lower()
    return {"amd64": "x86_64", "aarch64": "arm64"}.get(machine, machine) + ",native"


class AIODevice(Compiled):
    """A tinygrad device backed by the aiotinyrt device ``aiotinyrt_name(device)``."""

    def __init__(self, device: str) -> None:
        self.rt: RtCompiled = RtDevice[aiotinyrt_name(device)]
        super().__init__(device, AIOAllocator(self), [AIORenderer], AIOProgram, AIOGraph, arch=_arch())

    def synchronize(self, timeout: int | None = None) -> None:
        """Block until everything submitted to the device so far completed (``timeout`` in ms);
        raises the device's sticky ``DeviceError``. ``RuntimeError`` on an event-loop thread."""
        limit = None if timeout is None else timeout / 1000
        for timeline in self.rt.timelines:
            sig = Signal(timeline, timeline.submitted)
            if not sig.done():
                sig.wait_blocking(limit)
        error = self.rt._error
        if error is not None:
            raise error

    def finalize(self) -> None:
        """At interpreter exit: nothing to do (aiotinyrt finalizes its devices itself)."""
