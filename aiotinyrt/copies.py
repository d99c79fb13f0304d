"""The copy submission: every queued copy and transfer passes :func:`submit_copy`.

``Buffer.copyin``/``copyout``/``copy_from``, the allocator's raw copies
(``dev.allocator.copyin(handle, ...)``, ``copyout``, ``transfer``) and tinygrad's copies and
transfers all end here. It checks that a transfer's devices are open and that the source can
be copied out (a copy to a closed device is refused by its queue), orders
the copy after the pending work its ends conflict with (each end says which: a
:class:`~aiotinyrt.buffer.Buffer` through its access records, :mod:`aiotinyrt.hazards`; raw
memory, :class:`Raw`, after everything submitted to its device), picks the form (the allocator's
native command where the queue runs them, else its Python hook; one direct ``_transfer``, or two
copies staged through host memory), submits to the copy queue, and records the new access.
While a task captures a graph, a transfer between Buffers is recorded into it instead.

Copies of at most ``Allocator.inline_copy_bytes`` between idle device memory and host memory run
on the calling thread (``Buffer.copyin``/``copyout``, ``copyin_nowait``/``copyout_nowait``): they
submit nothing and do not come here.
"""

from __future__ import annotations

from typing import Any, Protocol, overload

from aiotinyrt.queue import Queue, capturing
from aiotinyrt.signal import Signal, Timeline

_NativeCall = tuple[int, int, int, object]


class CopyAllocator(Protocol):
    """The allocator hooks a copy calls (implemented by ``Allocator``)."""

    def _copyin(self, dest: Any, src: memoryview) -> None: ...
    def _copyout(self, dest: memoryview, src: Any) -> None: ...
    def _transfer(self, dest: Any, src: Any, nbytes: int, src_device: Any) -> None: ...
    def _native_copyin(self, dest: Any, src: memoryview) -> _NativeCall | None: ...
    def _native_copyout(self, dest: memoryview, src: Any) -> _NativeCall | None: ...
    def _native_transfer(self, dest: Any, src: Any, nbytes: int) -> _NativeCall | None: ...
    def direct_from(self, src_device: Any) -> bool: ...
    def check_copyout(self) -> None: ...
    def _size_of(self, opaque: Any) -> int | None: ...


class CopyDevice(Protocol):
    """What a copy needs of a device (implemented by ``Compiled``)."""

    _copy_queue: Queue

    @property
    def allocator(self) -> CopyAllocator: ...
    def _check_open(self) -> None: ...
    def _barrier(self) -> tuple[Signal, ...]: ...


class Memory(Protocol):
    """Device memory at one end of a copy, and how work on it is ordered."""

    #: True for Buffers: a capture records copies between them.
    tracked: bool

    @property
    def device_obj(self) -> CopyDevice: ...
    def handle(self) -> Any: ...
    def extent(self) -> int | None:
        """Bytes a copy may touch (None: the allocator cannot tell)."""
        ...

    def dependencies(self, timeline: Timeline, write: bool) -> list[Signal]: ...
    def record(self, sig: Signal, write: bool) -> None: ...


class Raw:
    """Memory known by its allocator handle alone (the allocator's own copies): it has no access
    records, so a copy of it is ordered after everything already submitted to its device."""

    __slots__ = ("_handle", "device_obj")

    tracked = False

    def __init__(self, device: CopyDevice, handle: Any) -> None:
        self.device_obj = device
        self._handle = handle

    def handle(self) -> Any:
        """The allocator handle."""
        return self._handle

    def extent(self) -> int | None:
        """The allocation's size where the allocator knows it."""
        size: int | None = self.device_obj.allocator._size_of(self._handle)
        return size

    def dependencies(self, timeline: Timeline, write: bool) -> list[Signal]:
        """The last command of every queue of the device, where not done yet."""
        return list(self.device_obj._barrier())

    def record(self, sig: Signal, write: bool) -> None:
        """Nothing to record: later raw copies wait for the whole device anyway."""


