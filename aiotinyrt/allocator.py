"""Device memory: the Allocator base class, the LRU cache, BufferSpec and statistics.

Backends implement the synchronous hooks ``_alloc``, ``_free``, ``_copyin``, ``_copyout`` and
optionally ``_transfer``, ``_offset`` and ``_as_memoryview``. The public coroutines here own
validation, checkpoints, accounting and error translation; their copies are submitted by
:func:`aiotinyrt.copies.submit_copy`, as every copy is. Copies run on the device's worker
threads, never on the event loop.

Raw allocator copies are ordered after everything already submitted to the device (a full
barrier, :class:`aiotinyrt.copies.Raw`): code working at this level does not have buffer-level
hazard tracking, so the safe order is the submission order. :class:`~aiotinyrt.buffer.Buffer`
tracks hazards precisely.
"""

from __future__ import annotations

import functools
import re
import threading
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import anyio.lowlevel

from aiotinyrt import copies, recorder
from aiotinyrt.helpers import debug_level, format_bytes, get_logger, getenv
from aiotinyrt.lifetime import keep_forever
from aiotinyrt.queue import Queue
from aiotinyrt.signal import Signal, abandoned, when_all_done

T = TypeVar("T")
_log = get_logger("allocator")


class AllocatorOwner(Protocol):
    """What an allocator needs of its device (implemented by ``AllocatorOwner``)."""

    name: str
    _copy_queue: Queue

    @property
    def closed(self) -> bool: ...
    @property
    def allocator(self) -> Allocator[Any]: ...
    def _check_open(self) -> None: ...
    def _barrier(self) -> tuple[Signal, ...]: ...


@dataclass(frozen=True)
class BufferSpec:
    """How a buffer's memory should be allocated (as tinygrad's ``BufferSpec``).

    ``uncached``/``cpu_access``/``host`` are hints a backend may honour; ``nolru`` bypasses the
    LRU cache; ``zero`` asks for zero-filled memory (never served from the cache);
    ``external_ptr`` wraps memory the caller owns (never cached, never released by us).
    """

    uncached: bool = False
    cpu_access: bool = False
    host: bool = False
    nolru: bool = False
    zero: bool = False
    external_ptr: int | None = None

    def __post_init__(self) -> None:
        for name in ("uncached", "cpu_access", "host", "nolru", "zero"):
            value = getattr(self, name)
            if type(value) is not bool:
                raise TypeError(f"BufferSpec.{name} must be a bool, got {value!r}")
        ptr = self.external_ptr
        if ptr is not None and (type(ptr) is not int or ptr <= 0):
            raise ValueError(f"BufferSpec.external_ptr must be a positive int address, got {ptr!r}")

    @property
    def cacheable(self) -> bool:
        """Whether memory with this spec may go through the LRU cache."""
        return not (self.nolru or self.zero or self.external_ptr is not None)


@dataclass(frozen=True)
class AllocatorStatistics:
    """A snapshot of an allocator's accounting.

    ``bytes_in_use``: allocated and not yet released (memory freed while work was pending counts
    until that work completes); ``bytes_cached``: released into the LRU cache, ready for reuse;
    ``hits``/``misses``: allocations served from the cache or by the backend;
    ``allocations``: live allocations.
    """

    device: str
    bytes_in_use: int
    bytes_cached: int
    peak_bytes_in_use: int
    hits: int
    misses: int
    allocations: int


def _check_nbytes(device: str, nbytes: object) -> int:
    if type(nbytes) is not int:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int):
            raise TypeError(f"{device}: size must be an int number of bytes, got {nbytes!r}")
        nbytes = int(nbytes)
    if nbytes <= 0:
        raise ValueError(f"{device}: size must be positive, got {nbytes} bytes")
    return nbytes


def _check_spec(options: object) -> BufferSpec:
    if options is None:
        return _DEFAULT_SPEC
    if not isinstance(options, BufferSpec):
        raise TypeError(f"options must be a BufferSpec or None, got {type(options).__name__}")
    return options


