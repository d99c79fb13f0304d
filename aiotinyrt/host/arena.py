"""Executable arenas: many loaded objects per mapping, memory returned when an object goes.

An :class:`Arena` is one anonymous mapping in two parts: a *code* part (read + execute) and a
*data* part (read + write). Code is never writable and executable at once: a load makes its own
pages read + write, copies the relocated bytes in, and makes them read + execute again (then
flushes the instruction cache on AArch64). Code blocks are whole pages, so no other object's
code is ever made non-executable while a worker may be running it; data blocks share pages
(their protection never changes). Freed pages stay read + execute, so the kernel merges each
part back into one mapping: an arena costs two entries of ``/proc/self/maps`` however many
objects it holds, and an arena left empty is unmapped (one is kept for the next load).

Both parts lie in one mapping a few MiB long, so code reaches its data, GOT and stubs with
32-bit PC-relative offsets. An object larger than an arena gets an arena of its own.
"""

from __future__ import annotations

import bisect
import mmap
import platform
import threading
from dataclasses import dataclass
from typing import Any

import cffi

from aiotinyrt.compiler import CompileError

_ffi = cffi.FFI()
_ffi.cdef(
    """
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset);
    int mprotect(void *addr, size_t len, int prot);
    int munmap(void *addr, size_t length);
    void *dlopen(const char *filename, int flags);
    void *dlsym(void *handle, const char *symbol);
    """
)
_libc: Any = _ffi.dlopen(None)
try:
    _libc.dlopen  # noqa: B018 - glibc >= 2.34 exports dlopen from libc itself
except AttributeError:
    _libc = _ffi.dlopen("libdl.so.2")
_mm: Any = _ffi.dlopen(None)  # mmap, mprotect, munmap: always in libc

PAGE = mmap.PAGESIZE
#: Bytes of code (and of data) one arena holds: 8 MiB of code is ~2,000 typical kernels.
CODE_BYTES = 8 << 20
DATA_BYTES = 1 << 20
_RX = mmap.PROT_READ | mmap.PROT_EXEC
_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FAILED = 0xFFFF_FFFF_FFFF_FFFF
_AARCH64 = platform.machine().lower() in ("aarch64", "arm64")
_RTLD_NOW, _RTLD_GLOBAL = 2, 0x100

# ---- symbols of the process ----------------------------------------------------------------------

_LIBRARIES = ("libm.so.6", "libgcc_s.so.1")  # libm's functions; libgcc's helpers (__divti3, ...)
_handles: list[Any] = []
_symbols: dict[str, int | None] = {}
_symbols_lock = threading.Lock()


def _library_handles() -> list[Any]:
    if not _handles:
        found = [_libc.dlopen(name.encode(), _RTLD_NOW) for name in _LIBRARIES]
        _handles.extend(h for h in found if h != _ffi.NULL)
        _handles.append(_ffi.NULL)  # RTLD_DEFAULT: everything else the process has (libc)
    return _handles


def process_symbol(name: str) -> int | None:
    """The address of ``name`` in libm, libgcc_s or anything else loaded in the process."""
    try:
        return _symbols[name]
    except KeyError:
        pass
    with _symbols_lock:
        addr = None
        for handle in _library_handles():
            found = _libc.dlsym(handle, name.encode())
            if found != _ffi.NULL:
                addr = int(_ffi.cast("uintptr_t", found))
                break
        _symbols[name] = addr
        return addr


_clear_cache: Any = None


def _flush_icache(start: int, size: int) -> None:
    """Make freshly written code visible to instruction fetch (AArch64 has no coherent icache)."""
    global _clear_cache
    if _clear_cache is None:
        addr = process_symbol("__clear_cache")
        if addr is None:
            raise CompileError("cannot flush the instruction cache: no __clear_cache in the process")
        _clear_cache = _ffi.cast("void (*)(char *, char *)", addr)
    _clear_cache(_ffi.cast("char *", start), _ffi.cast("char *", start + size))


# ---- arenas ----------------------------------------------------------------------------------------


def _check(rc: int, what: str) -> None:
    if rc != 0:
        raise OSError(_ffi.errno, f"{what} failed")


class _FreeList:
    """Free ranges ``[start, end)`` of one part, sorted and coalesced; first fit."""

    def __init__(self, start: int, end: int) -> None:
        self.starts = [start]
        self.ends = [end]
        self.total = end - start

    def take(self, size: int, align: int) -> int | None:
        for i, (start, end) in enumerate(zip(self.starts, self.ends, strict=True)):
            at = (start + align - 1) & -align
            if at + size <= end:
                del self.starts[i], self.ends[i]
                if at + size < end:
                    self._insert(i, at + size, end)
                if start < at:
                    self._insert(i, start, at)
                return at
        return None

    def _insert(self, i: int, start: int, end: int) -> None:
        self.starts.insert(i, start)
        self.ends.insert(i, end)

    def give(self, start: int, size: int) -> None:
        end = start + size
        i = bisect.bisect_left(self.starts, start)
        if i > 0 and self.ends[i - 1] == start:  # joins the range before it
            i -= 1
            start = self.starts[i]
            del self.starts[i], self.ends[i]
        if i < len(self.starts) and self.starts[i] == end:  # and the one after it
            end = self.ends[i]
            del self.starts[i], self.ends[i]
        self._insert(i, start, end)

    def empty(self) -> bool:
        return len(self.starts) == 1 and self.ends[0] - self.starts[0] == self.total


