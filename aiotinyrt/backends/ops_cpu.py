"""CPU: C kernels compiled by clang (or gcc) to relocatable objects, loaded by
:mod:`aiotinyrt.host` (no linker, no dlopen), called with cffi on host worker threads.

Each ``CPU``/``CPU:N`` device has a compute queue and a copy queue, each with its own worker
thread; cffi releases the GIL for the duration of every kernel and every copy. Kernels use
tinygrad's calling convention: buffer pointers, then 32-bit ints, and they loop themselves.
"""

from __future__ import annotations

import mmap
import os
import platform
import queue
import shutil
import subprocess
import tempfile
import threading
from typing import Any

import anyio
import anyio.to_thread
import cffi

from aiotinyrt import native
from aiotinyrt.allocator import AllocatorOwner, BufferSpec, LRUAllocator
from aiotinyrt.compiler import CompileError, Compiler, compile_timeout
from aiotinyrt.device import Compiled
from aiotinyrt.graph import NativeRun
from aiotinyrt.helpers import debug_level, find_cc, get_logger, getenv, getenv_str
from aiotinyrt.host import ccprocess, elf
from aiotinyrt.kernel import ClangRenderer, Kernel, cpu_threads
from aiotinyrt.program import Program

_ffi = cffi.FFI()
_ffi.cdef(
    """
    void *memcpy(void *dest, const void *src, size_t n);
    void *memmove(void *dest, const void *src, size_t n);
    """
)
_libc: Any = _ffi.dlopen(None)


_MEMMOVE = int(_ffi.cast("uintptr_t", _libc.memmove))


def _host_address(view: memoryview, writable: bool) -> int:
    """The address of a contiguous host buffer. The caller keeps ``view`` alive until the copy
    ran: its own export pins the memory (a bytearray cannot be resized meanwhile). cffi's export
    is released at once, so no cffi object referring to the view outlives this call (one left
    in a reference cycle with the view crashes the interpreter's final collection)."""
    cdata = _ffi.from_buffer(view, require_writable=writable)
    try:
        return int(_ffi.cast("uintptr_t", cdata))
    finally:
        _ffi.release(cdata)


def _native_memmove(dest: int, src: int, nbytes: int, keep: object) -> tuple[int, int, int, object]:
    """A native queue command: ``memmove(dest, src, nbytes)`` (views of one buffer may overlap)."""
    block = native.ffi.new("uint64_t[3]", [dest, src, nbytes])
    return _MEMMOVE, 3, int(native.ffi.cast("uintptr_t", block)), (block, keep)


_log = get_logger("compiler")


