"""CPU: C kernels compiled by clang (or gcc) to relocatable objects, loaded by
:mod:`aiotinyrt.host` (no linker, no dlopen), called with cffi on host worker threads.

Each ``CPU``/``CPU:N`` device has a compute queue and a copy queue, each with its own worker
thread; cffi releases the GIL for the duration of every kernel and every copy. Kernels use
tinygrad's calling convention: buffer pointers, then 32-bit ints, and they loop themselves.
"""

from __future__ import annotations

import mmap
import os
import resource
import weakref
from typing import Any

from aiotinyrt import native
from aiotinyrt.allocator import AllocatorOwner, BufferSpec, LRUAllocator
from aiotinyrt.compiler import CompileError
from aiotinyrt.device import Compiled
from aiotinyrt.graph import NativeRun
from aiotinyrt.helpers import getenv
from aiotinyrt.host import elf
from aiotinyrt.host.compiler import ClangCompiler, find_compiler
from aiotinyrt.host.cores import CorePool
from aiotinyrt.host.graph import compile_run
from aiotinyrt.host.memory import (
    SMALL_COPY,
    address_of,
    copy_from_memory,
    copy_to_memory,
    ffi,
    memmove,
    native_memmove,
    unmap,
    unmapper,
)
from aiotinyrt.kernel import ClangRenderer, Kernel, cpu_threads
from aiotinyrt.program import Program


class CPUProgram(Program):
    """A relocatable object loaded by :func:`aiotinyrt.host.elf.load` and called with cffi.

    The loaded object (``image``) returns its memory to the arena when it is collected; queued
    launches hold the Program, and so the image, until they ran.
    """

    RAW_USES_GLOBAL_SIZE = False  # a raw C kernel is called once and loops itself

    def __init__(
        self, device: Compiled, name: str, lib: bytes, *, src: str | None = None, kernel: Kernel | None = None
    ) -> None:
        super().__init__(device, name, lib, src=src, kernel=kernel)
        #: The loaded object: its code and data, alive as long as the Program.
        try:
            self.image = elf.load(self.lib)
        except CompileError as exc:
            raise elf.LoadError(f"cannot load {name!r}: {exc}", exc.diagnostics) from None
        addr = self.image.symbols.get(name)
        if addr is None:
            raise ValueError(f"the binary has no function named {name!r}")
        self._addr = ffi.cast("void *", addr)
        self._fns: dict[tuple[int, int], Any] = {}
        self._native_fn = addr

    def function(self, nbufs: int, nvals: int) -> Any:
        """The kernel as a cffi function pointer taking ``nbufs`` addresses and ``nvals`` ints."""
        key = (nbufs, nvals)
        fn = self._fns.get(key)
        if fn is None:
            params = ", ".join(["void *"] * nbufs + ["int32_t"] * nvals) or "void"
            fn = self._fns[key] = ffi.cast(f"void (*)({params})", self._addr)
        return fn

    def _native_call(self, handles: list[Any], global_size: tuple[int, ...], vals: tuple[int, ...]) -> Any:
        args = [h.addr for h in handles] + [v & 0xFFFFFFFFFFFFFFFF for v in vals]
        if self.kernel is not None:
            device = self.device
            assert isinstance(device, CPUDevice)
            if cpu_threads(global_size, device.threads) != 1:
                return None  # split over the core pool: a Python command
            args += [0, 1]  # core_id, core_count
        if len(args) > native.MAX_ARGS:
            return None
        block = native.ffi.new("uint64_t[]", args or [0])
        return self._native_fn, len(args), int(native.ffi.cast("uintptr_t", block)), (block, self.image)

    def _launcher(
        self,
        handles: tuple[Any, ...],
        global_size: tuple[int, ...],
        local_size: tuple[int, ...] | None,
        vals: tuple[int, ...],
    ) -> tuple[Any, tuple[Any, ...]]:
        if self.kernel is None:  # raw C: called once, loops itself
            fn = self._fns.get((len(handles), len(vals))) or self.function(len(handles), len(vals))
            return fn, (*[h.ptr for h in handles], *vals)
        # rendered kernel: vals end with the global size; core_id and core_count follow
        fn = self.function(len(handles), len(vals) + 2)
        args = (*[h.ptr for h in handles], *vals)
        device = self.device
        assert isinstance(device, CPUDevice)
        threads = cpu_threads(global_size, device.threads)
        if threads == 1:
            return fn, (*args, 0, 1)
        return device._cores.run_split, (fn, args, threads)


