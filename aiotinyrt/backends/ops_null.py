"""NULL: real queues, timelines and signals, no work. The overhead floor and the test double.

Its compiler accepts any source; kernels do nothing; copyout raises unless
``NULL_ALLOW_COPYOUT=1`` (then it reads zeros).
"""

from __future__ import annotations

from typing import Any

import anyio.lowlevel

from aiotinyrt.allocator import AllocatorOwner, BufferSpec, LRUAllocator
from aiotinyrt.compiler import Compiler
from aiotinyrt.device import Compiled
from aiotinyrt.helpers import getenv
from aiotinyrt.program import Program


class NullCompiler(Compiler):
    """Accepts any source; the "binary" is the source text."""

    def __init__(self) -> None:
        super().__init__(None)

    async def compile(self, src: str) -> bytes:
        """The source's bytes. Cancellation: a checkpoint; cancelled, nothing is returned."""
        await anyio.lowlevel.checkpoint()
        return src.encode() or b"\0"


def _nothing() -> None:
    pass


class NullProgram(Program):
    def _native_call(self, handles: list[Any], global_size: tuple[int, ...], vals: tuple[int, ...]) -> Any:
        return 0, 0, 0, None  # function address 0: the native worker runs nothing

    def _launcher(
        self,
        handles: tuple[Any, ...],
        global_size: tuple[int, ...],
        local_size: tuple[int, ...] | None,
        vals: tuple[int, ...],
    ) -> tuple[Any, tuple[Any, ...]]:
        return _nothing, ()


class NullMemory:
    """A handle to memory that does not exist."""

    __slots__ = ("__weakref__", "nbytes")

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes


class NullAllocator(LRUAllocator[NullMemory]):
    handle_type = NullMemory

    def __init__(self, device: Compiled) -> None:
        super().__init__(device)
        self.supports_copyout = getenv("NULL_ALLOW_COPYOUT") != 0

    def _alloc(self, nbytes: int, options: BufferSpec) -> NullMemory:
        return NullMemory(nbytes)

    def _free(self, opaque: NullMemory, nbytes: int, options: BufferSpec) -> None:
        pass

    def _copyin(self, dest: NullMemory, src: memoryview) -> None:
        pass

    def _copyout(self, dest: memoryview, src: NullMemory) -> None:
        dest[:] = bytes(dest.nbytes)

    def _transfer(self, dest: NullMemory, src: Any, nbytes: int, src_device: AllocatorOwner) -> None:
        pass

    def _can_transfer_from(self, src_device: AllocatorOwner) -> bool:
        return True

    def _offset(self, opaque: NullMemory, nbytes: int, offset: int) -> NullMemory:
        return NullMemory(nbytes)


class NULLDevice(Compiled):
    def __init__(self, name: str) -> None:
        super().__init__(name, NullAllocator(self), NullCompiler(), NullProgram)
