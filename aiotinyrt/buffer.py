"""Buffer: typed device memory with views, automatic ordering of work on it, and deferred free.

Ordering (hazards)
------------------
Every command that touches a buffer reads or writes its *base* allocation. The base remembers
the signal of the last write and the signals of the reads since then. A new command depends on
the last write (read-after-write) and, if it writes, on those reads (write-after-read) and the
last write (write-after-write). Dependencies on the same queue are implied by its order and are
dropped; the rest are resolved by the device worker that runs the command, never by the event
loop. Tracking is per base allocation: two disjoint views of one base are ordered as if they
overlapped (conservative, never wrong).

Free
----
``free()`` marks the buffer unusable at once and hands the memory back when the last command
using it completes (immediately if none is pending). Views of a freed base become unusable too.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from aiotinyrt.allocator import BufferSpec, host_bytes
from aiotinyrt.dtype import DType
from aiotinyrt.program import Signal, Timeline

if TYPE_CHECKING:
    import numpy as np

    from aiotinyrt.device import Compiled


class Buffer:
    """``size`` elements of ``dtype`` on ``device``.

    Create it, then ``await buf.allocate()`` (or ``async with Buffer(...) as buf``). Views
    (``buf.view(size, dtype, offset)``) share the base's memory; ``offset`` is in bytes.
    """

    __slots__ = (
        "_base",
        "_freed",
        "_handle",
        "_last_write",
        "_reads",
        "device",
        "dtype",
        "offset",
        "options",
        "size",
    )

    def __init__(
        self,
        device: str,
        size: int,
        dtype: DType,
        options: BufferSpec | None = None,
        *,
        base: Buffer | None = None,
        offset: int = 0,
    ) -> None:
        from aiotinyrt.device import Device

        if not isinstance(dtype, DType):
            raise TypeError(f"dtype must be a DType (e.g. dtypes.float32), got {dtype!r}")
        if type(size) is not int:
            raise TypeError(f"buffer size must be an int number of elements, got {size!r}")
        if size <= 0:
            raise ValueError(f"buffer size must be positive, got {size} elements")
        if options is not None and not isinstance(options, BufferSpec):
            raise TypeError(f"options must be a BufferSpec or None, got {type(options).__name__}")
        self.device: str = Device.canonicalize(device)
        self.size = size
        self.dtype = dtype
        self.options = options
        self.offset = offset
        self._base = base
        self._handle: Any = None
        self._freed = False
        self._last_write: Signal | None = None
        self._reads: list[Signal] = []

    def __repr__(self) -> str:
        state = "freed" if self.freed else ("allocated" if self.is_allocated() else "unallocated")
        view = f" view of +{self.offset}" if self._base is not None else ""
        return f"<Buffer {self.device} size={self.size} dtype={self.dtype}{view} {state}>"

    @property
    def nbytes(self) -> int:
        """Size in bytes."""
        return self.size * self.dtype.itemsize

    @property
    def base(self) -> Buffer:
        """The buffer owning the memory (itself unless this is a view)."""
        return self._base if self._base is not None else self

    @property
    def freed(self) -> bool:
        """True once this buffer (or, for a view, its base) was freed."""
        return self._freed or (self._base is not None and self._base._freed)

    @property
    def device_obj(self) -> Compiled:
        from aiotinyrt.device import Device

        return Device[self.device]

    def is_allocated(self) -> bool:
        """True when the memory exists and is usable."""
        if self.freed:
            return False
        return self.base._handle is not None

    # ---- lifetime ------------------------------------------------------------------------------
    async def allocate(self, opaque: Any = None) -> Buffer:
        """Allocate the memory (or adopt ``opaque``, a handle of this device's allocator).

        Returns the buffer itself, so ``buf = await Buffer(...).allocate()`` works.

        Cancellation: a checkpoint at entry; once past it the allocation completes.
        """
        await anyio.lowlevel.checkpoint()
        if self._base is not None:
            raise ValueError("a view shares its base's memory; allocate the base buffer instead")
        if self._freed:
            raise RuntimeError(f"{self!r} was freed; create a new Buffer")
        if self._handle is not None:
            raise RuntimeError(f"{self!r} is already allocated")
        device = self.device_obj
        self._handle = (
            opaque if opaque is not None else device.allocator.alloc_nowait(self.nbytes, self.options)
        )
        return self

    def pending(self) -> list[Signal]:
        """Signals of work still using this buffer's memory (reads and writes not yet done)."""
        base = self.base
        sigs = [s for s in base._reads if not s.done()]
        if base._last_write is not None and not base._last_write.done():
            sigs.append(base._last_write)
        return sigs

    async def free(self) -> None:
        """Free the buffer. The memory is released when the work using it completes; this does not
        wait for that. Using the buffer afterwards raises; freeing twice raises.

        Cancellation: a checkpoint at entry (cancelled there: nothing happened); past entry it
        completes without interruption and returns at once.
        """
        await anyio.lowlevel.checkpoint()
        self.free_nowait()

    def free_nowait(self) -> None:
        """Synchronous :meth:`free` (used by cleanup paths that cannot await)."""
        if self._freed:
            raise RuntimeError(f"double free of {self!r}")
        if self._base is not None:
            self._freed = True  # a view owns no memory
            return
        if self._handle is None:
            raise RuntimeError(f"free of {self!r}: it was never allocated")
        handle, self._handle = self._handle, None
        self._freed = True
        pending = self.pending()
        self._reads, self._last_write = [], None
        self.device_obj.allocator.free_nowait(handle, self.nbytes, self.options, after=pending)

    async def __aenter__(self) -> Buffer:
        if not self.is_allocated():
            await self.allocate()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self._freed:
            self.free_nowait()

    # ---- views ----------------------------------------------------------------------------------
    def view(self, size: int, dtype: DType, offset: int = 0) -> Buffer:
        """A buffer of ``size`` elements of ``dtype`` starting ``offset`` bytes into this one,
        sharing its memory. Raises ``ValueError`` if it does not fit."""
        if not isinstance(dtype, DType):
            raise TypeError(f"dtype must be a DType, got {dtype!r}")
        if type(offset) is not int or type(size) is not int:
            raise TypeError("view size and offset must be ints")
        if offset < 0 or size <= 0:
            raise ValueError(f"view size must be positive and offset non-negative, got {size=} {offset=}")
        if offset + size * dtype.itemsize > self.nbytes:
            raise ValueError(
                f"view of {size * dtype.itemsize} bytes at offset {offset} does not fit in "
                f"a buffer of {self.nbytes} bytes"
            )
        if self.freed:
            raise RuntimeError(f"view of freed {self!r}")
        base = self.base
        return Buffer(self.device, size, dtype, base.options, base=base, offset=self.offset + offset)

    # ---- internal: handles and hazards -----------------------------------------------------------
    def handle(self) -> Any:
        """The allocator handle for this buffer (a view's is derived from its base's).

        Raises ``RuntimeError`` if the buffer is not allocated or was freed.
        """
        base = self._base
        if base is None:
            if self._handle is not None:
                return self._handle
        elif self._handle is not None and not self._freed and not base._freed:
            return self._handle
        if self.freed:
            raise RuntimeError(f"use after free: {self!r}")
        if base is None or base._handle is None:
            raise RuntimeError(f"{self!r} is not allocated; await buf.allocate() first")
        self._handle = self.device_obj.allocator._offset(base._handle, self.nbytes, self.offset)
        return self._handle

    def dependencies(self, timeline: Timeline, write: bool) -> list[Signal]:
        """Signals on other timelines that a new access on ``timeline`` must wait for."""
        base = self.base
        deps: list[Signal] = []
        last = base._last_write
        if last is not None and last.timeline is not timeline and last.timeline.completed < last.value:
            deps.append(last)
        if write:
            for read in base._reads:
                if read.timeline is not timeline and read.timeline.completed < read.value:
                    deps.append(read)
        return deps

    def record(self, sig: Signal, write: bool) -> None:
        """Remember that the command of ``sig`` reads or writes this buffer's memory."""
        base = self.base
        if write:
            base._last_write = sig
            base._reads = []
        else:
            reads = base._reads
            if len(reads) >= 16:
                reads[:] = [r for r in reads if not r.done()]
            reads.append(sig)

    # ---- copies -----------------------------------------------------------------------------------
    def _check_host(self, mv: object, writable: bool, what: str) -> memoryview:
        data = host_bytes(mv, writable=writable, what=what)
        if data.nbytes != self.nbytes:
            raise ValueError(f"{what} has {data.nbytes} bytes but {self!r} has {self.nbytes} bytes")
        return data

    async def copyin(self, src: object) -> Buffer:
        """Copy host data (anything with the buffer protocol, exactly ``nbytes`` long) in.

        Ordered after pending work on this memory; runs on the device's copy queue.

        Cancellation: cancels the wait only; the copy completes, reading ``src`` (kept alive).
        """
        data = self._check_host(src, writable=False, what="copyin source")
        handle = self.handle()
        device = self.device_obj
        queue = device._copy_queue
        deps = tuple(self.dependencies(queue.timeline, True))
        sig = queue.submit(device.allocator._copyin, (handle, data), deps, keep=(self, data))
        self.record(sig, True)
        await sig
        return self

    async def copyout(self, dest: object) -> None:
        """Copy the contents into writable host memory of exactly ``nbytes``.

        Ordered after pending writes to this memory; runs on the device's copy queue.

        Cancellation: cancels the wait only; the copy completes and writes into ``dest``.
        """
        data = self._check_host(dest, writable=True, what="copyout destination")
        handle = self.handle()
        device = self.device_obj
        device.allocator.check_copyout()
        queue = device._copy_queue
        deps = tuple(self.dependencies(queue.timeline, False))
        sig = queue.submit(device.allocator._copyout, (data, handle), deps, keep=(self, data))
        self.record(sig, False)
        await sig

    async def as_memoryview(self) -> memoryview:
        """The contents as a memoryview of unsigned bytes, after pending writes complete.

        Zero-copy where the device memory is host memory (CPU): the view aliases the buffer and
        keeps the memory alive even after ``free()``. Elsewhere, a copy.

        Cancellation: cancels the wait; nothing is returned and nothing is changed.
        """
        handle = self.handle()
        device = self.device_obj
        last = self.base._last_write
        if last is not None:
            await last.wait()
        else:
            await anyio.lowlevel.checkpoint()
        view = device.allocator._as_memoryview(handle, self.nbytes)
        if view is not None:
            return view
        out = memoryview(bytearray(self.nbytes))
        await self.copyout(out)
        return out

    async def numpy(self) -> np.ndarray[Any, Any]:
        """A numpy copy of the contents (numpy is imported only here).

        Cancellation: cancels the wait; nothing is returned.
        """
        import numpy as np

        if self.dtype.fmt is None:
            raise TypeError(f"{self.dtype} has no numpy equivalent")
        data = await self.as_memoryview()
        return np.frombuffer(data, dtype=np.dtype(self.dtype.fmt)).copy()

    async def copy_from(self, src: Buffer) -> Buffer:
        """Copy ``src`` (same size in bytes, any device) into this buffer.

        Ordered after pending writes to ``src`` and pending reads and writes of this buffer. Same
        device or host-memory devices (CPU and CPU:N): one copy on this device's copy worker.
        Otherwise through a host staging buffer, copied out by the source device's worker and in
        by this one's, never through the event loop.

        Cancellation: cancels the wait only; the copy completes.
        """
        if not isinstance(src, Buffer):
            raise TypeError(f"copy_from needs a Buffer, got {type(src).__name__}")
        if src.nbytes != self.nbytes:
            raise ValueError(f"copy_from size mismatch: {src.nbytes} bytes into {self.nbytes} bytes")
        await self.device_obj._submit_copy(self, src)
        return self


def buffers_pending(buffers: Sequence[Buffer]) -> list[Signal]:
    """Every pending signal of several buffers."""
    out: list[Signal] = []
    for b in buffers:
        out.extend(b.pending())
    return out