class CPUMemory:
    """A handle to host memory: the owning mmap (None for external memory), the address of the
    first byte, its offset into the mmap and its size; ``fd``: the memory file the mmap maps,
    open while the memory is allocated, where another process may map it (-1: none, see
    :attr:`CPUAllocator.shared_min`)."""

    __slots__ = ("__weakref__", "addr", "fd", "mm", "nbytes", "offset", "ptr")

    def __init__(self, mm: mmap.mmap | None, addr: int, offset: int, nbytes: int, fd: int = -1) -> None:
        self.mm = mm
        self.addr = addr
        self.ptr = ffi.cast("void *", addr)  # what kernels are called with (cheaper than an int)
        self.offset = offset
        self.nbytes = nbytes
        self.fd = fd

    def __repr__(self) -> str:
        return f"<CPUMemory 0x{self.addr:x} {self.nbytes} bytes>"


def fd_limit() -> int:
    """This process's limit of open file descriptors (the soft one)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return 1 << 30 if soft == resource.RLIM_INFINITY else soft


class CPUAllocator(LRUAllocator[CPUMemory]):
    """Page-aligned anonymous mmap memory; zero-copy host views."""

    handle_type = CPUMemory

    #: 64 KiB: a few microseconds of memcpy on the loop thread (see Allocator.inline_copy_bytes)
    inline_copy_bytes = SMALL_COPY

    #: Allocations of at least this many bytes map a memory file (``memfd_create``) kept open
    #: while they are allocated (:attr:`CPUMemory.fd`), so that another process of the same
    #: user may map the same pages through ``/proc/<pid>/fd/<fd>`` (a RAY device host sets it:
    #: its clients on the same machine copy with one ``memcpy``). None (the default): anonymous
    #: memory, no file descriptor per buffer. Where no file can be made (no ``memfd_create``, out
    #: of file descriptors) the memory is anonymous all the same, as it is once memory files would
    #: hold half of the process's file descriptor limit (each holds two: its own and its mmap's).
    shared_min: int | None = None

    def __init__(self, device: Compiled) -> None:
        super().__init__(device)
        # by id of the mmap: how many zero-copy host views of it are alive, and the mmaps freed
        # while some were (unmapped when the last goes)
        self._views: dict[int, int] = {}
        self._parked: dict[int, mmap.mmap] = {}
        self._files = 0  # memory files allocated and not freed (see shared_min)
        self._closers: dict[int, weakref.finalize[Any, Any]] = {}  # by fd: its closing, once

    def _alloc(self, nbytes: int, options: BufferSpec) -> CPUMemory:
        if options.external_ptr is not None:
            return CPUMemory(None, options.external_ptr, 0, nbytes)
        fd = self._memory_file(nbytes)
        try:
            mm = mmap.mmap(fd, nbytes)
        except BaseException:
            if fd >= 0:
                self._close_file(fd)
            raise
        if fd >= 0:  # (closed at the free, or with the mmap if the memory is never freed)
            closer = self._closers[fd] = weakref.finalize(mm, self._close_file, fd)
            closer.atexit = False  # (at exit the process's descriptors go anyway: no lock then)
        return CPUMemory(mm, int(ffi.cast("uintptr_t", ffi.from_buffer(mm))), 0, nbytes, fd)

    def _memory_file(self, nbytes: int) -> int:
        """A memory file of ``nbytes`` for a new allocation (see :attr:`shared_min`), or -1."""
        if self.shared_min is None or nbytes < self.shared_min or not hasattr(os, "memfd_create"):
            return -1
        with self._lock:
            if 2 * (self._files + 1) > fd_limit() // 2:
                return -1
            self._files += 1
        fd = -1
        try:
            fd = os.memfd_create(f"aiotinyrt-{self.device.name}", os.MFD_CLOEXEC)
            os.ftruncate(fd, nbytes)
        except OSError:  # (out of file descriptors, or of memory for the file: anonymous)
            if fd >= 0:
                os.close(fd)
            with self._lock:
                self._files -= 1
            return -1
        return fd

    def _close_file(self, fd: int) -> None:
        """Close the memory file ``fd`` (once: called through its finalizer in ``_closers``)."""
        with self._lock:  # (before the number can be reused)
            self._files -= 1
            self._closers.pop(fd, None)
        os.close(fd)

    def _free(self, opaque: CPUMemory, nbytes: int, options: BufferSpec) -> None:
        mm = opaque.mm
        if mm is None:
            return
        if opaque.fd >= 0:  # (the mapping keeps the pages; no process maps them anew from here)
            with self._lock:
                closer = self._closers.get(opaque.fd)
            if closer is not None:
                closer()
            opaque.fd = -1
        with self._lock:  # called from worker threads too
            if id(mm) in self._views:  # a view from as_memoryview() still uses it: when it goes
                self._parked[id(mm)] = mm
                return
        unmap(mm)

    def _reusable(self, opaque: CPUMemory) -> bool:
        return opaque.mm is not None and id(opaque.mm) not in self._views

    def _view_gone(self, mm: mmap.mmap) -> None:
        """The last reference to one zero-copy host view went (any thread, from cffi's gc)."""
        with self._lock:
            left = self._views.get(id(mm), 1) - 1
            if left > 0:
                self._views[id(mm)] = left
                return
            self._views.pop(id(mm), None)
            parked = self._parked.pop(id(mm), None)
        if parked is not None:
            unmap(parked)

    def _wait_released(self) -> None:
        unmapper.drain()

    def _copyin(self, dest: CPUMemory, src: memoryview) -> None:
        if src.nbytes > dest.nbytes:
            raise ValueError(f"copyin of {src.nbytes} bytes into {dest.nbytes} bytes")
        copy_to_memory(dest.ptr, src)

    def _copyout(self, dest: memoryview, src: CPUMemory) -> None:
        if dest.nbytes > src.nbytes:
            raise ValueError(f"copyout of {dest.nbytes} bytes from {src.nbytes} bytes")
        copy_from_memory(dest, src.ptr)

    def _transfer(self, dest: CPUMemory, src: Any, nbytes: int, src_device: AllocatorOwner) -> None:
        memmove(dest.addr, src.addr, nbytes)

    def _can_transfer_from(self, src_device: AllocatorOwner) -> bool:
        return isinstance(src_device.allocator, CPUAllocator)

    def _native_copyin(self, dest: CPUMemory, src: memoryview) -> tuple[int, int, int, object] | None:
        return native_memmove(dest.addr, address_of(src, False), src.nbytes, None)

    def _native_copyout(self, dest: memoryview, src: CPUMemory) -> tuple[int, int, int, object] | None:
        return native_memmove(address_of(dest, True), src.addr, dest.nbytes, None)

    def _native_transfer(self, dest: CPUMemory, src: Any, nbytes: int) -> tuple[int, int, int, object] | None:
        return native_memmove(dest.addr, src.addr, nbytes, None)

    def _offset(self, opaque: CPUMemory, nbytes: int, offset: int) -> CPUMemory:
        return CPUMemory(opaque.mm, opaque.addr + offset, opaque.offset + offset, nbytes, opaque.fd)

    def _as_memoryview(self, opaque: CPUMemory, nbytes: int) -> memoryview:
        pointer = ffi.cast("char *", opaque.addr)
        mm = opaque.mm
        if mm is not None:
            # The view exports a cffi pointer, not the mmap: its destructor runs when the last
            # view (slices included) goes, so memory freed meanwhile is unmapped right then. The
            # destructor holds the mmap, which therefore outlives every view.
            with self._lock:
                self._views[id(mm)] = self._views.get(id(mm), 0) + 1
            pointer = ffi.gc(pointer, lambda _: self._view_gone(mm))
        return memoryview(ffi.buffer(pointer, nbytes))


class CPUDevice(Compiled):
    """A CPU device. ``CPU``, ``CPU:1``, ... are separate devices with their own queues.

    Rendered kernels split their outermost dimension over ``threads`` cores (env
    ``CPU_THREADS``, default: every core); raw C kernels run on the queue's worker alone.
    """

    def __init__(self, name: str) -> None:
        cc = find_compiler()
        #: How many threads one rendered-kernel launch may use.
        self.threads = max(1, getenv("CPU_THREADS", os.cpu_count() or 1))
        self._cores = CorePool(name)
        super().__init__(name, CPUAllocator(self), ClangCompiler(cc), CPUProgram, ClangRenderer())

    def _on_close(self) -> None:
        self._cores.close()

    def count(self) -> int:
        return os.cpu_count() or 1

    async def _native_graph(self, entries: list[Any]) -> NativeRun | None:
        """A run of captured raw C launches (and folded transfers) as one C function
        (:func:`aiotinyrt.host.graph.compile_run`)."""
        return await compile_run(self, entries, CPUProgram, CPUAllocator._transfer)
