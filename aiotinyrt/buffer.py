"""Buffer: typed device memory with views, automatic ordering of work on it, and deferred free.

Ordering
--------
A base buffer keeps the access records of the commands that may still use it
(:mod:`aiotinyrt.hazards`); every launch and copy is ordered after the pending ones it
conflicts with.

Free
----
``free()`` marks the buffer unusable at once and hands the memory back when the last command
using it completes (immediately if none is pending). Views of a freed base become unusable too.
"""

from __future__ import annotations

from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel

from aiotinyrt import copies, hazards
from aiotinyrt.allocator import BufferSpec, host_bytes
from aiotinyrt.dtype import DType
from aiotinyrt.registry import Device, DeviceLike
from aiotinyrt.signal import Signal, Timeline

if TYPE_CHECKING:
    import numpy as np


class Buffer:
    """``size`` elements of ``dtype`` on ``device``.

    Create it, then ``await buf.allocate()`` (or ``async with Buffer(...) as buf``). Views
    (``buf.view(size, dtype, offset)``) share the base's memory; ``offset`` is in bytes.
    """

    __slots__ = (
        "_accesses",
        "_base",
        "_dev",
        "_freed",
        "_handle",
        "device",
        "dtype",
        "nbytes",
        "offset",
        "options",
        "size",
    )

    #: A Buffer's accesses are recorded, so its copies order precisely and a capture records
    #: them (see :mod:`aiotinyrt.copies`).
    tracked = True

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
        self.nbytes = size * dtype.itemsize  #: size in bytes
        self._base = base
        self._dev: DeviceLike | None = None
        self._handle: Any = None
        self._freed = False
        # on a base: the accesses that may still be pending (see aiotinyrt.hazards)
        self._accesses: list[hazards.Access] = []

    def __repr__(self) -> str:
        state = "freed" if self.freed else ("allocated" if self.is_allocated() else "unallocated")
        view = f" view of +{self.offset}" if self._base is not None else ""
        return f"<Buffer {self.device} size={self.size} dtype={self.dtype}{view} {state}>"

    @property
    def base(self) -> Buffer:
        """The buffer owning the memory (itself unless this is a view)."""
        return self._base if self._base is not None else self

    @property
    def freed(self) -> bool:
        """True once this buffer (or, for a view, its base) was freed."""
        return self._freed or (self._base is not None and self._base._freed)

    @property
    def device_obj(self) -> DeviceLike:
        """The device instance holding this buffer's memory (opened on first allocation). After
        that device is closed, operations raise ``DeviceError``; the name is never reopened."""
        dev = self.base._dev
        if dev is not None:
            return dev
        return Device[self.device]

    def is_allocated(self) -> bool:
        """True when the memory exists and is usable."""
        if self.freed:
            return False
        return self.base._handle is not None

    # ---- lifetime ------------------------------------------------------------------------------
    async def allocate(self, opaque: Any = None) -> Buffer:
        """Allocate the memory, or adopt ``opaque``: a live allocation of this device's allocator
        (``await dev.allocator.alloc(n)``), at least as large as the buffer, that no other Buffer
        owns; anything else raises ``TypeError``/``ValueError``. The buffer's ``free()`` then
        releases it.

        Returns the buffer itself, so ``buf = await Buffer(...).allocate()`` works.

        Cancellation: a checkpoint at entry; once past it the allocation completes.
        """
        await anyio.lowlevel.checkpoint()
        return self.allocate_nowait(opaque)

    def allocate_nowait(self, opaque: Any = None) -> Buffer:
        """Synchronous :meth:`allocate` (the allocation itself never waits), for code that is
        not async, such as tinygrad's allocator calls."""
        if self._base is not None:
            raise ValueError("a view shares its base's memory; allocate the base buffer instead")
        if self._freed:
            raise RuntimeError(f"{self!r} was freed; create a new Buffer")
        if self._handle is not None:
            raise RuntimeError(f"{self!r} is already allocated")
        device = self.device_obj
        device._check_open()
        alloc = device.allocator
        if opaque is not None:
            self._handle = alloc.adopt(opaque, self.nbytes)
        else:
            self._handle = alloc.alloc_nowait(self.nbytes, self.options)
            alloc._own(self._handle)
        self._dev = device
        return self

    def pending(self) -> list[Signal]:
        """Signals of work still using this buffer's memory (reads and writes not yet done)."""
        return hazards.pending(self.base._accesses)

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
        self._accesses = []
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

    def extent(self) -> int:
        """Bytes a copy of this buffer may touch: its ``nbytes``."""
        return self.nbytes

    def dependencies(self, timeline: Timeline, write: bool) -> list[Signal]:
        """Signals on other timelines that a new access on ``timeline`` must wait for."""
        start = self.offset
        return hazards.dependencies(self.base._accesses, start, start + self.nbytes, timeline, write)

    def _idle(self, write: bool) -> bool:
        """No pending command conflicts with a new access to these bytes (see :func:`hazards.idle`)."""
        return hazards.idle(self.base._accesses, self.offset, self.offset + self.nbytes, write)

    def record(self, sig: Signal, write: bool) -> None:
        """Remember that the command of ``sig`` reads or writes this buffer's bytes."""
        base = self._base
        if base is None:
            if write:  # a whole-buffer write covers every earlier access
                self._accesses = hazards.whole_write(self.nbytes, sig)
                return
            base = self
        start = self.offset
        base._accesses = hazards.recorded(base._accesses, start, start + self.nbytes, sig, write)

    def pending_writes(self) -> list[Signal]:
        """Signals of writes to this buffer's bytes that are not done yet."""
        return hazards.pending_writes(self.base._accesses, self.offset, self.offset + self.nbytes)

    # ---- copies -----------------------------------------------------------------------------------
    def _check_host(self, mv: object, writable: bool, what: str) -> memoryview:
        data = host_bytes(mv, writable=writable, what=what)
        if data.nbytes != self.nbytes:
            raise ValueError(f"{what} has {data.nbytes} bytes but {self!r} has {self.nbytes} bytes")
        return data

    def _inline_refusal(self, data: memoryview, into: bool) -> str | None:
        """Why a copy of ``data`` in (``into``) or out cannot run on the calling thread now, or
        None when it can: at most ``allocator.inline_copy_bytes`` (0 where the device memory is
        not host memory), and no pending command conflicting with it."""
        limit = self.device_obj.allocator.inline_copy_bytes
        if data.nbytes > limit:
            return f"a copy of {data.nbytes} bytes does not run on the calling thread (at most {limit} here)"
        if not self._idle(into):
            return f"pending commands {'use' if into else 'write'} these bytes"
        return None

    def _copy_host(self, handle: Any, data: memoryview, into: bool) -> None:
        """The backend's synchronous copy, on the calling thread (see :meth:`_inline_refusal`)."""
        alloc = self.device_obj.allocator
        if into:
            alloc._copyin(handle, data)
        else:
            alloc._copyout(data, handle)

    async def _copy_inline(self, data: memoryview, into: bool) -> bool:
        """The entry of :meth:`copyin` (``into``) and :meth:`copyout`: their checkpoint, and the
        copy itself when it can run on the calling thread (:meth:`_inline_refusal`); False when
        the caller must queue it.

        Cancellation: the checkpoint; cancelled there, nothing was copied."""
        device = self.device_obj
        if not device._healthy() or self._inline_refusal(data, into) is not None:
            await anyio.lowlevel.checkpoint_if_cancelled()
            return False
        await anyio.lowlevel.checkpoint()
        handle = self.handle()  # freed meanwhile: the use-after-free error, nothing copied
        if not device._healthy() or self._inline_refusal(data, into) is not None:
            return False  # (the checkpoint let others run)
        self._copy_host(handle, data, into)
        return True

    def copyin_nowait(self, src: object) -> None:
        """Copy host data in now, on the calling thread, without waiting and without a checkpoint:
        the inline copy of :meth:`copyin`, for callers that know the memory is idle (e.g. a ring
        of input buffers whose last readers are known to be done) and want no trip through the
        event loop per copy.

        Raises ``anyio.WouldBlock`` (nothing copied) when the copy cannot run now: a pending
        command touches these bytes, it is larger than ``allocator.inline_copy_bytes``, or the
        backend's memory is not host memory (``inline_copy_bytes`` is 0); ``await copyin`` then
        orders it. Raises the device's ``DeviceError`` if it is closed or holds a sticky error,
        and the errors of :meth:`copyin` for bad arguments. Not a coroutine.
        """
        data = self._check_host(src, writable=False, what="copyin source")
        self._copy_now(data, into=True)

    def copyout_nowait(self, dest: object) -> None:
        """Copy the contents into writable host memory now, without waiting and without a
        checkpoint (see :meth:`copyin_nowait`). Raises ``anyio.WouldBlock`` (nothing copied) when
        a pending command writes these bytes or the copy cannot run on the calling thread."""
        data = self._check_host(dest, writable=True, what="copyout destination")
        self.handle()
        self.device_obj.allocator.check_copyout()
        self._copy_now(data, into=False)

    def _copy_now(self, data: memoryview, into: bool) -> None:
        handle = self.handle()  # (unallocated or freed: the error before anything else)
        device = self.device_obj
        if not device._healthy():
            device._check_open()
            raise device._error  # type: ignore[misc]
        refusal = self._inline_refusal(data, into)
        if refusal is not None:
            raise anyio.WouldBlock(f"{self!r}: {refusal}; await copy{'in' if into else 'out'}()")
        self._copy_host(handle, data, into)

    async def copyin(self, src: object) -> Buffer:
        """Copy host data (anything with the buffer protocol, exactly ``nbytes`` long) in.

        Ordered after pending work on this memory; runs on the device's copy queue, or, for at
        most ``allocator.inline_copy_bytes`` into memory no pending command touches, on the
        calling thread after one checkpoint (see docs/architecture.md, Memory).

        Cancellation: a queued copy: cancels the wait only; the copy completes, reading ``src``
        (kept alive). An inline one is cancelled at its checkpoint, before anything is copied.
        """
        data = self._check_host(src, writable=False, what="copyin source")
        self.handle()  # (unallocated or freed: the error before anything else)
        if await self._copy_inline(data, into=True):
            return self
        await self._enqueue_copy(data, into=True)
        return self

    def _enqueue_copy(self, data: memoryview, into: bool) -> Signal:
        """Queue the copy of checked host memory ``data`` in (``into``) or out on the device's
        copy queue, ordered after the pending work it conflicts with; ``data`` is kept alive
        until it ran (:func:`aiotinyrt.copies.submit_copy`)."""
        if into:
            return copies.submit_copy(self, data, data.nbytes)
        return copies.submit_copy(data, self, data.nbytes)

    async def copyout(self, dest: object) -> None:
        """Copy the contents into writable host memory of exactly ``nbytes``.

        Ordered after pending writes to this memory; runs on the device's copy queue, or inline
        for small copies of memory nothing pending writes (as :meth:`copyin`).

        Cancellation: a queued copy: cancels the wait only; the copy completes and writes into
        ``dest``. An inline one is cancelled at its checkpoint, before anything is copied.
        """
        data = self._check_host(dest, writable=True, what="copyout destination")
        self.handle()  # (unallocated or freed: the error before anything else)
        self.device_obj.allocator.check_copyout()
        if await self._copy_inline(data, into=False):
            return
        await self._enqueue_copy(data, into=False)

    async def as_memoryview(self) -> memoryview:
        """The contents as a memoryview of unsigned bytes, after pending writes complete.

        Zero-copy where the device memory is host memory (CPU): the view aliases the buffer and
        keeps the memory alive even after ``free()``; it is a window, not a snapshot, so work
        submitted later that writes the buffer changes what it shows. Elsewhere, a copy. Use
        :meth:`numpy` or :meth:`copyout` for a snapshot ordered like any other read.

        Cancellation: cancels the wait; nothing is returned and nothing is changed.
        """
        handle = self.handle()
        device = self.device_obj
        device._check_open()
        writes = self.pending_writes()
        if writes:
            for sig in writes:
                await sig.wait()
        else:
            await anyio.lowlevel.checkpoint()
        view = device.allocator._as_memoryview(handle, self.nbytes)
        if view is not None:
            return view
        out = memoryview(bytearray(self.nbytes))
        await self.copyout(out)
        return out

    async def numpy(self) -> np.ndarray[Any, Any]:
        """A numpy copy of the contents (numpy is imported only here), read on the copy queue in
        order with the work submitted before the call.

        Cancellation: cancels the wait; the copy still completes, into an array nobody sees.
        """
        import numpy as np

        if self.dtype.fmt is None:
            raise TypeError(f"{self.dtype} has no numpy equivalent")
        out = np.empty(self.size, dtype=np.dtype(self.dtype.fmt))
        await self.copyout(out)  # a read, ordered like any other
        return out

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
        await _submit_copy(self, src)
        return self


async def _submit_copy(dest: Buffer, src: Buffer) -> None:
    """Copy ``src`` into ``dest`` on ``dest``'s copy queue and wait for it (``Buffer.copy_from``)."""
    await anyio.lowlevel.checkpoint_if_cancelled()
    sig = copies.submit_copy(dest, src, dest.nbytes)
    if sig is None:  # recorded into a capture
        await anyio.lowlevel.checkpoint()
    else:
        await sig


def enqueue_copy(dest: Buffer, src: Buffer) -> Signal | None:
    """Enqueue the copy of ``src`` into ``dest`` on ``dest``'s copy queue, ordered by the hazard
    rules, without waiting (for synchronous callers: tinygrad's transfers); its Signal, or None
    when a capture recorded it (:func:`aiotinyrt.copies.submit_copy`). Raises ``ValueError``
    for buffers of different sizes, before anything is enqueued."""
    if src.nbytes != dest.nbytes:
        raise ValueError(f"enqueue_copy size mismatch: {src.nbytes} bytes into {dest.nbytes} bytes")
    return copies.submit_copy(dest, src, dest.nbytes)