def host_bytes(mv: object, *, writable: bool, what: str) -> memoryview:
    """Validate a host buffer argument and return it as a flat unsigned-byte memoryview.

    The result is always a view of its own (never the caller's memoryview object): a queued copy
    keeps it, so the caller's memory stays exported, and cannot be freed or resized, until the
    copy ran, even if the caller releases its own view (``with memoryview(b) as mv:``) or
    stops waiting. Memory holding object references (numpy object arrays, struct formats with
    ``O``) is refused: bytes copied in or out of it would be dangling pointers."""
    try:
        view = memoryview(mv)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must support the buffer protocol, got {type(mv).__name__}") from None
    except ValueError as exc:  # a released memoryview
        raise ValueError(f"{what}: {exc}") from None
    if _holds_references(view.format):
        raise TypeError(
            f"{what} holds Python object references (buffer format {view.format!r}); copies take "
            "plain data only (numpy: a numeric dtype, not object)"
        )
    if writable and view.readonly:
        raise ValueError(f"{what} is read-only; copyout needs a writable buffer")
    if not view.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _holds_references(fmt: str) -> bool:
    """Whether a struct-module buffer format has an ``O`` (object reference) item; field names
    (``:name:`` in ``T{...}`` formats) are not items."""
    if "O" not in fmt:
        return False
    return "O" in re.sub(r":[^:]*:", "", fmt)


_DEFAULT_SPEC = BufferSpec()


def _same(obj: T) -> T:
    return obj