class Arena:
    """One mapping: ``code_bytes`` of read + execute memory, then ``data_bytes`` of read + write."""

    def __init__(self, code_bytes: int, data_bytes: int) -> None:
        self.size = code_bytes + data_bytes
        base = _mm.mmap(_ffi.NULL, self.size, _RW, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        self.base = int(_ffi.cast("uintptr_t", base))
        if self.base == _MAP_FAILED:
            raise MemoryError(f"cannot map a {self.size >> 20} MiB code arena (errno {_ffi.errno})")
        if code_bytes:
            _check(_mm.mprotect(base, code_bytes, _RX), "mprotect")
        self.code = _FreeList(self.base, self.base + code_bytes)
        self.data = _FreeList(self.base + code_bytes, self.base + self.size)
        self.data_start = self.base + code_bytes
        self.live = 0

    def unmap(self) -> None:
        _mm.munmap(_ffi.cast("void *", self.base), self.size)


@dataclass(frozen=True, slots=True)
class Allocation:
    """A code block (whole pages) and a data block of one arena."""

    arena: Arena
    code: int
    code_size: int  # bytes reserved: a multiple of the page size
    data: int
    data_size: int


class ArenaPool:
    """The arenas of the process. ``allocate``/``write``/``release`` are thread-safe; ``release``
    called from a garbage-collector callback while this thread is inside ``allocate`` is
    recorded and applied by the next call."""

    def __init__(self, code_bytes: int = CODE_BYTES, data_bytes: int = DATA_BYTES) -> None:
        self.code_bytes = code_bytes
        self.data_bytes = data_bytes
        self.arenas: list[Arena] = []
        self._lock = threading.Lock()
        self._pending: list[Allocation] = []

    def allocate(self, code_size: int, data_size: int, data_align: int = 16) -> Allocation:
        """Reserve a code block of ``code_size`` bytes (rounded up to pages) and a data block."""
        code_size = max(PAGE, (code_size + PAGE - 1) & -PAGE)
        data_align = max(16, data_align)
        data_size = (data_size + 15) & -16  # whole 16-byte units: no gap too small to reuse
        with self._lock:
            self._drain()
            for arena in reversed(self.arenas):  # the newest arena first: the others drain
                got = self._take(arena, code_size, data_size, data_align)
                if got is not None:
                    return got
            if code_size <= self.code_bytes and data_size + data_align <= self.data_bytes:
                arena = Arena(self.code_bytes, self.data_bytes)
            else:  # too big for a shared arena: one of its own, released with the object
                data_bytes = (data_size + data_align + PAGE - 1) & -PAGE
                arena = Arena(code_size, data_bytes)
            self.arenas.append(arena)
            got = self._take(arena, code_size, data_size, data_align)
            assert got is not None
            return got

    @staticmethod
    def _take(arena: Arena, code_size: int, data_size: int, data_align: int) -> Allocation | None:
        code = arena.code.take(code_size, PAGE)
        if code is None:
            return None
        data = arena.data.take(data_size, data_align) if data_size else arena.data_start
        if data is None:
            arena.code.give(code, code_size)
            return None
        arena.live += 1
        return Allocation(arena, code, code_size, data, data_size)

    def write(self, allocation: Allocation, code: bytes | bytearray, data: bytes | bytearray) -> None:
        """Copy ``code`` into the code block (write, then read + execute) and ``data`` into the
        data block."""
        if data:
            _ffi.memmove(_ffi.cast("void *", allocation.data), data, len(data))
        addr = _ffi.cast("void *", allocation.code)
        _check(_mm.mprotect(addr, allocation.code_size, _RW), "mprotect")
        try:
            _ffi.memmove(addr, code, len(code))
        finally:
            _check(_mm.mprotect(addr, allocation.code_size, _RX), "mprotect")
        if _AARCH64:
            _flush_icache(allocation.code, len(code))

    def release(self, allocation: Allocation) -> None:
        """Give an allocation back (an arena left empty is unmapped, but for the last one)."""
        if not self._lock.acquire(blocking=False):  # another thread, or a GC callback inside allocate
            self._pending.append(allocation)
            return
        try:
            self._pending.append(allocation)
            self._drain()
        finally:
            self._lock.release()

    def _drain(self) -> None:
        while self._pending:
            allocation = self._pending.pop()
            arena = allocation.arena
            arena.code.give(allocation.code, allocation.code_size)
            if allocation.data_size:
                arena.data.give(allocation.data, allocation.data_size)
            arena.live -= 1
            if arena.live == 0 and (len(self.arenas) > 1 or arena.size > self.code_bytes + self.data_bytes):
                self.arenas.remove(arena)
                arena.unmap()

    def statistics(self) -> tuple[int, int]:
        """``(arenas, live allocations)``."""
        with self._lock:
            self._drain()
            return len(self.arenas), sum(a.live for a in self.arenas)


_default: ArenaPool | None = None
_default_lock = threading.Lock()


def default_pool() -> ArenaPool:
    """The process-wide pool CPU programs are loaded into."""
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = ArenaPool()
    return _default