class ClangCompiler(Compiler):
    """C source to a relocatable ELF object, by the system C compiler run as a subprocess (no
    linker: :mod:`aiotinyrt.host.elf` loads the object)."""

    #: ``-c``: no link step and no startup code; ``-fPIC`` so code and data reach each other
    #: PC-relative wherever the loader puts them; no unwind tables (nothing reads them). Not
    #: ``-ffreestanding``: it implies ``-fno-builtin``, which turns raw C's ``sqrtf``/``fabsf``
    #: into libm calls and stops such loops vectorizing (20x slower, see docs/architecture.md).
    FLAGS = (
        "-c",
        "-O2",
        "-march=native",
        "-fPIC",
        "-fno-math-errno",
        "-fno-ident",
        "-fno-asynchronous-unwind-tables",
    )

    def __init__(self, cc: list[str]) -> None:
        super().__init__("compile_cpu_obj")  # the identity says "object": no shared object is ever loaded
        self.cc = cc
        self._process = ccprocess.for_argv([*cc, *self.FLAGS, "-x", "c", "-"])

    async def identity(self) -> str:
        """Compiler path, ``--version`` banner, flags, machine and CPU model.

        Cancellation: the ``--version`` process is killed; nothing is cached.
        """
        result = await anyio.run_process([*self.cc, "--version"], check=False)
        banner = result.stdout.decode(errors="replace").splitlines()[:1]
        cpu = await anyio.to_thread.run_sync(_cpu_model)
        return "|".join(["elf-relocatable", *self.cc, *banner, *self.FLAGS, platform.machine(), cpu])

    async def compile(self, src: str) -> bytes:
        """Compile C source to an object with ``cc -c -O2 -march=native -fPIC`` in a subprocess.

        Raises ``CompileError`` with the compiler's diagnostics on failure, when the compiler is
        killed, or after ``COMPILE_TIMEOUT_S`` seconds (default 120).

        Cancellation: the compiler process is killed.
        """
        if debug_level() >= 4:
            _log.debug("compiling:\n%s", src)
        limit = compile_timeout()
        result = await self._process.compile(src.encode(), limit)
        if result.timed_out:
            raise CompileError(f"{self.cc[0]} did not finish within {limit:g} s", src=src)
        if result.returncode != 0:
            how = (
                f"was killed by signal {-result.returncode}"
                if result.returncode < 0
                else f"exited with status {result.returncode}"
            )
            diagnostics = (result.stderr or result.output).decode(errors="replace")
            raise CompileError(f"{self.cc[0]} {how}", diagnostics, src)
        return result.output

    def disassemble(self, lib: bytes) -> str:
        """objdump -d of the object, relocations shown (blocking; call it from a thread in async code)."""
        objdump = shutil.which("objdump") or shutil.which("llvm-objdump")
        if objdump is None:
            raise RuntimeError("disassemble needs objdump (apt-get install -y binutils)")
        with tempfile.NamedTemporaryFile(suffix=".o") as f:
            f.write(lib)
            f.flush()
            return subprocess.run([objdump, "-dr", f.name], capture_output=True, text=True, check=True).stdout


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


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
        self._addr = _ffi.cast("void *", addr)
        self._fns: dict[tuple[int, int], Any] = {}
        self._native_fn = addr

    def function(self, nbufs: int, nvals: int) -> Any:
        """The kernel as a cffi function pointer taking ``nbufs`` addresses and ``nvals`` ints."""
        key = (nbufs, nvals)
        fn = self._fns.get(key)
        if fn is None:
            params = ", ".join(["void *"] * nbufs + ["int32_t"] * nvals) or "void"
            fn = self._fns[key] = _ffi.cast(f"void (*)({params})", self._addr)
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
    first byte, its offset into the mmap and its size."""

    __slots__ = ("__weakref__", "addr", "mm", "nbytes", "offset", "ptr")

    def __init__(self, mm: mmap.mmap | None, addr: int, offset: int, nbytes: int) -> None:
        self.mm = mm
        self.addr = addr
        self.ptr = _ffi.cast("void *", addr)  # what kernels are called with (cheaper than an int)
        self.offset = offset
        self.nbytes = nbytes

    def __repr__(self) -> str:
        return f"<CPUMemory 0x{self.addr:x} {self.nbytes} bytes>"


#: Host copies up to this size go through ``ffi.memmove``, which holds the GIL (a microsecond or
#: two); larger ones through libc's memcpy, called with the GIL released.
_SMALL_COPY = 64 * 1024


class CPUAllocator(LRUAllocator[CPUMemory]):
    """Page-aligned anonymous mmap memory; zero-copy host views."""

    handle_type = CPUMemory

    #: 64 KiB: a few microseconds of memcpy on the loop thread (see Allocator.inline_copy_bytes)
    inline_copy_bytes = _SMALL_COPY

    def __init__(self, device: Compiled) -> None:
        super().__init__(device)
        # by id of the mmap: how many zero-copy host views of it are alive, and the mmaps freed
        # while some were (unmapped when the last goes)
        self._views: dict[int, int] = {}
        self._parked: dict[int, mmap.mmap] = {}

    def _alloc(self, nbytes: int, options: BufferSpec) -> CPUMemory:
        if options.external_ptr is not None:
            return CPUMemory(None, options.external_ptr, 0, nbytes)
        mm = mmap.mmap(-1, nbytes)
        return CPUMemory(mm, int(_ffi.cast("uintptr_t", _ffi.from_buffer(mm))), 0, nbytes)

    def _free(self, opaque: CPUMemory, nbytes: int, options: BufferSpec) -> None:
        mm = opaque.mm
        if mm is None:
            return
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
        _unmapper.drain()

    def _copyin(self, dest: CPUMemory, src: memoryview) -> None:
        if src.nbytes > dest.nbytes:
            raise ValueError(f"copyin of {src.nbytes} bytes into {dest.nbytes} bytes")
        if src.nbytes <= _SMALL_COPY:  # (ffi.memmove takes the buffer as it is, but keeps the GIL)
            _ffi.memmove(dest.ptr, src, src.nbytes)
        else:  # a call through the library releases the GIL for the copy
            _libc.memcpy(dest.ptr, _ffi.from_buffer(src), src.nbytes)

    def _copyout(self, dest: memoryview, src: CPUMemory) -> None:
        if dest.nbytes > src.nbytes:
            raise ValueError(f"copyout of {dest.nbytes} bytes from {src.nbytes} bytes")
        if dest.nbytes <= _SMALL_COPY:
            _ffi.memmove(dest, src.ptr, dest.nbytes)  # (dest: a writable buffer, checked by the caller)
        else:
            _libc.memcpy(_ffi.from_buffer(dest, require_writable=True), src.ptr, dest.nbytes)

    def _transfer(self, dest: CPUMemory, src: Any, nbytes: int, src_device: AllocatorOwner) -> None:
        # memmove: two views of one buffer may overlap
        _libc.memmove(_ffi.cast("void *", dest.addr), _ffi.cast("void *", src.addr), nbytes)

    def _can_transfer_from(self, src_device: AllocatorOwner) -> bool:
        return isinstance(src_device.allocator, CPUAllocator)

    def _native_copyin(self, dest: CPUMemory, src: memoryview) -> tuple[int, int, int, object] | None:
        return _native_memmove(dest.addr, _host_address(src, False), src.nbytes, None)

    def _native_copyout(self, dest: memoryview, src: CPUMemory) -> tuple[int, int, int, object] | None:
        return _native_memmove(_host_address(dest, True), src.addr, dest.nbytes, None)

    def _native_transfer(self, dest: CPUMemory, src: Any, nbytes: int) -> tuple[int, int, int, object] | None:
        return _native_memmove(dest.addr, src.addr, nbytes, None)

    def _offset(self, opaque: CPUMemory, nbytes: int, offset: int) -> CPUMemory:
        return CPUMemory(opaque.mm, opaque.addr + offset, opaque.offset + offset, nbytes)

    def _as_memoryview(self, opaque: CPUMemory, nbytes: int) -> memoryview:
        pointer = _ffi.cast("char *", opaque.addr)
        mm = opaque.mm
        if mm is not None:
            # The view exports a cffi pointer, not the mmap: its destructor runs when the last
            # view (slices included) goes, so memory freed meanwhile is unmapped right then. The
            # destructor holds the mmap, which therefore outlives every view.
            with self._lock:
                self._views[id(mm)] = self._views.get(id(mm), 0) + 1
            pointer = _ffi.gc(pointer, lambda _: self._view_gone(mm))
        return memoryview(_ffi.buffer(pointer, nbytes))


#: Mappings at least this large are unmapped by the unmapper thread, not by the freeing thread:
#: munmap of touched pages costs ~0.2 ms per MiB (50 ms per 256 MiB), too long for the loop.
_UNMAP_INLINE_BYTES = 256 * 1024


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


_unmapper = _Unmapper()


def unmap(mm: mmap.mmap) -> None:
    """Unmap ``mm``: at once when small, else on the unmapper thread."""
    if len(mm) < _UNMAP_INLINE_BYTES:
        _close_mapping(mm)
    else:
        _unmapper.put(mm)


class CorePool:
    """Daemon threads that run the chunks of a split kernel launch (chunk 0 runs on the queue's
    own worker). Daemon, so a kernel that never returns cannot hold up interpreter exit."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: queue.SimpleQueue[tuple[Any, tuple[Any, ...], threading.Semaphore, list[BaseException]]]
        self._tasks = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def _ensure(self, n: int) -> None:
        with self._lock:
            while len(self._threads) < n:
                thread = threading.Thread(
                    target=self._run, name=f"aiotinyrt-{self.name}/core{len(self._threads) + 1}", daemon=True
                )
                thread.start()
                self._threads.append(thread)

    def _run(self) -> None:
        while True:
            fn, args, done, errors = self._tasks.get()
            if fn is None:
                return
            try:
                fn(*args)
            except BaseException as exc:
                errors.append(exc)
            done.release()

    def run_split(self, fn: Any, args: tuple[Any, ...], threads: int) -> None:
        """Run ``fn(*args, core_id, threads)`` for every core_id, concurrently; raise the first
        error after all chunks finished."""
        self._ensure(threads - 1)
        done = threading.Semaphore(0)
        errors: list[BaseException] = []
        for core in range(1, threads):
            self._tasks.put((fn, (*args, core, threads), done, errors))
        try:
            fn(*args, 0, threads)
        finally:
            for _ in range(threads - 1):
                done.acquire()
        if errors:
            raise errors[0]

    def close(self) -> None:
        for _ in self._threads:
            self._tasks.put((None, (), threading.Semaphore(), []))


