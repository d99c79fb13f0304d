"""CL: OpenCL devices (PoCL here) through the cffi binding in :mod:`aiotinyrt.backends.opencl`.

``CL``, ``CL:1``, ... are the devices of every platform, in the ICD loader's order. Queues are
driver-run (:class:`~aiotinyrt.driverqueue.DriverQueue`), each driven by a
:class:`~aiotinyrt.backends.cl_queue.CLQueue`: one in-order ``cl_command_queue``; a command is
enqueued from the submitting thread with the events it waits for as its wait list, and one
waiter thread per queue reports completed events in batches. Copies are non-blocking
``clEnqueueRead/WriteBuffer`` whose host memory the queue keeps alive until their event
completed. Builds run in compile-server processes (:mod:`aiotinyrt.backends.cl_build`). Raw
kernels take tinygrad's CL convention: buffers, then ``int`` vals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio.to_thread

from aiotinyrt import native
from aiotinyrt.allocator import AllocatorOwner, BufferSpec, LRUAllocator
from aiotinyrt.backends import opencl as ocl
from aiotinyrt.backends.cl_build import BuildPool
from aiotinyrt.backends.cl_queue import CLQueue, c_launch_ready, cl_command
from aiotinyrt.backends.cl_queue import cdata_address as _address
from aiotinyrt.backends.opencl import CLError, check, ffi
from aiotinyrt.compiler import CompileError, Compiler
from aiotinyrt.device import Compiled
from aiotinyrt.driverqueue import DriverQueue
from aiotinyrt.kernel import OpenCLRenderer
from aiotinyrt.program import Program
from aiotinyrt.queue import Queue

NULL = ffi.NULL
__all__ = ["CLAllocator", "CLCompiler", "CLDevice", "CLMemory", "CLProgram", "cl_command"]


class CLMemory:
    """A ``cl_mem`` and the byte range of it a handle covers (views share their base's)."""

    __slots__ = ("arg", "base", "mem", "nbytes", "offset")

    def __init__(self, mem: Any, nbytes: int, offset: int = 0, base: CLMemory | None = None) -> None:
        self.mem, self.nbytes, self.offset, self.base = mem, nbytes, offset, base
        self.arg: Any = ffi.new("cl_mem*", mem) if offset == 0 else None  # the kernel argument

    def kernel_arg(self) -> Any:
        """A ``cl_mem*`` for clSetKernelArg: the buffer, or a sub-buffer for a view."""
        if self.arg is None:
            self.arg = ffi.new("cl_mem*", ocl.sub_buffer(self.mem, self.offset, self.nbytes))
        return self.arg


class CLAllocator(LRUAllocator[CLMemory]):
    """``clCreateBuffer`` memory; copies are non-blocking enqueues on the copy queue."""

    def __init__(self, device: CLDevice) -> None:
        super().__init__(device)
        self.context = device.context

    def _alloc(self, nbytes: int, options: BufferSpec) -> CLMemory:
        cl, err, flags, host = ocl.lib(), ffi.new("cl_int*"), ocl.MEM_READ_WRITE, NULL
        if options.external_ptr is not None:
            flags, host = flags | ocl.MEM_USE_HOST_PTR, ffi.cast("void*", options.external_ptr)
        elif options.zero:
            flags, host = flags | ocl.MEM_COPY_HOST_PTR, ffi.from_buffer(bytes(nbytes))
        mem = cl.clCreateBuffer(self.context, flags, nbytes, host, err)
        if err[0] in ocl.OUT_OF_MEMORY:
            raise MemoryError(str(CLError("clCreateBuffer", err[0])))
        check(err[0], "clCreateBuffer")
        return CLMemory(mem, nbytes)

    def _free(self, opaque: CLMemory, nbytes: int, options: BufferSpec) -> None:
        if opaque.base is None:
            check(ocl.lib().clReleaseMemObject(opaque.mem), "clReleaseMemObject")

    def _offset(self, opaque: CLMemory, nbytes: int, offset: int) -> CLMemory:
        return CLMemory(opaque.mem, nbytes, opaque.offset + offset, opaque.base or opaque)

    @cl_command
    def _copyin(self, queue: Any, n: int, wl: Any, dest: CLMemory, src: memoryview) -> Any:
        ev = ffi.new("cl_event*")
        host = ffi.from_buffer(src)
        code = ocl.lib().clEnqueueWriteBuffer(queue, dest.mem, 0, dest.offset, src.nbytes, host, n, wl, ev)
        check(code, "clEnqueueWriteBuffer")
        return ev[0]

    @cl_command
    def _copyout(self, queue: Any, n: int, wl: Any, dest: memoryview, src: CLMemory) -> Any:
        ev = ffi.new("cl_event*")
        host = ffi.from_buffer(dest, require_writable=True)
        code = ocl.lib().clEnqueueReadBuffer(queue, src.mem, 0, src.offset, dest.nbytes, host, n, wl, ev)
        check(code, "clEnqueueReadBuffer")
        return ev[0]

    @cl_command
    def _transfer(
        self,
        queue: Any,
        n: int,
        wl: Any,
        dest: CLMemory,
        src: CLMemory,
        nbytes: int,
        src_device: AllocatorOwner,
    ) -> Any:
        ev = ffi.new("cl_event*")
        code = ocl.lib().clEnqueueCopyBuffer(
            queue, src.mem, dest.mem, src.offset, dest.offset, nbytes, n, wl, ev
        )
        check(code, "clEnqueueCopyBuffer")
        return ev[0]


class CLCompiler(Compiler):
    """``clBuildProgram`` to the device's binary (``CL_PROGRAM_BINARIES``), in compile-server
    processes (:mod:`aiotinyrt.backends.cl_build`: PoCL's builds take turns within a process)."""

    def __init__(self, device: CLDevice) -> None:
        super().__init__("compile_cl")
        self.device = device
        self.servers = BuildPool(device.index)

    async def identity(self) -> str:
        """Platform, device and driver version: the binary is the driver's, for this device."""
        d = self.device
        return f"cl {d.platform_version} | {d.device_name} | {d.driver_version} | {d.device_version}"

    async def compile(self, src: str) -> bytes:
        """Build ``src`` in a compile server (a worker thread waits for its reply).
        Cancellation: abandons the build (the server finishes it unobserved)."""
        return await anyio.to_thread.run_sync(self._build, self.servers.build, src, abandon_on_cancel=True)

    def build(self, src: str) -> bytes:
        """Build ``src`` in this process (blocking); ``CompileError`` with the build log."""
        return self._build(lambda s: ocl.build(self.device.context, self.device.device_ids, s), src)

    def _build(self, build: Callable[[str], bytes], src: str) -> bytes:
        try:
            return build(src)
        except ocl.BuildError as exc:
            raise CompileError(f"{self.device.name}: {exc}", diagnostics=exc.log, src=src) from None


class CLProgram(Program):
    """A kernel from a device binary (``clCreateProgramWithBinary``); a launch is one
    ``clSetKernelArg`` per changed argument and ``clEnqueueNDRangeKernel``."""

    __slots__ = ("_bufs", "_vals")  # (the repeat launch reads them by offset)

    def __init__(self, device: CLDevice, name: str, lib: bytes, **kwargs: Any) -> None:
        super().__init__(device, name, lib, **kwargs)
        self._prog, self._kernel = ocl.load(device.context, device.device_ids, self.lib, name)
        #: a cl_kernel's arguments are state: one launch at a time (the repeat launch takes it in C)
        self._lock = native.rlock()
        self._ev = ffi.new("cl_event*")  # (the launch's event, read under the lock)
        self._launch = self._enqueue  # (one bound method for every launch)
        self._vals: tuple[int, ...] = ()  # the arguments set last (_bufs None: none are)
        self._bufs: tuple[CLMemory, ...] | None = None
        self._sizes: dict[tuple[int, ...], Any] = {}
        queue: Any = device._compute_queue
        driver = queue.driver
        if self.kernel is None and driver.counters is not None and queue.profile is None and c_launch_ready():
            # the repeat launch in C (native/clfast.c): see Program._use_c_call
            self._use_c_call(
                (
                    queue,
                    queue.timeline,
                    self._by_bufs,
                    _address(driver._ring),
                    _address(driver.queue),
                    _address(self._kernel),
                    driver,
                    queue._submit_lock,
                    self._lock,
                    driver.counters,
                    device,
                )
            )

    def _native_entry(self, handles: list[Any], global_size: tuple[int, ...], vals: tuple[int, ...]) -> Any:
        """The repeat launch's entry (clfast.c): ``(fn, args, None, handles, global size
        address, 0)``, ``fn(queue, 0, NULL, *args)`` being the launch; cached per argument list."""
        if self._fast is None or global_size != _UNIT:
            return None
        key = (*handles, vals)
        entry = self._entries.get(key)
        if entry is None:
            if len(self._entries) >= 256:  # queued launches keep their own arguments alive
                self._entries.clear()
                self._by_bufs.clear()
            fn, args = self._launcher(tuple(handles), global_size, None, vals)
            entry = self._entries[key] = (fn, args, None, tuple(handles), _address(args[0]), 0)
        return entry

    def _size(self, size: tuple[int, ...]) -> Any:
        out = self._sizes.get(size)
        if out is None:
            out = self._sizes[size] = ffi.new("size_t[3]", size)
        return out

    def _launcher(
        self, handles: tuple[Any, ...], global_size: tuple[int, ...], local_size: Any, vals: tuple[int, ...]
    ) -> tuple[Any, tuple[Any, ...]]:
        gsz, lsz = global_size, NULL if local_size is None else self._size(local_size)
        if self.kernel is not None and local_size is not None:  # rendered: round up, extra items return
            gsz = tuple(-(-g // ls) * ls for g, ls in zip(global_size, local_size, strict=True))
        return self._launch, (self._size(gsz), lsz, vals, *handles)

    @cl_command
    def _enqueue(
        self, queue: Any, n: int, wl: Any, gsz: Any, lsz: Any, vals: tuple[int, ...], *bufs: CLMemory
    ) -> Any:
        cl, ev, kernel = ocl.lib(), self._ev, self._kernel
        with self._lock:
            if self._vals != vals or self._bufs != bufs:
                self._bufs = None  # (until every argument is set: a failure part way leaves some)
                for i, buf in enumerate(bufs):
                    check(
                        cl.clSetKernelArg(kernel, i, 8, buf.kernel_arg()), f"clSetKernelArg({self.name}, {i})"
                    )
                for i, v in enumerate(vals, len(bufs)):
                    check(
                        cl.clSetKernelArg(kernel, i, 4, ffi.new("int*", v)),
                        f"clSetKernelArg({self.name}, {i})",
                    )
                self._vals, self._bufs = vals, bufs
            code = cl.clEnqueueNDRangeKernel(queue, kernel, 3, NULL, gsz, lsz, n, wl, ev)
            if code != 0:
                self._bufs = None
                raise CLError(f"clEnqueueNDRangeKernel({self.name})", code)
            return ev[0]


_UNIT = (1, 1, 1)


class CLDevice(Compiled):
    """One OpenCL device: its own context, two in-order queues (compute, copy)."""

    def __init__(self, name: str) -> None:
        self.index = index = int(name.partition(":")[2] or 0)
        found = ocl.devices()
        if index >= len(found):
            raise RuntimeError(f"{name}: no OpenCL device {index}; this machine has {len(found)}")
        self.platform, self.device_id = found[index]
        self.device_ids = ffi.new("cl_device_id[1]", [self.device_id])
        self.platform_version, self.device_name, self.driver_version, self.device_version = ocl.versions(
            self.platform, self.device_id
        )
        self.context = ocl.create_context(self.device_ids)
        super().__init__(name, CLAllocator(self), CLCompiler(self), CLProgram, OpenCLRenderer())

    def _make_queue(self, name: str) -> Queue:
        driver = CLQueue(f"{self.name}/{name}", self.context, self.device_id)
        queue = DriverQueue(self, name, driver, context=self.context)
        driver.attach(queue)
        return queue

    def _on_close(self) -> None:
        for q in self.queues.values():
            q.driver.close()  # type: ignore[attr-defined]
        self.compiler.servers.close()  # type: ignore[attr-defined]

    def count(self) -> int:
        """OpenCL devices on this machine, over every platform."""
        return len(ocl.devices())
