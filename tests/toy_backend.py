"""TOY: a whole backend in one short file, the skeleton of docs/architecture.md ("Writing a
backend"; a test checks the two stay identical). Its kernels are Python functions over the
buffers' bytes; its memory is host memory; its queues are host-run (worker threads).
"""

from __future__ import annotations

from typing import Any

import anyio.to_thread

from aiotinyrt import Allocator, BufferSpec, Compiled, CompileError, Compiler, Program


class ToyCompiler(Compiler):
    """Source is Python defining the kernel function; the binary is the checked source."""

    def __init__(self) -> None:
        super().__init__("compile_toy")  # the compile cache's key for this backend

    async def compile(self, src: str) -> bytes:
        """Syntax-check ``src`` off the loop. Cancellation: cancels the wait."""
        try:
            await anyio.to_thread.run_sync(compile, src, "<toy kernel>", "exec")
        except SyntaxError as exc:
            raise CompileError(f"toy kernel does not parse: {exc}", src=src) from exc
        return src.encode()


class ToyProgram(Program):
    """Loads the kernel function; a launch calls it with the buffers' memoryviews, then vals."""

    def __init__(self, device: Compiled, name: str, lib: bytes, **kwargs: Any) -> None:
        super().__init__(device, name, lib, **kwargs)
        scope: dict[str, Any] = {}
        exec(lib.decode(), scope)
        self.fn = scope[name]

    def _launcher(
        self, handles: tuple[Any, ...], global_size: tuple[int, ...], local_size: Any, vals: tuple[int, ...]
    ) -> tuple[Any, tuple[Any, ...]]:
        return self.fn, (*handles, *vals)  # run later by the queue's worker, never here


class ToyAllocator(Allocator[memoryview]):
    """Memory is a bytearray; a handle is a byte memoryview of it (views slice it). Freed memory
    goes back to Python's allocator once no host view holds it (no LRU cache: a cached block
    could be handed out again while an old host view still shows it)."""

    def _alloc(self, nbytes: int, options: BufferSpec) -> memoryview:
        return memoryview(bytearray(nbytes))

    def _free(self, opaque: memoryview, nbytes: int, options: BufferSpec) -> None:
        pass

    def _copyin(self, dest: memoryview, src: memoryview) -> None:
        dest[:] = src.cast("B")

    def _copyout(self, dest: memoryview, src: memoryview) -> None:
        dest.cast("B")[:] = src

    def _offset(self, opaque: memoryview, nbytes: int, offset: int) -> memoryview:
        return opaque[offset : offset + nbytes]

    def _as_memoryview(self, opaque: memoryview, nbytes: int) -> memoryview:
        return opaque[:nbytes]


class TOYDevice(Compiled):
    def __init__(self, name: str) -> None:
        super().__init__(name, ToyAllocator(self), ToyCompiler(), ToyProgram)