class CPUDevice(Compiled):
    """A CPU device. ``CPU``, ``CPU:1``, ... are separate devices with their own queues.

    Rendered kernels split their outermost dimension over ``threads`` cores (env
    ``CPU_THREADS``, default: every core); raw C kernels run on the queue's worker alone.
    """

    def __init__(self, name: str) -> None:
        cc = find_cc()
        if cc is None:
            env = getenv_str("CC")
            found = f"CC={env!r} is not an executable on PATH" if env else "no clang, gcc or cc on PATH"
            raise RuntimeError(
                f"the CPU device needs a C compiler and finds none ({found}): install clang "
                "(apt-get install -y clang) or gcc, or set CC to a C compiler"
            )
        #: How many threads one rendered-kernel launch may use.
        self.threads = max(1, getenv("CPU_THREADS", os.cpu_count() or 1))
        self._cores = CorePool(name)
        super().__init__(name, CPUAllocator(self), ClangCompiler(cc), CPUProgram, ClangRenderer())

    def _on_close(self) -> None:
        self._cores.close()

    def count(self) -> int:
        return os.cpu_count() or 1

    async def _native_graph(self, entries: list[Any]) -> NativeRun | None:
        """Compile a run of captured raw C launches into one C function that calls each kernel
        with its recorded arguments (addresses come from arrays, so the code is cacheable)."""
        transfer = CPUAllocator._transfer

        def is_transfer(fn: Any) -> bool:
            return getattr(fn, "__func__", None) is transfer

        if not all(
            e.queue is self._compute_queue
            and (
                is_transfer(e.fn)  # a transfer folded into the run (see Graph._fold_transfers)
                or (
                    isinstance(e.program, CPUProgram)
                    and e.fn is e.program.function(len(e.bufs), len(e.args) - len(e.bufs))
                )
            )
            for e in entries
        ):
            return None
        lines: list[str] = []
        flat: list[int] = []
        positions: dict[tuple[int, int], list[int]] = {}
        starts: list[int] = []
        for i, entry in enumerate(entries):
            starts.append(len(flat))
            if is_transfer(entry.fn):  # memmove(dest, src, nbytes): views of one buffer may overlap
                base = len(flat)
                dest, src, nbytes, _ = entry.args
                flat.extend((dest.addr, src.addr, nbytes))
                for b, slots in enumerate(entry.slots):
                    positions[(i, b)] = [base + j for j, _ in slots]
                d, s_, n = base, base + 1, base + 2
                lines.append(f"  memmove((void *)a[{d}], (const void *)a[{s_}], (size_t)a[{n}]);")
                continue
            nbufs = len(entry.bufs)
            params = ", ".join(["uintptr_t"] * nbufs + ["int32_t"] * (len(entry.args) - nbufs)) or "void"
            base = len(flat)
            call = [
                f"a[{base + j}]" if j < nbufs else f"(int32_t)a[{base + j}]" for j in range(len(entry.args))
            ]
            flat.extend(
                a & 0xFFFF_FFFF_FFFF_FFFF if isinstance(a, int) else int(_ffi.cast("uintptr_t", a))
                for a in entry.args
            )
            for b, slots in enumerate(entry.slots):
                positions[(i, b)] = [base + j for j, _ in slots]
            lines.append(f"  ((void (*)({params}))f[{i}])({', '.join(call)});")
        src = (
            "#include <stdint.h>\n#include <string.h>\n"
            "void graph_replay(const uintptr_t *restrict f, const uintptr_t *restrict a) {\n"
            + "\n".join(lines)
            + "\n}\n"
        )
        replay = CPUProgram(self, "graph_replay", await self.compiler.compile_cached(src))
        count = max(len(flat), 1)

        def copy_args(old: Any) -> Any:
            new = _ffi.new("uintptr_t[]", count)
            _ffi.memmove(new, old, count * 8)
            return new

        return NativeRun(
            cfunc=_ffi.cast("void (*)(uintptr_t *, uintptr_t *)", replay._addr),
            fns=_ffi.new(
                "uintptr_t[]",
                [0 if is_transfer(e.fn) else int(_ffi.cast("uintptr_t", e.program._addr)) for e in entries],
            ),
            args=_ffi.new("uintptr_t[]", flat or [0]),
            positions=positions,
            copy_args=copy_args,
            keep=(replay, [e.program for e in entries if e.program is not None]),
            starts=starts,
        )