class Allocator(Generic[T]):
    """Device memory. Public coroutines validate and account; backends implement the hooks.

    ``limit`` (bytes, or None) caps the memory in use; an allocation past it raises
    ``MemoryError`` as the device running out would.
    """

    #: Whether ``_copyout`` can produce data (False on NULL).
    supports_copyout: bool = True
    #: Host copies up to this many bytes (``Buffer.copyin``/``copyout``) run on the calling
    #: thread, through ``_copyin``/``_copyout``, when no pending command touches the memory: a
    #: memcpy of a few microseconds instead of a queue round trip (a submission, a worker wake-up
    #: and a wake-up of the loop, 50-100 us of the loop's CPU on a 2-core machine). 0: always
    #: queued. Only for backends whose device memory is host memory, so the hooks never block.
    inline_copy_bytes: int = 0
    #: The class of this allocator's handles, where there is one (checks adopted handles).
    handle_type: type | None = None

    def __init__(self, device: AllocatorOwner) -> None:
        self.device = device
        self.limit: int | None = None
        # re-entrant: a backend hook may run (e.g. a host view's destructor, in a collection)
        # while this thread holds it
        self._lock = threading.RLock()
        self._in_use = 0
        #: (time, bytes in use) at every allocation and free while profiling (see aiotinyrt.recorder)
        self.memory_trace: list[tuple[float, int]] | None = [] if recorder.start() else None
        self._peak = 0
        self._live = 0
        self._hits = 0
        self._misses = 0
        # the handles handed out and not freed, by id: (a weak reference to the handle, its bytes
        # and spec; an entry goes when the handle dies unfreed); the ids of those a Buffer owns
        self._outstanding: dict[int, tuple[Callable[[], T | None], int, BufferSpec]] = {}
        self._owned: set[int] = set()

    # ---- hooks ---------------------------------------------------------------------------------
    def _alloc(self, nbytes: int, options: BufferSpec) -> T:
        raise NotImplementedError

    def _free(self, opaque: T, nbytes: int, options: BufferSpec) -> None:
        raise NotImplementedError

    def _copyin(self, dest: T, src: memoryview) -> None:
        raise NotImplementedError

    def _copyout(self, dest: memoryview, src: T) -> None:
        raise NotImplementedError

    def _transfer(self, dest: T, src: Any, nbytes: int, src_device: AllocatorOwner) -> None:
        """Copy ``nbytes`` from another device's memory. Only called when
        :meth:`_can_transfer_from` says this backend can."""
        raise NotImplementedError

    def _can_transfer_from(self, src_device: AllocatorOwner) -> bool:
        return False

    def direct_from(self, src_device: AllocatorOwner) -> bool:
        """Whether a copy from ``src_device``'s memory into this device's is one ``_transfer``
        (the backend has one, and it reads that device's memory); else it is staged through
        host memory (the source's copy worker copies out, this one's copies in)."""
        if type(self)._transfer is Allocator._transfer:
            return False
        return src_device is self.device or self._can_transfer_from(src_device)

    # Native variants (see aiotinyrt.native): the same copy as one C call the queue's worker makes
    # without the GIL, as ``(fn, nargs, block, keep)`` like ``Program._native_call``; None where
    # the backend has none (the Python hook above runs instead). Sizes are checked by the caller.
    def _native_copyin(self, dest: T, src: memoryview) -> tuple[int, int, int, object] | None:
        return None

    def _native_copyout(self, dest: memoryview, src: T) -> tuple[int, int, int, object] | None:
        return None

    def _native_transfer(self, dest: T, src: Any, nbytes: int) -> tuple[int, int, int, object] | None:
        """Only asked when :meth:`_can_transfer_from` holds for the source's device."""
        return None

    def _offset(self, opaque: T, nbytes: int, offset: int) -> T:
        """A handle to ``nbytes`` at ``offset`` inside ``opaque`` (views and sub-buffers)."""
        raise NotImplementedError(f"{self.device.name} does not support buffer views")

    def _as_memoryview(self, opaque: T, nbytes: int) -> memoryview | None:
        """A zero-copy host view of the memory, or None when the backend has none."""
        return None

    def _size_of(self, opaque: T) -> int | None:
        """Bytes behind a handle, where the backend knows (lets raw copies be checked up front)."""
        return getattr(opaque, "nbytes", None)

    def _wait_released(self) -> None:
        """Block until memory freed so far is back with the system (backends that release it on
        a worker thread)."""

    def _reusable(self, opaque: T) -> bool:
        """False while something outside the runtime (a host view) still uses the memory."""
        return True

    # ---- public API --------------------------------------------------------------------------
    async def alloc(self, nbytes: int, options: BufferSpec | None = None) -> T:
        """Allocate ``nbytes`` of device memory and return the backend's handle.

        Raises ``ValueError`` for a size <= 0, ``MemoryError`` (naming the device, the size and
        the memory in use) when out of memory after one retry with the cache freed.

        Cancellation: a checkpoint at entry; once past it the allocation completes.
        """
        await anyio.lowlevel.checkpoint()
        return self.alloc_nowait(nbytes, options)

    def alloc_nowait(self, nbytes: int, options: BufferSpec | None = None) -> T:
        """Synchronous allocation (the body of :meth:`alloc`, for code that is not async)."""
        nbytes = _check_nbytes(self.device.name, nbytes)
        spec = _check_spec(options)
        self.device._check_open()
        with self._lock:
            opaque = self._take_cached(nbytes, spec)
            if opaque is not None:
                self._account_alloc(opaque, nbytes, spec, hit=True)
                return opaque
        try:
            opaque = self._alloc_checked(nbytes, spec)
        except MemoryError:
            self.free_cache()
            try:
                opaque = self._alloc_checked(nbytes, spec)
            except MemoryError:  # the cache's memory may still be on its way back to the system
                self._wait_released()
                opaque = self._alloc_checked(nbytes, spec)
        with self._lock:
            self._account_alloc(opaque, nbytes, spec, hit=False)
        if debug_level() >= 7:
            _log.debug("%s: alloc %s (%d in use)", self.device.name, format_bytes(nbytes), self._in_use)
        return opaque

    def _alloc_checked(self, nbytes: int, spec: BufferSpec) -> T:
        limit = self.limit
        if limit is not None and self._in_use + nbytes > limit:
            raise self._oom(nbytes, f"over the limit of {format_bytes(limit)}")
        try:
            return self._alloc(nbytes, spec)
        except (MemoryError, OSError) as exc:
            raise self._oom(nbytes, str(exc) or type(exc).__name__) from exc

    def _oom(self, nbytes: int, why: str) -> MemoryError:
        return MemoryError(
            f"{self.device.name}: out of memory allocating {nbytes} bytes ({format_bytes(nbytes)}); "
            f"{self._in_use} bytes in use ({format_bytes(self._in_use)}): {why}"
        )

    def _account_alloc(self, opaque: T, nbytes: int, spec: BufferSpec, *, hit: bool) -> None:
        key = id(opaque)
        ref: Callable[[], T | None]
        try:
            ref = weakref.ref(opaque, lambda _: self._handle_died(key))
        except TypeError:  # a handle type without weak references: held until freed
            ref = functools.partial(_same, opaque)
        self._outstanding[key] = (ref, nbytes, spec)
        self._in_use += nbytes
        self._live += 1
        self._peak = max(self._peak, self._in_use)
        if self.memory_trace is not None:
            self.memory_trace.append((recorder.now(), self._in_use))
        if hit:
            self._hits += 1
        else:
            self._misses += 1

    def _take_cached(self, nbytes: int, spec: BufferSpec) -> T | None:
        return None

    async def free(
        self, opaque: T, nbytes: int, options: BufferSpec | None = None, *, after: Sequence[Signal] = ()
    ) -> None:
        """Release memory, once every signal in ``after`` (work still using it) is done.

        Returns without waiting for that work: the memory is released (or cached) when it
        completes, and counts as in use until then.

        Cancellation: a checkpoint at entry (cancelled there, nothing happened); past entry the
        free always completes.
        """
        await anyio.lowlevel.checkpoint()
        self.free_nowait(opaque, nbytes, options, after=after)

    def free_nowait(
        self, opaque: T, nbytes: int, options: BufferSpec | None = None, *, after: Sequence[Signal] = ()
    ) -> None:
        """Synchronous :meth:`free` (deferred the same way). Memory that a command abandoned at
        close may still use is never released (see :mod:`aiotinyrt.lifetime`)."""
        nbytes = _check_nbytes(self.device.name, nbytes)
        spec = _check_spec(options)
        with self._lock:  # each allocation is released once, with its own size
            entry = self._outstanding.get(id(opaque))
            if entry is None or entry[0]() is not opaque:
                raise ValueError(
                    f"{self.device.name}: free of {opaque!r}, which is not a live allocation of this "
                    "allocator (freed already, a view, or another allocator's)"
                )
            if nbytes > entry[1]:
                raise ValueError(f"{self.device.name}: free of {nbytes} bytes, but {opaque!r} has {entry[1]}")
            _, nbytes, spec = entry  # (an adopted handle may be larger than its Buffer)
            del self._outstanding[id(opaque)]
            self._owned.discard(id(opaque))
        if not after:
            self._release(opaque, nbytes, spec)
            return
        after = tuple(after)

        def release() -> None:
            if abandoned(after):  # (checked when the last one completes: abandonment completes it)
                keep_forever(opaque)  # still counted in use: it is
                return
            self._release(opaque, nbytes, spec)

        when_all_done(after, release)

    def adopt(self, opaque: object, nbytes: int) -> T:
        """Make ``opaque`` the memory of a Buffer of ``nbytes``: it must be a live allocation of
        this allocator of at least ``nbytes``, not owned by another Buffer. Raises ``TypeError``
        or ``ValueError`` otherwise (nothing changes)."""
        handle_type = self.handle_type
        if handle_type is not None and not isinstance(opaque, handle_type):
            raise TypeError(
                f"{self.device.name}: allocate(opaque=...) needs a {handle_type.__name__} from this "
                f"device's allocator, got {type(opaque).__name__}"
            )
        with self._lock:
            entry = self._outstanding.get(id(opaque))
            handle = None if entry is None else entry[0]()
            if entry is None or handle is None or handle is not opaque:
                raise ValueError(
                    f"{self.device.name}: allocate(opaque=...): {opaque!r} is not a live allocation of "
                    "this device's allocator (freed, a view, or another device's)"
                )
            if entry[1] < nbytes:
                raise ValueError(
                    f"{self.device.name}: allocate(opaque=...): the allocation has {entry[1]} bytes, "
                    f"the buffer needs {nbytes}"
                )
            if id(opaque) in self._owned:
                raise ValueError(
                    f"{self.device.name}: allocate(opaque=...): {opaque!r} is another Buffer's memory"
                )
            self._owned.add(id(opaque))
        return handle

    def _handle_died(self, key: int) -> None:
        """A handle was dropped without being freed (any thread; may run inside a section holding
        ``_lock``, so it takes none: single dict operations are atomic)."""
        entry = self._outstanding.get(key)
        if entry is not None and entry[0]() is None:
            self._outstanding.pop(key, None)
            self._owned.discard(key)

    def _own(self, opaque: T) -> None:
        """Mark a fresh allocation as a Buffer's (so no other Buffer adopts it)."""
        self._owned.add(id(opaque))

    def _release(self, opaque: T, nbytes: int, spec: BufferSpec) -> None:
        """Return memory to the cache or the backend. May run in a worker thread."""
        with self._lock:
            self._in_use -= nbytes
            self._live -= 1
            cached = self._put_cached(opaque, nbytes, spec)
            if self.memory_trace is not None:
                self.memory_trace.append((recorder.now(), self._in_use))
        if debug_level() >= 7:
            how = "to the cache" if cached else "to the backend"
            name, size = self.device.name, format_bytes(nbytes)
            _log.debug("%s: free %s %s (%d in use)", name, size, how, self._in_use)
        if not cached:
            self._free(opaque, nbytes, spec)

    def _put_cached(self, opaque: T, nbytes: int, spec: BufferSpec) -> bool:
        return False

    def free_cache(self) -> None:
        """Release every cached allocation back to the backend (no-op without a cache)."""

    def statistics(self) -> AllocatorStatistics:
        """A frozen snapshot of this allocator's accounting."""
        with self._lock:
            return AllocatorStatistics(
                device=self.device.name,
                bytes_in_use=self._in_use,
                bytes_cached=self._cached_bytes(),
                peak_bytes_in_use=self._peak,
                hits=self._hits,
                misses=self._misses,
                allocations=self._live,
            )

    def _cached_bytes(self) -> int:
        return 0

    # ---- copies ----------------------------------------------------------------------------------
    async def copyin(self, dest: T, src: memoryview) -> None:
        """Copy host memory ``src`` into device memory ``dest`` (``len(src)`` bytes).

        Runs on the device's copy queue after everything already submitted to the device.

        Cancellation: cancels the wait only; the copy still completes, reading ``src``, which is
        kept alive until it has.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        mv = host_bytes(src, writable=False, what="copyin source")
        self._check_copy_size(dest, mv.nbytes, "copyin")
        await copies.submit_copy(copies.Raw(self.device, dest), mv, mv.nbytes)

    async def copyout(self, dest: memoryview, src: T) -> None:
        """Copy device memory ``src`` into host memory ``dest`` (``len(dest)`` bytes).

        Runs on the device's copy queue after everything already submitted to the device.

        Cancellation: cancels the wait only; the copy still completes and writes into ``dest``.
        """
        await anyio.lowlevel.checkpoint_if_cancelled()
        mv = host_bytes(dest, writable=True, what="copyout destination")
        self.check_copyout()
        self._check_copy_size(src, mv.nbytes, "copyout")
        await copies.submit_copy(mv, copies.Raw(self.device, src), mv.nbytes)

    def _check_copy_size(self, opaque: T, nbytes: int, what: str) -> None:
        if nbytes == 0:
            raise ValueError(f"{self.device.name}: {what} of 0 bytes")
        size = self._size_of(opaque)
        if size is not None and nbytes > size:
            raise ValueError(
                f"{self.device.name}: {what} of {nbytes} bytes, but the allocation has {size} bytes"
            )

    def check_copyout(self) -> None:
        """Raise before enqueueing if this device cannot copy out."""
        if not self.supports_copyout:
            raise RuntimeError(
                f"{self.device.name} holds no data to copy out (set NULL_ALLOW_COPYOUT=1 to read zeros)"
            )

    async def transfer(self, dest: T, src: Any, nbytes: int, src_device: AllocatorOwner) -> None:
        """Copy ``nbytes`` from ``src`` (memory of ``src_device``) into ``dest`` on this device.

        Direct when the backend can (CPU to CPU:N: one memcpy on this device's copy worker);
        otherwise through a host staging buffer, still without passing through the event loop:
        the copy out of ``src`` waits for everything submitted to ``src_device``, the copy into
        ``dest`` for that and for everything submitted to this device.

        Cancellation: cancels the wait only; the transfer completes.
        """
        nbytes = _check_nbytes(self.device.name, nbytes)
        self._check_copy_size(dest, nbytes, "transfer")
        src_device.allocator._check_copy_size(src, nbytes, "transfer")
        await anyio.lowlevel.checkpoint_if_cancelled()
        sig = copies.submit_copy(copies.Raw(self.device, dest), copies.Raw(src_device, src), nbytes)
        assert sig is not None  # (raw memory is never recorded into a capture)
        await sig


class LRUAllocator(Allocator[T]):
    """An allocator that keeps freed memory for reuse: a dict ``(nbytes, spec) -> [handles]``,
    most recently freed reused first. ``LRU=0`` disables it; ``nolru``, ``zero`` and
    ``external_ptr`` bypass it. On out-of-memory the cache is emptied and the allocation retried
    once."""

    def __init__(self, device: AllocatorOwner) -> None:
        super().__init__(device)
        self._cache: defaultdict[tuple[int, BufferSpec], list[T]] = defaultdict(list)
        self._cached = 0
        self.enabled = getenv("LRU", 1) != 0

    def _take_cached(self, nbytes: int, spec: BufferSpec) -> T | None:
        if not spec.cacheable:
            return None
        entries = self._cache.get((nbytes, spec))
        if not entries:
            return None
        self._cached -= nbytes
        return entries.pop()

    def _put_cached(self, opaque: T, nbytes: int, spec: BufferSpec) -> bool:
        if not (self.enabled and spec.cacheable and not self.device.closed and self._reusable(opaque)):
            return False
        self._cache[(nbytes, spec)].append(opaque)
        self._cached += nbytes
        return True

    def _cached_bytes(self) -> int:
        return self._cached

    def free_cache(self) -> None:
        with self._lock:
            entries = [(key, op) for key, ops in self._cache.items() for op in ops]
            self._cache.clear()
            self._cached = 0
        for (nbytes, spec), opaque in entries:
            self._free(opaque, nbytes, spec)