@overload
def submit_copy(dest: Memory, src: memoryview, nbytes: int) -> Signal: ...
@overload
def submit_copy(dest: memoryview, src: Memory, nbytes: int) -> Signal: ...
@overload
def submit_copy(dest: Memory, src: Memory, nbytes: int) -> Signal | None: ...
def submit_copy(dest: Memory | memoryview, src: Memory | memoryview, nbytes: int) -> Signal | None:
    """Queue the copy of ``nbytes`` from ``src`` into ``dest`` on the copy queue of the device
    that receives device memory (``dest``'s, or ``src``'s for a copy out to host memory), ordered
    after the pending work it conflicts with, and return its Signal (None when a capture
    recorded it). Host memory is a flat byte memoryview already checked by
    :func:`~aiotinyrt.allocator.host_bytes`; the queue keeps it alive until the copy ran. Raises
    ``DeviceError`` (a device closed), ``RuntimeError`` (the source cannot be copied out),
    ``ValueError`` (``nbytes`` is not the host memory's size, or more than either end holds) or
    the ends' own errors (``handle()`` of freed memory) before anything is submitted."""
    for end in (dest, src):
        size = end.nbytes if isinstance(end, memoryview) else end.extent()
        if size is not None and (nbytes > size or (isinstance(end, memoryview) and nbytes != size)):
            raise ValueError(f"a copy of {nbytes} bytes does not fit an end of {size} bytes")
    if isinstance(src, memoryview):
        assert not isinstance(dest, memoryview)
        return _host_copy(dest, src, True, ())
    if isinstance(dest, memoryview):
        return _host_copy(src, dest, False, ())
    return _transfer(dest, src, nbytes)


def _host_copy(mem: Memory, data: memoryview, into: bool, after: tuple[Signal, ...]) -> Signal:
    """``data`` into ``mem`` (``into``) or ``mem`` into ``data``, after ``after`` too."""
    device = mem.device_obj
    handle = mem.handle()
    alloc = device.allocator
    queue = device._copy_queue
    deps = (*after, *mem.dependencies(queue.timeline, into))
    if into:
        call = alloc._native_copyin(handle, data) if queue.native else None
        sig = queue.submit_either(call, alloc._copyin, (handle, data), deps, (mem, data))
    else:
        alloc.check_copyout()
        call = alloc._native_copyout(data, handle) if queue.native else None
        sig = queue.submit_either(call, alloc._copyout, (data, handle), deps, (mem, data))
    mem.record(sig, into)
    return sig


def _transfer(dest: Memory, src: Memory, nbytes: int) -> Signal | None:
    """Device memory to device memory: one ``_transfer`` on ``dest``'s copy queue where its
    allocator reads ``src``'s memory, else staged through host memory (``src``'s copy queue
    copies out, ``dest``'s copies in)."""
    device, src_dev = dest.device_obj, src.device_obj
    device._check_open()
    src_dev._check_open()  # a closed device's memory is read by no copy, whatever the path
    dst_handle, src_handle = dest.handle(), src.handle()
    queue = device._copy_queue
    alloc = device.allocator
    graph = capturing.get() if dest.tracked and src.tracked else None
    if not alloc.direct_from(src_dev):
        src_dev.allocator.check_copyout()
        staging = memoryview(bytearray(nbytes))
        if graph is None:
            out_sig = _host_copy(src, staging, False, ())
            return _host_copy(dest, staging, True, (out_sig,))
        out_args = (staging, src_handle)
        graph._record(src_dev._copy_queue, src_dev.allocator._copyout, out_args, (src,), [False])
        graph._record(queue, alloc._copyin, (dst_handle, staging), (dest,), [True])
        return None
    args = (dst_handle, src_handle, nbytes, src_dev)
    if graph is not None:
        graph._record(queue, alloc._transfer, args, (dest, src), [True, False])
        return None
    deps = (*src.dependencies(queue.timeline, False), *dest.dependencies(queue.timeline, True))
    call = alloc._native_transfer(dst_handle, src_handle, nbytes) if queue.native else None
    sig = queue.submit_either(call, alloc._transfer, args, deps, (dest, src))
    src.record(sig, False)
    dest.record(sig, True)
    return sig
