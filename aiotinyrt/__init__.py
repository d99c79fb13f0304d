"""aiotinyrt: an async/await-native device runtime with tinygrad's runtime architecture.

Every backend is four components (Compiled, Allocator, Program, Compiler); every operation that
can wait is awaitable on asyncio, uvloop or trio, and nothing blocks the event loop.
"""

from __future__ import annotations

from aiotinyrt.allocator import Allocator, AllocatorStatistics, BufferSpec, LRUAllocator
from aiotinyrt.buffer import Buffer
from aiotinyrt.compiler import CompileError, Compiler
from aiotinyrt.device import Compiled, Device, get_available_devices, open_device, synchronize
from aiotinyrt.dtype import DType, dtypes
from aiotinyrt.kernel import BufferParam, IntParam, Kernel, KernelError, Renderer
from aiotinyrt.program import Program
from aiotinyrt.signal import DeviceError, Signal, Timeline

__version__ = "0.1.0"

__all__ = [
    "Allocator",
    "AllocatorStatistics",
    "Buffer",
    "BufferParam",
    "BufferSpec",
    "CompileError",
    "Compiled",
    "Compiler",
    "DType",
    "Device",
    "DeviceError",
    "IntParam",
    "Kernel",
    "KernelError",
    "LRUAllocator",
    "Program",
    "Renderer",
    "Signal",
    "Timeline",
    "dtypes",
    "get_available_devices",
    "open_device",
    "synchronize",
]
