"""Host memory helpers for backends whose device memory is host memory: libc's copies called
through cffi, the native queue's ``memmove`` command, and unmapping off the freeing thread.

Copies of at most :data:`SMALL_COPY` bytes go through ``ffi.memmove``, which holds the GIL (a
microsecond or two); larger ones through libc's ``memcpy``, called with the GIL released.
"""

from __future__ import annotations

import mmap
import os
import queue
import threading
from typing import Any

import cffi

from aiotinyrt import native

#: The cffi instance every host-code backend casts its pointers and function types with.
ffi = cffi.FFI()
ffi.cdef(
    """
    void *memcpy(void *dest, const void *src, size_t n);
    void *memmove(void *dest, const void *src, size_t n);
    """
)
libc: Any = ffi.dlopen(None)

_MEMMOVE = int(ffi.cast("uintptr_t", libc.memmove))

#: Host copies up to this size go through ``ffi.memmove``, which holds the GIL (a microsecond or
#: two); larger ones through libc's memcpy, called with the GIL released.
SMALL_COPY = 64 * 1024


def address_of(view: memoryview, writable: bool) -> int:
    """The address of a contiguous host buffer. The caller keeps ``view`` alive until the copy
    ran: its own export pins the memory (a bytearray cannot be resized meanwhile). cffi's export
    is released at once, so no cffi object referring to the view outlives this call (one left
    in a reference cycle with the view crashes the interpreter's final collection)."""
    cdata = ffi.from_buffer(view, require_writable=writable)
    try:
        return int(ffi.cast("uintptr_t", cdata))
    finally:
        ffi.release(cdata)


def native_memmove(dest: int, src: int, nbytes: int, keep: object) -> tuple[int, int, int, object]:
    """A native queue command: ``memmove(dest, src, nbytes)`` (views of one buffer may overlap)."""
    block = native.ffi.new("uint64_t[3]", [dest, src, nbytes])
    return _MEMMOVE, 3, int(native.ffi.cast("uintptr_t", block)), (block, keep)


def copy_to_memory(dest: Any, src: memoryview) -> None:
    """Copy host buffer ``src`` to the memory at cffi pointer ``dest`` (on the calling thread)."""
    if src.nbytes <= SMALL_COPY:  # (ffi.memmove takes the buffer as it is, but keeps the GIL)
        ffi.memmove(dest, src, src.nbytes)
    else:  # a call through the library releases the GIL for the copy
        libc.memcpy(dest, ffi.from_buffer(src), src.nbytes)


def copy_from_memory(dest: memoryview, src: Any) -> None:
    """Copy the memory at cffi pointer ``src`` into writable host buffer ``dest``."""
    if dest.nbytes <= SMALL_COPY:
        ffi.memmove(dest, src, dest.nbytes)  # (dest: a writable buffer, checked by the caller)
    else:
        libc.memcpy(ffi.from_buffer(dest, require_writable=True), src, dest.nbytes)


def memmove(dest: int, src: int, nbytes: int) -> None:
    """``memmove`` between two addresses, the GIL released (two views of one buffer may overlap)."""
    libc.memmove(ffi.cast("void *", dest), ffi.cast("void *", src), nbytes)


#: Mappings at least this large are unmapped by the unmapper thread, not by the freeing thread:
#: munmap of touched pages costs ~0.2 ms per MiB (50 ms per 256 MiB), too long for the loop.
UNMAP_INLINE_BYTES = 256 * 1024


class _Unmapper:
    """One daemon thread per process that closes (unmaps) the mmaps handed to it, so no free,
    ``free_cache()`` or out-of-memory retry unmaps on the event loop thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[mmap.mmap | threading.Event] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._pid = 0

    def put(self, mm: mmap.mmap) -> None:
        try:
            self._ensure()
        except RuntimeError:  # no new thread at interpreter shutdown: unmap here
            _close_mapping(mm)
            return
        self._queue.put(mm)

    def drain(self) -> None:
        """Block until everything handed over so far is unmapped (out-of-memory retry, tests)."""
        if self._thread is None or self._pid != os.getpid():
            return
        done = threading.Event()
        self._queue.put(done)
        done.wait()

    def _ensure(self) -> None:
        pid = os.getpid()
        if self._thread is not None and self._pid == pid:
            return
        with self._lock:
            if self._thread is None or self._pid != pid:  # (none in a forked child)
                self._queue = queue.SimpleQueue()
                self._pid = pid
                thread = threading.Thread(target=self._run, name="aiotinyrt-unmapper", daemon=True)
                thread.start()
                self._thread = thread

    def _run(self) -> None:
        q = self._queue
        while True:
            item = q.get()
            if isinstance(item, threading.Event):
                item.set()
            else:
                _close_mapping(item)


def _close_mapping(mm: mmap.mmap) -> None:
    mm.close()


#: The process's unmapper thread (started on first use).
unmapper = _Unmapper()


def unmap(mm: mmap.mmap) -> None:
    """Unmap ``mm``: at once when small, else on the unmapper thread."""
    if len(mm) < UNMAP_INLINE_BYTES:
        _close_mapping(mm)
    else:
        unmapper.put(mm)
